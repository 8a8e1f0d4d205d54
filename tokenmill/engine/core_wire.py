"""What the engine core process (``core_proc.py``) and its client (``core_client.py``) say to
each other: msgpack frames (msgspec), never pickle.

The core sends one frame per loop turn, holding the outputs of the step it ran as deltas: for
each completion the token ids, text and logprobs added since the previous frame. Outputs are
cumulative, so sending them whole would cost O(tokens²) bytes per request; ``OutputDeltas``
(core side) cuts them and ``OutputMirror`` (client side) puts them back together. Text only
grows while a request runs, but a stop string may cut tokens, text and logprobs when it ends:
every delta says how much of what was sent before to keep.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenmill.errors import LoRAError
from tokenmill.params import ConstraintError
from tokenmill.request import CompletionOutput, FinishReason, PromptError, RequestOutput

# frames from the client to the core: [ADD, ...], [ABORT, id], [CALL, call id, name, args],
# [STOP]; from the core: [READY, facts], [BATCH, ...], [DEAD, why], [FAILED, why]
ADD, ABORT, CALL, STOP = "add", "abort", "call", "stop"
READY, BATCH, DEAD, FAILED = "ready", "batch", "dead", "failed"


def _enc_hook(obj: object) -> object:
    if isinstance(obj, types.MappingProxyType):  # SamplingParams.logit_bias
        return dict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the engine core")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder()


def encode(frame: list) -> bytes:
    return _encoder.encode(frame)


def decode(data: bytes) -> list:
    return _decoder.decode(data)


def convert(value: Any, kind: type) -> Any:
    """A decoded frame's part (plain dicts and lists) as the dataclass it was sent as."""
    return msgspec.convert(value, kind)


def error_fields(e: BaseException) -> list:
    """An exception as [type name, message, param]: the client raises its like again."""
    return [type(e).__name__, str(e), getattr(e, "param", None)]


def rebuild_error(fields: list) -> Exception:
    """The exception ``error_fields`` described: the kinds the server answers 400 (or 404)
    for keep their type; anything else is a RuntimeError naming the original type."""
    name, message, param = fields
    if name == "PromptError":
        return PromptError(message, param=param or "prompt")
    if name == "ConstraintError":
        e = ConstraintError("", param or "")
        e.args = (message,)  # the message already names the field
        return e
    if name == "LoRAError":
        return LoRAError(message)
    if name == "ValueError":
        return ValueError(message)
    return RuntimeError(f"{name}: {message}")


@dataclass
class WireLogprob:
    """One sampled token's logprobs, as the client rebuilds them (``TokenLogprobs``' fields)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def _logprob_row(entry: Any) -> list | None:
    if entry is None:
        return None
    return [entry.token_id, entry.logprob, entry.rank, [list(t) for t in entry.top]]


@dataclass
class _Sent:
    """What the client has of one completion."""

    num_tokens: int = 0
    text: str = ""
    num_logprobs: int = 0


def _kept_text(before: str, now: str) -> int:
    return len(before) if now.startswith(before) else 0


class OutputDeltas:
    """(core) Cuts each request's cumulative output into what the client lacks."""

    def __init__(self) -> None:
        self._sent: dict[str, list[_Sent]] = {}
        self._prompt_scored: dict[str, int] = {}  # prompt logprobs sent, per request

    def delta(self, out: RequestOutput) -> list:
        """[id, finished, cached tokens, kv params, prompt ids (first time only), completions,
        new prompt logprobs (None: none asked)];
        each completion: [index, tokens kept, new ids, text kept, new text, finish reason,
        stop reason, logprobs kept (-1: none), new logprobs, cumulative logprob]."""
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, [])
        comps = []
        for c in out.outputs:
            while len(sent) <= c.index:
                sent.append(_Sent())
            s = sent[c.index]
            keep = min(s.num_tokens, len(c.token_ids))
            text_keep = _kept_text(s.text, c.text)
            lp_keep = -1 if c.logprobs is None else min(s.num_logprobs, len(c.logprobs))
            new_lp = [] if c.logprobs is None else [_logprob_row(e) for e in c.logprobs[lp_keep:]]
            comps.append([c.index, keep, c.token_ids[keep:], text_keep, c.text[text_keep:],
                          c.finish_reason.value if c.finish_reason else None, c.stop_reason,
                          lp_keep, new_lp, c.cumulative_logprob])
            s.num_tokens, s.text = len(c.token_ids), c.text
            s.num_logprobs = 0 if c.logprobs is None else len(c.logprobs)
        scored = None
        if out.prompt_logprobs is not None:  # grows as a chunked prompt is scored
            done = self._prompt_scored.get(out.request_id, 0)
            scored = [None if e is None else _logprob_row(e) for e in out.prompt_logprobs[done:]]
            self._prompt_scored[out.request_id] = len(out.prompt_logprobs)
        if out.finished:
            self.forget(out.request_id)
        return [out.request_id, out.finished, out.num_cached_tokens, out.kv_transfer_params,
                out.prompt_token_ids if first else None, comps, scored]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._prompt_scored.pop(request_id, None)


