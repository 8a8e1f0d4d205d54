"""Families that open every block with a marker: hermes (SmolLM2, Qwen2.5, Hermes) and
mistral. Qwen3-Coder's XML calls (``xml_calls.py``) share the marker walk and grammars.

hermes, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

mistral, one block for all of a turn's calls (its 9-character ids are what Mistral's own
templates check for); the v11 tokenizers' ``[TOOL_CALLS]name[ARGS]{...}`` is read as well::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

Known limitation (hermes): an end marker written inside a JSON string ends the block early,
which makes that call invalid (it is then content), in ``parse`` and in the streamer alike.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Sequence
from tokenmill.server.tools.base import (
    Call,
    Function,
    IdFactory,
    ToolCallParser,
    balanced_end,
    json_call,
    json_calls_schema,
    lark_json,
    marker_prefix_len,
    skip_space,
)
from tokenmill.server.tools.json_stream import CallReader, JsonCallReader


class MarkerToolParser(ToolCallParser):
    """Blocks open at ``start_marker``; subclasses say where they end and what follows the
    marker in a grammar (``after_marker``)."""

    start_marker: str
    # Forced parallel calls: several blocks one per line (True), or several calls in one block.
    repeat_blocks = True

    def find_start(self, text: str, pos: int) -> tuple[int, int] | None:
        start = text.find(self.start_marker, pos)
        return None if start == -1 else (start, start + len(self.start_marker))

    def start_hold(self, text: str) -> int:
        return marker_prefix_len(text, self.start_marker)

    def marker_extent(self, text: str, body_start: int, end_marker: str) -> int:
        """``body_extent`` for a block that ends at ``end_marker``: up to it, or while it is
        not written, short of a tail that could still become it."""
        end = text.find(end_marker, body_start)
        if end != -1:
            return end
        return max(body_start, len(text) - marker_prefix_len(text, end_marker))

    def after_marker(self, functions: Sequence[Function], parallel: bool) -> str:
        """Lark rules defining ``after``: what follows the start marker in one block (with
        ``parallel`` and one block per turn, all of the turn's calls)."""
        raise NotImplementedError

    def forced_grammar(self, functions: Sequence[Function], parallel: bool) -> str:
        repeat = ' ("\\n" block)*' if parallel and self.repeat_blocks else ""
        return (f"start: block{repeat}\n"
                f"block: {json.dumps(self.start_marker)} after\n"
                f"{self.after_marker(functions, parallel and not self.repeat_blocks)}")

    def auto_grammar(self, functions: Sequence[Function], parallel: bool) -> str:
        # Free text up to each marker (lazy: it ends at the first one), a checked block after.
        return ("%llguidance {}\n"
                f"start: block{'*' if parallel else '?'} text\n"
                "text: TEXT\n"
                "TEXT: /(.|\\n)*/\n"
                f"marker[lazy]: TEXT {json.dumps(self.start_marker)}\n"
                "block: marker after\n"
                f"{self.after_marker(functions, parallel and not self.repeat_blocks)}")


class HermesToolParser(MarkerToolParser):
    """``<tool_call>`` + a JSON object with "name" and "arguments" + ``</tool_call>``."""

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def block_end(self, text: str, body_start: int, final: bool) -> tuple[int, int] | None:
        end = text.find(self.end_marker, body_start)
        return None if end == -1 else (end, end + len(self.end_marker))

    def body_extent(self, text: str, body_start: int) -> int:
        return self.marker_extent(text, body_start, self.end_marker)

    def call_reader(self) -> CallReader:
        return JsonCallReader(("arguments", "parameters"))

    def decode_block(self, body: str) -> list[Call] | None:
        try:
            call = json_call(json.loads(body))
        except ValueError:
            return None
        return None if call is None else [call]

    def format_calls(self, calls: Sequence[Call]) -> str:
        return "\n".join(
            f"{self.start_marker}\n"
            f"{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n"
            f"{self.end_marker}" for name, arguments in calls)

    def after_marker(self, functions: Sequence[Function], parallel: bool) -> str:
        end = json.dumps("\n" + self.end_marker)
        return f'after: "\\n" {lark_json(json_calls_schema(functions, "arguments"))} {end}\n'


_MISTRAL_ID_CHARS = string.ascii_letters + string.digits
_V11_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_V11_ARGS = "[ARGS]"


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other call id."""
    return "".join(random.choices(_MISTRAL_ID_CHARS, k=9))


class MistralToolParser(MarkerToolParser):
    """``[TOOL_CALLS]`` + a JSON array of ``{"name", "arguments"}`` objects (or one object, or
    v11's ``name[ARGS]{...}``). The block ends where its JSON closes.

    ``[TOOL_CALLS]`` is a control token of Mistral's tokenizers: the server must decode the
    output with special tokens kept for it to reach the parser."""

    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    repeat_blocks = False
    keeps_special_tokens = True
    several_calls = "put several calls in the same list"

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory or mistral_call_id)

    def call_reader(self) -> CallReader:
        # v11's ``name[ARGS]{...}`` is no JSON value: the reader stops and the block goes out
        # whole when it closes
        return JsonCallReader(("arguments", "parameters"), lists=True)

    def block_end(self, text: str, body_start: int, final: bool) -> tuple[int, int] | None:
        i = skip_space(text, body_start)
        if i == len(text):
            return (i, i) if final else None
        if text[i] not in "[{":
            return self._v11_end(text, i, final)
        end = balanced_end(text, i)
        return None if end is None else (end, end)

    @staticmethod
    def _v11_end(text: str, i: int, final: bool) -> tuple[int, int] | None:
        """``name[ARGS]{...}``: the end of its JSON; a body that cannot be one ends at once."""
        name = _V11_NAME.match(text, i)
        if name is None:
            return (i, i)
        rest = text[name.end():]
        if not rest.startswith(_V11_ARGS):
            undecided = _V11_ARGS.startswith(rest) and not final
            return None if undecided else (name.end(), name.end())
        brace = name.end() + len(_V11_ARGS)
        if brace == len(text) or text[brace] != "{":
            return None if brace == len(text) and not final else (brace, brace)
        end = balanced_end(text, brace)
        return None if end is None else (end, end)

    def decode_block(self, body: str) -> list[Call] | None:
        body = body.strip()
        v11 = _V11_NAME.match(body)
        try:
            if v11 is not None and body[v11.end():].startswith(_V11_ARGS):
                value = {"name": v11.group(),
                         "arguments": json.loads(body[v11.end() + len(_V11_ARGS):])}
            else:
                value = json.loads(body)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [json_call(item) for item in items]
        return None if not calls or None in calls else calls

    def format_calls(self, calls: Sequence[Call]) -> str:
        items = [{"name": name, "arguments": arguments} for name, arguments in calls]
        return self.start_marker + json.dumps(items, ensure_ascii=False)

    def after_marker(self, functions: Sequence[Function], parallel: bool) -> str:
        item = lark_json(json_calls_schema(functions, "arguments"))
        more = ' (", " item)*' if parallel else ""
        return f'after: "[" item{more} "]"\nitem: {item}\n'
