"""Prompt logprobs as the completion APIs answer them: the prompt's tokens in front of a
completion's ``logprobs`` (``echo`` with ``logprobs``: what lm-evaluation-harness scores), vLLM's
``prompt_logprobs`` field, and ``echo`` with ``max_tokens: 0`` (score the prompt, generate
nothing: the engine samples one token, as vLLM does, which is dropped here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tokenmill.request import FinishReason, RequestOutput
from tokenmill.server.protocol import CompletionRequest, SamplingFields, invalid

TokenText = Callable[[int], str]


def without_generation(out: RequestOutput) -> RequestOutput:
    """``out`` with nothing generated: the one sampled token, its text and logprobs dropped;
    finished by length (``max_tokens: 0``) once the engine finished it."""
    outputs = [replace(c, token_ids=[], text="", logprobs=None if c.logprobs is None else [],
                       cumulative_logprob=None if c.logprobs is None else 0.0,
                       finish_reason=FinishReason.LENGTH if c.finish_reason else None,
                       stop_reason=None)
               for c in out.outputs]
    return replace(out, outputs=outputs)


def prompt_pairs(out: RequestOutput) -> list[tuple[int, Any]]:
    """Each prompt token with its logprobs entry (None for the first, or where not scored)."""
    scored = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return list(zip(out.prompt_token_ids, scored))


def vllm_prompt_logprobs(out: RequestOutput, token_text: TokenText) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or, keyed by token id, the
    token's and the top alternatives' logprob, rank and text."""
    if out.prompt_logprobs is None:
        return None
    result: list[dict | None] = []
    for token_id, entry in prompt_pairs(out):
        if entry is None:
            result.append(None)
            continue
        ranked = {token_id: (entry.logprob, entry.rank)}
        for rank, (t, lp) in enumerate(entry.top, start=1):
            ranked.setdefault(t, (lp, rank))
        result.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(t)}
                       for t, (lp, rank) in ranked.items()})
    return result


def check_prompt_scoring(req: SamplingFields, max_logprobs: int) -> bool:
    """400s for prompt scoring a request cannot have; whether it scores without generating
    (``echo`` with ``max_tokens: 0``, completions only)."""
    n = req.prompt_logprobs
    if n is not None and not (isinstance(n, int) and 0 <= n <= max_logprobs):
        raise invalid("prompt_logprobs", f"prompt_logprobs: an integer in [0, {max_logprobs}] "
                      f"(--max-logprobs), got {n}")
    if n is not None and req.stream:
        raise invalid("prompt_logprobs", "prompt_logprobs: not available with stream=true (as "
                      "in vLLM); with completions, echo with logprobs streams them instead",
                      "unsupported_parameter")
    if not isinstance(req, CompletionRequest) or req.max_tokens != 0:
        return False
    if not req.echo:
        raise invalid("max_tokens", "max_tokens: 0 only with echo=true (score the prompt "
                      "without generating); otherwise at least 1")
    return True
