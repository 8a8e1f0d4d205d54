"""AsyncEngine with a fake LLMEngine: streams, aborts, admission, a dying loop, shutdown (fast)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from tokenmill.engine.async_engine import (AsyncEngine, EngineOverloadedError,
                                           EngineUnavailableError)
from tokenmill.engine.llm_engine import EngineStats
from tokenmill.params import SamplingParams
from tokenmill.request import CompletionOutput, FinishReason, RequestOutput


class FakeEngine:
    """Emits one token per request per step; ``fail`` makes the next step raise."""

    def __init__(self, step_seconds: float = 0.002):
        self.reqs: dict[str, list] = {}
        self.step_seconds = step_seconds
        self.steps = 0
        self.fail = False
        self.stats = EngineStats()
        self.num_preemptions = 0
        self.scheduler_config = SimpleNamespace(max_num_seqs=4)
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, running=[],
                                         block_manager=SimpleNamespace(usage=0.0))
        self.thread_ids: set[int] = set()

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None,
                    cache_salt=None):
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise ValueError("prompt is empty")
        self.reqs[request_id] = [list(prompt), [], params.max_tokens]
        self._sync()

    def abort_request(self, request_id):
        self.thread_ids.add(threading.get_ident())
        self.reqs.pop(request_id, None)
        self._sync()

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(self.step_seconds)
        outs = []
        for rid, (prompt, tokens, max_tokens) in list(self.reqs.items()):
            tokens.append(7)
            done = len(tokens) >= max_tokens
            outs.append(RequestOutput(rid, prompt, [CompletionOutput(
                0, list(tokens), "x" * len(tokens),
                finish_reason=FinishReason.LENGTH if done else None)], finished=done))
            if done:
                del self.reqs[rid]
        self.stats.num_generated_tokens += len(outs)
        self.stats.iteration_tokens.append(len(outs))
        self._sync()
        return outs

    def _sync(self):
        self.scheduler.num_running = len(self.reqs)
        self.scheduler.block_manager.usage = 0.1 * len(self.reqs)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_stream_to_the_end_and_loop_thread_only():
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake)
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
        engine = AsyncEngine(fake)
        engine.start()
        gen = engine.generate("a", [1], SamplingParams(max_tokens=10_000))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(200):
            if not fake.reqs and engine.snapshot.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.01)
        assert not fake.reqs and engine.snapshot.num_running == 0
        steps = fake.steps
        await asyncio.sleep(0.3)
        assert fake.steps == steps  # no busy stepping while idle
        task = asyncio.create_task(_consume(engine, "b", 10_000))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        assert not fake.reqs
        await engine.shutdown(1)

    run(main())


async def _consume(engine, rid, max_tokens):
    return [o async for o in engine.generate(rid, [1], SamplingParams(max_tokens=max_tokens))]


def test_bad_prompt_and_admission_control():
    fake = FakeEngine(step_seconds=0.05)

    async def main():
        engine = AsyncEngine(fake, max_queued_requests=1)
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


def test_dead_loop_fails_streams_and_reports_not_alive():
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake)
        engine.start()
        gen = engine.generate("a", [1], SamplingParams(max_tokens=10_000))
        await gen.__anext__()
        fake.fail = True
        with pytest.raises(EngineUnavailableError):
            async for _ in gen:
                pass
        assert not engine.is_alive
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("b", [1], SamplingParams())

    run(main())


def test_shutdown_lets_running_requests_finish_and_refuses_new_ones():
    fake = FakeEngine(step_seconds=0.01)

    async def main():
        engine = AsyncEngine(fake)
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
