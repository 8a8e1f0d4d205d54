"""The Responses API's formatter: output items and typed stream events from one builder.

Text goes to one message item (opened at its first text, closed at the end); with a tool
parser each call becomes a function_call item, opened when the tool streamer opens the call and
given ``function_call_arguments.delta`` events as the model writes the arguments (closed at the
next text or call, or at the end). With a reasoning parser the thinking comes first, as a
reasoning item (``reasoning_text`` content) closed when the answer starts. A non-streamed
response feeds the whole text once and gets the same items a stream ends with.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.request import FinishReason, RequestOutput
from tokenmill.server.formatters import ChoiceCursor, OutputFormatter, Outputs, TokenText
from tokenmill.server.protocol import APIError
from tokenmill.server.reasoning import ReasoningSetup
from tokenmill.server.responses_request import ResponsesRequest
from tokenmill.server.tools.parsers import ToolCallParser

Events = list[dict[str, Any]]


@dataclass
class ResponseHead:
    """One response being made: what its object says back, and what the store keeps of it."""

    rid: str
    model: str
    req: ResponsesRequest
    tools: list[dict[str, Any]]  # as the response object lists them
    text: dict[str, Any]  # the ``text`` field said back
    history: list[dict[str, Any]]  # the previous responses' items and this input's
    namespace: str = ""  # whose store it is kept in (responses.namespace)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: dict | None = None,
             incomplete: dict | None = None, error: dict | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at,
            "status": status, "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "safety_identifier": req.safety_identifier, "service_tier": "default",
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": self.text, "tool_choice": req.tool_choice or "auto",
            "tools": self.tools, "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user}


def responses_usage(out: RequestOutput) -> dict[str, Any]:
    prompt, output = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"input_tokens": prompt,
            # cache_write_tokens counts explicit cache breakpoints, which tokenmill has none of.
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def outcome(out: RequestOutput) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a finished request."""
    reason = out.outputs[0].finish_reason
    if reason is FinishReason.STOP:
        return "completed", None, None
    if reason is FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}, None
    return "failed", None, {"code": "server_error", "message": "the request was aborted"}


