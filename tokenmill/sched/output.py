"""What one scheduler step hands to the runner and gets back from it.

The step contract::

    ScheduledChunk      token_ids = known tokens [start_pos, num_tokens) + draft tokens
                        num_logits = 0 (KV only: a prefill that continues next step)
                                   | 1 (the last known token: sample the next one)
                                   | k + 1 (the last known token and k drafts: verify)
    ModelOutput         per sequence that asked for logits: the accepted token ids (>= 1),
                        with a logprobs entry per token; a verifier accepts drafts while the
                        model agrees and then adds its own token
    update_from_output  appends them one by one (a stop truncates the rest), rolls the KV of
                        rejected drafts back (``KVBlockManager.trim``), and only then shares
                        full blocks with the prefix cache
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from tokenmill.request import Request

if TYPE_CHECKING:  # the types only: the connector's package may grow heavier imports
    from tokenmill.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 4x, per sequence per step
class ScheduledChunk:
    """Tokens of one sequence to compute this step (read-only for everyone but the scheduler).

    ``token_ids[:num_known]`` equals ``request.all_token_ids[start_pos:]`` up to the chunk's
    end; when the chunk reaches the last known token it may carry ``num_drafts`` proposed
    tokens after it. Positions run from ``start_pos``; ``block_table`` (a copy) covers every
    position of the chunk. Logits are wanted for the last ``num_logits`` positions: 0 (the
    chunk only writes KV), 1 (sample the next token) or ``num_drafts + 1`` (verify drafts).
    """

    request_id: str  # the sequence's id: "<id>" when n == 1, "<id>#<i>" for the i-th of n
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_logits: int
    request: Request  # read-only for the runner: sampling_params, token history, seq_index
    num_drafts: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts:] if self.num_drafts else []

    @property
    def num_known_tokens(self) -> int:
        """The sequence's prompt and output tokens when the step was scheduled (drafts not
        counted): what a length-dependent RoPE (LongRoPE) chooses its factors by."""
        return self.request.num_tokens


@dataclass
class ModelOutput:
    """What the runner returns for one step: for every chunk with ``num_logits > 0``, the
    accepted tokens (at least one) and, per token, its logprobs entry (``None`` entries where
    the request asked for none). Tokens past the scored positions are allowed (text a grammar
    forces): they are appended like the others and their KV is computed next step."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Sequence[object | None]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None  # the KV connector's workers' report
    # pooling sequences whose prompt ended this step: id -> their pooled vector (1-D float32)
    pooled: dict[str, Any] = field(default_factory=dict)
    # ``prompt_logprobs`` requests: caller's request id -> (index of the prompt token the first
    # entry scores, one logprobs entry per prompt token this step's chunk scored)
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)


# What a step sampled, as the scheduler takes it: ``ModelOutput.token_ids``, or one token id
# per sequence.
Sampled = Mapping[str, int | Sequence[int]]


def sampled_tokens(chunk: ScheduledChunk, sampled: Sampled) -> list[int]:
    """The chunk's accepted tokens as Python ints; ValueError when there are none."""
    value = sampled.get(chunk.request_id)
    if type(value) is list and value:  # what the runner returns: no ABC isinstance per chunk
        return value
    if value is None:
        raise ValueError(f"no sampled token for {chunk.request_id!r}, whose chunk asked for one")
    # operator.index also accepts numpy / 0-d tensor ints and turns them into Python ints.
    tokens = list(value) if isinstance(value, Sequence) else [operator.index(value)]
    if not tokens:
        raise ValueError(f"empty sampled token list for {chunk.request_id!r}")
    return tokens


def num_matching_drafts(drafts: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading drafts equal the tokens at their positions: the drafts the runner
    accepts, and the drafts whose KV the scheduler keeps."""
    n = 0
    for draft, token in zip(drafts, tokens):
        if draft != token:
            break
        n += 1
    return n


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_ids: list[str]  # sequences preempted by this step (informational for the runner)
    finished_ids: list[str]  # sequences finished or aborted since the previous step
    # The KV connector's ops for this step (saves, loads, pulls, exposes), for every worker;
    # present even when no chunk is scheduled (a step may only move KV).
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SeqUpdate(NamedTuple):
    """One sequence's result of a step, as ``update_from_output`` returns it."""

    request: Request
    new_token_ids: list[int]  # appended this step: the accepted tokens, cut after a stop
    finished: bool
    num_rejected: int = 0  # draft tokens whose KV was rolled back


def group_by_request(updates: list[SeqUpdate]) -> dict[str, list[SeqUpdate]]:
    """Updates keyed by the caller's request id (``Request.group_id``), sequences in step order."""
    groups: dict[str, list[SeqUpdate]] = {}
    for update in updates:
        groups.setdefault(update.request.group_id, []).append(update)
    return groups


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    kv_cache_usage: float  # fraction of usable blocks referenced
    num_free_blocks: int  # free for new KV: never used, or cached and evictable
    num_steps: int
    last_num_batched_tokens: int
    last_num_scheduled: int
    overhead_seconds_total: float  # time inside schedule() and update_from_output()
    prefix_cache_queries: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV the cache had
    num_draft_tokens: int = 0  # draft tokens scheduled for verification, total
    num_accepted_tokens: int = 0  # of those, accepted
    num_blocks: int = 0  # usable KV blocks
    num_cached_blocks: int = 0  # blocks the prefix cache holds (in use or evictable)
    num_loading: int = 0  # of num_running, the sequences waiting for a KV connector's load
    num_held: int = 0  # finished sequences whose blocks wait for a consumer to pull them
    external_cache_hits: int = 0  # tokens a KV connector filled at admission, total
    # LoRA adapters (names, sorted) of running sequences (loading ones included) and of
    # waiting ones (preempted included): vLLM's lora_requests_info
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / max(1, self.prefix_cache_queries)

    @property
    def mean_overhead_us(self) -> float:
        """Scheduler time per step, in microseconds."""
        return 1e6 * self.overhead_seconds_total / max(1, self.num_steps)
