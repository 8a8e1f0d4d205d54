"""Scheduler driven by a fake model (no torch): batches, preemption, n > 1, stops, aborts,
draft tokens and their rollback.

``tests.fakes.FakeExecutor`` keeps a (position, token) record per KV slot and checks, before
writing a step's tokens, that every chunk finds its whole history where its block table says:
that is what attention would read, so it catches shared, reused, forgotten or rolled-back
blocks, not just bookkeeping.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeExecutor
from tokenmill.cache import CacheIntegrityError, KVBlockManager
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.params import SamplingParams
from tokenmill.request import FinishReason, Request, RequestOutput, RequestStatus
from tokenmill.sched import Scheduler, SchedulerOutput, group_by_request

EOS = 2


def fake_token(request: Request, drafts_before: Sequence[int] = ()) -> int:
    """Never EOS; differs between the sequences of one request."""
    return 1000 + 100 * request.seq_index + request.num_output_tokens + len(drafts_before)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32,
                   max_seqs: int = 8, policy: str = "fcfs", max_model_len: int | None = None,
                   watermark: float = 0.0, prefix_cache: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     max_model_len=max_model_len, policy=policy),
                     CacheConfig(block_size=block_size, watermark=watermark,
                                 enable_prefix_caching=prefix_cache),
                     num_blocks=num_blocks, eos_token_ids=[EOS])


def make_request(request_id: str, prompt_len: int, max_tokens: int | None = 4,
                 arrival: float = 0.0, priority: int = 0, **params: object) -> Request:
    prompt = [10 + (i + len(request_id)) % 50 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=arrival, priority=priority)


def check_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """The contract the runner relies on, and the step limits."""
    config = scheduler.config
    assert output.num_batched_tokens == sum(c.num_tokens for c in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.scheduled) <= config.max_num_seqs
    assert len({c.request_id for c in output.scheduled}) == len(output.scheduled)
    for c in output.scheduled:
        end = c.start_pos + c.num_tokens
        assert c.num_tokens >= 1 and c.request.status is RequestStatus.RUNNING
        known = c.num_tokens - c.num_drafts
        assert c.token_ids[:known] == c.request.all_token_ids[c.start_pos:c.start_pos + known]
        assert len(c.block_table) * scheduler.block_size >= end
        reaches_end = c.start_pos + known == c.request.num_tokens
        assert c.num_logits == (c.num_drafts + 1 if reaches_end else 0)
        assert reaches_end or not c.num_drafts
        assert c.request_id not in output.preempted_ids


Proposer = Callable[[Request], list[int]]


class Driver:
    """Steps scheduler and fake runner, checking contract and integrity around every step.
    A ``proposer`` gives running sequences draft tokens before each step."""

    def __init__(self, scheduler: Scheduler, proposer: Proposer | None = None) -> None:
        self.scheduler = scheduler
        self.runner = FakeExecutor(scheduler.block_size, fake_token)
        self.proposer = proposer
        self.outputs: list[SchedulerOutput] = []

    def step(self) -> SchedulerOutput:
        if self.proposer is not None:
            for request in self.scheduler.running:
                request.spec_token_ids = self.proposer(request)
        output = self.scheduler.schedule()
        check_output(self.scheduler, output)
        self.scheduler.check_integrity()
        result = self.runner.execute(output)
        self.scheduler.update_from_output(output, result.token_ids)
        self.scheduler.check_integrity()
        self.runner.check_prefix_cache(self.scheduler.block_manager.prefix_cache)
        self.outputs.append(output)
        return output

    def run(self, arrivals: dict[int, list[Request]] | None = None,
            max_steps: int = 2000) -> list[Request]:
        """Add each arrival at its step, run until nothing is left; returns all sequences."""
        arrivals = dict(arrivals or {})
        sequences: list[Request] = []
        for step in range(max_steps):
            for request in arrivals.pop(step, []):
                sequences += self.scheduler.add_request(request)
            if not arrivals and not self.scheduler.has_unfinished_requests():
                assert_all_blocks_free(self.scheduler)
                return sequences
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.scheduler.stats()}")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    scheduler.check_integrity()
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.pool.num_usable_blocks and manager.usage == 0.0


def run_until(driver: Driver, condition, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if condition():
            return
        driver.step()
    raise AssertionError("condition never reached")


# ----- batches ------------------------------------------------------------------------------

def test_mixed_lengths_arriving_over_time_all_finish() -> None:
    scheduler = make_scheduler(num_blocks=64, budget=16, max_seqs=4)
    arrivals = {s: [make_request(f"r{s}-{k}", 1 + (7 * s + 3 * k) % 23, max_tokens=1 + s % 6)
                    for k in range(s % 3)] for s in range(12)}
    expected = {r.request_id: r.sampling_params.max_tokens for rs in arrivals.values() for r in rs}
    sequences = Driver(scheduler).run(arrivals)
    assert {s.request_id: s.num_output_tokens for s in sequences} == expected
    assert all(s.finish_reason is FinishReason.LENGTH for s in sequences)


def test_chunked_prefill_runs_alongside_decodes() -> None:
    scheduler = make_scheduler(budget=8)
    driver = Driver(scheduler)
    short = scheduler.add_request(make_request("short", 3, max_tokens=30))[0]
    driver.step()
    long = scheduler.add_request(make_request("long", 40, max_tokens=2))[0]
    prefill_steps = 0
    while long.num_output_tokens == 0:
        output = driver.step()
        ids = [c.request_id for c in output.scheduled]
        assert ids[0] == "short" and output.scheduled[0].num_tokens == 1  # decode first
        prefill_steps += 1
    assert prefill_steps == 6  # 40 prompt tokens at 7 per step
    driver.run()
    assert short.num_output_tokens == 30 and long.num_output_tokens == 2


def test_budget_and_max_num_seqs_are_never_exceeded() -> None:
    scheduler = make_scheduler(num_blocks=200, budget=10, max_seqs=3)
    requests = {0: [make_request(f"r{i}", 2 + 5 * i % 17, max_tokens=6) for i in range(12)]}
    driver = Driver(scheduler)
    driver.run(requests)  # check_output asserts both limits every step
    assert max(o.num_batched_tokens for o in driver.outputs) == 10
    assert max(len(o.scheduled) for o in driver.outputs) == 3


def test_stats_snapshot_counts_steps_and_overhead() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    scheduler.add_request(make_request("a", 5, max_tokens=3))
    scheduler.add_request(make_request("b", 5, max_tokens=3))
    driver.step()
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_steps) == (2, 0, 1)
    assert stats.last_num_batched_tokens == 10 and stats.last_num_scheduled == 2
    assert stats.num_free_blocks == 63 - 4 and stats.kv_cache_usage == pytest.approx(4 / 63)
    assert stats.overhead_seconds_total > 0 and stats.mean_overhead_us > 0
    driver.run()


# ----- memory pressure ------------------------------------------------------------------------

@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preemption_recomputes_and_every_request_finishes(prefix_cache: bool) -> None:
    scheduler = make_scheduler(num_blocks=9, block_size=4, budget=64,  # 32 tokens of KV
                               prefix_cache=prefix_cache)
    driver = Driver(scheduler)
    sequences = driver.run({0: [make_request(f"r{i}", 6, max_tokens=10) for i in range(4)]})
    assert scheduler.num_preemptions > 0
    assert sum(s.num_preemptions for s in sequences) == scheduler.num_preemptions
    assert all(s.num_output_tokens == 10 for s in sequences)
    assert all(s.output_token_ids == [fake_token_at(s, k) for k in range(10)] for s in sequences)
    if prefix_cache:  # the preempted blocks went to the cache; the recompute reuses them
        assert scheduler.stats().prefix_cache_hits > 0
    else:
        recomputes = [c for o in driver.outputs for c in o.scheduled
                      if c.start_pos == 0 and c.num_tokens > c.request.num_prompt_tokens]
        assert recomputes  # resumed as a prefill over prompt + kept output tokens
    assert any(o.preempted_ids for o in driver.outputs)


def fake_token_at(request: Request, k: int) -> int:
    return 1000 + 100 * request.seq_index + k


def test_a_request_needing_the_whole_cache_eventually_runs_alone() -> None:
    # 10 usable blocks of 4; "big" grows to 38 tokens = 37 KV tokens = all 10 blocks.
    scheduler = make_scheduler(num_blocks=11, block_size=4, budget=16, watermark=0.2)
    arrivals = {0: [make_request("small0", 5, max_tokens=6)],
                1: [make_request("big", 20, max_tokens=18, arrival=1.0)],
                2: [make_request(f"small{i}", 4, max_tokens=5, arrival=2.0) for i in (1, 2)]}
    sequences = Driver(scheduler).run(arrivals)
    big = next(s for s in sequences if s.request_id == "big")
    assert big.num_output_tokens == 18
    assert all(s.num_output_tokens == s.sampling_params.max_tokens for s in sequences)


def test_request_that_can_never_fit_is_rejected_up_front() -> None:
    scheduler = make_scheduler(num_blocks=11, block_size=4, max_model_len=100)  # 40 KV tokens
    scheduler.add_request(make_request("fits", 20, max_tokens=21))  # needs all 40
    with pytest.raises(ValueError, match="needs 11 KV blocks"):
        scheduler.add_request(make_request("huge", 20, max_tokens=22))
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add_request(make_request("unbounded", 5, max_tokens=None, ignore_eos=True))
    # Without max_model_len the context ends where the cache does: nothing is too long.
    make_scheduler(num_blocks=11, block_size=4).add_request(make_request("u", 5, max_tokens=None))
    capped = make_scheduler(num_blocks=11, block_size=4, max_model_len=16)
    capped.add_request(make_request("unbounded", 5, max_tokens=None))
    with pytest.raises(ValueError, match="maximum context length is 16"):
        capped.add_request(make_request("long-prompt", 16))
    with pytest.raises(ValueError, match="already in use"):
        capped.add_request(make_request("unbounded", 5))


def preemption_order(policy: str, priorities: dict[str, int]) -> list[str]:
    """Three 4-token prompts in 6 usable blocks: growth past 8 tokens forces preemptions."""
    scheduler = make_scheduler(num_blocks=7, block_size=4, policy=policy)
    driver = Driver(scheduler)
    requests = [make_request(rid, 4, max_tokens=8, arrival=float(i), priority=priorities[rid])
                for i, rid in enumerate(priorities)]
    driver.run({0: requests})
    return [rid for o in driver.outputs for rid in o.preempted_ids]


def test_fcfs_preempts_the_latest_arrival() -> None:
    assert preemption_order("fcfs", {"a": 0, "b": 5, "c": 1})[0] == "c"


def test_priority_preempts_largest_priority_value() -> None:
    assert preemption_order("priority", {"a": 0, "b": 5, "c": 1})[0] == "b"


def test_priority_ties_preempt_the_later_arrival() -> None:
    assert preemption_order("priority", {"a": 1, "b": 1, "c": 0})[0] == "b"


def test_priority_admits_most_important_first() -> None:
    scheduler = make_scheduler(max_seqs=1, policy="priority")
    for rid, priority in (("low", 3), ("high", 0), ("mid", 1)):
        scheduler.add_request(make_request(rid, 3, max_tokens=1, priority=priority))
    driver = Driver(scheduler)
    driver.run()
    assert [o.scheduled[0].request_id for o in driver.outputs] == ["high", "mid", "low"]


def test_unknown_policy_and_missing_block_count_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_scheduler(policy="lottery")
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig())
    manager = KVBlockManager(num_blocks=5, block_size=2)
    assert Scheduler(SchedulerConfig(), CacheConfig(), block_manager=manager).max_model_len == 9


# ----- aborts --------------------------------------------------------------------------------

def abort_waiting(scheduler: Scheduler, driver: Driver) -> Request:
    scheduler.add_request(make_request("other", 4, max_tokens=3))
    request = scheduler.add_request(make_request("x", 4))[0]
    driver.step()
    assert request.status is RequestStatus.WAITING
    return request


def abort_mid_prefill(scheduler: Scheduler, driver: Driver) -> Request:
    request = scheduler.add_request(make_request("x", 12))[0]
    driver.step()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 4
    return request


def abort_running(scheduler: Scheduler, driver: Driver) -> Request:
    request = scheduler.add_request(make_request("x", 3, max_tokens=10))[0]
    driver.step()
    driver.step()
    assert request.status is RequestStatus.RUNNING and request.num_output_tokens == 2
    return request


def abort_preempted(scheduler: Scheduler, driver: Driver) -> Request:
    scheduler.add_request(make_request("other", 4, max_tokens=9))
    request = scheduler.add_request(make_request("x", 4, max_tokens=9, arrival=1.0))[0]
    run_until(driver, lambda: request.status is RequestStatus.PREEMPTED)
    return request


def abort_finished(scheduler: Scheduler, driver: Driver) -> Request:
    request = scheduler.add_request(make_request("x", 3, max_tokens=1))[0]
    driver.step()
    assert request.finish_reason is FinishReason.LENGTH
    return request


@pytest.mark.parametrize("setup", [abort_waiting, abort_mid_prefill, abort_running,
                                   abort_preempted, abort_finished])
def test_abort_in_every_state_frees_blocks(setup) -> None:
    # 4 usable blocks of 4, budget 4, one sequence at a time for the waiting case.
    scheduler = make_scheduler(num_blocks=5, block_size=4, budget=4,
                               max_seqs=1 if setup is abort_waiting else 4)
    driver = Driver(scheduler)
    request = setup(scheduler, driver)
    was_finished = request.is_finished
    assert scheduler.abort_request("x") is not was_finished
    assert scheduler.abort_request("x") is False  # twice is fine
    scheduler.check_integrity()
    if not was_finished:
        assert request.finish_reason is FinishReason.ABORT
        assert "x" in driver.step().finished_ids
    driver.run()


def test_abort_between_schedule_and_update_skips_the_sample() -> None:
    scheduler = make_scheduler()
    request = scheduler.add_request(make_request("x", 5))[0]
    output = scheduler.schedule()
    scheduler.abort_request("x")
    assert scheduler.update_from_output(output, {"x": 7}) == []
    assert request.output_token_ids == [] and not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)
    assert scheduler.schedule().finished_ids == ["x"]
    assert scheduler.abort_request("never-seen") is False


# ----- n > 1 ---------------------------------------------------------------------------------

def test_n_sequences_share_full_prompt_blocks_and_free_them() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, budget=64)
    driver = Driver(scheduler)
    sequences = scheduler.add_request(make_request("r", 10, max_tokens=5, n=3))
    assert [s.request_id for s in sequences] == ["r#0", "r#1", "r#2"]
    assert scheduler.num_waiting == 3
    first = driver.step()
    assert [c.request_id for c in first.scheduled] == ["r#0"]  # the prompt is prefilled once
    tables = [scheduler.block_manager.block_table(s.request_id) for s in sequences]
    shared = tables[0][:2]  # 8 of the 10 prompt tokens
    assert all(t == shared for t in tables[1:])
    # three tables, plus the prefix cache's reference on the leader's computed prompt blocks
    assert [scheduler.block_manager.pool.ref_count(b) for b in shared] == [4, 4]
    second = driver.step()
    tails = {c.request_id: (c.start_pos, c.num_tokens) for c in second.scheduled}
    assert tails == {"r#0": (10, 1), "r#1": (8, 2), "r#2": (8, 2)}  # only the tail recomputed
    driver.run()
    grouped = RequestOutput.from_sequences(sequences)
    assert grouped.finished and [o.index for o in grouped.outputs] == [0, 1, 2]
    assert [o.token_ids for o in grouped.outputs] == [[fake_token_at(s, k) for k in range(5)]
                                                      for s in sequences]


def test_n_with_block_aligned_prompt_recomputes_last_block() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    driver = Driver(scheduler)
    sequences = scheduler.add_request(make_request("r", 8, max_tokens=2, n=2))
    driver.step()
    assert scheduler.block_manager.block_table("r#1") == \
        scheduler.block_manager.block_table("r#0")[:1]
    tails = {c.request_id: (c.start_pos, c.num_tokens) for c in driver.step().scheduled}
    assert tails == {"r#0": (8, 1), "r#1": (4, 4)}
    driver.run()
    assert all(s.num_output_tokens == 2 for s in sequences)


def test_n_with_short_prompt_runs_sequences_independently() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    scheduler.add_request(make_request("r", 3, max_tokens=2, n=3))
    assert sorted(c.request_id for c in driver.step().scheduled) == ["r#0", "r#1", "r#2"]
    updates = scheduler.update_from_output(scheduler.schedule(), {"r#0": 5, "r#1": 6, "r#2": 7})
    assert list(group_by_request(updates)) == ["r"]
    assert all(u.finished for u in updates)
    assert_all_blocks_free(scheduler)


def test_n_siblings_beyond_max_num_seqs_prefill_on_their_own() -> None:
    scheduler = make_scheduler(max_seqs=2, budget=64)
    sequences = Driver(scheduler).run({0: [make_request("r", 10, max_tokens=3, n=4)]})
    assert all(s.num_output_tokens == 3 for s in sequences)


def test_n_sequences_survive_preemption_and_free_everything() -> None:
    # Each sequence grows to 16 KV tokens (4 blocks), 2 of them shared; 6 usable blocks.
    scheduler = make_scheduler(num_blocks=7, block_size=4, budget=64)
    sequences = Driver(scheduler).run({0: [make_request("r", 9, max_tokens=8, n=3)]})
    assert scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in sequences] == [[fake_token_at(s, k) for k in range(8)]
                                                       for s in sequences]


def test_abort_leader_before_fork_releases_siblings() -> None:
    scheduler = make_scheduler(budget=4)
    driver = Driver(scheduler)
    sequences = scheduler.add_request(make_request("r", 10, max_tokens=2, n=3))
    driver.step()
    assert scheduler.abort_request("r#0")
    assert scheduler.num_waiting == 2
    driver.run()
    assert [s.num_output_tokens for s in sequences] == [0, 2, 2]


def test_abort_group_id_aborts_every_sequence() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    sequences = scheduler.add_request(make_request("r", 10, max_tokens=5, n=3))
    driver.step()
    driver.step()
    assert scheduler.abort_request("r")
    assert all(s.finish_reason is FinishReason.ABORT for s in sequences)
    assert_all_blocks_free(scheduler)


# ----- stop conditions ---------------------------------------------------------------------

def run_with_tokens(tokens: list[int], eos_per_request: tuple[int, ...] | None = None,
                    max_model_len: int | None = None, **params: object) -> Request:
    """One request fed ``tokens`` one per step; returns it once finished."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    request = make_request("x", 3, **{"max_tokens": 10, **params})
    request.eos_token_ids = eos_per_request
    scheduler.add_request(request)
    feed = iter(tokens)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, {c.request_id: next(feed) for c in output.scheduled
                                              if c.num_logits})
        scheduler.check_integrity()
    assert_all_blocks_free(scheduler)
    return request


