"""A request as the scheduler tracks it, and the output data the engine fills for callers.

A ``Request`` is one schedulable sequence. A request with ``n > 1`` is expanded by
``Request.sequences()`` into ``n`` sequences with ids ``"<request_id>#<i>"`` (``seq_index`` i,
``parent_id`` the caller's id); with ``n == 1`` the request is its own single sequence and keeps
its id. ``group_id`` names the caller's request either way, so outputs are grouped by it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from tokenmill.params import PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never run yet (or waiting for its prompt to be shared, n > 1)
    RUNNING = "running"  # holds KV blocks, scheduled every step while the budget allows
    PREEMPTED = "preempted"  # blocks taken back; recomputed from scratch when readmitted
    # Admitted, holding a seat and blocks, while a KV connector fills them (another instance's
    # prefill, an offload tier): never scheduled until the connector reports the load done.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


class FinishReason(str, enum.Enum):
    """The OpenAI ``finish_reason`` strings."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"

    @property
    def status(self) -> RequestStatus:
        return _FINISH_STATUSES[self]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}
_FINISH_STATUSES = {reason: status for status, reason in _FINISH_REASONS.items()}


def sequence_id(request_id: str, seq_index: int) -> str:
    return f"{request_id}#{seq_index}"


class PromptError(ValueError):
    """A prompt the engine cannot take; ``code`` and ``param`` are what an API error reports."""

    def __init__(self, message: str, code: str = "invalid_value", param: str = "prompt"):
        super().__init__(message)
        self.code = code
        self.param = param


def check_prompt(token_ids: Sequence[int], max_model_len: int, vocab_size: int | None = None,
                 param: str = "prompt") -> None:
    """The one check of a prompt's token ids: not empty, inside the vocabulary (when its size
    is known), and short enough to leave room for at least one generated token."""
    if not token_ids:
        raise PromptError(f"{param} must not be empty", param=param)
    if vocab_size is not None:
        check_vocabulary(token_ids, vocab_size, param)
    if len(token_ids) >= max_model_len:
        raise PromptError(f"This model's maximum context length is {max_model_len} tokens. "
                          f"However, your prompt has {len(token_ids)} tokens.",
                          code="context_length_exceeded", param=param)


def check_whole_prompt(token_ids: Sequence[int], max_num_batched_tokens: int,
                       param: str = "prompt") -> None:
    """A bidirectional encoder's prompt runs whole in one step (never chunked): it must fit the
    step's token budget."""
    if len(token_ids) > max_num_batched_tokens:
        raise PromptError(f"this encoder reads a prompt whole in one step of at most "
                          f"{max_num_batched_tokens} tokens (--max-num-batched-tokens); your "
                          f"prompt has {len(token_ids)} tokens",
                          code="context_length_exceeded", param=param)


