"""A step that fails fails the requests it touched, not the engine (fake runner, no torch, ms).

A fault is injected at each stage of a step (the engine's test-only ``fault_hook``) or raised
by a real part midway (the block allocator inside ``schedule()``, a runner that loses a token
inside ``update_from_output``). Each time the requests the step touched fail with a reason,
the others finish token for token as in a run without the fault, the next request runs, and
nothing leaks: the scheduler's integrity check holds after every step, the fake runner checks
that every read finds the sequence's own KV (so a failed step's KV never reaches the prefix
cache), every block is free at the end and the proposer has dropped every sequence.
"""

from __future__ import annotations

import functools

import pytest

from tests.test_engine_unit import (EOS, ListProposer, check_clean, check_step, make_engine,
                                    prompt, true_continuation)
from tokenmill.engine.faults import STAGES, FaultPlan, FaultRule, InjectedFault
from tokenmill.engine.llm_engine import MAX_BLAMELESS_FAILURES, EngineDeadError, LLMEngine
from tokenmill.params import SamplingParams
from tokenmill.request import Request

SHARED = prompt(9, 8)  # two blocks of 4 that every prompt starts with: the prefix cache is used


def prompt_of(i: int) -> list[int]:
    return SHARED + prompt(i, 3 + i % 3)


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)


# Three sequences run at a time: bad-0 and bad-1's two run from the first step, the ok ones
# come after it and wait. bad-0 ends in step 3, the step that fails: its caller must hear of
# the failure, not get the output.
BAD_REQUESTS = {"bad-0": (prompt_of(0), greedy(3)), "bad-1": (prompt_of(1), greedy(12, n=2))}
OK_REQUESTS = {"ok-0": (prompt_of(2), greedy(10)), "ok-1": (prompt_of(3), greedy(7)),
               "ok-2": (prompt_of(4), greedy(9, n=2))}
REQUESTS = {**BAD_REQUESTS, **OK_REQUESTS}
BAD = set(BAD_REQUESTS)
NEXT = {"next": (prompt_of(5), greedy(8))}
FAILING_STEP = 3


class ObservingProposer(ListProposer):
    """Right drafts for the ok requests only (bad-0 must end in the failing step)."""

    def __init__(self) -> None:
        super().__init__(lambda r: [] if r.group_id.startswith("bad")
                         else true_continuation(r, 2))
        self.observed = 0

    def observe(self, chunks, token_ids, num_batched_tokens, seconds) -> None:
        self.observed += 1


def engine_for_faults() -> LLMEngine:
    return make_engine(num_blocks=48, max_seqs=3, proposer=ObservingProposer())


def fault_at(stage: str, step: int):
    """A hook that raises at ``stage`` of the ``step``-th step."""
    steps = 0

    def hook(at: str, request_ids) -> None:
        nonlocal steps
        steps += at == "step"
        if at == stage and steps == step:
            raise InjectedFault(f"at {stage}")

    return hook