def test_eos_stops_and_is_kept_in_output() -> None:
    request = run_with_tokens([5, 6, EOS, 7])
    assert request.output_token_ids == [5, 6, EOS]
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, None)


def test_per_request_eos_replaces_the_models() -> None:
    assert run_with_tokens([EOS, 9, 5], eos_per_request=(9,)).output_token_ids == [EOS, 9]


def test_ignore_eos_runs_to_max_tokens() -> None:
    request = run_with_tokens([EOS] * 10, ignore_eos=True, max_tokens=4)
    assert request.output_token_ids == [EOS] * 4
    assert request.finish_reason is FinishReason.LENGTH


def test_stop_token_ids_report_the_token() -> None:
    request = run_with_tokens([5, 42, 6], stop_token_ids=[42])
    assert request.output_token_ids == [5, 42] and request.stop_reason == 42


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    request = run_with_tokens([EOS, 42, 5, EOS], min_tokens=3, stop_token_ids=[42])
    assert request.output_token_ids == [EOS, 42, 5, EOS]
    assert request.finish_reason is FinishReason.STOP


def test_max_tokens_and_max_model_len_stop_with_length() -> None:
    assert run_with_tokens([5] * 10, max_tokens=3).output_token_ids == [5] * 3
    request = run_with_tokens([5] * 10, max_tokens=None, max_model_len=7)
    assert request.num_tokens == 7 and request.finish_reason is FinishReason.LENGTH


