"""Turn a model's text output into OpenAI tool calls, whole or while it streams.

A parser knows one family's call syntax. The families handled here wrap each call in a pair of
markers, e.g. hermes (SmolLM2, Qwen, Hermes)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Both ``parse`` and the streamer split the text the same way, so a streamed answer reassembles to
exactly what ``parse`` returns for the whole text:

- text outside the calls is content; the content is the concatenation of those pieces with
  leading and trailing whitespace removed (``str.strip``), ``None`` when nothing is left;
- a block is the text from a start marker to the first end marker after it; a block whose body
  is not a valid call stays in the content verbatim, markers included;
- a start marker with no end marker (the output was cut off, or the model stopped right after
  the JSON) is a call if the rest of the text is a valid call, and content otherwise.

Known limitation: an end marker written inside a JSON string ends the block early, which makes
that call invalid (it is then content), in ``parse`` and in the streamer alike.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IdFactory = Callable[[], str]


def new_call_id() -> str:
    """An OpenAI-shaped call id: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, encoded as OpenAI returns it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall]


class ToolCallParser(ABC):
    """One family's call syntax: markers around each call and the call body inside them.

    Subclasses set ``name``, ``start_marker`` and ``end_marker`` and implement ``format_call``
    and ``_decode_body``. A family without markers (e.g. a bare JSON object) would override
    ``parse`` and ``streamer`` as well.
    """

    name: str
    start_marker: str
    end_marker: str

    def __init__(self, id_factory: IdFactory = new_call_id) -> None:
        self.id_factory = id_factory

    @abstractmethod
    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text the model writes for one call, markers included."""

    @abstractmethod
    def _decode_body(self, body: str) -> tuple[str, dict[str, Any]] | None:
        """(name, arguments) from the text between the markers, or None if it is no valid call."""

    @abstractmethod
    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """The JSON schema of one call's body: the named function with these parameters."""

    @abstractmethod
    def after_marker_grammar(self, body_schema: dict[str, Any]) -> str:
        """A Lark expression for what follows ``start_marker`` in one call whose body matches
        ``body_schema`` (llguidance's ``%json``), laid out as ``format_call`` writes it."""

    def call_grammar(self, body_schema: dict[str, Any]) -> str:
        """A Lark expression for one whole call, start marker included."""
        return f"{json.dumps(self.start_marker)} {self.after_marker_grammar(body_schema)}"

    def parse(self, text: str) -> ParsedMessage:
        """Split a complete output into content and calls (never raises on bad calls)."""
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(self.start_marker, pos)) != -1:
            pieces.append(text[pos:start])
            body_start = start + len(self.start_marker)
            end = text.find(self.end_marker, body_start)
            body_end = len(text) if end == -1 else end
            pos = len(text) if end == -1 else end + len(self.end_marker)
            call = self.make_call(text[body_start:body_end])
            if call is None:
                pieces.append(text[start:pos])
            else:
                calls.append(call)
        pieces.append(text[pos:])
        return ParsedMessage(content="".join(pieces).strip() or None, tool_calls=calls)

    def make_call(self, body: str) -> ToolCall | None:
        """A ToolCall (with a fresh id) for a block body, or None if the body is no valid call."""
        decoded = self._decode_body(body)
        if decoded is None:
            return None
        name, arguments = decoded
        text = json.dumps(arguments, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # the model wrote an escaped lone surrogate: keep it escaped
            text = json.dumps(arguments)
        return ToolCall(self.id_factory(), name, text)

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self)


class HermesToolParser(ToolCallParser):
    """``<tool_call>`` + a JSON object with "name" and "arguments" + ``</tool_call>``."""

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.start_marker}\n{call}\n{self.end_marker}"

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"], "additionalProperties": False}

    def after_marker_grammar(self, body_schema: dict[str, Any]) -> str:
        end = json.dumps("\n" + self.end_marker)
        return f'"\\n" %json {json.dumps(body_schema)} {end}'

    def _decode_body(self, body: str) -> tuple[str, dict[str, Any]] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        # Some models were trained with "parameters" for the same thing.
        arguments = obj.get("arguments", obj.get("parameters"))
        arguments = _as_arguments(arguments)
        return None if arguments is None else (obj["name"], arguments)


def _as_arguments(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: missing means none, a JSON-encoded object is decoded, else None."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


class _ContentStripper:
    """Streams content with the same leading/trailing whitespace removal as ``str.strip``.

    Leading whitespace is dropped; trailing whitespace is held until more text follows it, and
    never released if nothing does.
    """

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        combined = self._pending + text
        released = combined.rstrip()
        self._pending = combined[len(released):]
        return released


class ToolCallStreamer:
    """Incremental ``parse``: feed text deltas, get OpenAI chat-chunk ``delta`` dicts back.

    Content streams as it arrives, except a tail that could still become a start marker (and
    whitespace that could turn out to be trailing). Each call is held until its end marker (or
    ``finish``), then sent as two deltas: id and name with empty arguments, then all arguments.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._buf = ""  # undecided text: a possible-marker tail, or the body of an open call
        self._in_call = False
        self._scanned = 0  # in a call: how much of _buf was searched for the end marker
        self._content = _ContentStripper()
        self._next_index = 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._buf += delta
        out: list[dict[str, Any]] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Decide whatever is still held: an open call, or a tail that was not a marker."""
        out: list[dict[str, Any]] = []
        if self._in_call:
            self._close_call(self._buf, closed=False, out=out)
        else:
            self._emit_content(self._buf, out)
        self._buf, self._in_call, self._scanned = "", False, 0
        return out

    def _step(self, out: list[dict[str, Any]]) -> bool:
        """Consume what can be decided in _buf; True if the state changed and it may go on."""
        p = self._parser
        if self._in_call:
            end = self._buf.find(p.end_marker, self._scanned)
            if end == -1:
                self._scanned = max(0, len(self._buf) - len(p.end_marker) + 1)
                return False
            self._close_call(self._buf[:end], closed=True, out=out)
            self._buf = self._buf[end + len(p.end_marker):]
            self._in_call, self._scanned = False, 0
            return True
        start = self._buf.find(p.start_marker)
        if start == -1:
            keep = _marker_prefix_len(self._buf, p.start_marker)
            self._emit_content(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._emit_content(self._buf[:start], out)
        self._buf = self._buf[start + len(p.start_marker):]
        self._in_call = True
        return True

    def _close_call(self, body: str, closed: bool, out: list[dict[str, Any]]) -> None:
        p = self._parser
        call = p.make_call(body)
        if call is None:
            self._emit_content(p.start_marker + body + (p.end_marker if closed else ""), out)
            return
        index, self._next_index = self._next_index, self._next_index + 1
        out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})

    def _emit_content(self, text: str, out: list[dict[str, Any]]) -> None:
        released = self._content.push(text)
        if released:
            out.append({"content": released})


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    HermesToolParser.name: HermesToolParser,
}


def get_tool_parser(name: str, id_factory: IdFactory = new_call_id) -> ToolCallParser:
    """A parser by its registry name; ValueError listing the known names if there is none."""
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known parsers: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
    return cls(id_factory)