def run_checked(engine: LLMEngine, requests: dict, later: dict | None = None) -> tuple[
        dict, dict]:
    """Add the requests (``later`` ones after the first step), step to the end checking
    integrity after every step: (token ids of each finished request, per sequence; failures)
    by id."""
    for rid, (p, params) in requests.items():
        engine.add_request(rid, p, params)
    finished, failures = {}, {}
    for i in range(500):
        if not engine.has_unfinished_requests():
            return finished, failures
        for rid, (p, params) in (later or {}).items() if i == 1 else ():
            engine.add_request(rid, p, params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [c.token_ids for c in out.outputs]
        failures.update(engine.take_failures())
        check_step(engine)
    raise AssertionError("the engine did not finish")


@functools.cache
def reference() -> dict:
    engine = engine_for_faults()
    finished, failures = run_checked(engine, BAD_REQUESTS, OK_REQUESTS)
    finished.update(run_checked(engine, NEXT)[0])
    assert not failures and set(finished) == {*REQUESTS, *NEXT}
    return finished


def check_survivors(engine: LLMEngine, finished: dict, failures: dict, failed: set[str],
                    why: str) -> None:
    """The failed requests failed (and only they), the rest match the fault-free run, a
    request added afterwards runs as it would have, and nothing leaks."""
    assert set(failures) == failed and all(why in w for w in failures.values()), failures
    survivors = set(REQUESTS) - failed
    assert {r: finished[r] for r in survivors} == {r: reference()[r] for r in survivors}
    after, later_failures = run_checked(engine, NEXT)
    assert not later_failures and after["next"] == reference()["next"]
    check_clean(engine)
    ids = {f"{r}#{i}" if params.n > 1 else r for r, (_, params) in {**REQUESTS, **NEXT}.items()
           for i in range(params.n)}
    assert set(engine.proposer.forgotten) == ids  # a drafter's state for each is dropped


ENGINE_STAGES = [s for s in STAGES if s not in ("step", "metrics")]  # each touches requests


@pytest.mark.parametrize("stage", ENGINE_STAGES)
def test_a_stage_that_fails_fails_the_requests_of_its_step_only(stage: str) -> None:
    engine = engine_for_faults()
    engine.fault_hook = fault_at(stage, FAILING_STEP)
    finished, failures = run_checked(engine, BAD_REQUESTS, OK_REQUESTS)
    check_survivors(engine, finished, failures, BAD, f"InjectedFault: at {stage}")
    assert engine.stats().num_failed_steps == 1


def test_schedule_raising_midway_fails_the_running_requests_it_half_scheduled(
        monkeypatch) -> None:
    engine = engine_for_faults()
    manager = engine.scheduler.block_manager
    allocate = manager.allocate_slots
    steps = 0

    def broken_allocate(request: Request, num_tokens: int) -> bool:
        # bad-0's decode slot is allocated (and its chunk planned) before this raises
        if steps == FAILING_STEP and request.group_id == "bad-1":
            raise RuntimeError("allocator broke")
        return allocate(request, num_tokens)

    def count_steps(stage: str, request_ids) -> None:
        nonlocal steps
        steps += stage == "step"

    monkeypatch.setattr(manager, "allocate_slots", broken_allocate)
    engine.fault_hook = count_steps
    finished, failures = run_checked(engine, BAD_REQUESTS, OK_REQUESTS)
    check_survivors(engine, finished, failures, BAD, "RuntimeError: allocator broke")


def test_schedule_raising_while_admitting_fails_that_request_and_the_running_ones(
        monkeypatch) -> None:
    engine = make_engine(num_blocks=48, max_seqs=4)
    engine.add_request("a", prompt_of(0), greedy(6))
    engine.step()  # a's prompt is computed: SHARED's blocks are in the prefix cache
    engine.add_request("victim", prompt_of(1), greedy(6))
    engine.add_request("bystander", prompt_of(2), greedy(6))  # waits behind it, untouched
    manager = engine.scheduler.block_manager
    allocate = manager.allocate_slots

    def broken_allocate(request: Request, num_tokens: int) -> bool:
        if request.group_id == "victim":  # it holds the cached prefix by now
            raise RuntimeError("allocator broke")
        return allocate(request, num_tokens)

    monkeypatch.setattr(manager, "allocate_slots", broken_allocate)
    assert engine.step() == []
    failures = engine.take_failures()
    assert set(failures) == {"a", "victim"} and "allocator broke" in failures["victim"]
    engine.scheduler.check_integrity()
    monkeypatch.setattr(manager, "allocate_slots", allocate)
    finished, more = run_checked(engine, {})
    alone, _ = run_checked(make_engine(num_blocks=48, max_seqs=4),
                           {"bystander": (prompt_of(2), greedy(6))})
    assert not more and finished == alone
    check_clean(engine)


def test_update_raising_midway_fails_the_requests_of_its_step(monkeypatch) -> None:
    """A runner that loses one sequence's token: update_from_output has applied the chunks
    before it (bad-0 ends there) when it raises."""
    engine = engine_for_faults()
    execute = engine.executor.execute
    steps = 0

    def lossy_execute(chunks, masks=None, draft_probs=None):
        nonlocal steps
        steps += 1
        out = execute(chunks, masks, draft_probs)
        if steps == FAILING_STEP:
            del out.token_ids["bad-1#1"]
        return out

    monkeypatch.setattr(engine.executor, "execute", lossy_execute)
    finished, failures = run_checked(engine, BAD_REQUESTS, OK_REQUESTS)
    check_survivors(engine, finished, failures, BAD, "no sampled token for 'bad-1#1'")


def test_failures_with_no_request_to_blame_end_the_engine_only_in_a_row() -> None:
    engine = make_engine()
    engine.add_request("x", prompt(0), greedy(4))
    fails = [True] * (MAX_BLAMELESS_FAILURES - 1) + [False] + [True] * (MAX_BLAMELESS_FAILURES - 1)

    def flaky(stage: str, request_ids) -> None:
        if stage == "step" and fails and fails.pop(0):
            raise InjectedFault("before the step touched anything")

    engine.fault_hook = flaky  # blameless failures, but never MAX_BLAMELESS_FAILURES in a row
    finished, failures = run_checked(engine, {})
    assert not failures and len(finished["x"][0]) == 4
    engine.fault_hook = FaultRule("step", "", None)  # every step, whatever is in play
    engine.add_request("y", prompt(1), greedy(4))
    for _ in range(MAX_BLAMELESS_FAILURES - 1):
        assert engine.step() == [] and engine.take_failures() == {}  # y waits on, untouched
    with pytest.raises(EngineDeadError, match="no request to blame"):
        engine.step()
    engine.scheduler.check_integrity()
    assert engine.stats().num_failed_steps == 2 * (MAX_BLAMELESS_FAILURES - 1) + \
        MAX_BLAMELESS_FAILURES


def test_fault_plan_rules() -> None:
    plan = FaultPlan.parse("forward:fail-:raise; update::sleep=0")
    assert plan.rules == (FaultRule("forward", "fail-", None), FaultRule("update", "", 0.0))
    plan("forward", {"ok-1"})  # no request of the rule's: nothing
    plan("update", {"ok-1"})
    with pytest.raises(InjectedFault):
        plan("forward", {"ok-1", "cmpl-fail-2-abc"})
    for bad in ("nowhere:x:raise", "forward:x:explode", "forward:x:sleep=-1",
                "forward:x:sleep=soon", "forward"):
        with pytest.raises(ValueError, match="--test-faults"):
            FaultPlan.parse(bad)
    assert EOS not in prompt_of(0)  # the fake model never ends a request early