def test_several_sampled_tokens_are_truncated_at_a_stop() -> None:
    scheduler = make_scheduler()
    request = scheduler.add_request(make_request("x", 3, max_tokens=10))[0]
    updates = scheduler.update_from_output(scheduler.schedule(), {"x": [5, EOS, 6]})
    assert updates[0].new_token_ids == [5, EOS] and updates[0].finished
    assert request.output_token_ids == [5, EOS]
    assert_all_blocks_free(scheduler)


def test_finish_request_for_a_stop_string_frees_blocks() -> None:
    scheduler = make_scheduler()
    driver = Driver(scheduler)
    request = scheduler.add_request(make_request("x", 3, max_tokens=10))[0]
    driver.step()
    assert scheduler.finish_request("x", FinishReason.STOP, "\n\n")
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, "\n\n")
    assert not scheduler.finish_request("x", FinishReason.STOP)
    assert_all_blocks_free(scheduler)


def test_update_contract_violations_are_loud() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("x", 3))
    output = scheduler.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update_from_output(output, {})
    with pytest.raises(ValueError, match="once"):
        scheduler.update_from_output(output, {"x": 5})
    scheduler.abort_request("x")
    assert_all_blocks_free(scheduler)


def test_failed_step_is_recovered_by_aborting_its_sequences() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("x", 3))
    scheduler.add_request(make_request("y", 3))
    output = scheduler.schedule()
    for chunk in output.scheduled:  # the runner raised: the engine gives up on these
        scheduler.abort_request(chunk.request_id)
    assert scheduler.update_from_output(output, {}) == []
    assert_all_blocks_free(scheduler)