def _text_part(text: str, logprobs: list[dict]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _event_logprob(lp: dict) -> dict:
    """An output_text logprob as the delta/done events carry it (no bytes)."""
    return {"token": lp["token"], "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                             for t in lp["top_logprobs"]]}


class ResponsesFormatter(OutputFormatter):
    """``/v1/responses``: the response object, or ``event:`` lines numbered in order from
    ``response.created`` to ``response.completed`` (or incomplete, or failed). ``keep`` is
    given each finished body (the store decides what it keeps)."""

    def __init__(self, head: ResponseHead, token_text: TokenText,
                 parser: ToolCallParser | None, call_limit: int | None,
                 top_logprobs: int | None, keep: Callable[[ResponseHead, dict], None],
                 reasoning: ReasoningSetup | None = None):
        super().__init__(head.rid, head.model, token_text)
        self.head = head
        self.items: list[dict[str, Any]] = []
        self._streamer = parser.streamer() if parser is not None else None
        self._limit = call_limit  # the most function calls; later ones are dropped
        self._top = top_logprobs  # None: no logprobs asked for
        self._keep = keep
        self._message: dict[str, Any] | None = None  # the open message item
        self._index = 0  # its output index
        self._texts: list[str] = []
        self._logprobs: list[dict] = []
        self._call: dict[str, Any] | None = None  # the function call item being sent
        self._seq = itertools.count()
        self._thinker = reasoning.streamer() if reasoning is not None else None
        self._thought: dict[str, Any] | None = None  # the open reasoning item
        self._thought_texts: list[str] = []
        self._held: list[Any] = []  # logprob entries waiting for answer text

    # ----- the formatter contract -------------------------------------------------------------

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        final = finals[0]
        c = final.outputs[0]
        self.feed(c.text, c.logprobs or ())
        self.finish(outcome(final)[0])
        return self._finished(final)

    async def events(self, outputs: Outputs) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "response.created", "response": self.head.body("in_progress", [])}
        yield {"type": "response.in_progress", "response": self.head.body("in_progress", [])}
        final, cursor = None, ChoiceCursor()
        async for _, final in outputs:
            text, entries, _ = cursor.take(final.outputs[0])
            for event in self.feed(text, entries):
                yield event
        if final is None:
            yield self._failed_event("the request ended without output")
            return
        status = outcome(final)[0]
        for event in self.finish(status):
            yield event
        yield {"type": f"response.{status}", "response": self._finished(final)}

    def encode(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = next(self._seq)
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def failed(self, error: APIError) -> list[str]:
        return [self.encode(self._failed_event(error.message))]

    def _failed_event(self, message: str) -> dict[str, Any]:
        error = {"code": "server_error", "message": message}
        return {"type": "response.failed",
                "response": self.head.body("failed", self.items, error=error)}

    def _finished(self, final: RequestOutput) -> dict[str, Any]:
        status, incomplete, error = outcome(final)
        body = self.head.body(status, self.items, responses_usage(final), incomplete, error)
        self._keep(self.head, body)
        return body

    # ----- output items -----------------------------------------------------------------------

    def feed(self, text: str, entries: Sequence[Any] = ()) -> Events:
        """The events of new text (and its logprob entries)."""
        if self._thinker is None:
            return self._feed_answer(text, entries)
        events: Events = []
        pieces = self._thinker.feed(text) if text else []
        self._held += entries
        if pieces:
            self._pieces(pieces, events)
        return events

    def _pieces(self, pieces: list[tuple[str, str]], events: Events) -> None:
        """A reasoning parser's pieces: reasoning into its item, answer text into the
        message. The logprob entries held go with the first answer text; reasoning tokens'
        are not reported (as OpenAI reports none)."""
        entries, self._held = self._held, []
        for kind, piece in pieces:
            if kind == "reasoning":
                self._add_thought(piece, events)
                continue
            self._close_thought(events)
            events += self._feed_answer(piece, entries)
            entries = []

    def _feed_answer(self, text: str, entries: Sequence[Any] = ()) -> Events:
        events: Events = []
        if self._streamer is None:
            if text or entries:
                self._add_text(text, entries, events)
        elif text:
            self._deltas(self._streamer.feed(text), events)
        return events

    def finish(self, status: str) -> Events:
        """The events that close the items; ``status`` is the response's."""
        events: Events = []
        if self._thinker is not None:
            self._pieces(self._thinker.finish(), events)
            self._close_thought(events)
        if self._streamer is not None:
            self._deltas(self._streamer.finish(), events)
            self._close_call("completed" if status == "completed" else "incomplete", events)
        if not any(i["type"] != "reasoning" for i in self.items):
            # no answer: one empty message, as OpenAI answers
            self._open_message(events)
        if self._message is not None:
            self._close_message("completed" if status == "completed" else "incomplete", events)
        return events

    def _deltas(self, deltas: list[dict[str, Any]], events: Events) -> None:
        """Chat deltas of the tool streamer: content, or a call (its id and name, then its
        arguments in pieces as the model writes them)."""
        for delta in deltas:
            if "content" in delta:
                self._close_call("completed", events)
                self._add_text(delta["content"], (), events)
                continue
            call = delta["tool_calls"][0]
            if self._limit is not None and call["index"] >= self._limit:
                continue
            if "id" in call:
                self._open_call(call["id"], call["function"]["name"], events)
            else:
                self._add_arguments(call["function"]["arguments"], events)

    def _open_message(self, events: Events) -> None:
        self._message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                         "status": "in_progress", "role": "assistant", "content": []}
        self._index = len(self.items)
        self.items.append(self._message)
        where = {"item_id": self._message["id"], "output_index": self._index}
        events.append({"type": "response.output_item.added", "output_index": self._index,
                       "item": {**self._message, "content": []}})
        events.append({"type": "response.content_part.added", **where, "content_index": 0,
                       "part": _text_part("", [])})

    def _add_text(self, text: str, entries: Sequence[Any], events: Events) -> None:
        if self._message is None:
            self._open_message(events)
        logprobs = [self.token_logprob(e, self._top) for e in entries] \
            if self._top is not None else []
        self._texts.append(text)
        self._logprobs += logprobs
        events.append({"type": "response.output_text.delta", "item_id": self._message["id"],
                       "output_index": self._index, "content_index": 0, "delta": text,
                       "logprobs": [_event_logprob(lp) for lp in logprobs]})

    def _close_message(self, status: str, events: Events) -> None:
        text = "".join(self._texts)
        part = _text_part(text, self._logprobs)
        self._message.update(status=status, content=[part])
        where = {"item_id": self._message["id"], "output_index": self._index,
                 "content_index": 0}
        events.append({"type": "response.output_text.done", **where, "text": text,
                       "logprobs": [_event_logprob(lp) for lp in self._logprobs]})
        events.append({"type": "response.content_part.done", **where, "part": part})
        events.append({"type": "response.output_item.done", "output_index": self._index,
                       "item": self._message})
        self._message = None

    def _open_call(self, call_id: str, name: str, events: Events) -> None:
        self._close_call("completed", events)
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                "status": "in_progress", "call_id": call_id, "name": name, "arguments": ""}
        self._call = item
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": dict(item)})

    def _add_arguments(self, text: str, events: Events) -> None:
        item = self._call
        item["arguments"] += text
        events.append({"type": "response.function_call_arguments.delta",
                       "item_id": item["id"], "output_index": self.items.index(item),
                       "delta": text})

    def _close_call(self, status: str, events: Events) -> None:
        """End the function call being sent (``status``: "incomplete" when the output was cut
        off: its arguments may then be cut short)."""
        item, self._call = self._call, None
        if item is None:
            return
        item["status"] = status
        index = self.items.index(item)
        events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "output_index": index, "name": item["name"],
                       "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": item})

    def _add_thought(self, text: str, events: Events) -> None:
        if self._thought is None:
            self._thought = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning",
                             "summary": [], "content": [], "encrypted_content": None,
                             "status": "in_progress"}
            self.items.append(self._thought)
            index = len(self.items) - 1
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**self._thought, "content": []}})
            events.append({"type": "response.content_part.added",
                           **self._thought_where(), "part": _thought_part("")})
        self._thought_texts.append(text)
        events.append({"type": "response.reasoning_text.delta", **self._thought_where(),
                       "delta": text})

    def _close_thought(self, events: Events) -> None:
        if self._thought is None or self._thought["status"] == "completed":
            return
        part = _thought_part("".join(self._thought_texts))
        self._thought.update(status="completed", content=[part])
        where = self._thought_where()
        events.append({"type": "response.reasoning_text.done", **where, "text": part["text"]})
        events.append({"type": "response.content_part.done", **where, "part": part})
        events.append({"type": "response.output_item.done",
                       "output_index": where["output_index"], "item": self._thought})

    def _thought_where(self) -> dict[str, Any]:
        return {"item_id": self._thought["id"], "output_index": self.items.index(self._thought),
                "content_index": 0}


def _thought_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}
