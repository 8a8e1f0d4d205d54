"""Overlapped scheduling (``async_scheduling``, ``--async-scheduling``): the engine schedules
and launches step N+1 before it does step N's text work, which then runs while N+1 computes.

One ``LLMEngine.step`` call with step N in flight::

    join N (its sampled tokens) -> update_from_output(N): append; EOS, max_tokens, stop ids
    -> schedule N+1 -> launch N+1 on the executor's step thread (``Executor.launch``)
    -> N's detokenization, stop strings and RequestOutputs, while N+1 computes -> return them

The outputs are the plain engine's, token for token. A sequence that a stop string ends at N
already has a chunk in N+1: that chunk's token is computed and dropped (the update of N+1 skips
finished sequences), and so is the token of a sequence aborted while N+1 runs. Such a sequence's
blocks go back at once, cached only up to what step N left computed (``unschedule``), as the plain
engine caches them; nothing is scheduled, so nothing else writes them, before N+1 is joined.

Steps run in the plain order (schedule, forward, outputs) while any of these holds
(``plain_reason``): a draft proposer (speculative decoding: drafts follow the last token), a
KV connector (its ops follow each step's outcome), LoRA adapters (one ends, and its weights go,
while the worker may run them), or a live request with a grammar (the mask of N+1 needs N's
token through the grammar) or a pooling request. A step in flight is always joined first.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.engine.step_state import StepState
from tokenmill.request import FinishReason

if TYPE_CHECKING:
    from tokenmill.engine.output_state import RequestState
    from tokenmill.executor.base import Executor
    from tokenmill.request import Request, RequestOutput
    from tokenmill.sched.output import ModelOutput, SchedulerOutput
    from tokenmill.sched.scheduler import Scheduler


@dataclass
class InFlight:
    """A launched step: its schedule, the worker's future and when the forward ended."""

    out: SchedulerOutput
    future: Future
    launched: float  # perf_counter() when it was handed over
    ended: float = 0.0
    # sequence id -> tokens its chunk computes: what a sequence ended before the join gives back
    tokens: dict[str, int] = field(default_factory=dict)

    def result(self) -> tuple[ModelOutput, float]:
        """Wait for the step; its output and the seconds its forward and sampling took."""
        output = self.future.result()
        return output, max(0.0, (self.ended or time.perf_counter()) - self.launched)

    def unschedule(self, seq: Request) -> None:
        """``seq`` ends before the join: its KV counts as step N left it (this step's chunk of
        it is never cached), so its blocks are cached as the plain engine caches them."""
        seq.num_computed_tokens -= self.tokens.pop(seq.request_id, 0)


def launch(executor: Executor, out: SchedulerOutput) -> InFlight:
    """Start ``out`` on the executor's step thread; returns at once."""
    launched = time.perf_counter()
    flight = InFlight(out, executor.launch(out), launched,
                      tokens={c.request_id: c.num_tokens for c in out.scheduled})

    def ended(_: Future) -> None:  # the forward's end (on the step thread), not the join's
        flight.ended = time.perf_counter()

    flight.future.add_done_callback(ended)
    return flight


def plain_reason(*, proposer: object, connector: object, lora: object,
                 plain_requests: Collection[str]) -> str | None:
    """Why the next step must run in the plain order (None: it may overlap).
    ``plain_requests``: the live requests (callers' ids) with a grammar or pooling."""
    if proposer is not None:
        return "speculative decoding"
    if connector is not None:
        return "a KV connector"
    if lora is not None:
        return "LoRA adapters"
    if plain_requests:
        return "a request with a grammar or a pooling request"
    return None