# ----- several tokens per step: drafts, verification, rollback --------------------------------

def true_drafts(k: int) -> Proposer:
    """The fake model's own next k tokens: every draft is accepted."""
    return lambda r: [fake_token_at(r, r.num_output_tokens + j) for j in range(k)]


def drafts_wrong_from(k: int, wrong_at: int) -> Proposer:
    """k drafts, right up to index ``wrong_at`` and wrong from there on."""
    return lambda r: [fake_token_at(r, r.num_output_tokens + j) + (j >= wrong_at) * 7
                      for j in range(k)]


def test_drafts_are_verified_with_the_last_token_and_all_accepted() -> None:
    scheduler = make_scheduler(block_size=4, budget=64)
    driver = Driver(scheduler, proposer=true_drafts(3))
    request = scheduler.add_request(make_request("x", 5, max_tokens=9))[0]
    first = driver.step()  # the prompt: no drafts before the first token exists
    assert first.scheduled[0].num_drafts == 0 and request.num_output_tokens == 1
    second = driver.step()
    chunk = second.scheduled[0]
    assert (chunk.start_pos, chunk.num_tokens, chunk.num_logits, chunk.num_drafts) == (5, 4, 4, 3)
    assert request.num_output_tokens == 5  # 3 drafts accepted + the model's own token
    assert request.num_computed_tokens == request.num_tokens - 1
    driver.run()
    assert request.output_token_ids == [fake_token_at(request, k) for k in range(9)]
    assert len(driver.outputs) == 3  # 1 + 4 + 4 tokens, not 9 steps
    stats = scheduler.stats()
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (6, 6)


