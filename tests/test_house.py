"""The house rules, read from the code itself.

- Imports go down the layer table of ``docs/architecture.md`` ("Layers"): every import in
  ``tokenmill/`` (at module level, inside functions, under ``if TYPE_CHECKING:``) is one the
  table allows, no layer imports a library it must never import, and no module imports itself
  back through others (type-only imports included).
- Functions are short: p90 <= 25 lines and none over 70 (Triton kernels aside), counted from
  the ``def`` line to the last line of the body.
- No source file under ``tokenmill/`` (Python or C++) is over 600 lines.

The table lives in the docs and here (``LAYERS``); a test checks that the two agree, so neither
drifts. ``python tests/test_house.py`` prints the figures (function lengths, largest files).
"""

from __future__ import annotations

import ast
import math
import re
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tokenmill"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TOP = "__init__"  # the layer name of tokenmill/__init__.py
ANY = "*"  # as a row: holds for every layer; in "may import": everything

# layer -> (what of tokenmill it may import, libraries it never imports); lowest layers first.
# A dotted entry allows that module (and those under it) only: the runner takes the step
# contract, sched.output, and never the scheduler. A layer always imports its own modules.
LAYERS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    layer: (frozenset(may), frozenset(never)) for layer, may, never in [
        (ANY, ["util", "errors"], ["transformers"]),
        ("util", [], ["torch"]),
        ("errors", [], ["torch"]),
        ("config", [], ["torch"]),
        ("model_source", [], ["torch"]),
        ("gguf_meta", [], ["torch"]),
        ("params", [], ["torch"]),
        ("request", ["params"], ["torch"]),
        ("platform", [], []),
        ("kv_events", [], ["torch"]),
        ("cache", ["config", "kv_events", "request"], ["torch"]),
        ("kv_transfer", ["cache", "config", "request"], []),
        ("sched", ["cache", "config", "kv_transfer.base", "params", "request"], ["torch"]),
        ("tokenizer", ["gguf_meta", "model_source"], []),
        ("kernels", ["platform"], []),
        ("attention", ["config", "kernels", "platform"], []),
        ("distributed", ["config", "kernels"], []),
        ("model", ["attention", "config", "distributed", "gguf_meta", "kernels", "model_source",
                   "platform"], []),
        ("runner", ["attention", "config", "kernels", "model", "params", "platform", "request",
                    "sched.output"], []),
        ("structured", ["params", "request", "sched.output"], []),
        ("speculative", ["cache", "config", "model", "params", "platform", "request", "runner",
                         "sched.output", "tokenizer"], []),
        ("executor", ["config", "distributed", "kv_transfer", "model", "params", "platform",
                      "request", "runner", "sched.output"], []),
        ("engine", ["attention", "config", "distributed", "executor", "kernels", "kv_events",
                    "kv_transfer", "model", "params", "platform", "request", "runner.kv_cache",
                    "sched", "speculative", "structured", "tokenizer"], []),
        ("eval", ["config", "engine", "executor", "params", "request", "runner", "tokenizer"],
         []),
        ("server", [TOP, "config", "engine", "params", "request", "structured", "tokenizer"],
         []),
        ("bench", ["config", "tokenizer"], ["torch"]),
        ("router", ["kv_events"], ["torch"]),
        ("lang", [], ["torch"]),
        ("cli", [ANY], []),
        (TOP, ["config", "engine", "params", "structured"], []),
    ]
}

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 70
P90_FUNCTION_LINES = 25
SOURCE_SUFFIXES = {".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"}


# ----- reading the code ------------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted: "tokenmill.runner.sampler"
    target: str  # the imported module: a submodule where ``from pkg import name`` names one
    where: str  # "tokenmill/runner/sampler.py:57"
    statement: str  # as written

    def __str__(self) -> str:
        return f"{self.where}: {self.statement}"


@cache
def modules() -> dict[str, Path]:
    """Every Python module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def read_imports(module: str, text: str, is_package: bool, known: Iterable[str],
                 where: str) -> list[Import]:
    """The imports anywhere in one module's text (ast.walk reaches function bodies and
    ``if TYPE_CHECKING:`` blocks alike); relative ones made absolute."""
    known = set(known)
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        statement = ast.get_source_segment(text, node) or ast.unparse(node)
        statement = " ".join(statement.split())
        found += [Import(module, t, f"{where}:{node.lineno}", statement)
                  for t in dict.fromkeys(targets)]
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


@cache
def all_imports() -> tuple[Import, ...]:
    known = modules()
    found: list[Import] = []
    for module, path in known.items():
        found += read_imports(module, path.read_text(), path.name == "__init__.py", known,
                              str(path.relative_to(ROOT)))
    return tuple(found)


def layer_of(module: str) -> str:
    """"tokenmill.sched.output" -> "sched"; the package itself -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else TOP


