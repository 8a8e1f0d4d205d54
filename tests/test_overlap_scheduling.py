"""Overlapped scheduling (``async_scheduling``, engine/overlap.py): step N+1 is launched before
step N's outputs are built, and the outputs are the plain engine's, token for token: stop
strings (whose sequences' next token is computed and dropped), aborts while a step runs,
preemption, n > 1, seeds and logprobs. The fake runner's tests run in ms; the real default
model's in float32, where any change of tokens would show."""

from __future__ import annotations

import asyncio
from concurrent.futures import wait

import pytest

from tests.test_engine_unit import check_clean, check_step, make_engine, prompt
from tests.test_server_async_engine import FakeEngine
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.overlap import plain_reason
from tokenmill.params import SamplingParams
from tokenmill.structured.spec import StructuredOutputs


def overlapped(**options):
    """``make_engine``'s engine with overlapped scheduling on."""
    engine = make_engine(**options)
    engine.async_scheduling = True
    return engine


def summary(outputs: dict) -> dict:
    """Everything a caller sees of the final outputs, by request id."""
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
                   None if c.logprobs is None else [(e.token_id, e.logprob) for e in c.logprobs])
                  for c in out.outputs] for rid, out in outputs.items()}


def step_to_end(engine, requests: dict, abort: str | None = None) -> dict:
    """Add the requests and step until idle; every step's state is checked once the launched
    step (if any) has run. ``abort``: that request is aborted while a step is in flight."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    finals, seen = {}, set()
    for _ in range(1000):
        if not engine.has_pending_work():
            check_clean(engine)
            return finals
        for out in engine.step():
            assert out.request_id not in finals  # nothing after the final output
            seen.add(out.request_id)
            if out.finished:
                finals[out.request_id] = out
        if abort in seen and engine.has_unfinished_requests():
            assert engine.async_scheduling is False or engine._inflight is not None
            assert engine.abort_request(abort)
            seen.discard(abort)
            abort = None
        if engine._inflight is not None:  # the fake's KV is written by the step thread
            engine._inflight.future.result()
        check_step(engine)
    raise AssertionError("engine did not finish")


def fake_requests(stop_words: dict[int, str]) -> dict:
    requests = {}
    for i in range(12):
        stop = [stop_words[i]] if i in stop_words else []
        params = SamplingParams(temperature=0.0, max_tokens=10 + i, stop=stop,
                                include_stop_str_in_output=i % 2 == 0, logprobs=0)
        requests[f"r{i}"] = (prompt(i, 5 + i % 7), params)
    return requests


def stop_words() -> dict[int, str]:
    """A word each of the first eight requests produces mid-way: its stop string."""
    plain = step_to_end(make_engine(), fake_requests({}))
    return {i: plain[f"r{i}"].outputs[0].text.split()[3 + i % 3] for i in range(8)}


@pytest.mark.parametrize("blocks", [64, 14])  # 14: preemption
def test_fake_outputs_equal_the_plain_engine(blocks):
    words = stop_words()
    plain, overlap = make_engine(num_blocks=blocks), overlapped(num_blocks=blocks)
    expected = step_to_end(plain, fake_requests(words))
    got = step_to_end(overlap, fake_requests(words))
    assert summary(got) == summary(expected)
    assert sum(o.outputs[0].finish_reason == "stop" for o in got.values()) == 8
    # the stopped sequences' next tokens were computed, never shown; the cache is the same
    assert overlap.executor.num_executed > plain.executor.num_executed
    assert overlap.stats().num_cached_blocks == plain.stats().num_cached_blocks
    assert overlap.stats().num_generated_tokens == plain.stats().num_generated_tokens
    if blocks == 14:
        assert plain.num_preemptions and overlap.num_preemptions


def test_fake_stop_string_on_the_last_token_names_the_stop_string():
    """A stop string completed by the token that also hits max_tokens or a stop token: the
    stop string is the reason, in both orders."""
    base = {f"r{i}": (prompt(i), SamplingParams(temperature=0.0, max_tokens=8)) for i in range(4)}
    plain_out = step_to_end(make_engine(), dict(base))
    requests = {}
    for i, (rid, (ids, _)) in enumerate(base.items()):
        c = plain_out[rid].outputs[0]
        if i % 2:  # on the max_tokens-th token
            params = SamplingParams(temperature=0.0, max_tokens=8, stop=[c.text.split()[-1]])
        else:  # on a stop token
            params = SamplingParams(temperature=0.0, max_tokens=8, stop=[c.text.split()[4]],
                                    stop_token_ids=[c.token_ids[4]])
        requests[rid] = (ids, params)
    expected = step_to_end(make_engine(), dict(requests))
    overlap = overlapped()
    got = step_to_end(overlap, dict(requests))
    assert summary(got) == summary(expected)
    assert all(isinstance(o.outputs[0].stop_reason, str) for o in got.values())


def test_fake_abort_while_a_step_runs():
    requests = {f"r{i}": (prompt(i), SamplingParams(temperature=0.0, max_tokens=16))
                for i in range(4)}
    expected = step_to_end(make_engine(), dict(requests))
    overlap = overlapped()
    got = step_to_end(overlap, dict(requests), abort="r1")
    assert "r1" not in got
    assert summary(got) == {k: v for k, v in summary(expected).items() if k != "r1"}


def test_fake_seeded_n2_equal_the_plain_engine():
    params = SamplingParams(temperature=0.9, max_tokens=9, n=2, seed=5)
    requests = {f"r{i}": (prompt(i), params) for i in range(3)}
    plain, overlap = make_engine(seed=1), overlapped(seed=1)
    assert summary(step_to_end(overlap, dict(requests))) == \
        summary(step_to_end(plain, dict(requests)))


def test_fake_switches_to_plain_steps_and_back():
    requests = {f"r{i}": (prompt(i), SamplingParams(temperature=0.0, max_tokens=14))
                for i in range(5)}
    expected = step_to_end(make_engine(), dict(requests))
    engine = overlapped()
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    finals, modes = {}, []
    while engine.has_pending_work():
        if len(modes) == 3:  # as a request with a grammar arrives and, later, ends
            engine._needs_plain.add("grammar")
        if len(modes) == 7:
            engine._needs_plain.discard("grammar")
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        modes.append(engine._inflight is not None)
    assert modes[:3] == [True] * 3 and modes[3:7] == [False] * 4 and modes[7]
    assert summary(finals) == summary(expected)
    check_clean(engine)


def test_async_engine_abort_mid_run():
    fake = FakeEngine(step_seconds=0.001)
    fake.engine.async_scheduling = True
    params = SamplingParams(temperature=0.0, max_tokens=12)

    async def main():
        engine = AsyncEngine(fake.engine)
        engine.start()
        kept = asyncio.create_task(_last(engine, "a", params))
        stream = await engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=10_000))
        first = await stream.__anext__()
        stream.abort()
        last = await kept
        await engine.shutdown(1)
        return first, last

    first, last = asyncio.run(asyncio.wait_for(main(), 20))
    assert not first.finished
    assert last.finished and len(last.outputs[0].token_ids) == 12
    assert not fake.engine.has_pending_work()
    check_clean(fake.engine)


async def _last(engine, request_id, params):
    out = None
    async for out in engine.generate(request_id, [1, 2, 3], params):
        pass
    return out


def test_plain_order_when_a_step_needs_it():
    assert plain_reason(proposer=None, connector=None, lora=None, plain_requests=()) is None
    assert "grammar" in plain_reason(proposer=None, connector=None, lora=None,
                                     plain_requests={"g"})
    assert "speculative" in plain_reason(proposer=object(), connector=None, lora=None,
                                         plain_requests=())


REAL_PROMPTS = ["The capital of France is", "def add(a, b):", "List three colors:",
                "Water boils at", "Once upon a time", "1 + 1 =", "The speed of light is",
                "My favourite food is", "A part number:"]


def real_params(i: int) -> SamplingParams:
    kinds = [dict(temperature=0.0, max_tokens=24, stop=[" the", "\n"]),
             dict(temperature=0.8, top_p=0.9, max_tokens=20, seed=i, n=2, logprobs=2,
                  stop=["."]),
             dict(temperature=0.0, max_tokens=6 + i),  # EOS or max_tokens
             dict(temperature=1.0, seed=100 + i, max_tokens=30, stop=[","],
                  include_stop_str_in_output=True)]
    if i == 8:  # a grammar: plain steps while it runs, overlapped ones after it
        return SamplingParams(temperature=0.0, max_tokens=12,
                              structured_outputs=StructuredOutputs(regex="[0-9]{3}-[a-z]{4}"))
    return SamplingParams(**kinds[i % 4])


def test_real_model_outputs_equal_the_plain_engine(fp32_llm):
    params = [real_params(i) for i in range(len(REAL_PROMPTS))]
    engine = fp32_llm.engine
    runs = []
    try:
        for flag in (False, True):
            engine.flush_prefix_cache()
            engine.async_scheduling = flag
            outs = fp32_llm.generate(REAL_PROMPTS, params, use_tqdm=False)
            runs.append(summary({o.request_id[-3:] + str(i): o for i, o in enumerate(outs)}))
            assert not engine.has_pending_work()
    finally:
        engine.async_scheduling = False
        engine.flush_prefix_cache()
    plain, overlap = runs
    assert list(overlap.values()) == list(plain.values())
    reasons = [c[3] for outs in plain.values() for c in outs]
    assert {" the", ".", ","} & set(reasons)  # stop strings ended some of them


FAULT_REQUESTS = {f"q{i}": (prompt(i, 6 + i), SamplingParams(temperature=0.0, max_tokens=6 + i,
                                                            stop=["w77"]))
                  for i in range(5)}


def run_with_failures(engine) -> tuple[dict, dict]:
    finished, failures = {}, {}
    for rid, (ids, params) in FAULT_REQUESTS.items():
        engine.add_request(rid, ids, params)
    while engine.has_pending_work():
        finished.update({o.request_id: summary({"": o})[""] for o in engine.step()
                         if o.finished})
        failures.update(engine.take_failures())
        if engine._inflight is not None:
            wait([engine._inflight.future])  # its failure is the next step's to report
        check_step(engine)
    return finished, failures


@pytest.mark.parametrize("stage", ["schedule", "forward", "sample", "update", "process",
                                   "finish", "executor"])
def test_fake_failures_while_overlapping_fail_only_their_step(stage):
    expected, _ = run_with_failures(make_engine(max_seqs=3))
    engine = overlapped(max_seqs=3)
    calls = 0

    def hook(at: str, request_ids) -> None:
        nonlocal calls
        calls += at == stage
        if at == stage and calls == 3:
            raise RuntimeError(f"at {stage}")

    def executor_fails(chunks) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("at executor")

    if stage == "executor":
        engine.executor.before_execute = executor_fails
    else:
        engine.fault_hook = hook
    finished, failures = run_with_failures(engine)
    assert failures and all(f"at {stage}" in why for why in failures.values())
    assert set(finished) | set(failures) == set(FAULT_REQUESTS)
    assert {r: expected[r] for r in finished} == finished
    check_clean(engine)
    again, none = run_with_failures(engine)  # the engine goes on as before
    assert not none and again == expected


def test_shutdown_and_flush_wait_for_the_launched_step():
    engine = overlapped()
    engine.add_request("a", prompt(1), SamplingParams(temperature=0.0, max_tokens=30))
    engine.step()
    assert engine._inflight is not None and engine.has_pending_work()
    engine.abort_request("a")  # the last request: its launched step is nobody's now
    assert engine.has_pending_work() and not engine.has_unfinished_requests()
    engine.flush_prefix_cache()
    assert engine._inflight is None and not engine.has_pending_work()
    check_clean(engine)
    engine.add_request("b", prompt(2), SamplingParams(temperature=0.0, max_tokens=30))
    engine.step()
    engine.shutdown()
    assert engine._inflight is None