def test_rollback_of_two_of_three_drafts_frees_their_block() -> None:
    # block_size 4, prompt 6: the last prompt token sits at position 5 in block 1; the three
    # drafts go to positions 6, 7 (block 1) and 8 (a new block 2).
    scheduler = make_scheduler(num_blocks=16, block_size=4, budget=64)
    driver = Driver(scheduler)
    request = scheduler.add_request(make_request("x", 6, max_tokens=8))[0]
    driver.step()
    free_before = scheduler.block_manager.num_free_blocks
    request.spec_token_ids = drafts_wrong_from(3, 1)(request)
    output = scheduler.schedule()
    assert output.scheduled[0].num_drafts == 3
    assert len(scheduler.block_manager.block_table("x")) == 3
    result = driver.runner.execute(output)
    assert result.token_ids["x"] == [fake_token_at(request, 1), fake_token_at(request, 2)]
    update, = scheduler.update_from_output(output, result.token_ids)
    assert (update.new_token_ids, update.num_rejected) == (result.token_ids["x"], 2)
    assert request.num_tokens == 9 and request.num_computed_tokens == 8  # 7 + 1 accepted draft
    assert len(scheduler.block_manager.block_table("x")) == 2  # block 2 went back
    assert scheduler.block_manager.num_free_blocks == free_before
    scheduler.check_integrity()
    driver.run()
    assert request.output_token_ids == [fake_token_at(request, k) for k in range(8)]


