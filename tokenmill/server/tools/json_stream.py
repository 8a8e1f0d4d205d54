"""Calls read while the model writes them, so a streamed call's arguments go out as it types.

``JsonRewriter`` reads one JSON value a character at a time and writes it again as
``json.dumps(value, ensure_ascii=False)`` would (``canonical``), each piece as soon as it is
certain: brackets and separators at once, strings a character at a time, a number once a
delimiter ends it. What it has written is therefore always a prefix of the canonical text of the
whole value, which is what a non-streamed call's ``arguments`` hold: a streamed call's argument
deltas concatenate to them.

``CallReader`` is what the tool streamer (``base.ToolCallStreamer``) asks of a family that can
stream arguments: fed a block's body as it grows, it returns ``CallDelta``s — a call *opened*
(its name known and its arguments begun) and pieces of its arguments. ``JsonCallReader`` reads
the JSON families (hermes, mistral, llama3_json); ``xml_calls.XmlCallReader`` Qwen3-Coder's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# (call number in the block, its name when this delta opens it else None, arguments text)
CallDelta = tuple[int, str | None, str]
Path = tuple[Any, ...]  # member keys and element indices from the value's root

_LONE = re.compile("[\ud800-\udfff]")
_WS = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_TOKEN = re.compile(r"[A-Za-z0-9+\-.]*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"true", "false", "null", "NaN", "Infinity", "-Infinity"}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}


def escape_lone_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as a JSON escape: it could not be sent as
    UTF-8, and the escape reads back as the same string."""
    return _LONE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def canonical(value: Any) -> str:
    """A JSON value as tool-call arguments are written: compact separators, non-ASCII kept,
    lone surrogates escaped."""
    return escape_lone_surrogates(json.dumps(value, ensure_ascii=False))


class CallReader:
    """Reads the calls of one block while its body is written. ``feed`` takes the next text
    of the body (only text certain to belong to it); ``position`` is how much of the body the
    reader has used: a call cut off owns the text up to there. A call it opened stays a call:
    the streamer never takes it back."""

    position = 0

    def feed(self, text: str) -> list[CallDelta]:
        raise NotImplementedError


