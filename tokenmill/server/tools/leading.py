"""Families whose answer is either calls or text, with no marker: the calls, if any, open the
output (whitespace aside); text after them is content.

llama3_json (Llama 3.1-3.3 with JSON tool calling), calls separated by ``;``, optionally after
the ``<|python_tag|>`` token::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", ...}

pythonic (Llama 3.2/4, ToolACE), a Python list of keyword-argument calls::

    [get_weather(city="Paris"), add(a=2, b=3)]

A pythonic value is a Python literal; JSON's ``true``, ``false`` and ``null`` are read too,
since a grammar-constrained call writes its values as JSON.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

from tokenmill.server.tools.base import (
    Call,
    Function,
    ToolCallParser,
    balanced_end,
    json_call,
    json_calls_schema,
    lark_json,
    skip_space,
)
from tokenmill.server.tools.json_stream import CallReader, JsonCallReader


class LeadingToolParser(ToolCallParser):
    """A block opens with one of ``openers`` at the start; ``body_opener`` is the opener that
    belongs to the body itself (a bracket), the others are dropped (a tag)."""

    leading = True
    openers: tuple[str, ...]
    body_opener: str

    def find_start(self, text: str, pos: int) -> tuple[int, int] | None:
        i = skip_space(text, pos)
        for opener in self.openers:
            if text.startswith(opener, i):
                return i, i if opener == self.body_opener else i + len(opener)
        return None

    def start_hold(self, text: str) -> int:
        # Undecided while what is there (whitespace aside) may still grow into an opener.
        head = text.lstrip()
        return len(text) if any(o.startswith(head) for o in self.openers) else 0

    def auto_grammar(self, functions: Sequence[Function], parallel: bool) -> str:
        # Calls, then free text; or text that does not open like a call (so a call is checked).
        opener = json.dumps(self.body_opener)[1:-1].replace("[", "\\[")
        return (f"%llguidance {{}}\n"
                f"start: block TAIL? | TEXT?\n"
                f"TAIL: /\\s*[^\\s;](.|\\n)*/\n"
                f"TEXT: /\\s*[^\\s{opener}](.|\\n)*/ | /\\s+/\n"
                f"{self.block_rules(functions, parallel)}")

    def forced_grammar(self, functions: Sequence[Function], parallel: bool) -> str:
        return f"start: block\n{self.block_rules(functions, parallel)}"

    def block_rules(self, functions: Sequence[Function], parallel: bool) -> str:
        """Lark rules defining ``block``: one call, or several with ``parallel``."""
        raise NotImplementedError


class Llama3JsonToolParser(LeadingToolParser):
    name = "llama3_json"
    openers = ("<|python_tag|>", "{")
    body_opener = "{"
    several_calls = "separate several calls with '; '"

    def call_reader(self) -> CallReader:
        return JsonCallReader(("parameters", "arguments"), separator=";")

    def block_end(self, text: str, body_start: int, final: bool) -> tuple[int, int] | None:
        # Calls separated by ";": the block ends after the last call that no "; {" follows.
        i = skip_space(text, body_start)
        end = None  # just past the last complete call
        while True:
            if i == len(text) and not final:
                return None  # a tag, a call or a ";" so far: more may follow
            if i == len(text) or text[i] != "{":
                return (end, end) if end is not None else (i, i)
            close = balanced_end(text, i)
            if close is None:
                return None if not final else (end or len(text), end or len(text))
            end = close
            j = skip_space(text, close)
            if j < len(text) and text[j] != ";":
                return end, end
            i = skip_space(text, j + 1) if j < len(text) else j

    def decode_block(self, body: str) -> list[Call] | None:
        decoder = json.JSONDecoder()
        calls: list[Call] = []
        i = skip_space(body, 0)
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except ValueError:
                return None
            call = json_call(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            i = skip_space(body, i)
            if i < len(body) and body[i] == ";":
                i = skip_space(body, i + 1)
        return calls or None

    def format_calls(self, calls: Sequence[Call]) -> str:
        return "; ".join(json.dumps({"name": name, "parameters": arguments},
                                    ensure_ascii=False) for name, arguments in calls)

    def block_rules(self, functions: Sequence[Function], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return (f"block: call{more}\n"
                f"call: {lark_json(json_calls_schema(functions, 'parameters'))}\n")


_JSON_CONSTANTS = {"true": True, "false": False, "null": None}


class PythonicToolParser(LeadingToolParser):
    name = "pythonic"
    openers = ("[",)
    body_opener = "["
    several_calls = "put several calls in the same list"

    def block_end(self, text: str, body_start: int, final: bool) -> tuple[int, int] | None:
        end = balanced_end(text, body_start)
        return (end, end) if end is not None else None

    def decode_block(self, body: str) -> list[Call] | None:
        try:
            tree = ast.parse(body.strip(), mode="eval").body
            if not isinstance(tree, ast.List):
                return None
            return [_python_call(node) for node in tree.elts] or None
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None

    def format_calls(self, calls: Sequence[Call]) -> str:
        return "[" + ", ".join(
            f"{name}(" + ", ".join(f"{k}={_literal(v)}" for k, v in arguments.items()) + ")"
            for name, arguments in calls) + "]"

    def block_rules(self, functions: Sequence[Function], parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        rules = [f'block: "[" call{more} "]"',
                 f"call: {' | '.join(f'f{i}' for i in range(len(functions)))}"]
        for i, (name, parameters) in enumerate(functions):
            rules += _keyword_rules(f"f{i}", name, parameters)
        return "\n".join(rules) + "\n"


def _python_call(node: ast.expr) -> Call:
    """(name, arguments) of ``name(key=literal, ...)``; ValueError for anything else."""
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a keyword-argument call")
    name = node.func.id if isinstance(node.func, ast.Name) else _dotted(node.func)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise ValueError("not a keyword-argument call")
        arguments[keyword.arg] = _value(keyword.value)
    return name, arguments


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    raise ValueError("not a function name")


def _value(node: ast.expr) -> Any:
    """A JSON value from a Python (or JSON) literal; ValueError for anything else."""
    if isinstance(node, ast.Name) and node.id in _JSON_CONSTANTS:
        return _JSON_CONSTANTS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict literal")
        keys = [_value(k) for k in node.keys]  # type: ignore[arg-type]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a JSON object's keys are strings")
        return dict(zip(keys, (_value(v) for v in node.values), strict=True))
    value = ast.literal_eval(node)
    if value is not None and not isinstance(value, str | int | float | bool):
        raise ValueError("not a JSON value")
    return value


def _literal(value: Any) -> str:
    """A JSON value as a Python literal."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def _keyword_rules(rule: str, name: str, parameters: dict[str, Any]) -> list[str]:
    """``name(k=v, ...)`` with the parameters in schema order, required ones always and the
    others optionally, commas only between those present. ``rest_j``: what follows once
    something was written; ``first_j``: the arguments from parameter j on, none written yet."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    items = list(properties.items()) if isinstance(properties, dict) else []
    required = set(parameters.get("required") or ()) if isinstance(parameters, dict) else set()
    n = len(items)
    rules = [f"{rule}: {json.dumps(name + '(')} {rule}_first0 \")\""]
    for j, (key, schema) in enumerate(items):
        checked = dict(schema) if isinstance(schema, dict) else {}
        checked["x-guidance"] = {"whitespace_flexible": False}
        value = f"{json.dumps(key + '=')} {lark_json(checked)}"
        after = f"{rule}_rest{j + 1}"
        if key in required:
            rules.append(f"{rule}_first{j}: {value} {after}")
            rules.append(f"{rule}_rest{j}: \", \" {value} {after}")
        else:
            rules.append(f"{rule}_first{j}: {value} {after} | {rule}_first{j + 1}")
            rules.append(f"{rule}_rest{j}: \", \" {value} {after} | {after}")
    rules.append(f'{rule}_first{n}: ""')
    rules.append(f'{rule}_rest{n}: ""')
    return rules