def test_a_stop_token_inside_an_accepted_run_truncates_the_rest() -> None:
    scheduler = make_scheduler(block_size=4)
    request = scheduler.add_request(make_request("x", 3, max_tokens=10))[0]
    Driver(scheduler).step()
    request.spec_token_ids = [5, EOS, 6]
    output = scheduler.schedule()
    update, = scheduler.update_from_output(output, {"x": [5, EOS, 6, 9]})
    assert update.new_token_ids == [5, EOS] and update.finished
    assert request.output_token_ids[1:] == [5, EOS]
    assert request.finish_reason is FinishReason.STOP
    assert_all_blocks_free(scheduler)
    # The KV of the prompt, the first token and the accepted draft 5 is valid and was cached.
    assert scheduler.block_manager.prefix_cache.num_cached_blocks == 1


def drafts_granted(scheduler: Scheduler, prompt_len: int, max_tokens: int | None) -> int:
    """How many of 5 drafts the scheduler takes for a request with one token generated."""
    driver = Driver(scheduler)
    request = scheduler.add_request(make_request("x", prompt_len, max_tokens=max_tokens))[0]
    run_until(driver, lambda: request.num_output_tokens == 1)
    request.spec_token_ids = [1, 2, 3, 4, 5]
    output = scheduler.schedule()
    scheduler.abort_request("x")
    scheduler.update_from_output(output, {})
    assert_all_blocks_free(scheduler)
    return output.scheduled[0].num_drafts


def test_drafts_never_run_past_max_tokens_the_context_or_the_budget() -> None:
    # 1 token generated + 2 drafts + the model's own token = max_tokens 4
    assert drafts_granted(make_scheduler(block_size=4), 3, max_tokens=4) == 2
    # 9 known tokens + 2 drafts + 1 = max_model_len 12
    assert drafts_granted(make_scheduler(block_size=4, max_model_len=12), 8, None) == 2
    # a budget of 3 tokens: the last known one and 2 drafts
    assert drafts_granted(make_scheduler(block_size=4, budget=3), 2, max_tokens=9) == 2


def test_drafts_without_blocks_are_dropped_rather_than_preempting() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=4, budget=64)  # 2 usable blocks
    driver = Driver(scheduler)
    a = scheduler.add_request(make_request("a", 3, max_tokens=3))[0]
    b = scheduler.add_request(make_request("b", 3, max_tokens=3, arrival=1.0))[0]
    driver.step()
    a.spec_token_ids = [7, 7, 7]  # would need a third block
    chunk = scheduler.schedule().scheduled[0]
    assert chunk.request is a and chunk.num_drafts == 0
    assert scheduler.num_preemptions == 0 and b.status is RequestStatus.RUNNING


