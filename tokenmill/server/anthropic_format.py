"""Anthropic's Messages API answer: content blocks and typed stream events from one builder.

The generated text goes through the reasoning splitter (when the server has one: ``thinking``
blocks), then the tool-call parser (when tools are active: ``tool_use`` blocks); what is left is
``text``. A block opens at its first piece and closes when a block of another kind starts, so a
stream is ``message_start``, then per block ``content_block_start`` / ``_delta``... / ``_stop``,
then ``message_delta`` (stop reason, usage) and ``message_stop``. A non-streamed answer feeds
the whole text once and gets the blocks a stream ends with.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from tokenmill.request import FinishReason, RequestOutput
from tokenmill.server.formatters import ChoiceCursor, OutputFormatter, Outputs, TokenText
from tokenmill.server.protocol import APIError
from tokenmill.server.reasoning import ReasoningSetup
from tokenmill.server.tools.parsers import ToolCallParser

Events = list[dict[str, Any]]

# Anthropic's error types by HTTP status; other statuses keep their OpenAI-side type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    """An API error as Anthropic shapes it: ``{"type": "error", "error": {type, message}}``."""
    kind = _ERROR_TYPES.get(anthropic_status(error), "invalid_request_error"
                            if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def anthropic_status(error: APIError) -> int:
    """The HTTP status Anthropic's clients expect: the server's overload (its 503 with
    Retry-After) is Anthropic's 529, which their SDKs retry after the Retry-After delay."""
    return 529 if error.status == 503 and error.code == "overloaded" else error.status


def thinking_signature(thinking: str) -> str:
    """A thinking block's ``signature``: nothing is encrypted here, so it is a digest of the
    thinking text, the same for a streamed and a whole answer (clients that drop unsigned
    thinking blocks keep these)."""
    return hashlib.blake2b(thinking.encode("utf-8", "surrogatepass"),
                           digest_size=16).hexdigest()


class DeltaStreamer(Protocol):
    """Text in, pieces out: the tool-call streamer's chat deltas (``{"content"}``,
    ``{"tool_calls"}``), the reasoning streamer's ``(kind, text)`` pairs."""

    def feed(self, delta: str) -> list[Any]: ...

    def finish(self) -> list[Any]: ...


def anthropic_usage(out: RequestOutput) -> dict[str, Any]:
    """Prompt tokens read from the prefix cache are ``cache_read_input_tokens``, the rest
    ``input_tokens`` (their sum is the prompt, as ``count_tokens`` counts it)."""
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": len(out.outputs[0].token_ids)}


