"""Fewer forward threads while other processes compete for the cores.

The CPU forward runs a step as a few hundred parallel regions, and every region ends when its
slowest thread does. On cores of its own that costs nothing; when another process keeps the
cores busy, the scheduler takes one of the threads away for a slice now and then and all the
others wait for it at the end of every region: measured on 2 cores with a busy loop on each,
two threads kept 0.3 of their idle throughput and one thread 0.65.

The thread that calls the forward is one of its workers, and spins rather than sleeps while it
waits for the others (``OMP_WAIT_POLICY=ACTIVE``), so the CPU time it gets during the forward,
over the wall time, is the share of a core the machine gives it: about 1 alone, about 1/2 to
2/3 beside busy neighbours. ``ThreadGovernor`` measures that share over windows of steps,
drops to one thread when it is low, and tries the full count again every few seconds (the
share of a single thread cannot tell whether a second core has become free).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

logger = logging.getLogger("tokenmill.runner")

T = TypeVar("T")


@dataclass(frozen=True)
class GovernorLimits:
    window_s: float = 0.5  # forward time measured before each decision
    contended_below: float = 0.8  # a share of a core under this: neighbours take the cores
    retry_after_s: float = 4.0  # on fewer threads, the full count is tried again after this


class ThreadGovernor:
    """Wraps each forward (``run``); between forwards sets the intra-op thread count to
    ``max_threads`` or 1. The clocks and the setter are parameters for the tests."""

    def __init__(self, max_threads: int, limits: GovernorLimits = GovernorLimits(),
                 wall: Callable[[], float] = time.perf_counter,
                 cpu: Callable[[], float] = time.thread_time,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.max_threads = max_threads
        self.limits = limits
        self._wall, self._cpu, self._set_threads = wall, cpu, set_threads
        self.threads = max_threads
        self._since = wall()  # when the count last changed
        self._wall_sum = self._cpu_sum = 0.0
        self.num_changes = 0

    def run(self, forward: Callable[[], T]) -> T:
        w0, c0 = self._wall(), self._cpu()
        out = forward()
        self._wall_sum += self._wall() - w0
        self._cpu_sum += self._cpu() - c0
        if self._wall_sum >= self.limits.window_s:
            self._decide(self._cpu_sum / self._wall_sum)
            self._wall_sum = self._cpu_sum = 0.0
        return out

    def _decide(self, share: float) -> None:
        if self.threads > 1 and share < self.limits.contended_below:
            self._use(1, share)
        elif self.threads < self.max_threads and \
                self._wall() - self._since >= self.limits.retry_after_s:
            self._use(self.max_threads, share)

    def _use(self, threads: int, share: float) -> None:
        logger.debug("forward threads %d -> %d (the forward got %.2f of a core)",
                     self.threads, threads, share)
        self._set_threads(threads)
        self.threads = threads
        self._since = self._wall()
        self.num_changes += 1
