"""LLMEngine built from parts: a real scheduler and tokenizer, a fake runner, no torch (ms).

The fake model continues a sequence deterministically from its last two tokens, so greedy
output is known in advance; proposers give right or wrong drafts, and every result is compared
with the engine's own output without drafts.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeExecutor, run_collecting_failures, word_tokenizer
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.engine.llm_engine import EngineInfo, LLMEngine
from tokenmill.params import SamplingParams
from tokenmill.request import Request
from tokenmill.sched import Scheduler

EOS = 2
VOCAB = 200


def next_word(history: Sequence[int]) -> int:
    """The fake model: never EOS, never a word below 10."""
    before = history[-2] if len(history) > 1 else 0
    return 10 + (history[-1] * 7 + before * 3 + len(history)) % (VOCAB - 10)


def fake_model(request: Request, drafts_before: Sequence[int]) -> int:
    return next_word([*request.all_token_ids, *drafts_before])


class ListProposer:
    """Drafts from a function of the sequence; records what it was asked."""

    def __init__(self, drafts) -> None:
        self.drafts = drafts
        self.calls = 0
        self.forgotten: list[str] = []

    def propose(self, requests: Sequence[Request],
                waiting_tokens: int = 0) -> Mapping[str, list[int]]:
        self.calls += 1
        return {r.request_id: self.drafts(r) for r in requests}

    def forget(self, seq_ids: Sequence[str]) -> None:
        self.forgotten.extend(seq_ids)


def true_continuation(request: Request, k: int) -> list[int]:
    history = list(request.all_token_ids)
    for _ in range(k):
        history.append(next_word(history))
    return history[request.num_tokens:]


def make_engine(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 8,
                proposer=None, seed: int | None = None, prefix_cache: bool = True,
                model=fake_model, forced=None) -> LLMEngine:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                          max_model_len=256),
                          CacheConfig(block_size=block_size, enable_prefix_caching=prefix_cache),
                          num_blocks=num_blocks, eos_token_ids=[EOS])
    info = EngineInfo("fake", VOCAB, 256, (num_blocks - 1) * block_size, max_seqs, block_size)
    return LLMEngine(scheduler, FakeExecutor(block_size, model, forced), word_tokenizer(VOCAB),
                     info, proposer=proposer, seed=seed)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Add the requests, step to the end; returns the final outputs by id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            check_clean(engine)
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        check_step(engine)
    raise AssertionError("engine did not finish")


def check_step(engine: LLMEngine) -> None:
    engine.scheduler.check_integrity()
    engine.executor.check_prefix_cache(engine.scheduler.block_manager.prefix_cache)


def check_clean(engine: LLMEngine) -> None:
    manager = engine.scheduler.block_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.pool.num_usable_blocks


GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def prompt(i: int, length: int = 6) -> list[int]:
    return [10 + (7 * i + 3 * k) % 150 for k in range(length)]


def plain_outputs(requests) -> dict[str, list[int]]:
    finals = run(make_engine(), requests)
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


# ----- several tokens per step --------------------------------------------------------------

def test_three_tokens_for_one_sequence_and_one_for_another() -> None:
    requests = {"a": (prompt(0), GREEDY), "b": (prompt(1), GREEDY)}
    proposer = ListProposer(lambda r: true_continuation(r, 2) if r.request_id == "a" else [])
    engine = make_engine(proposer=proposer)
    for rid, (p, params) in requests.items():
        engine.add_request(rid, p, params)
    engine.step()  # prompts: the first token of each
    outs = {o.request_id: o.outputs[0].token_ids for o in engine.step()}
    assert [len(outs["a"]), len(outs["b"])] == [4, 2]  # a: 1 + 3 this step, b: 1 + 1
    assert engine.last_step.num_new_tokens == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_accepted_tokens == engine.stats().num_draft_tokens > 0
    final = run(make_engine(proposer=proposer), requests)
    assert {k: v.outputs[0].token_ids for k, v in final.items()} == plain_outputs(requests)


@pytest.mark.parametrize("wrong_at", [0, 1, 2, 3])
def test_wrong_drafts_are_rolled_back_and_output_is_unchanged(wrong_at: int) -> None:
    def drafts(r: Request) -> list[int]:
        right = true_continuation(r, 3)
        return [t if j < wrong_at else (t + 1) % VOCAB for j, t in enumerate(right)]

    requests = {f"r{i}": (prompt(i), GREEDY) for i in range(4)}
    engine = make_engine(block_size=2, proposer=ListProposer(drafts))
    finals = run(engine, requests)
    assert {k: v.outputs[0].token_ids for k, v in finals.items()} == plain_outputs(requests)
    stats = engine.stats()
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == (0 if wrong_at == 0 else stats.num_draft_tokens
                                         if wrong_at == 3 else stats.num_accepted_tokens)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens or wrong_at in (0, 3)


def test_rollback_of_two_of_three_tokens_block_accounting() -> None:
    def drafts(r: Request) -> list[int]:
        right = true_continuation(r, 3)
        return [right[0], right[1] + 1, right[2]]

    engine = make_engine(num_blocks=16, block_size=4, proposer=ListProposer(drafts))
    engine.add_request("x", prompt(0, 6), SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()  # 6 prompt tokens -> blocks 1, 2; the first generated token
    manager = engine.scheduler.block_manager
    free_before = manager.num_free_blocks
    engine.step()  # positions 6..9 written (block 3 for 8, 9); drafts 2 and 3 rejected
    seq = engine.scheduler.running.first()
    assert seq.num_output_tokens == 3 and seq.num_computed_tokens == 8
    assert len(manager.block_table("x")) == 2 and manager.num_free_blocks == free_before
    engine.scheduler.check_integrity()
    engine.abort_request("x")
    check_clean(engine)


def test_prefix_cache_never_holds_a_rolled_back_block() -> None:
    # Four wrong drafts fill a whole block with rejected tokens every step.
    def drafts(r: Request) -> list[int]:
        return [(t + 1) % VOCAB for t in true_continuation(r, 4)]

    engine = make_engine(block_size=2, proposer=ListProposer(drafts))
    requests = {f"r{i}": (prompt(i % 2, 5), GREEDY) for i in range(4)}
    finals = run(engine, requests)  # checks the cache's KV against the fake KV every step
    cache = engine.scheduler.block_manager.prefix_cache
    assert cache.num_cached_blocks > 0
    sequences = [tuple(prompt(i % 2, 5) + finals[f"r{i}"].outputs[0].token_ids)
                 for i in range(4)]
    for _, tokens, _ in cache.entries():
        assert any(seq[:len(tokens)] == tokens for seq in sequences), tokens


def test_stop_token_in_the_middle_of_an_accepted_run() -> None:
    seen: list[int] = []

    def model(request: Request, drafts_before: Sequence[int]) -> int:
        n = request.num_output_tokens + len(drafts_before)
        return EOS if n == 3 else 20 + n

    def drafts(r: Request) -> list[int]:
        seen.append(r.num_output_tokens)
        n = r.num_output_tokens
        return [EOS if n + j == 3 else 20 + n + j for j in range(4)]

    engine = make_engine(proposer=ListProposer(drafts), model=model)
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=0)
    out = run(engine, {"x": (prompt(0), params)})["x"].outputs[0]
    assert out.token_ids == [20, 21, 22, EOS]  # the accepted draft after EOS is not appended
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert len(out.logprobs) == 4 and out.cumulative_logprob == pytest.approx(-1.0)
    assert seen == [1]


def test_stop_string_inside_a_run_drops_the_tokens_after_it() -> None:
    def model(request: Request, drafts_before: Sequence[int]) -> int:
        return 30 + request.num_output_tokens + len(drafts_before)

    proposer = ListProposer(lambda r: [30 + r.num_output_tokens + j for j in range(5)])
    engine = make_engine(proposer=proposer, model=model)
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=["w32"], logprobs=0)
    out = run(engine, {"x": (prompt(0), params)})["x"].outputs[0]
    assert out.token_ids == [30, 31, 32] and out.text == " w30 w31 "
    assert (out.finish_reason, out.stop_reason) == ("stop", "w32")
    assert len(out.logprobs) == 3


def test_stop_string_before_max_tokens_in_the_same_run_wins() -> None:
    def model(request: Request, drafts_before: Sequence[int]) -> int:
        return 30 + request.num_output_tokens + len(drafts_before)

    proposer = ListProposer(lambda r: [30 + r.num_output_tokens + j for j in range(5)])
    engine = make_engine(proposer=proposer, model=model)
    params = SamplingParams(temperature=0.0, max_tokens=4, stop=["w31"])
    out = run(engine, {"x": (prompt(0), params)})["x"].outputs[0]
    assert out.token_ids == [30, 31] and (out.finish_reason, out.stop_reason) == ("stop", "w31")


def test_forced_tokens_are_appended_and_computed_next_step() -> None:
    engine = make_engine(forced=lambda r: [EOS - 1] if r.num_output_tokens % 2 == 0 else [])
    out = run(engine, {"x": (prompt(0), SamplingParams(temperature=0.0, max_tokens=9))})["x"]
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 9 and tokens[1::2] == [EOS - 1] * 4
    assert EOS - 1 not in tokens[::2]


def test_abort_while_tokens_are_pending() -> None:
    engine = make_engine(proposer=ListProposer(lambda r: true_continuation(r, 3)))
    engine.add_request("x", prompt(0), SamplingParams(max_tokens=20))
    engine.add_request("y", prompt(1), SamplingParams(max_tokens=20))
    engine.step()
    # The abort arrives while the runner computes the drafts' step.
    engine.executor.before_execute = lambda chunks: engine.abort_request("x")
    outs = engine.step()
    assert [o.request_id for o in outs] == ["y"]
    engine.executor.before_execute = None
    assert engine.abort_request("y") and not engine.abort_request("x")
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert set(engine.proposer.forgotten) == {"x", "y"}
    check_clean(engine)


def test_a_request_whose_output_processing_fails_fails_alone(monkeypatch) -> None:
    from tokenmill.engine.output_state import RequestState

    engine = make_engine()
    engine.add_request("good", prompt(0), SamplingParams(max_tokens=5))
    engine.add_request("bad", prompt(1), SamplingParams(max_tokens=5, n=2))
    original = RequestState.on_tokens

    def on_tokens(self, seq, *args):
        if self.request_id == "bad" and seq.num_output_tokens >= 2:
            raise RuntimeError("detokenizer broke")
        return original(self, seq, *args)

    monkeypatch.setattr(RequestState, "on_tokens", on_tokens)
    finished, failures = run_collecting_failures(engine)
    assert list(failures) == ["bad"] and "RuntimeError: detokenizer broke" in failures["bad"]
    assert list(finished) == ["good"] and len(finished["good"].outputs[0].token_ids) == 5
    check_clean(engine)


def test_a_failing_model_step_fails_its_requests_and_the_engine_goes_on() -> None:
    engine = make_engine()
    engine.add_request("a", prompt(0), SamplingParams(max_tokens=5))
    engine.step()

    def boom(chunks):
        raise RuntimeError("kernel fault")

    engine.executor.before_execute = boom
    assert engine.step() == []
    assert engine.take_failures() == {"a": "the engine step failed: RuntimeError: kernel fault"}
    engine.executor.before_execute = None
    engine.add_request("b", prompt(1), SamplingParams(max_tokens=3))
    finished, failures = run_collecting_failures(engine)
    assert not failures and len(finished["b"].outputs[0].token_ids) == 3
    b_tokens = finished["b"].outputs[0].token_ids
    # Failing again and again, each time with requests to blame: each fails its own, and the
    # engine never gives up on the ones after (three bad requests must not stop the server).
    engine.executor.before_execute = boom
    for i in range(5):
        engine.add_request(f"c{i}", prompt(2), SamplingParams(max_tokens=3))
        assert engine.step() == [] and list(engine.take_failures()) == [f"c{i}"]
        engine.scheduler.check_integrity()
    engine.executor.before_execute = None
    engine.add_request("d", prompt(1), SamplingParams(max_tokens=3))
    finished, failures = run_collecting_failures(engine)
    assert not failures and finished["d"].outputs[0].token_ids == b_tokens  # same prompt
    assert engine.stats().num_failed_steps == 6
    check_clean(engine)


# ----- seeds, the engine's surface ----------------------------------------------------------

def test_seed_gives_unseeded_sampled_requests_a_reproducible_seed() -> None:
    def seeds(engine_seed: int | None) -> list[int | None]:
        engine = make_engine(seed=engine_seed)
        sampled = SamplingParams(temperature=0.7, max_tokens=2)
        for i, params in enumerate([sampled, GREEDY, sampled, SamplingParams(seed=5)]):
            engine.add_request(f"r{i}", prompt(i), params)
        return [s.sampling_params.seed for s in engine.scheduler.waiting]

    first = seeds(7)
    assert first == seeds(7) and first != seeds(8)
    assert first[1] is None and first[3] == 5  # greedy needs none; a request's own seed stays
    assert first[0] != first[2] and all(s >= 0 for s in (first[0], first[2]))
    assert seeds(None) == [None, None, None, 5]


def test_prompt_checks_are_one_rule_with_the_field_named() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add_request("x", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary") as e:
        engine.check_prompt([1, VOCAB], param="messages")
    assert (e.value.param, e.value.code) == ("messages", "invalid_value")
    with pytest.raises(ValueError, match="maximum context length is 256") as e:
        engine.add_request("x", [5] * 256, GREEDY)
    assert e.value.code == "context_length_exceeded"
    assert not engine.has_unfinished_requests()


def test_stats_and_last_step() -> None:
    engine = make_engine()
    engine.add_request("a", "w11 w12 w13", SamplingParams(temperature=0.0, max_tokens=3, n=2))
    engine.step()
    assert engine.last_step.scheduled_request_ids == {"a"}
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.num_generated_tokens == 6 and stats.num_prompt_tokens_computed >= 3
    assert stats.num_steps == engine.executor.num_executed and stats.step_seconds > 0
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_engine_needs_no_torch() -> None:
    code = ("import sys; from tests.test_engine_unit import run, make_engine, prompt, GREEDY; "
            "run(make_engine(), {'a': (prompt(0), GREEDY)}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(num_requests=st.integers(1, 6), max_drafts=st.integers(0, 5), wrong=st.floats(0, 1),
       block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(17, 48),
       budget=st.integers(4, 32), seed=st.integers(0, 1000))
def test_random_drafts_never_change_greedy_output(num_requests: int, max_drafts: int,
                                                  wrong: float, block_size: int,
                                                  num_blocks: int, budget: int,
                                                  seed: int) -> None:
    import random

    rng = random.Random(seed)

    def drafts(r: Request) -> list[int]:
        return [t if rng.random() > wrong else (t + 3) % VOCAB
                for t in true_continuation(r, rng.randint(0, max_drafts))]

    requests = {f"r{i}": (prompt(i % 3, 3 + i), SamplingParams(temperature=0.0,
                                                                max_tokens=4 + i % 5))
                for i in range(num_requests)}
    engine = make_engine(num_blocks, block_size, budget, proposer=ListProposer(drafts))
    finals = run(engine, requests)  # integrity and cached KV checked every step
    assert {k: v.outputs[0].token_ids for k, v in finals.items()} == plain_outputs(requests)


def test_a_shut_down_executor_says_so_and_runs_nothing() -> None:
    """The engine's health check reads the executor's; a step after shutdown fails loudly."""
    from types import SimpleNamespace

    from tokenmill.executor import ExecutorError, UniProcExecutor
    from tokenmill.sched.output import SchedulerOutput

    executor = UniProcExecutor(SimpleNamespace(num_blocks=8))
    executor.check_health()
    assert executor.kv_capacity == 8 and executor.describe()["workers"] == 1
    executor.shutdown()
    with pytest.raises(ExecutorError, match="shut down"):
        executor.check_health()
    with pytest.raises(ExecutorError):
        executor.execute(SchedulerOutput([], 0, [], []))
    engine = make_engine()
    engine.check_health()  # the fake executor is always fine