def within(module: str) -> str:
    """"tokenmill.sched.output" -> "sched.output", as the table names it."""
    return module.partition(".")[2] or TOP


def is_ours(module: str) -> bool:
    return module == "tokenmill" or module.startswith("tokenmill.")


# ----- the layer table in the docs -------------------------------------------------------------

def parse_layer_table(markdown: str) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """The first table under the "## Layers" heading: | layer | may import | never imports |,
    names in backticks."""
    section = re.search(r"^## Layers\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert section, f"{ARCHITECTURE.relative_to(ROOT)} has no '## Layers' section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    assert len(rows) > 2, "the Layers section has no table"
    table = {}
    for row in rows[2:]:  # past the header and its |---| line
        cells = [re.findall(r"`([^`]+)`", cell) for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 3 and len(cells[0]) == 1, f"a malformed Layers row: {row}"
        table[cells[0][0]] = (frozenset(cells[1]), frozenset(cells[2]))
    return table


def may_import(layer: str, target: str) -> bool:
    """Whether ``layer`` may import the tokenmill module ``target`` (dotted, package-relative)."""
    if target.split(".")[0] == layer:
        return True
    may = LAYERS[layer][0] | LAYERS[ANY][0]
    return ANY in may or any(target == e or target.startswith(e + ".") for e in may)


def layers_present() -> set[str]:
    return {layer_of(m) for m in modules()}


# ----- cycles -----------------------------------------------------------------------------------

def import_graph() -> dict[str, dict[str, Import]]:
    """module -> {module it imports: the first statement that does}, tokenmill only."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules()}
    for imp in all_imports():
        if imp.target in graph and imp.target != imp.source:
            graph[imp.source].setdefault(imp.target, imp)
    return graph


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's components with more than one module: each holds at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def shortest_cycle(graph: dict[str, dict[str, Import]], component: list[str]) -> list[Import]:
    """A shortest cycle through the component's first module, as the imports that close it."""
    start, members = component[0], set(component)
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w, imp in graph[v].items():
                if w == start:
                    path = [imp]
                    while path[0].source != start:
                        path.insert(0, came_from[path[0].source])
                    return path
                if w in members and w not in came_from:
                    came_from[w] = imp
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


# ----- lengths ----------------------------------------------------------------------------------

def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
    return any(name.startswith("triton.") for name in names)


@cache
def function_lengths() -> tuple[tuple[int, str], ...]:
    """(lines from ``def`` to the end of the body, "path:line name") of every function and
    method, nested ones included, Triton kernels left out; longest first."""
    found = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and not _is_triton_kernel(node):
                found.append((node.end_lineno - node.lineno + 1,
                              f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return tuple(sorted(found, key=lambda f: (-f[0], f[1])))


def percentile(values: list[int], p: float) -> int:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)]


@cache
def file_lengths() -> tuple[tuple[int, str], ...]:
    """(lines, path) of every source file under tokenmill/, longest first."""
    found = [(len(p.read_text(errors="replace").splitlines()), str(p.relative_to(ROOT)))
             for p in PACKAGE.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()
             and "__pycache__" not in p.parts]
    return tuple(sorted(found, key=lambda f: (-f[0], f[1])))


def _listing(items: Iterable[object], limit: int = 60) -> str:
    items = list(items)
    shown = [f"  {item}" for item in items[:limit]]
    if len(items) > limit:
        shown.append(f"  ... and {len(items) - limit} more")
    return "\n".join(shown)


# ----- the tests ----------------------------------------------------------------------------------

def test_the_layer_table_in_the_docs_is_the_rule() -> None:
    documented = parse_layer_table(ARCHITECTURE.read_text())
    differ = [f"  {layer}: docs {documented.get(layer)} / test {LAYERS.get(layer)}"
              for layer in sorted(documented.keys() | LAYERS.keys(), key=str)
              if documented.get(layer) != LAYERS.get(layer)]
    assert not differ, ("docs/architecture.md's Layers table and tests/test_house.py's LAYERS "
                        "differ; change both together:\n" + "\n".join(differ))


def test_every_layer_has_a_row() -> None:
    present = layers_present()
    missing = sorted(present - LAYERS.keys())
    stale = sorted(LAYERS.keys() - present - {ANY})
    assert not missing, f"layers with no row in the Layers table: {missing}"
    assert not stale, f"rows for layers that do not exist under tokenmill/: {stale}"


def test_the_import_reader_sees_every_kind_of_import() -> None:
    text = ("import os\nfrom typing import TYPE_CHECKING\nimport tokenmill.sched.output\n"
            "from tokenmill.sched import output, Scheduler\nfrom . import rows\n"
            "from ..params import SamplingParams\nif TYPE_CHECKING:\n"
            "    from tokenmill.engine import LLMEngine\n"
            "def f():\n    from tokenmill.server.app import run_server\n")
    known = {"tokenmill.sched", "tokenmill.sched.output", "tokenmill.runner.rows"}
    found = read_imports("tokenmill.runner.sampler", text, False, known, "x.py")
    assert [(i.target, i.where) for i in found if is_ours(i.target)] == [
        ("tokenmill.sched.output", "x.py:3"), ("tokenmill.sched.output", "x.py:4"),
        ("tokenmill.sched", "x.py:4"), ("tokenmill.runner.rows", "x.py:5"),
        ("tokenmill.params", "x.py:6"), ("tokenmill.engine", "x.py:8"),
        ("tokenmill.server.app", "x.py:10")]
    assert not may_import("runner", within("tokenmill.sched"))  # the scheduler, not the contract
    assert may_import("runner", within("tokenmill.sched.output"))


def test_imports_follow_the_layers() -> None:
    upward = [imp for imp in all_imports() if is_ours(imp.target)
              and not may_import(layer_of(imp.source), within(imp.target))]
    assert not upward, (
        f"{len(upward)} imports the Layers table of docs/architecture.md does not allow "
        f"(importer's layer -> imported module: statement):\n" + _listing(
            f"{layer_of(i.source)} -> {within(i.target)}: {i}" for i in upward))


def test_no_layer_imports_a_library_it_must_not() -> None:
    banned = [imp for imp in all_imports() if not is_ours(imp.target)
              and imp.target.split(".")[0] in LAYERS[layer_of(imp.source)][1] | LAYERS[ANY][1]]
    assert not banned, "imports of libraries the Layers table bans:\n" + _listing(banned)


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = []
    for component in strongly_connected(graph):
        path = shortest_cycle(graph, component)
        chain = " -> ".join([within(path[0].source), *(within(i.target) for i in path)])
        cycles.append(f"{chain}\n    " + "\n    ".join(map(str, path))
                      + f"\n    (all modules in this knot: {', '.join(map(within, component))})")
    assert not cycles, (f"{len(cycles)} import cycles (type-only and function-level imports "
                        f"count):\n" + _listing(cycles))


def test_functions_are_short() -> None:
    lengths = [n for n, _ in function_lengths()]
    too_long = [f"{n} lines: {name}" for n, name in function_lengths() if n > MAX_FUNCTION_LINES]
    p90 = percentile(lengths, 90)
    problems = []
    if too_long:
        problems.append(f"{len(too_long)} functions over {MAX_FUNCTION_LINES} lines:\n"
                        + _listing(too_long))
    if p90 > P90_FUNCTION_LINES:
        over = [f"{n} lines: {name}" for n, name in function_lengths() if n > P90_FUNCTION_LINES]
        problems.append(f"function length p90 is {p90} lines (limit {P90_FUNCTION_LINES}); "
                        f"the {len(over)} longer than that, longest first:\n" + _listing(over))
    assert not problems, "\n".join(problems)


def test_source_files_are_short() -> None:
    too_long = [f"{n} lines: {path}" for n, path in file_lengths() if n > MAX_FILE_LINES]
    assert not too_long, (f"{len(too_long)} source files over {MAX_FILE_LINES} lines:\n"
                          + _listing(too_long))


def house_figures() -> Iterator[str]:
    lengths = [n for n, _ in function_lengths()]
    yield (f"functions: {len(lengths)}, median {statistics.median(lengths):g}, "
           f"p90 {percentile(lengths, 90)}, max {max(lengths)} lines")
    yield "longest functions:"
    yield from (f"  {n:4d}  {name}" for n, name in function_lengths()[:10])
    python = sum(n for n, path in file_lengths() if path.endswith(".py"))
    yield f"largest source files (Python in tokenmill/: {python} lines):"
    yield from (f"  {n:5d}  {path}" for n, path in file_lengths()[:10])


if __name__ == "__main__":
    print("\n".join(house_figures()))
