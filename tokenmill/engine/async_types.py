"""What ``AsyncEngine`` (``engine/async_engine.py``) tells its callers: the errors a request or
the engine ends with, a request's timings, the gauges the loop thread publishes after every
step and the listener it calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.engine.info import EngineStats
from tokenmill.request import RequestOutput


class EngineOverloadedError(Exception):
    """Too many requests are waiting: the caller should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailableError(Exception):
    """The engine is shutting down or its loop died; no new requests are taken."""


class RequestFailedError(Exception):
    """The engine failed this request (its step or its output processing raised); the engine
    and the other requests go on."""


@dataclass
class RequestTimings:
    """Monotonic timestamps of one request, for metrics and the per-request log line."""

    arrival: float
    scheduled: float | None = None  # first step that ran any of its tokens
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # inter-token latencies (per step)
    num_tokens: int = 0  # generated tokens over all n completions


@dataclass(frozen=True)
class EngineSnapshot:
    """Gauges published by the loop thread after every step (read by /metrics, /health)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_adds_taken: int = 0  # add commands the loop has taken (admission counts the rest)
    stats: EngineStats = field(default_factory=EngineStats)  # the engine's own counters


class StatsListener(Protocol):
    """Called from the loop thread; implementations must be thread-safe (prometheus-client is)."""

    def on_step(self, num_batched_tokens: int, num_new_tokens: int, num_preemptions: int) -> None:
        ...

    def on_request_finished(self, output: RequestOutput, timings: RequestTimings) -> None:
        ...
