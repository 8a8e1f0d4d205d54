"""What every tool-call syntax shares: calls, the parsed message, and the parser's contract.

A parser splits a model's output into content and *blocks*. A block starts where the family's
syntax opens one (``find_start``: a marker such as ``<tool_call>``, or for families whose whole
answer is the calls, an opener at the very start) and ends where ``block_end`` says (an end
marker, or a balanced bracket). A block holds one call or several. ``parse`` and the streamer
(``ToolCallStreamer``) walk the text the same way, so a streamed answer reassembles to what
``parse`` returns for the whole text (the one exception, a call cut off after it was opened, is
in ``ToolCallStreamer``'s docstring):

- text outside the blocks is content; the content is the concatenation of those pieces with
  leading and trailing whitespace removed (``str.strip``), ``None`` when nothing is left;
- a block whose body does not decode to valid calls stays in the content verbatim;
- a block still open when the text ends is decoded as it stands (the output was cut off, or the
  model stopped right after the call): calls if that is valid, content otherwise.

``block_end`` must be prefix-stable: once it decides on some text, any longer text gives the
same answer. That is what lets the streamer decide a block as soon as it is closed.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.server.tools.json_stream import CallReader, canonical

IdFactory = Callable[[], str]
Call = tuple[str, dict[str, Any]]  # (function name, arguments)
Function = tuple[str, dict[str, Any]]  # (function name, parameters schema), for grammars


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
    """One family's call syntax, both ways: reading calls out of text (``find_start``,
    ``block_end``, ``decode_block``), writing them (``format_calls``) and constraining a model
    to write them (``forced_grammar``, ``auto_grammar``: llguidance Lark text)."""

    name: str
    # Families whose answer is either calls or text (no marker) open a block only at the start.
    leading = False
    # The call syntax uses control tokens, which decoding must keep (skip_special_tokens off).
    keeps_special_tokens = False
    # How the tool prompt (``prompt.tool_section``) tells a model to make several calls.
    several_calls = "write one block per call if you need several"

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        self.id_factory = id_factory or new_call_id

    # ---- reading ----------------------------------------------------------------------------
    @abstractmethod
    def find_start(self, text: str, pos: int) -> tuple[int, int] | None:
        """(block start, body start) of the first block opening at or after ``pos``."""

    @abstractmethod
    def start_hold(self, text: str) -> int:
        """How many characters at the end of ``text`` (which holds no start) could still become
        one: the streamer holds them back."""

    @abstractmethod
    def block_end(self, text: str, body_start: int, final: bool) -> tuple[int, int] | None:
        """(body end, block end) of the block whose body starts at ``body_start``; None while
        undecided. ``final``: ``text`` is the whole output."""

    @abstractmethod
    def decode_block(self, body: str) -> list[Call] | None:
        """The calls in a block body, or None if it is not a valid block."""

    # ---- writing ----------------------------------------------------------------------------
    @abstractmethod
    def format_calls(self, calls: Sequence[Call]) -> str:
        """The text the model writes for these calls (one turn), markers included."""

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        return self.format_calls([(name, arguments)])

    @abstractmethod
    def forced_grammar(self, functions: Sequence[Function], parallel: bool) -> str:
        """Lark grammar: the whole output is a call of one of ``functions`` (several with
        ``parallel``), written as ``format_calls`` writes them."""

    @abstractmethod
    def auto_grammar(self, functions: Sequence[Function], parallel: bool) -> str:
        """Lark grammar: free text, but whatever the model writes as a call is a valid call of
        one of ``functions`` (without ``parallel``, text after the first call is free)."""

    def body_extent(self, text: str, body_start: int) -> int:
        """How far the open block's body may reach in ``text``: the call reader is given no
        more. Families whose body ends where its syntax ends leave that to the reader."""
        return len(text)

    def call_reader(self) -> CallReader | None:
        """A reader that opens calls and streams their arguments while the block is written
        (``json_stream.py``), or None: calls go out whole when the block closes."""
        return None

    def for_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> ToolCallParser:
        """This parser for one request's tools. Families whose calls carry untyped text (XML
        parameters) read the tools' schemas to type the arguments; the rest ignore them."""
        return self

    # ---- the shared walk --------------------------------------------------------------------
    def parse(self, text: str) -> ParsedMessage:
        """Split a complete output into content and calls (never raises on bad calls)."""
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (found := self._start(text, pos)) is not None:
            start, body_start = found
            pieces.append(text[pos:start])
            ends = self.block_end(text, body_start, final=True)
            body_end, pos = ends if ends is not None else (len(text), len(text))
            made = self.make_calls(text[body_start:body_end])
            if made is None:
                pieces.append(text[start:pos])
            else:
                calls += made
        pieces.append(text[pos:])
        return ParsedMessage(content="".join(pieces).strip() or None, tool_calls=calls)

    def _start(self, text: str, pos: int) -> tuple[int, int] | None:
        # A leading family's only block opens before any content (whitespace aside).
        if self.leading and pos > 0:
            return None
        return self.find_start(text, pos)

    def make_calls(self, body: str) -> list[ToolCall] | None:
        """ToolCalls (fresh ids) for a block body, or None if it holds no valid call."""
        decoded = self.decode_block(body)
        if not decoded:
            return None
        return [ToolCall(self.id_factory(), name, arguments_json(arguments))
                for name, arguments in decoded]

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self)


