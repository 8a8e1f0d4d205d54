"""AsyncEngine over a real LLMEngine with a fake runner: streams, aborts, admission, a dying
loop, shutdown (fast, no torch)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.test_engine_unit import make_engine
from tokenmill.engine.async_engine import (AsyncEngine, EngineOverloadedError,
                                           EngineUnavailableError, RequestFailedError)
from tokenmill.engine.faults import FaultRule
from tokenmill.engine.llm_engine import MAX_BLAMELESS_FAILURES
from tokenmill.params import SamplingParams


class FakeEngine:
    """An ``LLMEngine`` (4 sequences at a time, 256-token context) whose runner takes
    ``step_seconds`` per step; records the threads that touch it; ``fail`` makes the next
    step raise."""

    def __init__(self, step_seconds: float = 0.002):
        self.engine = make_engine(num_blocks=300, max_seqs=4)
        self.step_seconds = step_seconds
        self.fail = False
        self.thread_ids: set[int] = set()
        self.engine.executor.before_execute = self._before_execute
        for name in ("add_request", "abort_request", "step"):
            setattr(self.engine, name, self._recorded(getattr(self.engine, name)))

    def _recorded(self, method):
        def call(*args, **kwargs):
            self.thread_ids.add(threading.get_ident())
            return method(*args, **kwargs)
        return call

    def _before_execute(self, chunks) -> None:
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(self.step_seconds)

    @property
    def steps(self) -> int:
        return self.engine.stats().num_steps

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_stream_to_the_end_and_loop_thread_only():
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake.engine)
        engine.start()
        outs = [o async for o in engine.generate("a", [1, 2], SamplingParams(max_tokens=5))]
        await engine.shutdown(1)
        return outs

    outs = run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert len(fake.thread_ids) == 1 and threading.get_ident() not in fake.thread_ids


def test_consumer_that_stops_aborts_and_idle_loop_sleeps():
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake.engine)
        engine.start()
        gen = engine.generate("a", [1], SamplingParams(max_tokens=10_000))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(200):
            if not fake.busy and engine.snapshot.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.01)
        assert not fake.busy and engine.snapshot.num_running == 0
        steps = fake.steps
        await asyncio.sleep(0.3)
        assert fake.steps == steps  # no busy stepping while idle
        task = asyncio.create_task(_consume(engine, "b", 10_000))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        assert not fake.busy
        await engine.shutdown(1)

    run(main())


async def _consume(engine, rid, max_tokens):
    return [o async for o in engine.generate(rid, [1], SamplingParams(max_tokens=max_tokens))]


def test_bad_prompt_and_admission_control():
    fake = FakeEngine(step_seconds=0.05)

    async def main():
        engine = AsyncEngine(fake.engine, max_queued_requests=1)
        engine.start()
        with pytest.raises(ValueError):
            await engine.add_request("bad", [], SamplingParams())
        results = await asyncio.gather(*(_consume(engine, f"r{i}", 3) for i in range(10)),
                                       return_exceptions=True)
        await engine.shutdown(1)
        return results

    results = run(main())
    ok = [r for r in results if isinstance(r, list)]
    rejected = [r for r in results if isinstance(r, EngineOverloadedError)]
    assert len(ok) + len(rejected) == 10 and rejected and len(ok) >= 5  # 4 slots + 1 queued
    assert all(r[-1].finished for r in ok)


def test_failing_steps_fail_their_requests_and_the_loop_goes_on():
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake.engine)
        engine.start()
        gen = engine.generate("a", [1], SamplingParams(max_tokens=10_000))
        await gen.__anext__()
        fake.fail = True
        with pytest.raises(RequestFailedError, match="boom"):
            async for _ in gen:
                pass
        for i in range(MAX_BLAMELESS_FAILURES + 2):  # step after step: each fails its own
            with pytest.raises(RequestFailedError, match="boom"):
                await _consume(engine, f"c{i}", 3)
        assert engine.is_alive and engine.error is None
        fake.fail = False
        outs = await _consume(engine, "b", 3)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        await engine.shutdown(1)
        assert not fake.engine.has_unfinished_requests()

    run(main())


def test_failures_with_no_request_to_blame_stop_the_loop_and_say_why():
    fake = FakeEngine()
    fake.engine.fault_hook = FaultRule("step", "doomed", None)  # before any request is touched

    async def main():
        engine = AsyncEngine(fake.engine)
        engine.start()
        assert (await _consume(engine, "fine", 2))[-1].finished
        with pytest.raises(EngineUnavailableError, match="no request to blame"):
            await _consume(engine, "doomed", 3)
        assert not engine.is_alive and "EngineDeadError" in engine.error
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("d", [1], SamplingParams())
        assert not fake.engine.has_unfinished_requests()
        fake.engine.scheduler.check_integrity()
        assert fake.engine.stats().num_failed_steps == MAX_BLAMELESS_FAILURES

    run(main())


class FlakyListener:
    """A metrics listener that raises while ``broken`` names the call to break."""

    def __init__(self) -> None:
        self.broken: str | None = None
        self.finished: list[str] = []

    def on_step(self, *args) -> None:
        if self.broken == "on_step":
            raise RuntimeError("metrics broke")

    def on_request_finished(self, output, timings) -> None:
        if self.broken == "on_request_finished":
            raise RuntimeError("metrics broke")
        self.finished.append(output.request_id)


@pytest.mark.parametrize("broken", ["on_step", "on_request_finished"])
def test_a_failing_metrics_listener_fails_the_steps_requests_not_the_loop(broken):
    fake = FakeEngine()
    listener = FlakyListener()

    async def main():
        engine = AsyncEngine(fake.engine, listener=listener)
        engine.start()
        expected = (await _consume(engine, "ref", 4))[-1].outputs[0].token_ids
        listener.broken = broken
        # on_request_finished breaks when the request ends, on_step at its first step: either
        # way the request's caller is told, not left waiting.
        with pytest.raises(RequestFailedError, match="metrics broke"):
            await _consume(engine, "hit", 4)
        stream = await engine.add_request("gone", [1], SamplingParams(max_tokens=10_000))
        stream.abort()  # the listener hears of the abort; its failure is only logged
        listener.broken = None
        outs = await _consume(engine, "next", 4)
        assert engine.is_alive and outs[-1].outputs[0].token_ids == expected
        await engine.shutdown(1)
        fake.engine.scheduler.check_integrity()
        manager = fake.engine.scheduler.block_manager
        assert manager.num_free_blocks == manager.pool.num_usable_blocks

    run(main())
    assert "hit" not in listener.finished and "next" in listener.finished


def test_drain_ends_what_is_left_with_an_error():
    fake = FakeEngine(step_seconds=0.01)

    async def main():
        engine = AsyncEngine(fake.engine)
        engine.start()
        gen = engine.generate("a", [1], SamplingParams(max_tokens=10_000))
        await gen.__anext__()
        assert await engine.drain(0.1) == 1
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            async for _ in gen:
                pass
        await engine.shutdown(1)
        assert not fake.engine.has_unfinished_requests()

    run(main())


def test_shutdown_lets_running_requests_finish_and_refuses_new_ones():
    fake = FakeEngine(step_seconds=0.01)

    async def main():
        engine = AsyncEngine(fake.engine)
        engine.start()
        task = asyncio.create_task(_consume(engine, "a", 20))
        await asyncio.sleep(0.05)
        stop = asyncio.create_task(engine.shutdown(5))
        await asyncio.sleep(0)
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("b", [1], SamplingParams())
        outs = await task
        await stop
        assert outs[-1].finished and not engine.is_alive

    run(main())


def test_watchdog_marks_an_overlong_step_unhealthy_until_it_ends(caplog):
    from tokenmill.server.health import Watchdog

    fake = FakeEngine(step_seconds=0.6)

    async def main():
        engine = AsyncEngine(fake.engine)
        engine.start()
        watchdog = Watchdog(engine, step_timeout=0.2)
        watch = asyncio.create_task(watchdog.run())
        seen = []
        task = asyncio.create_task(_consume(engine, "slow", 2))  # two 0.6 s steps
        while not task.done():
            seen.append(watchdog.healthy)
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        seen.append(watchdog.healthy)
        watch.cancel()
        await engine.shutdown(1)
        return seen

    seen = run(main())
    assert seen[0] and not all(seen) and seen[-1]  # healthy, stalled, healthy again
    assert "an engine step has run for" in caplog.text


def test_a_request_aborted_while_waiting_is_reported_finished():
    fake = FakeEngine(step_seconds=0.01)
    finished = []

    class Listener:
        def on_step(self, *args) -> None:
            pass

        def on_request_finished(self, output, timings) -> None:
            finished.append(output.request_id)

    async def main():
        engine = AsyncEngine(fake.engine, listener=Listener())
        engine.start()
        streams = [await engine.add_request(f"r{i}", [1], SamplingParams(max_tokens=10_000))
                   for i in range(5)]  # four slots: r4 waits
        await streams[0].__anext__()
        for _ in range(100):
            if engine.snapshot.num_adds_taken == 5:
                break
            await asyncio.sleep(0.01)
        assert engine.snapshot.num_waiting == 1
        streams[4].abort()
        for _ in range(100):
            if "r4" in finished:
                break
            await asyncio.sleep(0.01)
        for s in streams[:4]:
            s.abort()
        await engine.shutdown(1)

    run(main())
    assert finished[0] == "r4" and sorted(finished) == [f"r{i}" for i in range(5)]
