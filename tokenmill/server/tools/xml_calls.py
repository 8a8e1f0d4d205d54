"""Qwen3-Coder's XML tool calls: one ``<tool_call>`` block per call, each argument a
``<parameter=...>`` element whose raw text is typed by the function's JSON schema::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are text, so the same ``3`` is the string "3" for a ``string`` parameter and the number
3 for an ``integer`` one: ``for_tools`` binds a request's schemas. Without them (or for a
parameter the schema does not describe) a value that reads as JSON is taken as that JSON, and as
a string otherwise.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.server.tools.base import (
    Call,
    Function,
    IdFactory,
    ToolCallParser,
    lark_json,
    marker_prefix_len,
    skip_space,
)
from tokenmill.server.tools.json_stream import CallDelta, CallReader, canonical
from tokenmill.server.tools.markers import MarkerToolParser

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_PARAM_END = "\n</parameter>\n"
_ANY_NAME = r"/[A-Za-z_][A-Za-z0-9_.\-]*/"


class Qwen3CoderToolParser(MarkerToolParser):
    name = "qwen3_coder"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def __init__(self, id_factory: IdFactory | None = None,
                 schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__(id_factory)
        self._schemas = dict(schemas or {})  # function name -> its parameters schema

    def for_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> ToolCallParser:
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                   for t in tools or ()}
        return Qwen3CoderToolParser(self.id_factory, schemas)

    def block_end(self, text: str, body_start: int, final: bool) -> tuple[int, int] | None:
        end = text.find(self.end_marker, body_start)
        return None if end == -1 else (end, end + len(self.end_marker))

    def body_extent(self, text: str, body_start: int) -> int:
        return self.marker_extent(text, body_start, self.end_marker)

    def call_reader(self) -> CallReader:
        return XmlCallReader(self._schemas)

    def decode_block(self, body: str) -> list[Call] | None:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, inner = function.group(1).strip(), function.group(2)
        properties = _properties(self._schemas.get(name))
        arguments: dict[str, Any] = {}
        pos = 0
        for parameter in _PARAMETER.finditer(inner):
            if inner[pos:parameter.start()].strip():
                return None  # stray text between parameters: not this syntax
            key = parameter.group(1).strip()
            arguments[key] = typed_value(_unwrap(parameter.group(2)), properties.get(key))
            pos = parameter.end()
        return [(name, arguments)] if name and not inner[pos:].strip() else None

    def format_calls(self, calls: Sequence[Call]) -> str:
        return "\n".join(self._format_call(name, arguments) for name, arguments in calls)

    def _format_call(self, name: str, arguments: dict[str, Any]) -> str:
        parameters = "".join(f"<parameter={key}>\n{_value_text(value)}{_PARAM_END}"
                             for key, value in arguments.items())
        return (f"{self.start_marker}\n<function={name}>\n{parameters}</function>\n"
                f"{self.end_marker}")

    def after_marker(self, functions: Sequence[Function], parallel: bool) -> str:
        rules = [f"after: \"\\n\" ({' | '.join(f'f{i}' for i in range(len(functions)))}) "
                 f"{json.dumps(chr(10) + self.end_marker)}",
                 f"text_value[lazy]: /(.|\\n)*/ {json.dumps(_PARAM_END)}"]
        for i, (name, parameters) in enumerate(functions):
            rules += _function_rules(f"f{i}", name, parameters)
        return "\n".join(rules) + "\n"


def _function_rules(rule: str, name: str, parameters: dict[str, Any]) -> list[str]:
    """Rules for one function's element: its parameters in schema order, the required ones
    always, the others optionally; any named parameter if the schema lists none."""
    properties = _properties(parameters)
    required = set(parameters.get("required") or ())
    head = json.dumps(f"<function={name}>\n")
    if not properties:
        anything = f'("<parameter=" {_ANY_NAME} ">\\n" text_value)*'
        return [f"{rule}: {head} {anything} \"</function>\""]
    parts, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        rules.append(f"{rule}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} "
                     f"{_value_grammar(schema)}")
        parts.append(f"{rule}_{j}" if key in required else f"{rule}_{j}?")
    return [f"{rule}: {head} {' '.join(parts)} \"</function>\"", *rules]


def _value_grammar(schema: Any) -> str:
    """Lark for a parameter's value and the element's end: raw text for a plain string, the
    JSON of anything else."""
    if isinstance(schema, dict) and _is_plain_string(schema):
        return "text_value"
    if isinstance(schema, dict) and _string_enum(schema):
        return f"({' | '.join(json.dumps(v) for v in schema['enum'])}) {json.dumps(_PARAM_END)}"
    checked = dict(schema) if isinstance(schema, dict) else {}
    checked["x-guidance"] = {"whitespace_flexible": False}
    return f"{lark_json(checked)} {json.dumps(_PARAM_END)}"


_STRING_KEYWORDS = {"type", "description", "title", "default", "examples"}


def _is_plain_string(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "string" and set(schema) <= _STRING_KEYWORDS


def _string_enum(schema: dict[str, Any]) -> bool:
    values = schema.get("enum")
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


def _properties(schema: Any) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _unwrap(raw: str) -> str:
    """The value inside its element: one newline after the open tag and one before the close
    tag are layout, not value."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def is_text(schema: Any) -> bool:
    """Whether a parameter's raw text is its value (a string, with nothing else allowed)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "string" or (isinstance(kind, list) and "string" in kind
                                and "null" not in kind)


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the value its schema describes (see the module docstring)."""
    if is_text(schema):
        return raw
    kind = schema.get("type") if isinstance(schema, dict) else None
    text = raw.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    if kind in ("object", "array"):
        try:  # models trained on Python reprs write single quotes and True/None
            # Through JSON: a tuple becomes a list; a set or bytes is no JSON value (TypeError).
            return json.loads(json.dumps(ast.literal_eval(text)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return raw


_OPEN_FUNCTION, _OPEN_PARAMETER = "<function=", "<parameter="
_CLOSE_FUNCTION, _CLOSE_PARAMETER = "</function>", "</parameter>"


class XmlCallReader(CallReader):
    """Reads one ``<function=...>`` element as it is written: the call opens at its name, a
    parameter's key goes out when its tag closes, a text parameter's value character by
    character (short of a tail that could be the layout newline or the closing tag), any other
    value when its element closes (its type needs the whole text). Anything that is not this
    syntax stops the reader."""

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]) -> None:
        self._schemas = schemas
        self._text = ""
        self.position = 0
        self._state = "function"
        self._properties: dict[str, Any] = {}
        self._count = 0  # parameters begun
        self._key = ""
        self._sent = 0  # characters of a text parameter's value sent

    def feed(self, text: str) -> list[CallDelta]:
        self._text += text
        out: list[CallDelta] = []
        while self._state != "stopped" and getattr(self, f"_{self._state}")(out):
            pass
        return out

    def _tag(self, opener: str) -> tuple[bool | None, str]:
        """(True, NAME) of ``<opener NAME>`` ahead, whitespace skipped, moving past it; (None,
        "") while the text may still become one; (False, "") when it cannot."""
        i = skip_space(self._text, self.position)
        head = self._text[i:i + len(opener)]
        if head != opener:
            return (None if opener.startswith(head) else False), ""
        close = self._text.find(">", i + len(opener))
        name = self._text[i + len(opener):close if close != -1 else len(self._text)]
        if "\n" in name or close == i + len(opener):
            return False, ""
        if close == -1:
            return None, ""
        self.position = close + 1
        return True, name.strip()

    def _function(self, out: list[CallDelta]) -> bool:
        found, name = self._tag(_OPEN_FUNCTION)
        if found is None:
            return False
        if not found or not name:
            self._state = "stopped"
            return False
        out.append((0, name, "{"))
        self._properties = _properties(self._schemas.get(name))
        self._state = "parameters"
        return True

    def _parameters(self, out: list[CallDelta]) -> bool:
        i = skip_space(self._text, self.position)
        if self._text.startswith(_CLOSE_FUNCTION, i):
            out.append((0, None, "}"))
            self.position, self._state = i + len(_CLOSE_FUNCTION), "stopped"
            return False
        found, key = self._tag(_OPEN_PARAMETER)
        if found is None or (found is False and _CLOSE_FUNCTION.startswith(self._text[i:])):
            return False  # a closing tag or a parameter may be coming
        if not found or not key:
            self._state = "stopped"
            return False
        plain = is_text(self._properties.get(key))
        separator = ", " if self._count else ""
        out.append((0, None, f"{separator}{canonical(key)}: " + ('"' if plain else "")))
        self._key, self._count, self._sent = key, self._count + 1, 0
        self._state = "plain" if plain else "typed"
        return True

    def _typed(self, out: list[CallDelta]) -> bool:
        """A typed parameter: sent once its element closes."""
        end = self._text.find(_CLOSE_PARAMETER, self.position)
        if end == -1:
            return False
        raw = _unwrap(self._text[self.position:end])
        out.append((0, None, canonical(typed_value(raw, self._properties.get(self._key)))))
        self.position, self._state = end + len(_CLOSE_PARAMETER), "parameters"
        return True

    def _plain(self, out: list[CallDelta]) -> bool:
        """A text parameter: its characters as a JSON string, as far as they are certain."""
        end = self._text.find(_CLOSE_PARAMETER, self.position)
        raw = self._text[self.position:end if end != -1 else len(self._text)]
        if end == -1:
            raw = raw[:len(raw) - marker_prefix_len(raw, _CLOSE_PARAMETER)]
            raw = raw[:-1] if raw.endswith("\n") and len(raw) > 1 else raw  # layout, perhaps
        value = _unwrap(raw) if end != -1 else raw.removeprefix("\n")
        if len(value) > self._sent:
            out.append((0, None, canonical(value[self._sent:])[1:-1]))
            self._sent = len(value)
        if end == -1:
            return False
        out.append((0, None, '"'))
        self.position, self._state = end + len(_CLOSE_PARAMETER), "parameters"
        return True