def stop_reason(out: RequestOutput, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    c = out.outputs[0]
    if c.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if c.finish_reason is not FinishReason.STOP:
        return None, None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class MessagesFormatter(OutputFormatter):
    """``/v1/messages``: the message object, or ``event:`` lines of Anthropic's event types.
    With ``reasoning`` the thinking is split off into ``thinking`` blocks (dropped unless
    ``reasoning.include``)."""

    def __init__(self, rid: str, model: str, token_text: TokenText,
                 parser: ToolCallParser | None, call_limit: int | None,
                 reasoning: ReasoningSetup | None = None):
        super().__init__(rid, model, token_text)
        self.blocks: list[dict[str, Any]] = []
        self._tools: DeltaStreamer | None = parser.streamer() if parser is not None else None
        self._reasoning: DeltaStreamer | None = reasoning.streamer() if reasoning else None
        self._show_thinking = reasoning is not None and reasoning.include
        self._limit = call_limit  # the most tool calls kept; later ones are dropped
        self._open: dict[str, Any] | None = None  # the block being written
        self._json: dict[int, list[str]] = {}  # a tool_use block's input, as sent
        self.called = False

    # ----- the formatter contract -------------------------------------------------------------

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        final = finals[0]
        self.feed(final.outputs[0].text)
        self.finish()
        reason, sequence = stop_reason(final, self.called)
        return {**self._head(), "content": self.blocks, "stop_reason": reason,
                "stop_sequence": sequence, "usage": anthropic_usage(final)}

    async def events(self, outputs: Outputs) -> AsyncIterator[dict[str, Any]]:
        final, cursor = None, ChoiceCursor()
        async for _, out in outputs:
            if final is None:  # its usage says how much of the prompt was cached
                yield self._message_start(out)
                yield {"type": "ping"}
            final = out
            text, _, _ = cursor.take(final.outputs[0])
            for event in self.feed(text):
                yield event
        if final is None:
            raise APIError(500, "the request ended without output", "server_error")
        for event in self.finish():
            yield event
        reason, sequence = stop_reason(final, self.called)
        usage = anthropic_usage(final)
        yield {"type": "message_delta", "delta": {"stop_reason": reason,
                                                  "stop_sequence": sequence},
               "usage": usage}
        yield {"type": "message_stop"}

    def encode(self, event: dict[str, Any]) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def failed(self, error: APIError) -> list[str]:
        return [self.encode(error_body(error))]

    def _head(self) -> dict[str, Any]:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model}

    def _message_start(self, first: RequestOutput) -> dict[str, Any]:
        usage = {**anthropic_usage(first), "output_tokens": 0}
        return {"type": "message_start",
                "message": {**self._head(), "content": [], "stop_reason": None,
                            "stop_sequence": None, "usage": usage}}

    # ----- content blocks ---------------------------------------------------------------------

    def feed(self, text: str) -> Events:
        """The events of new text."""
        events: Events = []
        if text:
            self._split(text, events)
        return events

    def finish(self) -> Events:
        """The events that decide what the streamers still hold and close the last block."""
        events: Events = []
        if self._reasoning is not None:
            self._route(self._reasoning.finish(), events)
        if self._tools is not None:
            self._apply(self._tools.finish(), events)
        self._close(events)
        return events

    def _split(self, text: str, events: Events) -> None:
        if self._reasoning is None:
            self._content(text, events)
        else:
            self._route(self._reasoning.feed(text), events)

    def _route(self, pieces: list[tuple[str, str]], events: Events) -> None:
        """The reasoning streamer's pieces: thinking, and content for the tool parser."""
        for kind, text in pieces:
            if kind == "content":
                self._content(text, events)
            elif text and self._show_thinking:
                self._add("thinking", text, events)

    def _content(self, text: str, events: Events) -> None:
        if self._tools is None:
            self._add("text", text, events)
        else:
            self._apply(self._tools.feed(text), events)

    def _apply(self, deltas: list[dict[str, Any]], events: Events) -> None:
        """The tool streamer's chat deltas: text, or a call (its id and name, then input)."""
        for delta in deltas:
            if delta.get("content"):
                self._add("text", delta["content"], events)
            for call in delta.get("tool_calls") or ():
                if self._limit is not None and call["index"] >= self._limit:
                    continue
                if "id" in call:
                    self._open_tool(call, events)
                arguments = (call.get("function") or {}).get("arguments")
                if arguments:
                    self._add("tool_use", arguments, events)

    def _open_tool(self, call: dict[str, Any], events: Events) -> None:
        self._close(events)
        block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                 "name": call["function"]["name"], "input": {}}
        self._start(block, events)
        self.called = True

    def _add(self, kind: str, piece: str, events: Events) -> None:
        """``piece`` of a block of ``kind``, in the open block when it is one."""
        if self._open is None or self._open["type"] != kind:
            self._close(events)
            self._start({"type": kind, kind: ""} if kind == "text"
                        else {"type": "thinking", "thinking": "", "signature": ""}, events)
        block, index = self._open, len(self.blocks) - 1
        if kind == "tool_use":
            self._json.setdefault(index, []).append(piece)
            delta = {"type": "input_json_delta", "partial_json": piece}
        elif kind == "text":
            block["text"] += piece
            delta = {"type": "text_delta", "text": piece}
        else:
            block["thinking"] += piece
            delta = {"type": "thinking_delta", "thinking": piece}
        events.append({"type": "content_block_delta", "index": index, "delta": delta})

    def _start(self, block: dict[str, Any], events: Events) -> None:
        self.blocks.append(block)
        self._open = block
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                       "content_block": dict(block)})

    def _close(self, events: Events) -> None:
        if self._open is None:
            return
        index = len(self.blocks) - 1
        if self._open["type"] == "tool_use":
            self._open["input"] = _tool_input("".join(self._json.pop(index, [])))
        if self._open["type"] == "thinking":
            signature = self._open["signature"] = thinking_signature(self._open["thinking"])
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": signature}})
        events.append({"type": "content_block_stop", "index": index})
        self._open = None


def _tool_input(text: str) -> dict[str, Any]:
    """A tool_use block's input from the JSON streamed for it; {} when the output was cut off
    in the middle of it (the stop reason, max_tokens, says so)."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