class JsonRewriter:
    """One JSON value, read as it arrives and re-written canonically (see the module
    docstring). ``take()`` returns the pieces written since the last call, each with the path
    of the value it belongs to (a container's brackets, keys and separators belong to the
    container), and ``(path, None)`` when the value at ``path`` is complete."""

    def __init__(self, text: str = "", pos: int = 0) -> None:
        self.text, self.pos = text, pos
        self.done = self.failed = False
        self.top: str | None = None  # "{" or "[" once the value opens as a container
        self._keys: list[Any] = []  # per open container: its current member key or index
        self._kinds: list[str] = []  # per open container: "{" or "["
        self._state = "value"
        self._key: list[str] | None = None  # the decoded key being read, in a key string
        self._out: list[tuple[Path, str | None]] = []

    def feed(self, text: str) -> None:
        self.text += text
        self.run()

    def take(self) -> list[tuple[Path, str | None]]:
        out, self._out = self._out, []
        return out

    def run(self) -> None:
        """Read as far as the text allows."""
        while not (self.done or self.failed) and self.pos < len(self.text):
            before = (self.pos, self._state)
            getattr(self, f"_{self._state}")()
            if (self.pos, self._state) == before:
                return  # waiting for more text

    # ---- states: each reads from self.pos, advances or waits --------------------------------
    def _value(self) -> None:
        self.pos = _WS.match(self.text, self.pos).end()
        if self.pos == len(self.text):
            return
        ch = self.text[self.pos]
        if ch in "{[":
            self.top = self.top or ch
            self._emit(ch)
            self._kinds.append(ch)
            self._keys.append(None if ch == "{" else 0)
            self.pos += 1
            self._state = "first_key" if ch == "{" else "first_item"
        elif ch == '"':
            self._emit('"')
            self.pos += 1
            self._state = "string"
        else:
            self._state = "token"

    def _first_item(self) -> None:
        self.pos = _WS.match(self.text, self.pos).end()
        if self.pos < len(self.text):
            if self.text[self.pos] == "]":
                self._close()
            else:
                self._state = "value"

    def _first_key(self) -> None:
        self._key_start(closing_ok=True)

    def _member(self) -> None:
        self._key_start(closing_ok=False)

    def _key_start(self, closing_ok: bool) -> None:
        self.pos = _WS.match(self.text, self.pos).end()
        if self.pos == len(self.text):
            return
        ch = self.text[self.pos]
        if ch == "}" and closing_ok:
            self._close()
        elif ch == '"':
            self._emit('"', container=True)
            self._key = []
            self.pos += 1
            self._state = "string"
        else:
            self.failed = True

    def _colon(self) -> None:
        self.pos = _WS.match(self.text, self.pos).end()
        if self.pos < len(self.text):
            if self.text[self.pos] != ":":
                self.failed = True
                return
            self._emit(": ", container=True)
            self.pos += 1
            self._state = "value"

    def _next(self) -> None:
        self.pos = _WS.match(self.text, self.pos).end()
        if self.pos == len(self.text):
            return
        ch, kind = self.text[self.pos], self._kinds[-1]
        if ch == ",":
            self._emit(", ", container=True)
            self.pos += 1
            if kind == "[":
                self._keys[-1] += 1
            self._state = "member" if kind == "{" else "value"
        elif ch == ("}" if kind == "{" else "]"):
            self._close()
        else:
            self.failed = True

    def _token(self) -> None:
        """A number or a literal: read whole, once a delimiter ends it."""
        end = _TOKEN.match(self.text, self.pos).end()
        if end == len(self.text):
            return  # it may go on
        token = self.text[self.pos:end]
        if token not in _LITERALS and not _NUMBER.fullmatch(token):
            self.failed = True
            return
        try:
            self._emit(canonical(json.loads(token)))
        except ValueError:  # an integer too long for Python's int conversion
            self.failed = True
            return
        self.pos = end
        self._value_done()

    def _string(self) -> None:
        run = _STRING_RUN.match(self.text, self.pos)
        if run is not None:
            self._chars(run.group())
            self.pos = run.end()
            return
        ch = self.text[self.pos]
        if ch == '"':
            self.pos += 1
            self._string_done()
        elif ch == "\\":
            self._escape()
        else:  # a raw control character: json.loads refuses it
            self.failed = True

    def _escape(self) -> None:
        text, i = self.text, self.pos
        if i + 1 >= len(text):
            return
        kind = text[i + 1]
        if kind in _ESCAPES:
            self._chars(_ESCAPES[kind])
            self.pos = i + 2
            return
        if kind != "u":
            self.failed = True
            return
        code = _hex4(text, i + 2)
        if code is None:
            self.failed = len(text) >= i + 6
            return
        if 0xD800 <= code <= 0xDBFF:  # a high surrogate: a low one may follow as an escape
            after = text[i + 6:i + 12]
            if len(after) < 6 and _may_start_escape(after):
                return
            low = _hex4(text, i + 8) if after.startswith("\\u") else None
            if low is not None and 0xDC00 <= low <= 0xDFFF:
                self._chars(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                self.pos = i + 12
                return
        self._chars(chr(code))
        self.pos = i + 6

    # ---- output ---------------------------------------------------------------------------
    def _chars(self, decoded: str) -> None:
        if self._key is not None:
            self._key.append(decoded)
        self._emit(canonical(decoded)[1:-1], container=self._key is not None)

    def _string_done(self) -> None:
        if self._key is None:
            self._emit('"')
            self._value_done()
            return
        self._emit('"', container=True)
        self._keys[-1] = "".join(self._key)
        self._key = None
        self._state = "colon"

    def _close(self) -> None:
        self._emit("}" if self._kinds.pop() == "{" else "]", container=True)
        self._keys.pop()
        self.pos += 1
        self._value_done()

    def _value_done(self) -> None:
        self._out.append((tuple(self._keys), None))
        if self._kinds:
            self._state = "next"
        else:
            self.done = True

    def _emit(self, piece: str, container: bool = False) -> None:
        if piece:
            path = self._keys[:-1] if container else self._keys
            self._out.append((tuple(path), piece))


def _may_start_escape(text: str) -> bool:
    """Whether ``text`` could be the start of a ``\\uXXXX`` escape."""
    return "\\u".startswith(text[:2]) and all(c in _HEX for c in text[2:])


def _hex4(text: str, i: int) -> int | None:
    digits = text[i:i + 4]
    if len(digits) < 4 or any(c not in _HEX for c in digits):
        return None
    return int(digits, 16)


@dataclass
class _Call:
    """One call object being read: its name, which key holds its arguments, and the
    arguments' text while the name is still unknown."""

    name: str | None = None
    name_text: list[str] = field(default_factory=list)
    key: str | None = None
    streams: bool = False  # its arguments are an object, re-written as they arrive
    held: list[str] = field(default_factory=list)
    number: int | None = None  # its number among the block's opened calls, once opened


class JsonCallReader(CallReader):
    """Calls written as JSON objects ``{"name": ..., "<arguments key>": {...}}``: one object
    (hermes), several separated by ``separator`` (llama3_json's ``;``), or, with ``lists``,
    a JSON array of them (mistral). A call opens once its name is read and its arguments
    object has begun; arguments given any other way (a JSON-encoded string) are left to the
    block's end."""

    def __init__(self, arguments_keys: Sequence[str], separator: str | None = None,
                 lists: bool = False) -> None:
        self._arg_keys = tuple(arguments_keys)
        self._separator = separator
        self._lists = lists
        self._json = JsonRewriter()
        self._value = 0  # which top-level value is being read
        self._calls: dict[Path, _Call] = {}
        self._opened = 0
        self._stopped = False

    @property
    def position(self) -> int:  # type: ignore[override]
        """Inside a value, all it was given (a number may still be going on); else where it
        ended or went wrong."""
        j = self._json
        return j.pos if j.done or j.failed or self._stopped else len(j.text)

    def feed(self, text: str) -> list[CallDelta]:
        out: list[CallDelta] = []
        self._json.text += text
        while not self._stopped:
            self._json.run()
            for path, piece in self._json.take():
                self._piece(path, piece, out)
            if not self._json.done or not self._next_value():
                break
        return out

    def _next_value(self) -> bool:
        """After a complete value: start the next one if a separator follows."""
        j = self._json
        i = _WS.match(j.text, j.pos).end()
        if i == len(j.text):
            return False
        if self._separator is None or j.text[i] != self._separator:
            self._stopped = True
            return False
        self._json = JsonRewriter(j.text, i + 1)
        self._value += 1
        return True

    def _piece(self, path: Path, piece: str | None, out: list[CallDelta]) -> None:
        """Route a piece of the value to the call it belongs to: the value itself, or with
        ``lists`` each element of an array."""
        top = self._json.top
        if top == "[" and not self._lists:
            return
        depth = 1 if top == "[" else 0  # path items before a call's member key
        if len(path) <= depth:
            return  # the call object's own brackets and keys, or the array's
        call = self._calls.setdefault((self._value, *path[:depth]), _Call())
        member, inner = path[depth], path[depth + 1:]
        if member == "name" and not inner:
            self._name(call, piece, out)
        elif member in self._arg_keys:
            self._arguments(call, member, bool(inner), piece, out)

    def _name(self, call: _Call, piece: str | None, out: list[CallDelta]) -> None:
        if piece is not None:
            call.name_text.append(piece)
            return
        if call.name is None:
            try:
                name = json.loads("".join(call.name_text))
            except ValueError:  # not a string: the call is not valid, so it never opens
                return
            if isinstance(name, str) and name:
                call.name = name
                self._open(call, out)

    def _arguments(self, call: _Call, key: str, inner: bool, piece: str | None,
                   out: list[CallDelta]) -> None:
        if call.key is None:
            call.key, call.streams = key, piece == "{" and not inner
        if key != call.key or not call.streams or piece is None:
            return
        if call.number is None:
            call.held.append(piece)
            self._open(call, out)
        else:
            out.append((call.number, None, piece))

    def _open(self, call: _Call, out: list[CallDelta]) -> None:
        if call.number is None and call.name is not None and call.streams:
            call.number, self._opened = self._opened, self._opened + 1
            out.append((call.number, call.name, "".join(call.held)))
            call.held = []
