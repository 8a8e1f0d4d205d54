"""Engine outputs -> what an API answers: one formatter family for the three generation APIs.

``OutputFormatter`` is the contract: ``response`` makes the body of a non-streamed response
from each prompt's final output; ``events`` makes a stream's events as outputs arrive, and
``streaming_response`` puts them on the wire, ending a stream the engine failed with the
API's own error event. Both read a choice through a ``ChoiceCursor``, so a streamed answer
adds up to exactly the non-streamed one. Implementations: ``CompletionFormatter`` and
``ChatFormatter`` here (choices, SSE ``data:`` chunks, ``[DONE]``), ``ResponsesFormatter`` in
``responses_format.py`` (output items, typed events).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi.responses import StreamingResponse

from tokenmill.engine.async_engine import RequestStream
from tokenmill.request import CompletionOutput, RequestOutput
from tokenmill.server.prompt_scores import (prompt_pairs, vllm_prompt_logprobs,
                                            without_generation)
from tokenmill.server.protocol import APIError, StreamOptions
from tokenmill.server.reasoning import ReasoningSetup, ReasoningStreamer
from tokenmill.server.streams import (STREAM_ERRORS, AbortingStreamingResponse, as_api_error,
                                      merge)
from tokenmill.server.tools.parsers import ToolCallParser, ToolCallStreamer

TokenText = Callable[[int], str]  # a token id's text (cached by the pipeline)
Outputs = AsyncIterator[tuple[int, RequestOutput]]  # (prompt index, output) as they arrive


@dataclass
class ChoiceCursor:
    """How much of one choice was already formatted: text characters, logprob entries, and
    whether its finish reason was said."""

    text: int = 0
    logprobs: int = 0
    done: bool = False

    def take(self, c: CompletionOutput) -> tuple[str, list[Any], str | None]:
        """What is new in ``c`` since the last take: text, logprob entries, and the finish
        reason the first time there is one."""
        text = c.text[self.text:]
        entries = list((c.logprobs or [])[self.logprobs:])
        finish = c.finish_reason.value if c.finish_reason and not self.done else None
        self.text, self.logprobs = len(c.text), self.logprobs + len(entries)
        self.done = self.done or finish is not None
        return text, entries, finish


class OutputFormatter(ABC):
    """One request's engine outputs as one API answers them (an instance per HTTP request)."""

    def __init__(self, rid: str, model: str, token_text: TokenText):
        self.rid = rid
        self.model = model
        self.token_text = token_text
        self.created = int(time.time())

    @abstractmethod
    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The body of a non-streamed response, from each prompt's final output."""

    @abstractmethod
    def events(self, outputs: Outputs) -> AsyncIterator[dict[str, Any]]:
        """A stream's events, as the outputs arrive."""

    @abstractmethod
    def encode(self, event: dict[str, Any]) -> str:
        """One event as it goes on the wire."""

    @abstractmethod
    def failed(self, error: APIError) -> list[str]:
        """The wire text that ends a stream with ``error`` instead of its last output."""

    def trailer(self) -> str:
        """The wire text after the last event, failed or not."""
        return ""

    def streaming_response(self, streams: list[RequestStream]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in self.events(merge(streams)):
                    yield self.encode(event)
            except STREAM_ERRORS as e:
                for text in self.failed(as_api_error(e)):
                    yield text
            if self.trailer():
                yield self.trailer()

        return AbortingStreamingResponse(body(), streams)

    def token_logprob(self, entry: Any, top: int) -> dict[str, Any]:
        """A sampled token's logprob with its ``top`` alternatives, as chat and responses give
        them (token text, logprob, UTF-8 bytes)."""
        return {**self._token(entry.token_id, entry.logprob),
                "top_logprobs": [self._token(t, lp) for t, lp in entry.top[:top]]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def openai_usage(outputs: Iterable[RequestOutput]) -> dict[str, Any]:
    """Chat/completions usage over a request's outputs; ``cached_tokens`` came from the
    prefix cache."""
    outputs = list(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}


def with_kv_transfer(body: dict[str, Any], outputs: Iterable[RequestOutput]) -> dict[str, Any]:
    """``body`` with vLLM's top-level ``kv_transfer_params`` when the engine's KV connector
    returned some (a producer's: where the decode instance pulls the prompt's blocks from);
    without them the key is left out, so other answers keep their shape."""
    params = next((o.kv_transfer_params for o in outputs if o.kv_transfer_params is not None),
                  None)
    if params is not None:
        body["kv_transfer_params"] = params
    return body


class ChoicesFormatter(OutputFormatter):
    """Completions and chat: ``choices`` in a body, or ``data:`` chunks of choice deltas and
    ``[DONE]``. With ``stream_options.include_usage`` every chunk carries ``usage`` (null, or
    with ``continuous_usage_stats`` the usage so far of the output it carries) and a last
    chunk the whole request's, as vLLM does."""

    chunk_object: ClassVar[str]

    def __init__(self, rid: str, model: str, token_text: TokenText,
                 stream_options: StreamOptions | None):
        super().__init__(rid, model, token_text)
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.continuous = self.include_usage and stream_options.continuous_usage_stats

    def encode(self, event: dict[str, Any]) -> str:
        return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"

    def failed(self, error: APIError) -> list[str]:
        return [f"data: {json.dumps(error.body())}\n\n"]

    def trailer(self) -> str:
        return "data: [DONE]\n\n"

    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        chunk = {"id": self.rid, "object": self.chunk_object, "created": self.created,
                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return chunk

    def running_usage(self, out: RequestOutput) -> dict[str, Any] | None:
        """The usage a chunk carrying ``out`` shows (continuous_usage_stats), else None."""
        return openai_usage([out]) if self.continuous else None

    def usage_chunk(self, outputs: Iterable[RequestOutput]) -> dict[str, Any]:
        return {**self.chunk([]), "usage": openai_usage(outputs)}


@dataclass
class _CompletionCursor(ChoiceCursor):
    offset: int = 0  # text_offset of the next token
    started: bool = False  # the echo (or a first delta) went out


class CompletionFormatter(ChoicesFormatter):
    """``/v1/completions``: choice ``i * n + j`` is prompt i's j-th; ``echo`` (the prompts'
    texts, one per prompt, or None) precedes each choice's text."""

    chunk_object = "text_completion"

    def __init__(self, rid: str, model: str, token_text: TokenText,
                 stream_options: StreamOptions | None, n: int, num_prompts: int,
                 logprobs: int | None, echo: Sequence[str] | None = None,
                 score_only: bool = False, prompt_logprobs: bool = False):
        super().__init__(rid, model, token_text, stream_options)
        self.n = n
        self.num_prompts = num_prompts
        self.logprobs = logprobs
        self.echo = echo
        self.score_only = score_only  # echo with max_tokens 0: the sampled token is dropped
        self.prompt_logprobs = prompt_logprobs  # vLLM's per-choice ``prompt_logprobs`` field

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        if self.score_only:
            finals = [without_generation(out) for out in finals]
        choices = [self._choice(pi, out, c, _CompletionCursor())
                   for pi, out in enumerate(finals) for c in out.outputs]
        return with_kv_transfer({"id": self.rid, "object": "text_completion",
                                 "created": self.created, "model": self.model,
                                 "choices": choices, "usage": openai_usage(finals)}, finals)

    async def events(self, outputs: Outputs) -> AsyncIterator[dict[str, Any]]:
        cursors = [_CompletionCursor() for _ in range(self.n * self.num_prompts)]
        finals: dict[int, RequestOutput] = {}
        async for pi, out in outputs:
            out = without_generation(out) if self.score_only else out
            finals[pi] = out
            choices = [d for c in out.outputs if (d := self._choice(
                pi, out, c, cursors[pi * self.n + c.index])) is not None]
            if choices:
                yield self.chunk(choices, self.running_usage(out))
        if self.include_usage:
            yield self.usage_chunk(finals.values())

    def _choice(self, pi: int, out: RequestOutput, c: CompletionOutput,
                cursor: _CompletionCursor) -> dict | None:
        """What of choice ``c`` of prompt ``pi`` is new, or None when nothing is. The echo goes
        out first, with the prompt tokens' logprobs where logprobs are asked for."""
        echo = self.echo is not None and not cursor.started
        new, entries, finish = cursor.take(c)
        text = (self.echo[pi] if echo else "") + new
        if not (text or entries or finish or echo):
            return None
        cursor.started = True
        pairs = prompt_pairs(out) if echo else []
        pairs += [(e.token_id, e) for e in entries]
        lp = self._logprobs(pairs, cursor) if self.logprobs is not None else None
        choice = {"index": pi * self.n + c.index, "text": text, "logprobs": lp,
                  "finish_reason": finish, "stop_reason": c.stop_reason if finish else None}
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(out, self.token_text)
        return choice

    def _logprobs(self, pairs: list[tuple[int, Any]], cursor: _CompletionCursor
                  ) -> dict[str, Any]:
        """Tokens with their logprobs entries (None: a token nothing scored, the prompt's
        first, which OpenAI reports as null)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, e in pairs:
            text = self.token_text(token_id)
            top = None
            if e is not None:
                top = {self.token_text(t): lp for t, lp in e.top}
                top.setdefault(text, e.logprob)
            tokens.append(text)
            token_lps.append(None if e is None else e.logprob)
            tops.append(top)
            offsets.append(cursor.offset)
            cursor.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}


class ChatFormatter(ChoicesFormatter):
    """``/v1/chat/completions``. With a tool ``parser`` (tools offered, tool_choice not
    "none") each choice's text is split into content and ``tool_calls``, whole or as it
    streams; calls past ``call_limit`` are dropped. With ``reasoning`` (``--reasoning-parser``)
    the thinking is split off first into ``reasoning`` (and ``reasoning_content``, its older
    name), and only the rest is content and calls."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, rid: str, model: str, token_text: TokenText,
                 stream_options: StreamOptions | None, n: int, top_logprobs: int | None,
                 parser: ToolCallParser | None = None, call_limit: int | None = None,
                 reasoning: ReasoningSetup | None = None):
        super().__init__(rid, model, token_text, stream_options)
        self.n = n
        self.top_logprobs = top_logprobs  # None: no logprobs asked for
        self.parser = parser
        self.call_limit = call_limit
        self.reasoning = reasoning

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        out = finals[0]
        choices = []
        for c in out.outputs:
            message, finish = self._message(c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c.logprobs or []),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        body = {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": openai_usage([out])}
        if out.prompt_logprobs is not None:  # vLLM's, beside the choices
            body["prompt_logprobs"] = vllm_prompt_logprobs(out, self.token_text)
        return with_kv_transfer(body, [out])

    async def events(self, outputs: Outputs) -> AsyncIterator[dict[str, Any]]:
        choices = [_ChatChoice(self.parser, self.reasoning) for _ in range(self.n)]
        final = None
        for i in range(self.n):  # the role first, like OpenAI, so clients see headers early
            yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}])
        async for _, out in outputs:
            final = out
            pending = [self._deltas(c, choices[c.index]) for c in out.outputs]
            # A choice may have several deltas (text, then a call): the k-th of each per chunk.
            usage = self.running_usage(out)
            for k in range(max(map(len, pending), default=0)):
                yield self.chunk([d[k] for d in pending if k < len(d)], usage)
        if self.include_usage and final is not None:
            yield self.usage_chunk([final])

    def _deltas(self, c: CompletionOutput, choice: _ChatChoice) -> list[dict[str, Any]]:
        text, entries, finish = choice.cursor.take(c)
        if not (text or entries or finish):
            return []
        deltas = choice.deltas(text, finish is not None, self.call_limit)
        if finish == "stop" and choice.called:
            finish = "tool_calls"
        out = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in deltas or [{}]]
        out[0]["logprobs"] = self._logprobs(entries)
        out[-1]["finish_reason"] = finish
        return out

    def _message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice and its finish reason."""
        finish = c.finish_reason.value if c.finish_reason else None
        message: dict[str, Any] = {"role": "assistant"}
        text: str | None = c.text
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(c.text)
            if not self.reasoning.include:
                reasoning = None
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.parser is None:
            return {**message, "content": text}, finish
        parsed = self.parser.parse(text or "")
        if self.call_limit is not None:
            del parsed.tool_calls[self.call_limit:]
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            if finish == "stop":
                finish = "tool_calls"
        return message, finish

    def _logprobs(self, entries: list[Any]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return {"content": [self.token_logprob(e, self.top_logprobs) for e in entries]}


class _ChatChoice:
    """One streamed chat choice: its cursor and, with tools, the call parser's state; with a
    reasoning parser, that parser's state in front of it."""

    def __init__(self, parser: ToolCallParser | None, reasoning: ReasoningSetup | None = None):
        self.cursor = ChoiceCursor()
        self.streamer: ToolCallStreamer | None = parser.streamer() if parser else None
        self.thinker: ReasoningStreamer | None = reasoning.streamer() if reasoning else None
        self.show_reasoning = reasoning is not None and reasoning.include
        self.called = False  # a tool call was streamed

    def deltas(self, text: str, finished: bool, call_limit: int | None) -> list[dict[str, Any]]:
        """The chat deltas of new text: reasoning, then content, or with tools content and
        calls."""
        if self.thinker is None:
            return self._answer(text, finished, call_limit)
        pieces = self.thinker.feed(text) if text else []
        if finished:
            pieces += self.thinker.finish()
        deltas: list[dict[str, Any]] = []
        for kind, piece in pieces:
            if kind == "content":
                deltas += self._answer(piece, False, call_limit)
            elif self.show_reasoning:
                deltas.append({"reasoning": piece, "reasoning_content": piece})
        if finished:
            deltas += self._answer("", True, call_limit)
        return deltas

    def _answer(self, text: str, finished: bool, call_limit: int | None
                ) -> list[dict[str, Any]]:
        """The deltas of answer text: content, or with tools content and calls."""
        if self.streamer is None:
            return [{"content": text}] if text else []
        deltas = self.streamer.feed(text) if text else []
        if finished:
            deltas += self.streamer.finish()
        if call_limit is not None:  # later calls are dropped
            deltas = [d for d in deltas
                      if d.get("tool_calls", [{}])[0].get("index", 0) < call_limit]
        self.called = self.called or any("tool_calls" in d for d in deltas)
        return deltas
