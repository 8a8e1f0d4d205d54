"""A request's sampling fields -> ``SamplingParams``, after the bounds one request must keep.

``SamplingRules`` joins the server's ``RequestLimits`` with the engine's sizes. ``check`` runs
before anything is tokenized (it needs only the body); ``params`` runs once the prompts' lengths
are known. Every refusal is an ``APIError`` naming the field as the endpoint spells it
(``max_completion_tokens``, ``max_output_tokens``, ``top_logprobs``...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.params import ParamError, SamplingParams, StructuredOutputs
from tokenmill.server.limits import RequestLimits
from tokenmill.server.protocol import ChatCompletionRequest, SamplingFields, invalid, printable

# Sampling fields a request may leave null, with the value null stands for.
_DEFAULTS = (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0),
             ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))


@dataclass(frozen=True)
class OutputLimit:
    """The most tokens to generate (None: until the context ends) and the field that set it."""

    value: int | None
    param: str = "max_tokens"

    @classmethod
    def of_chat(cls, req: ChatCompletionRequest) -> OutputLimit:
        """``max_completion_tokens`` where given, else the older ``max_tokens``."""
        if req.max_completion_tokens is not None:
            return cls(req.max_completion_tokens, "max_completion_tokens")
        return cls(req.max_tokens, "max_tokens")


@dataclass(frozen=True)
class SamplingRules:
    """What one request may ask of this engine: the server's limits (resolved) and the
    engine's fixed sizes."""

    limits: RequestLimits
    vocab_size: int
    max_model_len: int
    kv_cache_tokens: int
    priorities: bool  # the scheduler orders by priority (else a priority orders nothing)

    def check(self, req: SamplingFields, num_prompts: int, limit: OutputLimit,
              logprobs: int | None, logprobs_param: str) -> None:
        """The bounds of the request's fields, before anything is tokenized."""
        self._check_options(req)
        self._check_size(req, num_prompts, limit)
        self._check_stops(req)
        self._check_logit_bias(req.logit_bias)
        if logprobs is not None and logprobs > self.limits.max_logprobs:
            raise invalid(logprobs_param, f"{logprobs_param}: at most "
                          f"{self.limits.max_logprobs} (--max-logprobs), got {logprobs}")

    def params(self, req: SamplingFields, prompt_lengths: Sequence[int], limit: OutputLimit,
               logprobs: int | None,
               structured: StructuredOutputs | None = None) -> SamplingParams:
        """The engine's parameters for prompts of these lengths; a request asking past the
        context is a 400 naming ``limit.param``."""
        max_tokens = self._max_tokens(req.n, prompt_lengths, limit)
        try:
            return SamplingParams(**sampling_kwargs(req, max_tokens, logprobs),
                                  structured_outputs=structured)
        except ParamError as e:  # max_tokens is what the endpoint calls limit.param
            raise invalid(limit.param if e.param == "max_tokens" else e.param, str(e)) from None

    def _max_tokens(self, n: int, prompt_lengths: Sequence[int], limit: OutputLimit) -> int:
        longest = max(prompt_lengths)
        if limit.value is None:  # until the context (or what the KV cache can hold) ends
            room = min(self.max_model_len, self.kv_cache_tokens) - longest
            share = self.limits.max_request_tokens // (len(prompt_lengths) * max(1, n))
            return max(1, min(room, share))
        if longest + limit.value > self.max_model_len:
            raise invalid(limit.param, f"{limit.param}={limit.value} plus the prompt's "
                          f"{longest} tokens exceeds the model's maximum context length of "
                          f"{self.max_model_len} tokens", "context_length_exceeded")
        return limit.value

    def _check_options(self, req: SamplingFields) -> None:
        """Fields that would be ignored where they are sent are refused instead."""
        if req.priority != 0 and not self.priorities:
            raise invalid("priority", f"priority: this server schedules first come, first "
                          f"served; start it with --scheduling-policy priority to order "
                          f"requests (got {req.priority})")
        if req.stream_options is not None and not req.stream:
            raise invalid("stream_options", "stream_options: only with stream=true")

    def _check_size(self, req: SamplingFields, num_prompts: int, limit: OutputLimit) -> None:
        """Choices and tokens: n, and prompts x n x the output limit."""
        lim = self.limits
        if req.n > lim.max_n:
            raise invalid("n", f"n: at most {lim.max_n} choices per request (--max-n), got "
                          f"{req.n}")
        value, param = limit.value, limit.param
        if value is None:
            return
        if value < 1:
            raise invalid(param, f"{param} must be an integer >= 1 or None, got {value!r}")
        if num_prompts * req.n * value > lim.max_request_tokens:
            raise invalid(param, f"{param}: {num_prompts} prompt(s) x n={req.n} x {value} "
                          f"tokens asks for more than the {lim.max_request_tokens} tokens one "
                          f"request may generate (--max-request-tokens)")

    def _check_stops(self, req: SamplingFields) -> None:
        lim = self.limits
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop or any(len(x) > lim.max_stop_chars for x in stops):
            raise invalid("stop", f"stop: at most {lim.max_stop} stop strings of at most "
                          f"{lim.max_stop_chars} characters (--max-stop, --max-stop-chars)")
        stop_ids = req.stop_token_ids or []
        if len(stop_ids) > 4 * lim.max_stop \
                or any(not 0 <= i < self.vocab_size for i in stop_ids):
            raise invalid("stop_token_ids", f"stop_token_ids: at most {4 * lim.max_stop} token "
                          f"ids in [0, {self.vocab_size})")

    def _check_logit_bias(self, bias: dict[str, float] | None) -> None:
        if not bias:
            return
        if len(bias) > self.limits.max_logit_bias:
            raise invalid("logit_bias", f"logit_bias: at most {self.limits.max_logit_bias} "
                          f"entries (--max-logit-bias), got {len(bias)}")
        for key in bias:
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < self.vocab_size:
                raise invalid("logit_bias", f"logit_bias: keys must be token ids in [0, "
                              f"{self.vocab_size}), got {printable(key)[:40]!r}")


def sampling_kwargs(req: SamplingFields, max_tokens: int,
                    logprobs: int | None) -> dict[str, Any]:
    """``SamplingParams`` keywords of a request's sampling fields (nulls as the defaults)."""
    kw: dict[str, Any] = {"n": req.n, "max_tokens": max_tokens, "logprobs": logprobs,
                          "prompt_logprobs": req.engine_prompt_logprobs(),
                          "seed": req.seed, "min_tokens": req.min_tokens,
                          "ignore_eos": req.ignore_eos,
                          "skip_special_tokens": req.skip_special_tokens,
                          "include_stop_str_in_output": req.include_stop_str_in_output,
                          "stop_token_ids": req.stop_token_ids or ()}
    for name, default in _DEFAULTS:
        value = getattr(req, name)
        kw[name] = default if value is None else value
    kw["stop"] = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    # keys were checked to be token ids by SamplingRules.check
    kw["logit_bias"] = {int(key): value for key, value in (req.logit_bias or {}).items()}
    return kw