def test_abort_while_drafts_are_pending_frees_everything() -> None:
    scheduler = make_scheduler(block_size=2)
    driver = Driver(scheduler)
    request = scheduler.add_request(make_request("x", 3, max_tokens=10))[0]
    driver.step()
    request.spec_token_ids = [1, 2, 3, 4]
    output = scheduler.schedule()
    assert output.scheduled[0].num_drafts == 4
    assert scheduler.abort_request("x")
    assert scheduler.update_from_output(output, {"x": [1, 2, 9]}) == []
    assert request.output_token_ids == [fake_token_at(request, 0)]
    assert_all_blocks_free(scheduler)


def test_forced_tokens_past_the_scored_ones_are_computed_next_step() -> None:
    scheduler = make_scheduler(block_size=4)
    request = scheduler.add_request(make_request("x", 3, max_tokens=10))[0]
    output = scheduler.schedule()
    scheduler.update_from_output(output, {"x": [5, 6, 7]})  # one sampled, two forced
    assert request.output_token_ids == [5, 6, 7] and request.num_computed_tokens == 3
    chunk = scheduler.schedule().scheduled[0]
    assert (chunk.start_pos, chunk.token_ids, chunk.num_logits) == (3, [5, 6, 7], 1)
    scheduler.abort_request("x")


def test_trim_refuses_to_touch_shared_blocks() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, budget=64)
    driver = Driver(scheduler)
    sequences = scheduler.add_request(make_request("r", 10, max_tokens=5, n=2))
    driver.step()
    manager = scheduler.block_manager
    sibling = sequences[1]  # shares the leader's first two prompt blocks
    with pytest.raises(CacheIntegrityError, match="shared"):
        manager.trim(sibling, 5)  # would make block 1, shared, writable again
    assert len(manager.block_table(sibling.request_id)) == 2
    scheduler.check_integrity()
    driver.run()


# ----- properties ----------------------------------------------------------------------------

def test_bookkeeping_never_imports_torch() -> None:
    code = ("import sys, tokenmill.sched, tokenmill.cache, tokenmill.params, tokenmill.request; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


request_specs = st.lists(st.tuples(
    st.integers(0, 15),  # arrival step
    st.integers(1, 24),  # prompt length
    st.integers(1, 10),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 3),  # priority
    st.one_of(st.none(), st.integers(0, 40)),  # abort at step
), min_size=1, max_size=8)


def random_drafts(seed: int, max_k: int) -> Proposer:
    """Up to ``max_k`` drafts, each right with probability 3/4 while the run is right."""
    rng = random.Random(seed)

    def propose(r: Request) -> list[int]:
        k = rng.randint(0, max_k)
        return [fake_token_at(r, r.num_output_tokens + j) + (rng.random() < 0.25) * 9
                for j in range(k)]

    return propose


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(specs=request_specs, num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(1, 24), max_seqs=st.integers(1, 6),
       policy=st.sampled_from(["fcfs", "priority"]), watermark=st.sampled_from([0.0, 0.1]),
       max_drafts=st.sampled_from([0, 0, 2, 5]), draft_seed=st.integers(0, 1000),
       prefix_cache=st.booleans())
def test_random_workloads_keep_invariants(specs, num_blocks: int, block_size: int, budget: int,
                                          max_seqs: int, policy: str, watermark: float,
                                          max_drafts: int, draft_seed: int,
                                          prefix_cache: bool) -> None:
    """Random arrivals, aborts, n > 1, memory pressure and (right or wrong) drafts: the step
    contract, cache integrity and the prefix cache's KV are checked around every step, and
    every surviving sequence ends with exactly the fake model's tokens."""
    scheduler = make_scheduler(num_blocks, block_size, budget, max_seqs, policy, None, watermark,
                               prefix_cache)
    proposer = random_drafts(draft_seed, max_drafts) if max_drafts else None
    driver = Driver(scheduler, proposer)
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    for i, (step, prompt_len, max_tokens, n, priority, abort_at) in enumerate(specs):
        request = make_request(f"r{i}", prompt_len, max_tokens, float(step), priority, n=n)
        arrivals.setdefault(step, []).append(request)
        if abort_at is not None:
            aborts.setdefault(abort_at, []).append(request.request_id)
    sequences, aborted = drive_random(driver, arrivals, aborts)
    for seq in sequences:
        if seq.group_id not in aborted:
            room = scheduler.max_model_len - seq.num_prompt_tokens
            assert seq.num_output_tokens == min(seq.sampling_params.max_tokens, room), seq
            assert seq.output_token_ids == [fake_token_at(seq, k)
                                            for k in range(seq.num_output_tokens)]
    assert_all_blocks_free(scheduler)


