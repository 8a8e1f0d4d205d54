"""The C++ kernels' layout: every header of ``tokenmill/kernels/csrc`` compiles alone, and every
rung of the kernel ladder (``tokenmill/kernels/ladder.py``) is real: its header defines the
binding, its references import, its test exists and its benchmark names what it times; every
binding of the module is on the ladder or one of its helpers."""

from __future__ import annotations

import ast
import importlib
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels.ladder import HELPERS, LADDER, Rung, table
from tokenmill.platform import usable_cores

ROOT = Path(__file__).resolve().parent.parent
CSRC = cpu_kernels.CSRC
HEADERS = sorted(CSRC.glob("*.h"))


def compiler() -> str:
    """The C++ compiler the kernels build with; a skip without one, which CI (kernels
    required) does not accept."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        if os.environ.get("TOKENMILL_REQUIRE_KERNELS", "") not in ("", "0"):
            pytest.fail(f"TOKENMILL_REQUIRE_KERNELS is set and there is no C++ compiler ({cxx})")
        pytest.skip("no C++ compiler: the kernels fall back")
    return cxx


def compile_flags(march: str) -> list[str]:
    """Syntax only, with the kernels' language, instruction sets and include paths (torch's,
    Python's, csrc/)."""
    from torch.utils.cpp_extension import include_paths

    paths = [*include_paths(), sysconfig.get_paths()["include"]]
    return ["-std=c++17", f"-march={march}", "-DTORCH_EXTENSION_NAME=tokenmill_cpu_ops",
            f"-I{CSRC}", *(f"-isystem{p}" for p in paths)]


def syntax_check(cmd: list[str], source: str) -> tuple[str, str]:
    """(``source``, the compiler's errors or "") for ``source`` compiled on its own."""
    done = subprocess.run([*cmd, "-fsyntax-only", "-x", "c++", "-"], input=source,
                          capture_output=True, text=True)
    return source.strip(), done.stderr[-3000:] if done.returncode else ""


def check_all(jobs: list[tuple[list[str], str]]) -> None:
    """Each (compiler command, source) at once, a job per core; fails with every error."""
    with ThreadPoolExecutor(max_workers=usable_cores()) as pool:
        results = list(pool.map(lambda job: syntax_check(*job), jobs))
    errors = [f"{what}:\n{err}" for what, err in results if err]
    assert not errors, "\n\n".join(errors)


def torch_includes() -> list[str]:
    """common.h's #include <...> lines: torch's headers (and the standard ones) for every
    kernel header."""
    return re.findall(r"^#include <.+?>", (CSRC / "common.h").read_text(), re.M)


@pytest.mark.slow  # 55 s on a quiet 2-core Zen 3 (82 s when each header parsed torch alone)
def test_every_header_compiles_alone(tmp_path):
    """Each header includes what it uses (cpu_ops.cpp, which includes them all, passes whatever
    the order): a translation unit of that one #include compiles. common.h compiles as it is;
    the others start from its system includes precompiled once (a PCH: ~6 s of parsing saved
    per header on a 2-core Zen 3), the same translation unit since each includes common.h
    before any code of its own (test_every_header_includes_common_before_its_code)."""
    assert len(HEADERS) >= 10
    cmd = [compiler(), *compile_flags("native")]
    pre = tmp_path / "torch_includes.h"
    pre.write_text("\n".join(torch_includes()) + "\n")
    with ThreadPoolExecutor(max_workers=2) as pool:
        # where no PCH comes of it, -include parses the same text instead (slower, as strict)
        pool.submit(subprocess.run, [*cmd, "-x", "c++-header", str(pre), "-o", f"{pre}.gch"],
                    capture_output=True)
        common = pool.submit(syntax_check, cmd, '#include "common.h"\n')
    what, err = common.result()
    assert not err, f"{what}:\n{err}"  # every other header includes it
    check_all([([*cmd, "-include", str(pre)], f'#include "{h.name}"\n')
               for h in HEADERS if h.name != "common.h"])


