"""Crash and watchdog dumps (``serve --dump-dir DIR``, or the ``--request-log`` directory).

When the server turns unhealthy — the engine loop died of an exception (``crash``), or a step
has run past ``--step-timeout`` or the executor lost a worker (``watchdog``), as
``Watchdog.problem`` sees it — one JSON file is written at once, ``dump-<time>-<reason>.json``:

    reason, problem, time, version
    engine      the loop's error, the published gauges and counters (running, waiting, KV
                usage, blocks, preemptions, steps), how long the current step has run
    info        the engine's facts and load-time plan (dtype, kernels, KV dtype, machine)
    scheduler   its running and waiting sequences (tokens, computed, preemptions, age);
                absent for an engine in another process
    in_flight   the HTTP requests not yet answered
    recent      the request log's lines of the last ``--dump-window`` seconds

One dump per trip (a stall that turns into a crash dumps again); the next one needs the server
healthy again first, and stalls that keep coming back dump once a minute. The scheduler is read
from the event loop while a stalled step may still hold it: best effort, retried if it moved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.health import Watchdog

logger = logging.getLogger("tokenmill.server")
_STALL_INTERVAL = 60.0  # seconds between two watchdog dumps


class DumpWriter:
    """Writes dumps of ``engine`` into ``directory``; ``in_flight`` and ``recent`` give the
    requests' part (plain dicts)."""

    def __init__(self, directory: str, engine: AsyncEngine,
                 in_flight: Callable[[], list[dict[str, Any]]],
                 recent: Callable[[], list[dict[str, Any]]]):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.engine = engine
        self.in_flight = in_flight
        self.recent = recent

    async def watch(self, watchdog: Watchdog, interval: float = 1.0) -> None:
        """Poll the watchdog's verdict; write a dump when it turns unhealthy, or from a stall
        to a crash. Stalls that come and go (each slow step one) dump once a minute at
        most."""
        tripped: str | None = None  # the reason dumped since the server was last healthy
        last_stall = -_STALL_INTERVAL
        while True:
            await asyncio.sleep(interval)
            problem = watchdog.problem()
            if problem is None or (not self.engine.is_alive and self.engine.error is None):
                tripped = None  # healthy, or a clean stop: nothing to dump
                continue
            reason = "crash" if self.engine.error is not None else "watchdog"
            now = time.monotonic()
            if reason == tripped or (reason == "watchdog" and now - last_stall
                                     < _STALL_INTERVAL):
                continue
            tripped = reason
            last_stall = now if reason == "watchdog" else last_stall
            try:
                await asyncio.to_thread(self.write, self.state(reason, problem))
            except Exception:  # a dump that failed must not end the watch
                logger.exception("writing a %s dump failed", reason)

    def state(self, reason: str, problem: str) -> dict[str, Any]:
        """What a dump holds (read on the event loop)."""
        engine = self.engine
        snap = engine.snapshot
        return {"reason": reason, "problem": problem, "time": time.time(),
                "version": tokenmill.__version__,
                "engine": {"error": engine.error, "alive": engine.is_alive,
                           "step_seconds": engine.step_seconds,
                           "num_running": snap.num_running, "num_waiting": snap.num_waiting,
                           "kv_cache_usage": snap.kv_cache_usage,
                           "stats": _plain(snap.stats)},
                "info": _plain(engine.info),
                "scheduler": scheduler_state(engine),
                "in_flight": self.in_flight(), "recent": self.recent()}

    def write(self, state: dict[str, Any]) -> Path:
        """The dump file, written whole or not at all."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(state["time"]))
        millis = int(state["time"] * 1000) % 1000
        path = self.directory / f"dump-{stamp}.{millis:03d}-{state['reason']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, default=str))
        os.replace(tmp, path)
        logger.error("%s: wrote the engine's state and recent requests to %s",
                     state["reason"], path)
        return path


def scheduler_state(engine: AsyncEngine) -> dict[str, Any] | None:
    """The scheduler's queues (None for an engine in another process, or one that would not
    hold still)."""
    sched = getattr(engine.engine, "scheduler", None)
    if not hasattr(sched, "running"):  # the engine's process holds it (--engine-process)
        return None
    for _ in range(3):
        try:
            now = time.monotonic()
            return {"policy": getattr(sched.config, "policy", None),
                    "max_num_seqs": getattr(sched.config, "max_num_seqs", None),
                    "max_num_batched_tokens": getattr(sched.config, "max_num_batched_tokens",
                                                      None),
                    "running": [_sequence(r, now) for r in list(sched.running)],
                    "waiting": [_sequence(r, now) for r in list(sched.waiting)]}
        except RuntimeError:  # the loop thread changed a queue while it was read
            continue
    return None


def _sequence(request: Any, now: float) -> dict[str, Any]:
    return {"id": request.request_id, "status": getattr(request.status, "name", None),
            "prompt_tokens": len(request.prompt_token_ids),
            "output_tokens": len(request.output_token_ids),
            "computed_tokens": request.num_computed_tokens,
            "cached_tokens": request.num_cached_tokens,
            "preemptions": request.num_preemptions, "priority": request.priority,
            "age": round(now - request.arrival_time, 3),
            "lora": request.lora.lora_name if request.lora is not None else None}


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
