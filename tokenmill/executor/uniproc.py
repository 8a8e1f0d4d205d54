"""The one-worker executor: a ``ModelRunner`` in the engine's own process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.executor.base import Executor, ExecutorError
from tokenmill.executor.worker import Worker, WorkerSpec, build_worker

if TYPE_CHECKING:
    from tokenmill.runner.model_runner import ModelRunner
    from tokenmill.runner.rows import RowMasks
    from tokenmill.sched.output import ModelOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """Runs every step on ``worker``, in the calling thread."""

    def __init__(self, worker: ModelRunner, details: Mapping[str, Any] | None = None) -> None:
        self.worker: ModelRunner | None = worker
        self._capacity = worker.num_blocks
        self._details = dict(details or {})

    @classmethod
    def from_spec(cls, spec: WorkerSpec) -> tuple[UniProcExecutor, Worker]:
        """The executor of one worker built from ``spec`` (and the worker, whose loaded model
        a drafter in the same process may share)."""
        worker = build_worker(spec)
        details = {"cpu_step": worker.cpu_step,
                   "cuda_graphs": worker.runner.graphs_description(),
                   "quantization": worker.loaded.quantization}
        return cls(worker.runner, details), worker

    def execute(self, out: SchedulerOutput, masks: RowMasks | None = None,
                draft_probs: Mapping[str, Sequence[object | None]] | None = None
                ) -> ModelOutput:
        if self.worker is None:
            raise ExecutorError("the executor was shut down")
        return self.worker.execute(out.scheduled, masks, draft_probs)

    @property
    def kv_capacity(self) -> int:
        return self._capacity

    def check_health(self) -> None:
        if self.worker is None:
            raise ExecutorError("the executor was shut down")

    def shutdown(self) -> None:
        self.worker = None  # the model and its KV cache go with the last reference

    def describe(self) -> dict[str, Any]:
        return {"kind": "in-process", "workers": 1, **self._details}