def test_every_header_includes_common_before_its_code():
    """What makes test_every_header_compiles_alone's PCH the same translation unit: each header
    but common.h includes common.h itself, after nothing but comments and other #includes."""
    late = []
    for h in HEADERS:
        if h.name == "common.h":
            continue
        before, found, _ = h.read_text().partition('\n#include "common.h"\n')
        code = [line for line in before.splitlines() if line.strip() and not re.match(
            r"(//|#pragma once$|#include [<\"])", line)]
        if not found or code:
            late.append((h.name, code or "no #include of common.h"))
    assert not late, late


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_the_module_compiles_for_avx2_plain_x86_and_amx():
    """The paths for CPUs without AVX512 (AVX2 only: x86-64-v3), without AVX2 (the plain
    fallback) and with AMX (Sapphire Rapids: the AMX tiles' code, which no build on a CPU
    without them compiles) compile too, wherever the test runs: a build is per machine, and
    the machine that first builds them may be a user's. A march whose instruction sets, as
    the sources test them, are this machine's own is left to the kernels' build here (which
    compiles that path for real), and one the compiler predates (GCC < 11: no
    sapphirerapids) is left out."""
    source = (CSRC / "cpu_ops.cpp").read_text()
    native = isa_macros("native")
    marches = [m for m in ("x86-64-v3", "x86-64", "sapphirerapids")
               if isa_macros(m) not in (None, native)]
    assert marches or native is None
    check_all([([compiler(), *compile_flags(march)], source) for march in marches])


def isa_macros(march: str) -> frozenset[str] | None:
    """The macros ``-march=march`` defines that a preprocessor line of the sources tests
    (``__AVX2__``, ``__AMX_TILE__``, ...); None where the compiler does not know the march."""
    done = subprocess.run([compiler(), f"-march={march}", "-dM", "-E", "-x", "c++", "-"],
                          input="", capture_output=True, text=True)
    if done.returncode:
        return None
    tested = set(re.findall(r"\b__\w+__\b", "\n".join(
        line for line in csrc_text().splitlines() if line.lstrip().startswith("#"))))
    return frozenset(re.findall(r"^#define (\w+)", done.stdout, re.M)) & tested


def test_the_module_includes_every_header():
    """cpu_ops.cpp reaches every header, directly or through another (a header nothing includes
    would be compiled by no build)."""
    seen, todo = set(), ["cpu_ops.cpp"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += re.findall(r'^#include "(\w+\.h)"', (CSRC / name).read_text(), re.M)
    assert {p.name for p in HEADERS} <= seen


# ----- the ladder -------------------------------------------------------------------------


@cache
def csrc_text() -> str:
    return "\n".join(p.read_text() for p in sorted(CSRC.iterdir()) if p.suffix in (".h", ".cpp"))


def bound_names() -> set[str]:
    """The names the module binds: m.def("name", ...) and class_<T[, holder]>(m, "name", ...)."""
    text = csrc_text()
    return (set(re.findall(r'\bm\.def\(\s*"(\w+)"', text))
            | set(re.findall(r'class_<[\w:]+(?:,\s*[\w:<>]+)?>\(\s*m\s*,\s*"(\w+)"', text)))


def defines(text: str, name: str) -> bool:
    """Whether C++ ``text`` defines a function, class or struct ``name`` (at a line's start)."""
    return re.search(rf"^(?:(?:class|struct)\s+{name}\b|[A-Za-z_][\w:<>,]*[\s&*]+{name}\()",
                     text, re.M) is not None


def resolve(dotted: str) -> object:
    """The object a dotted name names: the longest module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def has_test_function(node_id: str) -> bool:
    path, _, name = node_id.partition("::")
    file = ROOT / path
    if not file.exists():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


@pytest.mark.parametrize("rung", LADDER, ids=lambda r: r.binding)
def test_every_rung_is_real(rung: Rung):
    header = CSRC / rung.header
    assert header.exists(), rung.header
    assert defines(header.read_text(), rung.binding), f"{rung.header} defines no {rung.binding}"
    assert rung.binding in bound_names(), f"{rung.binding} is not bound"
    for reference in rung.references:
        assert callable(resolve(reference)), reference
    assert has_test_function(rung.test), rung.test
    script = ROOT / rung.bench_script
    assert script.exists(), rung.bench
    assert (rung.timed_as or rung.binding) in script.read_text(), \
        f"{rung.bench_script} does not name {rung.timed_as or rung.binding}"


def test_every_binding_is_a_rung_or_a_helper():
    rungs = {r.binding for r in LADDER}
    assert len(rungs) == len(LADDER)
    assert bound_names() - rungs - HELPERS == set()
    assert HELPERS <= bound_names()


def test_the_ladder_prints_as_a_table():
    done = subprocess.run([sys.executable, "-m", "tokenmill.kernels.ladder"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == table()
    for rung in LADDER:
        assert f"{rung.binding}: {rung.name}" in done.stdout and rung.test in done.stdout