@dataclass
class _Mirror:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list | None = None


class OutputMirror:
    """(client) Each live request's output rebuilt from the deltas, as ``RequestOutput``s the
    server reads exactly as it reads the in-process engine's."""

    def __init__(self) -> None:
        self._live: dict[str, _Mirror] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self._live[request_id] = _Mirror(prompt, prompt_token_ids)

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def apply(self, delta: list) -> RequestOutput | None:
        """The request's output with ``delta`` applied (None: a request no longer live)."""
        request_id, finished, cached, kv_params, prompt_ids, comps, scored = delta
        m = self._live.get(request_id)
        if m is None:
            return None
        if prompt_ids is not None:
            m.prompt_token_ids = prompt_ids
        if scored is not None:
            m.prompt_logprobs = (m.prompt_logprobs or []) + [_wire_logprob(r) for r in scored]
        for comp in comps:
            _apply_completion(m, comp)
        if finished:
            del self._live[request_id]
        # new lists each time: a reader may still hold the previous output
        outs = [replace_lists(m.outputs[i]) for i in sorted(m.outputs)]
        return RequestOutput(request_id, m.prompt_token_ids, outs, finished=finished,
                             prompt=m.prompt, num_cached_tokens=cached,
                             kv_transfer_params=kv_params,
                             prompt_logprobs=None if m.prompt_logprobs is None
                             else list(m.prompt_logprobs))

    def current(self, request_id: str) -> RequestOutput | None:
        m = self._live.get(request_id)
        if m is None or not m.outputs:
            return None
        return RequestOutput(request_id, m.prompt_token_ids,
                             [replace_lists(m.outputs[i]) for i in sorted(m.outputs)],
                             prompt=m.prompt)


def _apply_completion(m: _Mirror, comp: list) -> None:
    index, keep, new_ids, text_keep, new_text, finish, stop, lp_keep, new_lp, cum = comp
    c = m.outputs.get(index)
    if c is None:
        c = m.outputs[index] = CompletionOutput(index, [])
    del c.token_ids[keep:]
    c.token_ids.extend(new_ids)
    c.text = c.text[:text_keep] + new_text
    c.finish_reason = FinishReason(finish) if finish is not None else None
    c.stop_reason = stop
    if lp_keep < 0:
        c.logprobs = None
    else:
        rows = [_wire_logprob(r) for r in new_lp]
        c.logprobs = (c.logprobs or [])[:lp_keep] + rows
    c.cumulative_logprob = cum


def _wire_logprob(row: list | None) -> WireLogprob | None:
    return None if row is None else WireLogprob(row[0], row[1], row[2], [tuple(t) for t in row[3]])


def replace_lists(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, list(c.token_ids), c.text, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            logprobs=list(c.logprobs) if c.logprobs is not None else None,
                            cumulative_logprob=c.cumulative_logprob)