def check_vocabulary(token_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """Every id names a token: raise ``PromptError`` on the first that does not."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                          param=param)


def stop_token_set(params: SamplingParams, eos_token_ids: Collection[int]) -> frozenset[int]:
    """Tokens that end a sequence (once ``min_tokens`` were generated): its ``stop_token_ids``,
    plus ``eos_token_ids`` unless ``ignore_eos``. The scheduler stops on exactly these and the
    sampler's min_tokens stage masks exactly these."""
    if params.ignore_eos:
        return frozenset(params.stop_token_ids)
    return frozenset((*params.stop_token_ids, *eos_token_ids))


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs under (vLLM's ``LoRARequest``): ``lora_name`` is what a
    client names in ``model``, ``lora_int_id`` the engine's id for it (unique for the life of
    the process, never reused after an unload), ``lora_path`` the PEFT directory. ``fingerprint``
    identifies the adapter's weights (a hash of its files): it keys the prefix cache, so blocks
    computed under one adapter never serve another, nor a different adapter later loaded under
    the same name; empty until the engine registers the adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    fingerprint: str = ""
    base_model_name: str | None = None

    @property
    def cache_key(self) -> str:
        """The prefix-cache namespace part for this adapter."""
        return f"lora:{self.lora_name}:{self.fingerprint or self.lora_int_id}"


@dataclass(eq=False)
class Request:
    """One sequence: its tokens and the scheduler's bookkeeping about it.

    Its KV block table lives in the ``KVBlockManager`` (keyed by ``request_id``) so that one
    owner counts block references. ``prompt_token_ids`` is shared by the sequences of a request
    and must not be mutated.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = more important (the `priority` policy)
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's (set by the scheduler)
    parent_id: str | None = None  # the caller's request id when this is one of n > 1 sequences
    seq_index: int = 0
    cache_salt: str | None = None  # prefix-cache namespace: other salts never share its blocks
    # The caller's ``kv_transfer_params`` (prefill/decode disaggregation), read by the engine's
    # KV connector; ``kv_transfer_out`` is what the connector answered when the sequence ended.
    kv_transfer_params: dict | None = None
    kv_transfer_out: dict | None = None
    lora: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    # its KV is computed with LongRoPE's long factors (set by the scheduler at admission)
    long_rope: bool = False
    # A pooling request (an embedding, a cross-encoder's score): its output is one vector from
    # its prompt's hidden states, no token; ``sampling_params`` only bound its length.
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None  # BERT's segment of each prompt token (a pair)
    # An encoder's prompt (bidirectional attention): computed whole in one step, no KV kept
    bidirectional: bool = False
    # Owned by the scheduler from here on.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or written this step)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    arrival_seq: int = 0  # set by the scheduler: orders requests with equal arrival times
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission; None before
    # Proposed continuations (speculative decoding) for the next schedule(), set by the
    # engine's proposer: verified in one forward after the last known token, and cleared when
    # the sequence's chunk is scheduled (unused ones too) or it is preempted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured output: the grammar state of this sequence (``structured.SequenceGrammar``),
    # set by the engine; it has consumed exactly the accepted output tokens.
    grammar: object | None = field(default=None, repr=False)

    @property
    def group_id(self) -> str:
        """The caller's request id, shared by all n sequences."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def prefix_namespace(self) -> str | None:
        """What prefix-cache entries are keyed by besides the tokens: the ``cache_salt``, the
        adapter, and LongRoPE's long factors (their KV differs from the short factors').
        Without either it is the salt alone, so base-model hashes are as before."""
        space = self.cache_salt if self.lora is None else \
            f"{self.cache_salt or ''}\x1f{self.lora.cache_key}"
        return f"{space or ''}\x1elong-rope" if self.long_rope else space

    @property
    def reuses_cached_prefix(self) -> bool:
        """Whether a cached prefix may stand in for computing its first tokens: not for an
        encoder, nor for a pooling request that reads more than its last row, nor for a request
        scoring its prompt (every position's logits are needed: the prompt is recomputed, and
        its blocks still go to the cache for others)."""
        params = self.pooling_params
        return not self.bidirectional and (params is None or params.pooling == "last") and \
            self.sampling_params.prompt_logprobs is None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """What ends this sequence: ``stop_token_set`` of its params and its EOS ids (which the
        scheduler resolves on admission, before anything reads this)."""
        return stop_token_set(self.sampling_params, self.eos_token_ids or ())

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole history (the decode hot path)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[:end - p]]

    def sequences(self) -> list[Request]:
        """The schedulable sequences: ``[self]`` when n == 1, else n fresh ``"<id>#<i>"`` copies."""
        n = self.sampling_params.n
        if n == 1:
            return [self]
        return [replace(self, request_id=sequence_id(self.request_id, i), parent_id=self.request_id,
                        seq_index=i, output_token_ids=[], spec_token_ids=[], grammar=None,
                        kv_transfer_out=None)
                for i in range(n)]


@dataclass
class CompletionOutput:
    """One of the n completions of a request. The engine fills ``text`` and ``logprobs``."""

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # per generated token: the sampler's TokenLogprobs (sampled token's logprob, rank, top-N)
    logprobs: list | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingOutput:
    """A pooling request's result: ``data`` is a 1-D float32 ``torch.Tensor`` on the CPU (an
    embedding, or a cross-encoder's logits); typed loosely because this module stays
    torch-free."""

    request_id: str
    data: Any
    num_prompt_tokens: int


@dataclass
class EmbeddingOutput:
    """What ``LLM.embed`` returns per prompt."""

    request_id: str
    embedding: list[float]
    prompt_token_ids: list[int]


@dataclass
class RequestOutput:
    """What a caller receives for its request (one per step while streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt: str | None = None  # the prompt text, when the caller gave text
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    kv_transfer_params: dict | None = None  # the KV connector's answer (its leader's), when done
    pooled: PoolingOutput | None = None  # a pooling request's vector, once finished (no tokens)
    # ``prompt_logprobs`` asked: per prompt token, the sampler's TokenLogprobs of it given the
    # tokens before (None for the first token, which nothing predicts)
    prompt_logprobs: list | None = None

    @classmethod
    def from_sequences(cls, sequences: list[Request]) -> RequestOutput:
        """Token-level snapshot of a request's sequences; text and logprobs are the engine's."""
        ordered = sorted(sequences, key=lambda s: s.seq_index)
        first = ordered[0]
        outputs = [CompletionOutput(s.seq_index, list(s.output_token_ids),
                                    finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                   for s in ordered]
        return cls(first.group_id, first.prompt_token_ids, outputs,
                   finished=all(s.is_finished for s in sequences),
                   num_cached_tokens=first.num_cached_tokens or 0,
                   kv_transfer_params=first.kv_transfer_out)