class OverlappedSteps:
    """``LLMEngine``'s overlapped steps (kept here, beside what they rely on); the engine's
    ``step`` runs ``_overlap_step`` while a step is in flight or ``_may_overlap`` says so.
    They use the engine's step parts: ``_inject``, ``_forget``, ``_count_prompt_tokens``,
    ``_outputs``, ``_account`` and ``_recover``."""

    async_scheduling: bool
    scheduler: Scheduler
    executor: Executor
    proposer: Any
    lora_config: Any
    _requests: dict[str, RequestState]
    _counters: dict[str, Any]
    _inflight: InFlight | None
    _needs_plain: set[str]

    def _may_overlap(self) -> bool:
        return self.async_scheduling and plain_reason(
            proposer=self.proposer, connector=self.scheduler.connector, lora=self.lora_config,
            plain_requests=self._needs_plain) is None

    def _finish_by_stop_string(self, seq: Request, text: str, num_output_tokens: int) -> None:
        """A stop string ended ``seq`` after ``num_output_tokens``. With a step in flight its
        chunk there is wasted; and a stop token or max_tokens that ended it at the same token
        gives way to the stop string, as in the plain order (the scheduler forgot that finish
        when it scheduled the step in flight)."""
        if self._inflight is not None:
            self._inflight.unschedule(seq)
        if not self.scheduler.finish_request(seq.request_id, FinishReason.STOP, text,
                                             num_output_tokens) and seq.is_finished:
            seq.status, seq.stop_reason = FinishReason.STOP.status, text

    def _overlap_step(self, s: StepState) -> list[RequestOutput]:
        """Join the launched step (launch one first if none is), apply its tokens, launch the
        next where the plain order allows, then build the joined step's outputs while the
        next one runs."""
        start, preempted = time.perf_counter(), self.scheduler.num_preemptions
        self._inject("step", s)
        flight = self._inflight or self._launch(s)
        self._inflight = None
        if flight is None:  # nothing to run
            return []
        s.out = flight.out
        result, seconds = flight.result()
        self._counters["forward_seconds"] += seconds
        self._inject("sample", s)
        s.updated = True
        updates = self.scheduler.update_from_output(flight.out, result.token_ids)
        self._inject("update", s)
        failed = self._launch_next() if self._requests and self._may_overlap() else None
        outputs = self._outputs(s, updates, result)
        if failed is not None:
            self._recover(*failed)
        if not self._requests:  # the launched step's sequences all ended here
            self._drain()
        self._account(flight.out, updates, preempted, start)
        return outputs

    def _launch(self, s: StepState) -> InFlight | None:
        """Schedule a step and launch it on the executor's step thread (None: nothing to run)."""
        s.stage = "schedule"
        out = s.out = self.scheduler.schedule()
        self._inject("schedule", s)
        self._forget(out.finished_ids)  # aborted between steps
        if not out.scheduled:
            s.updated = True
            self.scheduler.update_from_output(out, {})
            return None
        self._inject("forward", s)
        self._count_prompt_tokens(out)
        return launch(self.executor, out)

    def _launch_next(self) -> tuple[StepState, Exception] | None:
        """Launch the next step; a failure to launch is handed back, to be recovered from once
        the joined step's outputs are built."""
        s = StepState()
        try:
            self._inflight = self._launch(s)
        except Exception as e:
            return s, e
        return None

    def _drain(self) -> None:
        """Wait for the launched step and apply it, when its sequences all ended meanwhile (its
        tokens are dropped): after the last request's outputs, before a prefix-cache flush."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        s = StepState(stage="drain", out=flight.out)
        try:
            result, _ = flight.result()
            s.updated = True
            self.scheduler.update_from_output(flight.out, result.token_ids)
        except Exception as e:
            self._recover(s, e)

    def _close_step_thread(self) -> None:
        """Shutting down: wait for the launched step (the workers must not go while it runs),
        whatever it returns, and let the step thread go."""
        flight, self._inflight = self._inflight, None
        if flight is not None:
            try:  # a step launched on this thread (executor/base.py DeferredStep) runs here
                flight.future.result()
            except Exception:  # noqa: S110 -- its outcome no longer matters
                pass
        self.executor.close_step_thread()
