"""How far an engine step got (``StepState``), which says what a failure in it touched, and
what the KV connector's workers never heard of when it failed early (``undelivered_kv``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.kv_transfer.base import KVConnectorOutput
    from tokenmill.sched.output import SchedulerOutput


@dataclass
class StepState:
    """How far the running step got, which says what a failure in it touched."""

    stage: str = "step"  # step (nothing touched yet), propose, schedule
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