def drive_random(driver: Driver, arrivals: dict[int, list[Request]],
                 aborts: dict[int, list[str]]) -> tuple[list[Request], set[str]]:
    scheduler = driver.scheduler
    sequences: list[Request] = []
    aborted: set[str] = set()
    for step in range(5000):
        for request in arrivals.pop(step, []):
            try:
                sequences += scheduler.add_request(request)
            except ValueError:
                assert does_not_fit(scheduler, request)
        for request_id in aborts.pop(step, []):
            if scheduler.abort_request(request_id):
                aborted.add(request_id)
        if not arrivals and not scheduler.has_unfinished_requests():
            return sequences, aborted
        driver.step()
    raise AssertionError(f"deadlock: {scheduler.stats()}")


def does_not_fit(scheduler: Scheduler, request: Request) -> bool:
    kv_tokens = request.num_prompt_tokens + request.sampling_params.max_tokens - 1
    return scheduler.block_manager.blocks_for_tokens(kv_tokens) > \
        scheduler.block_manager.pool.num_usable_blocks


# ----- a prefix being computed is computed once ------------------------------------------------

def shared_prompt_requests(n: int, shared: int, own: int, tag: str = "") -> list[Request]:
    """n requests whose prompts start with the same ``shared`` tokens, then ``own`` of their own."""
    head = [7 + i % 40 for i in range(shared)]
    return [Request(f"{tag}s{i}", head + [200 + 10 * i + j for j in range(own)],
                    SamplingParams(max_tokens=3)) for i in range(n)]


def test_requests_wait_for_a_shared_prefix_being_computed() -> None:
    from tokenmill.sched.scheduler import SHARED_PREFIX_BLOCKS

    scheduler = make_scheduler(num_blocks=128, block_size=4, budget=256, max_seqs=8)
    shared = SHARED_PREFIX_BLOCKS * 4 + 8  # 40 tokens, 10 full blocks
    group = shared_prompt_requests(3, shared, 5)
    other = Request("other", [300 + j for j in range(shared + 5)], SamplingParams(max_tokens=3))
    for r in (*group, other):
        scheduler.add_request(r)
    driver = Driver(scheduler)
    first = driver.step()
    # the budget holds everyone, but only one of the group computes the shared blocks; the
    # request behind them with a prefix of its own is admitted past them
    assert [c.request_id for c in first.scheduled] == ["s0", "other"]
    second = driver.step()
    late = {c.request_id: c for c in second.scheduled}
    for rid in ("s1", "s2"):  # now from the cache: only their own tokens (and the last block)
        assert late[rid].start_pos >= shared - 4 and late[rid].request.num_cached_tokens >= 36
    assert scheduler.stats().prefix_cache_hits >= 2 * 36
    driver.run()


def test_short_or_cached_prefixes_and_no_cache_never_wait() -> None:
    from tokenmill.sched.scheduler import SHARED_PREFIX_BLOCKS

    short = SHARED_PREFIX_BLOCKS * 4  # not longer than the key: nothing is held
    scheduler = make_scheduler(num_blocks=128, block_size=4, budget=256)
    for r in shared_prompt_requests(3, short - 2, 2):
        scheduler.add_request(r)
    assert len(Driver(scheduler).step().scheduled) == 3
    # without a prefix cache there is nothing to wait for
    scheduler = make_scheduler(num_blocks=128, block_size=4, budget=256, prefix_cache=False)
    for r in shared_prompt_requests(3, short + 8, 5):
        scheduler.add_request(r)
    assert len(Driver(scheduler).step().scheduled) == 3
    # once the prefix is cached, newcomers take it at once, together
    scheduler = make_scheduler(num_blocks=128, block_size=4, budget=256)
    driver = Driver(scheduler)
    driver.run({0: shared_prompt_requests(1, short + 8, 5, "a")})
    for r in shared_prompt_requests(3, short + 8, 5, "b"):
        scheduler.add_request(r)
    assert len(driver.step().scheduled) == 3


def test_a_long_shared_prefix_chunked_over_steps_is_computed_once() -> None:
    """The prefix outlasts one step's budget: the others wait while the first computes it
    chunk by chunk, then all finish; the prefix's tokens are computed once."""
    scheduler = make_scheduler(num_blocks=256, block_size=4, budget=48, max_seqs=8)
    group = shared_prompt_requests(4, 120, 6)
    driver = Driver(scheduler)
    done = driver.run({0: group})
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in done)
    computed = sum(o.num_batched_tokens for o in driver.outputs)
    # 126 prompt tokens for the first; the others compute their own 6 (plus the last block's
    # re-read) and 3 outputs each
    assert computed <= 126 + 3 * (6 + 4) + 4 * 3, computed
