"""The one-worker executor: a ``ModelRunner`` in the engine's own process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.errors import LoRAError
from tokenmill.executor.base import DeferredStep, Executor, ExecutorError
from tokenmill.executor.worker import Worker, WorkerSpec, build_worker
from tokenmill.kv_transfer.worker import IDLE_POLL_SECONDS
from tokenmill.sched.output import ModelOutput

if TYPE_CHECKING:
    from concurrent.futures import Future

    from tokenmill.kv_transfer.worker import ConnectorWorker
    from tokenmill.request import LoRARequest
    from tokenmill.runner.lora import LoRAManager
    from tokenmill.runner.model_runner import ModelRunner
    from tokenmill.runner.rows import RowMasks
    from tokenmill.sched.output import SchedulerOutput


class UniProcExecutor(Executor):
    """Runs every step on ``worker``, in the calling thread."""

    def __init__(self, worker: ModelRunner, details: Mapping[str, Any] | None = None,
                 connector: ConnectorWorker | None = None,
                 connector_info: Mapping[str, Any] | None = None) -> None:
        self.worker: ModelRunner | None = worker
        self._capacity = worker.num_blocks
        self._details = dict(details or {})
        self.connector = connector
        self._connector_info = dict(connector_info) if connector_info is not None else None

    @classmethod
    def from_spec(cls, spec: WorkerSpec) -> tuple[UniProcExecutor, Worker]:
        """The executor of one worker built from ``spec`` (and the worker, whose loaded model
        a drafter in the same process may share)."""
        worker = build_worker(spec)
        details = {"cpu_step": worker.cpu_step,
                   "cuda_graphs": worker.runner.graphs_description(),
                   "quantization": worker.loaded.quantization}
        info = None
        if worker.connector is not None:
            from tokenmill.kv_transfer.factory import worker_connector_info

            info = worker_connector_info(worker.connector, spec.kv_transfer.config)
        return cls(worker.runner, details, worker.connector, info), worker

    def execute(self, out: SchedulerOutput, masks: RowMasks | None = None,
                draft_probs: Mapping[str, Sequence[object | None]] | None = None
                ) -> ModelOutput:
        if self.worker is None:
            raise ExecutorError("the executor was shut down")
        if self.connector is None:
            return self.worker.execute(out.scheduled, masks, draft_probs)
        # saves copy their blocks out before the forward can overwrite them
        self.connector.start_step(out.kv_connector_metadata)
        result = self.worker.execute(out.scheduled, masks, draft_probs) if out.scheduled \
            else ModelOutput()
        # a step that only waits for loads polls briefly rather than spin the loop
        result.kv_connector_output = self.connector.get_finished(
            wait=0.0 if out.scheduled else IDLE_POLL_SECONDS)
        return result

    def launch(self, out: SchedulerOutput, masks: RowMasks | None = None,
               draft_probs: Mapping[str, Sequence[object | None]] | None = None
               ) -> Future[ModelOutput]:
        """On a GPU the step is queued from the calling thread and waited for at ``result()``;
        a CPU's forward computes on the step thread (``Executor.launch``)."""
        worker = self.worker
        if worker is None or worker.device.type != "cuda" or self.connector is not None \
                or not out.scheduled:
            return super().launch(out, masks, draft_probs)
        return DeferredStep(worker.launch(out.scheduled, masks, draft_probs))

    def on_step_thread(self) -> None:
        device = self.worker.device if self.worker is not None else None
        # the current GPU is per thread ("cuda" alone: the default one, as in the caller's)
        if device is not None and device.type == "cuda" and device.index is not None:
            import torch

            torch.cuda.set_device(device)

    def kv_connector_info(self) -> dict[str, Any] | None:
        return self._connector_info

    def add_lora(self, lora: LoRARequest) -> str:
        return self._loras().add(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        self._loras().remove(lora_int_id)

    def _loras(self) -> LoRAManager:
        self.check_health()
        manager = getattr(self.worker, "lora", None)
        if manager is None:
            raise LoRAError("this engine serves no LoRA adapters: start it with --enable-lora "
                            "(LLM(..., enable_lora=True))")
        return manager

    @property
    def kv_capacity(self) -> int:
        return self._capacity

    def check_health(self) -> None:
        if self.worker is None:
            raise ExecutorError("the executor was shut down")

    def shutdown(self) -> None:
        self.worker = None  # the model and its KV cache go with the last reference
        if self.connector is not None:
            self.connector.shutdown()

    def describe(self) -> dict[str, Any]:
        return {"kind": "in-process", "workers": 1, **self._details}
