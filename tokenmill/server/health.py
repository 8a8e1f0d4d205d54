"""Is the server healthy: a watchdog on the engine loop's steps, and the one-token probe of
``/health?generate=true``."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from tokenmill.engine.async_engine import (AsyncEngine, EngineOverloadedError,
                                           EngineUnavailableError, RequestFailedError)
from tokenmill.params import PoolingParams, SamplingParams

logger = logging.getLogger("tokenmill.server")


class Watchdog:
    """Watches the engine loop: a step running longer than ``step_timeout`` s (a hung kernel,
    a stuck lock) makes /health answer 503 until it ends; a loop that died is logged once. An
    executor that broke (a worker process died or hung) calls ``on_broken`` once: the server
    then exits, non-zero, for a supervisor to restart it."""

    def __init__(self, engine: AsyncEngine, step_timeout: float):
        self.engine = engine
        self.step_timeout = step_timeout
        self.healthy = True  # as of the last check (for the log lines)
        self.broken = False
        self.on_broken: Callable[[], None] = lambda: None

    def problem(self) -> str | None:
        """Why /health answers 503 now (read at each call), or None."""
        if not self.engine.is_alive:
            why = self.engine.error or "the server is shutting down"
            return f"the engine has stopped: {why}"
        broken = self.engine.executor_problem()
        if broken is not None:
            return f"the executor cannot run steps: {broken}"
        running = self.engine.step_seconds
        if running > self.step_timeout:
            return f"an engine step has run for {running:.1f}s (--step-timeout " \
                   f"{self.step_timeout:g}s)"
        return None

    async def run(self) -> None:
        reported_dead = False
        while True:
            await asyncio.sleep(min(1.0, self.step_timeout / 4))
            running = self.engine.step_seconds
            stalled = running > self.step_timeout
            if stalled and self.healthy:
                logger.error("watchdog: an engine step has run for %.0fs (--step-timeout "
                             "%.0fs); /health answers 503 until it ends", running,
                             self.step_timeout)
            elif not stalled and not self.healthy:
                logger.warning("watchdog: the engine step ended; healthy again")
            self.healthy = not stalled
            if not self.engine.is_alive and not reported_dead:
                logger.error("watchdog: the engine loop is not running; /health answers 503")
                reported_dead = True
            self._check_executor()

    def _check_executor(self) -> None:
        if self.broken:
            return
        problem = self.engine.executor_problem()
        if problem is not None:
            self.broken = True
            logger.error("watchdog: the executor cannot run steps (%s); exiting", problem)
            self.on_broken()


async def probe(engine: AsyncEngine, timeout: float) -> tuple[str, str | None]:
    """A one-token generation through the whole engine (``/health?generate=true``): ``("ok",
    None)`` once it came back, ``("busy", why)`` when the server is too busy to run it now
    (steps go on), else ``("unhealthy", why)``. A probe that failed with a step it shared
    with a failing request runs once more: that request is gone by then."""
    why = None
    for _ in range(2):
        status, why = await _probe_once(engine, timeout)
        if status != "failed":
            return status, why
    return "unhealthy", why


async def _probe_once(engine: AsyncEngine, timeout: float) -> tuple[str, str | None]:
    token = engine.tokenizer.bos_token_id
    steps = engine.snapshot.stats.num_steps
    task = getattr(engine.engine, "task", "generate")
    # one token generated, or (an embedding model, a cross-encoder) one token pooled
    params = SamplingParams(max_tokens=1, temperature=0.0) if task == "generate" \
        else PoolingParams(task="score" if task in ("score", "rerank") else "embed")
    try:
        stream = await engine.add_request(f"health-{uuid.uuid4().hex}",
                                          [token if token is not None else 0], params)
    except EngineOverloadedError:
        return "busy", "the request queue is full"
    except EngineUnavailableError as e:
        return "unhealthy", str(e)
    try:
        async with asyncio.timeout(timeout):
            async for out in stream:
                if out.finished:
                    return "ok", None
    except TimeoutError:
        if engine.snapshot.stats.num_steps > steps:  # working, just not on the probe yet
            return "busy", f"the probe's generation waited over {timeout:g}s behind others"
        return "unhealthy", f"no engine step completed in {timeout:g}s"
    except RequestFailedError as e:
        return "failed", f"the probe's generation failed: {e}"
    except EngineUnavailableError as e:
        return "unhealthy", str(e)
    finally:
        stream.abort()
    return "unhealthy", "the probe's generation ended without a result"
