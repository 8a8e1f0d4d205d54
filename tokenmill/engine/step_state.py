"""How far an engine step got (``StepState``), which says what a failure in it touched
(``touched_requests``), and what the KV connector's workers never heard of when it failed early
(``undelivered_kv``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenmill.engine.output_state import RequestState
    from tokenmill.kv_transfer.base import KVConnectorOutput
    from tokenmill.sched.output import SchedulerOutput
    from tokenmill.sched.scheduler import Scheduler

# A failing step fails the requests it touched and the engine goes on, however often that
# happens (a request that crashes a kernel must not take the server down with it). A failure
# that touched no request has no one to blame: this many in a row mean the engine itself is
# broken, and the step raises EngineDeadError.
MAX_BLAMELESS_FAILURES = 3


class EngineDeadError(RuntimeError):
    """Steps kept failing with no request to blame: the engine cannot go on."""


@dataclass
class BlamelessFailures:
    in_a_row: int = 0  # failed steps in a row that touched no request

    def count(self, blamed: bool, error: Exception) -> None:
        """A failed step; raises ``EngineDeadError`` at the limit of blameless ones."""
        if blamed:
            return
        self.in_a_row += 1
        if self.in_a_row >= MAX_BLAMELESS_FAILURES:
            raise EngineDeadError(
                f"{self.in_a_row} steps in a row failed with no request to blame, "
                f"the last with {type(error).__name__}: {error}") from error


@dataclass
class StepState:
    """How far the running step got, which says what a failure in it touched."""

    stage: str = "step"  # step (nothing touched yet), propose, schedule, drain
    out: SchedulerOutput | None = None  # schedule()'s result, once it returned
    updated: bool = False  # update_from_output() was called: the scheduler took ``out``
    kv_output: KVConnectorOutput | None = None  # what the KV connector's workers reported
    kv_sent: bool = False  # the step's KV connector ops reached the executor


def undelivered_kv(s: StepState) -> KVConnectorOutput | None:
    """A step that failed before its KV connector ops reached the workers: its loads and
    pulls never ran (their requests recompute from their local prefix) and its exposed blocks
    are nobody's to pull (freed now)."""
    meta = s.out.kv_connector_metadata if s.out is not None else None
    if meta is None or s.kv_sent:
        return None
    from tokenmill.kv_transfer.base import ExposeBlocks, KVConnectorOutput, LoadBlocks, PullBlocks

    return KVConnectorOutput(
        finished_sending={op.request_id for op in meta.ops if isinstance(op, ExposeBlocks)},
        failed_recving={op.request_id: 0 for op in meta.ops
                        if isinstance(op, LoadBlocks | PullBlocks)})


def touched_requests(s: StepState, scheduler: Scheduler,
                     requests: Iterable[RequestState]) -> set[str]:
    """The requests (callers' ids) a step that fails now may have left half-changed."""
    if s.out is not None:  # schedule() returned: the requests it scheduled
        return {c.request.group_id for c in s.out.scheduled}
    if s.stage == "schedule":  # schedule() raised: the step it half built is lost
        return _unsettled(scheduler, requests)
    if s.stage == "propose":  # drafts (and grammar state) of every running sequence
        return {r.group_id for r in scheduler.running}
    return set()


def _unsettled(scheduler: Scheduler, requests: Iterable[RequestState]) -> set[str]:
    """After schedule() raised: every request with a sequence it may have advanced or given
    blocks (running, holding blocks, or with computed tokens). Waiting sequences without any
    are as they were, and wait on."""
    owners = set(scheduler.block_manager.owners())

    def unsettled(seq: Request) -> bool:
        if seq.is_finished:
            return False
        return seq.status is RequestStatus.RUNNING or bool(seq.num_computed_tokens) \
            or seq.request_id in owners

    return {state.request_id for state in requests
            if any(unsettled(seq) for seq in state.sequences)}
