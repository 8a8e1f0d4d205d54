"""LoRA adapters at admission: at most ``max_loras`` distinct adapters among running sequences.

A step's forward can hold only ``max_loras`` adapters in its slots, so the scheduler admits a
waiting sequence of an adapter only while that adapter already runs (its slot is taken) or a
slot is free. Base-model sequences take no slot. Loading sequences (waiting in ``running`` for
a KV connector) hold their adapter's slot as running ones do; n > 1 siblings share their
leader's.

Fairness, within one ``schedule()`` call::

    waiting, in admission order    A1  X1  A2  B1  A0*  base
    running adapters {A, B}, max_loras 2, X has no slot
      A1    admitted (A runs)
      X1    cannot get a slot: skipped; the cutoff is X1's arrival
      A2    arrived after X1: not admitted, so A's slot can empty and X1 get it
      B1    the same
      A0*   a preempted sequence that arrived before X1: admitted (it keeps its place)
      base  admitted: base sequences never wait for a slot

Without the cutoff a steady stream of A's requests could keep A's slot busy forever and X1
would never run. An admission order that is not the queue's (``lpm``: longest cached prefix
first) would let A's cache hits take a freed slot before X1 is even looked at, so there the
free slots and the cutoff are first decided in queue order (``plan``), and the admission
order only picks among what that allows. Nothing deadlocks: with nothing running every slot is
free, so the most important waiting sequence always gets one (``max_loras`` >= 1).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from tokenmill.request import LoRARequest, Request
from tokenmill.sched.policy import fcfs


def check_max_loras(max_loras: int | None) -> None:
    if max_loras is not None and max_loras < 1:
        raise ValueError(f"max_loras must be >= 1 (or None: no limit), got {max_loras}")


def adapter_names(loras: Iterable[LoRARequest]) -> tuple[str, ...]:
    """Sorted, unique adapter names (what the ``lora_requests_info`` metric shows)."""
    return tuple(sorted({lora.lora_name for lora in loras}))


class AdapterSlots:
    """One step's admission test for LoRA sequences, from the adapters running when admission
    starts (``running``: one entry per adapter, as ``RequestQueue.loras`` keys them)."""

    def __init__(self, max_loras: int, running: Collection[LoRARequest]) -> None:
        self._active = {lora.lora_int_id for lora in running}
        self._free = max_loras - len(self._active)
        # The arrival key of the earliest sequence that found no slot in this step: from then
        # on only sequences of running adapters that arrived before it are admitted.
        self._cutoff: tuple[float, ...] | None = None

    @classmethod
    def for_step(cls, max_loras: int | None, running: Collection[LoRARequest],
                 queue_order: Iterable[Request] = ()) -> AdapterSlots | None:
        """This step's slots (None without a limit), planned over ``queue_order`` when the
        admission order is another."""
        if max_loras is None:
            return None
        slots = cls(max_loras, running)
        slots.plan(queue_order)
        return slots

    def plan(self, queue_order: Iterable[Request]) -> None:
        """Grant the free slots and set the cutoff as an admission in ``queue_order`` would;
        a later admission in another order then takes no slot beyond these."""
        for request in queue_order:
            if self.allows(request):
                self.admitted(request)

    def allows(self, request: Request) -> bool:
        """Whether ``request`` may be admitted now as far as adapters go; a False for want of a
        slot moves the cutoff."""
        lora = request.lora
        if lora is None:
            return True
        if lora.lora_int_id in self._active:
            return self._cutoff is None or fcfs(request) < self._cutoff
        if self._free > 0:  # no cutoff yet: one is only set once no slot is left
            return True
        arrival = fcfs(request)
        if self._cutoff is None or arrival < self._cutoff:
            self._cutoff = arrival
        return False

    def admitted(self, request: Request) -> None:
        """``request`` was admitted: its adapter holds a slot from now on."""
        lora = request.lora
        if lora is not None and lora.lora_int_id not in self._active:
            self._active.add(lora.lora_int_id)
            self._free -= 1
