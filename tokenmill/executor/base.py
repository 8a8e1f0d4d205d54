"""The seam between the engine and the workers that run the model.

``LLMEngine`` hands each step's ``SchedulerOutput`` to an ``Executor`` and gets a ``ModelOutput``
back; it never touches a model, a tensor or a KV cache itself. The executor owns the workers:
today one ``ModelRunner`` in the engine's process (``UniProcExecutor``); a multi-process executor
(tensor / pipeline parallel workers over torch.distributed) plugs in here with the same surface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tokenmill.errors import LoRAError

if TYPE_CHECKING:
    from tokenmill.request import LoRARequest
    from tokenmill.runner.rows import RowMasks
    from tokenmill.sched.output import ModelOutput, SchedulerOutput


class DeferredStep(Future):
    """A step launched on the calling thread, whose device runs it meanwhile: ``result()``
    waits for it there (no step thread, so no GIL hand-over between two Python threads)."""

    def __init__(self, finish: Callable[[], ModelOutput]) -> None:
        super().__init__()
        self._finish = finish

    def result(self, timeout: float | None = None) -> ModelOutput:
        if not self.done():
            try:
                self.set_result(self._finish())
            except BaseException as e:  # handed to the caller, as a step thread's would be
                self.set_exception(e)
        return super().result(timeout)


class ExecutorError(RuntimeError):
    """A worker is gone or broken: the executor cannot run steps any more."""


class Executor(ABC):
    """Runs scheduled steps on the model's workers."""

    @abstractmethod
    def execute(self, out: SchedulerOutput, masks: RowMasks | None = None,
                draft_probs: Mapping[str, Sequence[object | None]] | None = None
                ) -> ModelOutput:
        """One forward over ``out.scheduled`` and the accepted tokens of every chunk with
        logits. ``masks`` (structured output) are being filled while the forward runs and are
        applied before sampling; ``draft_probs``: per sequence, the distribution each of its
        drafts was drawn from (None: none), for the rejection rule."""

    def launch(self, out: SchedulerOutput, masks: RowMasks | None = None,
               draft_probs: Mapping[str, Sequence[object | None]] | None = None
               ) -> Future[ModelOutput]:
        """``execute`` on the executor's step thread; returns at once (overlapped scheduling:
        the engine builds the last step's outputs meanwhile). One step at a time: the caller
        waits for it before it launches or executes another. An engine that launches runs
        every step here, so the CPU forward's intra-op threads always serve the same caller."""
        pool = self.__dict__.get("_step_thread")  # made on first use: no __init__ here
        if pool is None:
            pool = self.__dict__["_step_thread"] = ThreadPoolExecutor(
                1, thread_name_prefix="tokenmill-step", initializer=self.on_step_thread)
        return pool.submit(self.execute, out, masks, draft_probs)

    def on_step_thread(self) -> None:
        """Set-up of the step thread, before its first step (the GPU it runs on)."""

    def close_step_thread(self) -> None:
        """Let the step thread go (after the last launched step was waited for)."""
        pool = self.__dict__.pop("_step_thread", None)
        if pool is not None:
            pool.shutdown(wait=False)

    @property
    @abstractmethod
    def kv_capacity(self) -> int:
        """KV blocks every worker holds (block 0, the tables' padding, included)."""

    def check_health(self) -> None:
        """Raise ``ExecutorError`` when a worker cannot run steps any more."""

    def shutdown(self) -> None:
        """Stop the workers and free what they hold; idempotent."""

    def describe(self) -> dict[str, Any]:
        """What the workers run as (for the log and ``/server_info``)."""
        return {}

    def kv_connector_info(self) -> dict[str, Any] | None:
        """What the workers' KV connector side learnt at start-up (block bytes, the side
        channel's address, blocks on disk) for the scheduler's side; None without one."""
        return None

    def heartbeat_ages(self) -> dict[int, float]:
        """Seconds since each worker rank was last heard from ({}: the workers are in this
        process); any thread may call it."""
        return {}

    def add_lora(self, lora: LoRARequest) -> str:
        """Load and check a LoRA adapter on every worker, which serve it from then on under
        ``lora.lora_int_id``; returns its fingerprint. Raises ``LoRAError`` naming what does
        not fit (its rank, targets or shapes), or when the workers serve no adapters."""
        raise LoRAError(f"{type(self).__name__} serves no LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop an adapter's weights from every worker (no request uses it any more)."""
        raise LoRAError(f"{type(self).__name__} serves no LoRA adapters")
