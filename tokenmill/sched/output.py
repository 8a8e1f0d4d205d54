"""What one scheduler step hands to the runner and gets back from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one sequence to compute this step.

    ``token_ids == request.all_token_ids[start_pos:start_pos + len(token_ids)]``; positions run
    from ``start_pos``; ``block_table`` (a copy) covers at least ``start_pos + len(token_ids)``
    tokens. When ``sample`` is True the chunk ends at the sequence's last known token and the
    runner samples one token from its last position; otherwise it only writes KV (a prefill
    chunk that continues next step).
    """

    request_id: str  # the sequence's id: "<id>" when n == 1, "<id>#<i>" for the i-th of n
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    request: Request  # read-only for the runner: sampling_params, token history, seq_index

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_ids: list[str]  # sequences preempted by this step (informational for the runner)
    finished_ids: list[str]  # sequences finished or aborted since the previous step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SeqUpdate(NamedTuple):
    """One sequence's result of a step, as ``update_from_output`` returns it."""

    request: Request
    new_token_ids: list[int]
    finished: bool


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
    num_free_blocks: int
    num_steps: int
    last_num_batched_tokens: int
    last_num_scheduled: int
    overhead_seconds_total: float  # time inside schedule() and update_from_output()
    prefix_cache_queries: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV the cache had

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / max(1, self.prefix_cache_queries)

    @property
    def mean_overhead_us(self) -> float:
        """Scheduler time per step, in microseconds."""
        return 1e6 * self.overhead_seconds_total / max(1, self.num_steps)
