"""What the dashboard (``server/dashboard.py``) remembers of the last minutes: each finished
request's latencies (``LatencyWindow``, fed by the metrics listener on the engine's loop
thread) and the server's counters as polls saw them (``CounterHistory``), from which it draws
rates and charts. Prometheus keeps totals since start; a person watching wants "now"."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

WINDOW_SECONDS = 300.0
# At c=32 and ~200 tok/s, 5 minutes hold ~60k inter-token gaps; past this many the oldest go
# first, so memory stays bounded whatever the load (the percentiles then cover less time).
_MAX_SAMPLES = 100_000


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted values, nearest rank: always a value that was seen."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class LatencyWindow:
    """Latency samples of the last ``seconds`` per series (``ttft``, ``itl``, ``e2e``, ...).
    Thread-safe: the engine's loop thread observes, the event loop summarises."""

    def __init__(self, seconds: float = WINDOW_SECONDS, max_samples: int = _MAX_SAMPLES):
        self.seconds = seconds
        self._max = max_samples
        self._series: dict[str, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def observe(self, series: str, values: Iterable[float], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            samples = self._series.setdefault(series, deque(maxlen=self._max))
            samples.extend((now, v) for v in values)

    def summary(self, series: str, now: float | None = None) -> dict[str, float | int | None]:
        """``{"n", "p50", "p99", "max"}`` of the window (None without samples)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            samples = self._series.get(series)
            if samples is None:
                values: list[float] = []
            else:
                while samples and samples[0][0] < now - self.seconds:
                    samples.popleft()
                values = [v for _, v in samples]
        values.sort()
        if not values:
            return {"n": 0, "p50": None, "p99": None, "max": None}
        return {"n": len(values), "p50": percentile(values, 0.5),
                "p99": percentile(values, 0.99), "max": values[-1]}


@dataclass(frozen=True)
class Sample:
    """The server's figures at one poll: ``values`` holds counters and gauges by name."""

    t: float  # Unix time
    values: Mapping[str, float]


class CounterHistory:
    """Samples of the server's figures, at most one per ``every`` seconds, for ``seconds``.
    Rates come from differences of counters between samples, as Prometheus's ``rate``."""

    def __init__(self, seconds: float = WINDOW_SECONDS, every: float = 1.0):
        self.seconds = seconds
        self.every = every
        self._samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> None:
        """Keep ``sample`` unless the last kept one is under ``every`` s old (several viewers
        polling add one sample a second between them); drop what is past the window."""
        if self._samples and sample.t - self._samples[-1].t < self.every:
            return
        self._samples.append(sample)
        while self._samples and self._samples[0].t < sample.t - self.seconds:
            self._samples.popleft()

    def samples(self) -> list[Sample]:
        return list(self._samples)

    def rate(self, name: str, now: Sample, over: float = 5.0) -> float | None:
        """Per second of counter ``name`` between ``now`` and the newest kept sample at least
        ``over`` s older (or the oldest); None with nothing to compare."""
        base = None
        for s in reversed(self._samples):
            if s.t < now.t:
                base = s
                if now.t - s.t >= over:
                    break
        if base is None:
            return None
        return max(0.0, now.values.get(name, 0.0) - base.values.get(name, 0.0)) / (now.t - base.t)

    def delta(self, name: str, now: Sample) -> float:
        """How much counter ``name`` grew over the kept history up to ``now``."""
        if not self._samples:
            return 0.0
        return max(0.0, now.values.get(name, 0.0) - self._samples[0].values.get(name, 0.0))