def arguments_json(arguments: dict[str, Any]) -> str:
    """Arguments as calls carry them: compact JSON, non-ASCII text kept as it is; a lone
    surrogate the model wrote as an escape stays escaped (it could not be sent as UTF-8)."""
    return canonical(arguments)


def as_arguments(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: missing means none, a JSON-encoded object is decoded, else None."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def json_call(obj: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> Call | None:
    """(name, arguments) of a ``{"name": ..., "arguments": {...}}`` object, else None. Models
    were trained with "arguments" or "parameters" for the same thing: both are read."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw = next((obj[k] for k in arguments_keys if k in obj), None)
    arguments = as_arguments(raw)
    return None if arguments is None else (obj["name"], arguments)


def marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def skip_space(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after ``i`` (``len`` if none)."""
    while i < len(text) and text[i].isspace():
        i += 1
    return i


_PLAIN = re.compile(r"""[^"'\\()\[\]{}]+""")  # nothing that opens, closes or quotes
_IN_QUOTE = {q: re.compile(rf"[^{q}\\]+") for q in "\"'"}


def balanced_end(text: str, start: int) -> int | None:
    """The index just past the bracket that closes the one at ``text[start]``, or None if it is
    not closed yet. Brackets inside strings (JSON's double quotes, Python's single ones too) do
    not count; the kinds of bracket are not matched against each other (the decoder checks).
    Runs of ordinary characters are skipped by regex: the streamer rescans open blocks."""
    depth, quote, i = 0, "", start
    while i < len(text):
        skip = (_IN_QUOTE[quote] if quote else _PLAIN).match(text, i)
        if skip is not None:
            i = skip.end()
            continue
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        else:  # a closing bracket: the only character left
            depth -= 1
            if depth <= 0:
                return i + 1
        i += 1
    return None


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

    Content streams as it arrives, except a tail that could still open a block (and whitespace
    that could turn out to be trailing). A call is sent as a delta with its id and name (empty
    arguments), then deltas of its arguments. For a family with a ``call_reader`` the call
    opens as soon as its name is read and its arguments have begun, and its arguments go out
    as the model writes them, re-written as ``parse`` writes them, so for a block that decodes
    the deltas concatenate to ``parse``'s arguments whatever the chunking. Other families'
    calls (and calls whose arguments the reader cannot stream) are sent when the block closes.

    A call once opened is never taken back. If its block then fails to decode (the output was
    cut off mid-call, or the text stops being the family's syntax), that call keeps the
    arguments sent so far and the block's text is not content; ``parse``, which sees the whole
    text, keeps such a block as content. That is the one place where the stream and ``parse``
    differ, and it depends only on the text, never on how it was chunked.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._buf = ""  # undecided text: a possible-start tail, or an open block from its start
        self._body = -1  # in a block: where its body starts in _buf; -1 outside one
        self._consumed = 0  # characters decided and dropped from _buf so far
        self._content = _ContentStripper()
        self._next_index = 0
        self._reader: CallReader | None = None  # the open block's call reader
        self._read = 0  # how much of the open block's body the reader was given
        self._opened: list[list[Any]] = []  # the open block's calls sent: [index, arguments]

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._buf += delta
        out: list[dict[str, Any]] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Decide whatever is still held: an open block, or a tail that opened none."""
        out: list[dict[str, Any]] = []
        while self._buf and self._step(out, final=True):
            pass
        if self._body >= 0:
            self._close_block(len(self._buf), len(self._buf), out)
        else:
            self._emit_content(self._buf, out)
        self._buf, self._body = "", -1
        return out

    def _step(self, out: list[dict[str, Any]], final: bool) -> bool:
        """Consume what can be decided in _buf; True if the state changed and it may go on."""
        p = self._parser
        if self._body >= 0:
            self._read_body(p.body_extent(self._buf, self._body), out)
            ends = p.block_end(self._buf, self._body, final)
            if ends is None:
                return False
            self._close_block(*ends, out)
            return True
        found = None if p.leading and self._consumed else p.find_start(self._buf, 0)
        if found is None:
            keep = 0 if final or (p.leading and self._consumed) else p.start_hold(self._buf)
            self._take(len(self._buf) - keep, out)
            return False
        start, body = found
        self._take(start, out)
        self._body = body - start
        self._reader, self._read, self._opened = p.call_reader(), 0, []
        return True

    def _take(self, n: int, out: list[dict[str, Any]]) -> None:
        """Emit the first ``n`` characters of _buf as content."""
        self._emit_content(self._buf[:n], out)
        self._buf = self._buf[n:]
        self._consumed += n

    def _read_body(self, upto: int, out: list[dict[str, Any]]) -> None:
        """Give the call reader the body up to ``upto``; send the calls it opens and their
        arguments, one delta per call."""
        start = self._body + self._read
        if self._reader is None or upto <= start:
            return
        pieces = self._reader.feed(self._buf[start:upto])
        self._read = upto - self._body
        merged: dict[int, list[str]] = {}
        for number, name, text in pieces:
            if name is not None:
                self._opened.append([self._open_call(name, out), ""])
            merged.setdefault(number, []).append(text)
        for number, texts in merged.items():
            self._send_arguments(number, "".join(texts), out)

    def _open_call(self, name: str, out: list[dict[str, Any]]) -> int:
        index, self._next_index = self._next_index, self._next_index + 1
        out.append({"tool_calls": [{"index": index, "id": self._parser.id_factory(),
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        return index

    def _send_arguments(self, number: int, text: str, out: list[dict[str, Any]]) -> None:
        if text:
            call = self._opened[number]
            call[1] += text
            out.append({"tool_calls": [{"index": call[0], "function": {"arguments": text}}]})

    def _close_block(self, body_end: int, end: int, out: list[dict[str, Any]]) -> None:
        self._read_body(body_end, out)
        decoded = self._parser.decode_block(self._buf[self._body:body_end]) or []
        if not decoded and not self._opened:
            self._emit_content(self._buf[:end], out)
        for number, (name, arguments) in enumerate(decoded):
            text = arguments_json(arguments)
            if number == len(self._opened):
                self._opened.append([self._open_call(name, out), ""])
            sent = self._opened[number][1]
            # a reader's text is a prefix of ``text`` unless a key was written twice
            self._send_arguments(number, text[len(sent):] if text.startswith(sent) else "", out)
        if len(self._opened) > len(decoded):  # a call cut off: its text is the call's
            end = max(end, self._body + self._reader.position)
        self._buf = self._buf[end:]
        self._consumed += end or 1  # an empty block still counts as something decided
        self._body, self._reader, self._opened = -1, None, []

    def _emit_content(self, text: str, out: list[dict[str, Any]]) -> None:
        released = self._content.push(text)
        if released:
            out.append({"content": released})


def json_calls_schema(functions: Sequence[Function], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one ``{"name": ..., "<arguments_key>": {...}}`` call of any of
    ``functions``, compact (no free whitespace) as json outputs are."""
    bodies = [{"type": "object",
               "properties": {"name": {"const": name}, arguments_key: parameters},
               "required": ["name", arguments_key], "additionalProperties": False}
              for name, parameters in functions]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    body["x-guidance"] = {"whitespace_flexible": False}
    return body


def lark_json(schema: dict[str, Any]) -> str:
    """llguidance's inline JSON-schema lexeme."""
    return f"%json {json.dumps(schema)}"
