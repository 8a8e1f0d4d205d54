"""The scheduler with a KV connector (no torch): loads at admission (async and sync), their
failures, aborts while a worker writes, blocks held for a consumer, and preemption around
sequences waiting for KV.

The fake connector offers each request a number of its leading tokens "from elsewhere"; the
fake worker writes their (position, token) records into ``tests.fakes.FakeExecutor``'s KV, as
a real load writes K/V: a sync load before the step's forward, an async one when the test
says it finished (a failed one writes the good blocks and garbage after them). The executor
checks every read against that record, so a block kept when it should have been recomputed,
freed while a worker still writes it, or reused too early shows up as a wrong read, not only
as bookkeeping. ``check_integrity`` runs around every step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeExecutor
from tests.test_scheduler import (assert_all_blocks_free, check_output, fake_token,
                                  fake_token_at, make_request)
from tokenmill.cache import CacheIntegrityError
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.kv_transfer.base import (ExposeBlocks, KVConnectorMetadata, KVConnectorOutput,
                                        KVConnectorScheduler, LoadBlocks)
from tokenmill.request import FinishReason, Request, RequestOutput, RequestStatus
from tokenmill.sched import ScheduledChunk, Scheduler, SchedulerOutput, SeqUpdate
from tokenmill.util import cdiv

EOS = 2
WAITING_FOR_KV = RequestStatus.WAITING_FOR_REMOTE_KVS


class FakeConnector(KVConnectorScheduler):
    """Offers ``available[id]`` leading tokens of a sequence (async unless its id is in
    ``sync``); holds the blocks of finished sequences in ``hold`` for a consumer."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.available: dict[str, int] = {}
        self.sync: set[str] = set()
        self.hold: set[str] = set()
        self.ops: list[Any] = []
        self.queries: list[tuple[str, int]] = []
        self.allocs: list[tuple[str, tuple[int, ...], int, int]] = []
        self.finished: list[tuple[str, tuple[int, ...], RequestStatus]] = []
        self.aborted: list[str] = []
        self.reports: list[KVConnectorOutput] = []
        self.busy = False  # has_pending_work

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        self.queries.append((request.request_id, num_computed_tokens))
        ext = max(0, self.available.get(request.request_id, 0) - num_computed_tokens)
        return ext, request.request_id not in self.sync

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        rid, bs = request.request_id, self.block_size
        self.allocs.append((rid, tuple(block_ids), num_local_tokens, num_external_tokens))
        start, end = num_local_tokens, num_local_tokens + num_external_tokens
        blocks = range(start // bs, cdiv(end, bs))
        firsts = tuple(max(start, b * bs) for b in blocks)  # the position each block fills from
        tokens = tuple(tuple(request.token_ids_slice(p, min(end, (b + 1) * bs)))
                       for p, b in zip(firsts, blocks))
        tier = "sync" if rid in self.sync else "async"
        self.ops.append(LoadBlocks(rid, firsts, tuple(block_ids[b] for b in blocks), tokens,
                                   (tier,) * len(firsts)))

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if not self.ops:
            return None
        meta, self.ops = KVConnectorMetadata(tuple(self.ops)), []
        return meta

    def request_finished(self, request: Request,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.finished.append((rid, tuple(block_ids), request.status))
        if rid not in self.hold:
            return False, None
        self.ops.append(ExposeBlocks(rid, tuple(block_ids), 30.0))
        return True, {"remote_request_id": rid, "remote_block_ids": list(block_ids)}

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.reports.append(output)

    def request_aborted(self, request: Request) -> None:
        self.aborted.append(request.request_id)

    @property
    def has_pending_work(self) -> bool:
        return self.busy


class LoadingExecutor(FakeExecutor):
    """Reads of sequences whose sync load failed this step go unchecked: a real forward reads
    their garbage, and the scheduler must drop what it sampled from it."""

    unchecked: frozenset[str] = frozenset()

    def check_reads(self, chunks: Sequence[ScheduledChunk]) -> None:
        super().check_reads([c for c in chunks if c.request_id not in self.unchecked])


class FakeWorker:
    """The connector's worker side: sync loads are written before the forward (or fail as
    ``fail_sync`` says), async loads and exposes wait for the test to finish them."""

    def __init__(self, runner: LoadingExecutor) -> None:
        self.runner = runner
        self.loads: dict[str, LoadBlocks] = {}
        self.exposed: dict[str, ExposeBlocks] = {}
        self.fail_sync: dict[str, int] = {}  # sequence id -> good blocks of its sync load
        self.report = KVConnectorOutput()

    def start_step(self, meta: KVConnectorMetadata | None) -> None:
        failed = set()
        for op in meta.ops if meta is not None else ():
            if isinstance(op, ExposeBlocks):
                self.exposed[op.request_id] = op
            elif op.tiers[0] == "sync":
                good = self.fail_sync.pop(op.request_id, None)
                self._write(op, good)
                if good is not None:
                    failed.add(op.request_id)
            else:
                self.loads[op.request_id] = op
        self.runner.unchecked = frozenset(failed)

    def finish_load(self, request_id: str, good_blocks: int | None = None) -> None:
        """The async load is done: every block written, or only ``good_blocks`` of them."""
        self._write(self.loads.pop(request_id), good_blocks)

    def pulled(self, request_id: str) -> None:
        del self.exposed[request_id]
        self.report.finished_sending.add(request_id)

    def get_finished(self) -> KVConnectorOutput:
        report, self.report = self.report, KVConnectorOutput()
        return report

    def _write(self, op: LoadBlocks, good_blocks: int | None) -> None:
        bs = self.runner.block_size
        for i, (block, first, tokens) in enumerate(zip(op.block_ids, op.keys, op.tokens)):
            for j, token in enumerate(tokens):
                ok = good_blocks is None or i < good_blocks
                self.runner.kv[block * bs + (first + j) % bs] = (first + j, token if ok else -1)
        if good_blocks is None:
            self.report.finished_recving.add(op.request_id)
        else:
            self.report.failed_recving[op.request_id] = good_blocks


class KVDriver:
    """Steps scheduler, fake worker and fake runner; checks the step contract and integrity
    around every step."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, budget: int = 32,
                 max_seqs: int = 8, policy: str = "fcfs", prefix_cache: bool = True,
                 connector: bool = True) -> None:
        self.connector = FakeConnector(block_size) if connector else None
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy),
            CacheConfig(block_size=block_size, watermark=0.0,
                        enable_prefix_caching=prefix_cache),
            num_blocks=num_blocks, eos_token_ids=[EOS], connector=self.connector)
        self.runner = LoadingExecutor(block_size, fake_token)
        self.worker = FakeWorker(self.runner)
        self.updates: list[SeqUpdate] = []

    def add(self, request: Request, available: int = 0, sync: bool = False,
            hold: bool = False) -> Request:
        for seq in request.sequences():
            if self.connector is not None:
                self.connector.available[seq.request_id] = available
                if sync:
                    self.connector.sync.add(seq.request_id)
                if hold:
                    self.connector.hold.add(seq.request_id)
        return self.scheduler.add_request(request)[0]

    def step(self) -> SchedulerOutput:
        scheduler = self.scheduler
        output = scheduler.schedule()
        check_output(scheduler, output)
        scheduler.check_integrity()
        self.worker.start_step(output.kv_connector_metadata)
        result = self.runner.execute(output)
        self.updates = scheduler.update_from_output(output, result.token_ids,
                                                    self.worker.get_finished())
        scheduler.check_integrity()
        self.runner.check_prefix_cache(scheduler.block_manager.prefix_cache)
        return output

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not (self.scheduler.has_unfinished_requests()
                    or self.scheduler.has_pending_kv_work):
                assert_all_blocks_free(self.scheduler)
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.scheduler.stats()}")

    def scheduled(self, output: SchedulerOutput) -> dict[str, tuple[int, int]]:
        return {c.request_id: (c.start_pos, c.num_tokens) for c in output.scheduled}


def expected_tokens(seq: Request) -> list[int]:
    return [fake_token_at(seq, k) for k in range(seq.num_output_tokens)]


def loads(output: SchedulerOutput) -> list[LoadBlocks]:
    meta = output.kv_connector_metadata
    return [op for op in (meta.ops if meta else ()) if isinstance(op, LoadBlocks)]


# ----- async loads -------------------------------------------------------------------------

def test_async_load_waits_unscheduled_then_computes_only_the_last_prompt_token() -> None:
    d = KVDriver()
    req = d.add(make_request("r", 10, max_tokens=3), available=9)  # a remote prefill: P - 1
    out = d.step()
    assert req.status is WAITING_FOR_KV and out.scheduled == [] and out.num_batched_tokens == 0
    table = d.scheduler.block_manager.block_table("r")
    assert len(table) == 3 and req.num_computed_tokens == 9 and req.num_cached_tokens == 9
    assert d.connector.allocs == [("r", tuple(table), 0, 9)]
    [load] = loads(out)
    assert load.block_ids == tuple(table) and load.keys == (0, 4, 8)
    stats = d.scheduler.stats()
    assert (stats.num_loading, stats.num_running, stats.num_waiting) == (1, 1, 0)
    assert stats.external_cache_hits == 9 and d.scheduler.has_pending_kv_work
    assert d.step().scheduled == []  # still loading: nothing to run
    d.worker.finish_load("r")
    assert d.step().scheduled == [] and req.status is RequestStatus.RUNNING  # learnt at update
    assert d.scheduler.block_manager.cached_prefix_len(req) == 8  # loaded full blocks shared
    assert d.scheduled(d.step()) == {"r": (9, 1)}  # the last prompt token only
    d.run()
    assert req.output_token_ids == expected_tokens(req) and len(req.output_token_ids) == 3
    assert d.scheduler.stats().num_loading == 0 and not d.scheduler.has_pending_kv_work


def test_async_load_starts_after_the_local_cached_prefix() -> None:
    d = KVDriver()
    first = d.add(make_request("a", 10, max_tokens=1))
    d.run()
    assert first.num_output_tokens == 1 and d.connector.allocs == []  # nothing offered
    req = d.add(make_request("b", 10, max_tokens=2), available=9)  # same prompt ("a", "b")
    d.step()
    assert d.connector.queries[-1] == ("b", 8)  # asked past the 8 tokens cached here
    table = tuple(d.scheduler.block_manager.block_table("b"))
    assert d.connector.allocs == [("b", table, 8, 1)]
    assert req.num_cached_tokens == 9 and d.scheduler.stats().external_cache_hits == 1
    assert d.scheduler.stats().prefix_cache_hits == 8
    d.worker.finish_load("b")
    d.step()
    assert d.scheduled(d.step()) == {"b": (9, 1)}
    d.run()
    assert req.output_token_ids == expected_tokens(req)


@pytest.mark.parametrize("good", [0, 1, 3, 4])
def test_failed_load_keeps_the_good_blocks_and_recomputes_the_rest(good: int) -> None:
    d = KVDriver()
    req = d.add(make_request("r", 14, max_tokens=2), available=13)  # 4 blocks to load
    d.step()
    d.worker.finish_load("r", good_blocks=good)  # the rest holds garbage
    d.step()
    keep = min(4 * good, 13)
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == keep
    assert len(d.scheduler.block_manager.block_table("r")) == cdiv(keep, 4)
    assert req.num_cached_tokens == keep and d.scheduler.stats().external_cache_hits == keep
    assert d.scheduled(d.step()) == {"r": (keep, 14 - keep)}  # reads only good KV
    d.run()
    assert req.output_token_ids == expected_tokens(req)


def test_a_loading_request_holds_its_seat() -> None:
    d = KVDriver(max_seqs=1)
    d.add(make_request("r", 10, max_tokens=1), available=9)
    other = d.add(make_request("o", 5, max_tokens=1))
    for _ in range(3):
        assert d.step().scheduled == [] and other.status is RequestStatus.WAITING
    d.worker.finish_load("r")
    d.run()
    assert other.num_output_tokens == 1


def test_n_sequences_fork_from_a_loaded_leader() -> None:
    d = KVDriver()
    leader = d.add(make_request("r", 10, max_tokens=3, n=2), available=9)
    d.step()
    assert leader.status is WAITING_FOR_KV and d.scheduler.stats().num_waiting == 1  # r#1
    d.worker.finish_load("r#0")
    d.step()
    assert d.scheduled(d.step()) == {"r#0": (9, 1)}  # and r#1 forks from its loaded blocks
    sibling = d.scheduler._live["r#1"]
    assert sibling.status is RequestStatus.RUNNING and sibling.num_computed_tokens == 8
    assert d.scheduled(d.step())["r#1"] == (8, 2)
    d.run()
    assert [(rid, len(table)) for rid, table, _, _ in d.connector.allocs] == [("r#0", 3)]
    assert sibling.output_token_ids == expected_tokens(sibling)


# ----- sync loads ------------------------------------------------------------------------------

def test_sync_load_is_scheduled_in_its_admission_step() -> None:
    d = KVDriver(budget=8)
    req = d.add(make_request("r", 30, max_tokens=2), available=20, sync=True)
    out = d.step()  # the worker writes the 20 tokens before this forward reads them
    assert d.scheduled(out) == {"r": (20, 8)} and req.status is RequestStatus.RUNNING
    assert [op.tiers[0] for op in loads(out)] == ["sync"] and req.num_cached_tokens == 20
    assert d.scheduler.stats().num_loading == 0
    d.run()
    assert req.output_token_ids == expected_tokens(req)


def test_failed_sync_load_drops_the_steps_samples_and_recomputes() -> None:
    d = KVDriver()
    req = d.add(make_request("r", 10, max_tokens=2), available=9, sync=True)
    d.worker.fail_sync["r"] = 1
    out = d.step()
    assert d.scheduled(out) == {"r": (9, 1)}
    assert d.updates == [] and req.num_output_tokens == 0  # sampled from garbage: dropped
    assert req.num_computed_tokens == 4 and req.num_cached_tokens == 4
    assert len(d.scheduler.block_manager.block_table("r")) == 1
    assert d.scheduled(d.step()) == {"r": (4, 6)}
    d.run()
    assert req.output_token_ids == expected_tokens(req)


# ----- aborts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("good", [None, 1])  # the worker reports it done / failed
def test_abort_while_loading_keeps_the_blocks_until_the_worker_reports(good: int | None) -> None:
    d = KVDriver()
    req = d.add(make_request("r", 10, max_tokens=2), available=9)
    d.step()
    manager = d.scheduler.block_manager
    free = manager.num_free_blocks
    assert d.scheduler.abort_request("r")
    assert req.status is RequestStatus.FINISHED_ABORTED and d.connector.aborted == ["r"]
    assert manager.owners() == ["r"] and manager.num_free_blocks == free  # a worker writes
    assert not d.scheduler.has_unfinished_requests() and d.scheduler.has_pending_kv_work
    with pytest.raises(ValueError, match="already in use"):
        d.scheduler.add_request(make_request("r", 10))
    other = d.add(make_request("other", 20, max_tokens=5))  # runs meanwhile, elsewhere
    d.step()
    d.worker.finish_load("r", good)  # writes into the orphan's blocks, not o's
    d.step()
    assert manager.owners() == ["other"] and manager.cached_prefix_len(req) == 0  # not cached
    d.run()
    assert other.output_token_ids == expected_tokens(other)
    assert req.num_output_tokens == 0


def test_abort_of_a_waiting_or_running_request_tells_the_connector() -> None:
    d = KVDriver(max_seqs=1)
    d.add(make_request("a", 5, max_tokens=5))
    d.add(make_request("b", 5, max_tokens=5))
    d.step()
    d.scheduler.abort_request("b")  # never admitted
    d.scheduler.abort_request("a")  # running
    assert d.connector.aborted == ["b", "a"] and d.connector.finished == []
    d.run()


def test_admission_without_room_for_the_load_leaves_no_trace() -> None:
    d = KVDriver(num_blocks=9)  # 8 usable blocks
    big = d.add(make_request("a", 20, max_tokens=8))
    req = d.add(make_request("bb", 18, max_tokens=2), available=17)  # 5 blocks; 3 free
    d.step()
    d.step()
    assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
    assert d.connector.allocs == [] and d.connector.aborted == []
    assert [q for q in d.connector.queries if q[0] == "bb"] == [("bb", 0), ("bb", 0)]
    while big.num_output_tokens < 8:
        d.step()
    d.step()  # a's blocks are evictable cache now: bb gets them
    assert req.status is WAITING_FOR_KV and req.num_cached_tokens == 17
    d.worker.finish_load("bb")
    d.run()
    assert req.output_token_ids == expected_tokens(req)


# ----- finishing: blocks held for a consumer ----------------------------------------------------

def test_finished_request_holds_its_blocks_until_pulled() -> None:
    d = KVDriver()
    req = d.add(make_request("p", 10, max_tokens=1), hold=True)  # a producer's prefill
    d.step()
    manager = d.scheduler.block_manager
    table = tuple(manager.block_table("p"))
    assert req.status is RequestStatus.FINISHED_LENGTH and len(table) == 3
    assert d.connector.finished == [("p", table, RequestStatus.FINISHED_LENGTH)]
    params = {"remote_request_id": "p", "remote_block_ids": list(table)}
    assert req.kv_transfer_out == params
    assert RequestOutput.from_sequences([req]).kv_transfer_params == params
    assert not d.scheduler.has_unfinished_requests() and d.scheduler.has_pending_kv_work
    assert d.scheduler.stats().num_held == 1 and manager.owners() == ["p"]
    with pytest.raises(ValueError, match="already in use"):
        d.scheduler.add_request(make_request("p", 10))
    assert manager.cached_prefix_len(make_request("q", 10)) == 8  # shared while held
    out = d.step()
    assert [op for op in out.kv_connector_metadata.ops] == [ExposeBlocks("p", table, 30.0)]
    d.step()
    assert manager.owners() == ["p"]  # nobody pulled yet
    d.worker.pulled("p")
    d.step()
    assert manager.owners() == [] and d.scheduler.stats().num_held == 0
    assert not d.scheduler.has_pending_kv_work
    d.run()


def test_a_stop_string_finish_is_held_with_the_kept_tokens_only() -> None:
    d = KVDriver(block_size=2)
    req = d.add(make_request("p", 7, max_tokens=6), hold=True)
    while req.num_output_tokens < 4:
        d.step()
    d.scheduler.finish_request("p", FinishReason.STOP, num_output_tokens=2)  # a stop string
    assert req.status is RequestStatus.FINISHED_STOPPED and req.num_tokens == 9
    assert d.connector.finished[0][2] is RequestStatus.FINISHED_STOPPED
    assert d.scheduler.stats().num_held == 1 and req.kv_transfer_out is not None
    d.step()  # exposes them
    d.worker.pulled("p")
    d.run()  # the prefix cache check catches KV filed under the dropped tokens


def test_connector_pending_work_keeps_the_engine_polling() -> None:
    d = KVDriver()
    assert not d.scheduler.has_pending_kv_work
    d.connector.busy = True
    assert d.scheduler.has_pending_kv_work
    out = d.step()  # a step with nothing to schedule still carries the connector's report
    assert out.is_empty and len(d.connector.reports) == 1


# ----- preemption ---------------------------------------------------------------------------------

def test_preemption_never_picks_a_loading_request() -> None:
    d = KVDriver(num_blocks=9, budget=64)  # 8 usable blocks
    a = d.add(make_request("a", 4, max_tokens=20))
    d.step()
    bb = d.add(make_request("bb", 18, max_tokens=2), available=17)  # last in FCFS order
    d.step()
    assert bb.status is WAITING_FOR_KV and len(d.scheduler.block_manager.block_table("bb")) == 5
    while not d.scheduler.num_preemptions:
        d.step()
    assert a.status is RequestStatus.PREEMPTED and bb.status is WAITING_FOR_KV
    d.worker.finish_load("bb")
    d.run()
    assert bb.output_token_ids == expected_tokens(bb) and a.output_token_ids == expected_tokens(a)
    assert a.num_output_tokens == 20


# ----- without a connector, or one that matches nothing ------------------------------------------

def test_without_a_connector_nothing_changes() -> None:
    d = KVDriver(connector=False)
    d.add(make_request("a", 10, max_tokens=3))
    out = d.step()
    assert out.kv_connector_metadata is None and d.scheduler.remote_kv is None
    stats = d.scheduler.stats()
    assert (stats.num_loading, stats.num_held, stats.external_cache_hits) == (0, 0, 0)
    assert not d.scheduler.has_pending_kv_work
    d.run()


def run_workload(connector: bool) -> tuple[list[list[int]], list[list[str]], int]:
    d = KVDriver(num_blocks=9, budget=12, max_seqs=4, connector=connector)
    arrivals = {i: [make_request(f"r{i}-{k}", 3 + 5 * (i + k) % 13, max_tokens=6 + i % 5)
                    for k in range(2)] for i in range(6)}
    seqs: list[Request] = []
    preempted: list[list[str]] = []
    for step in range(500):
        for request in arrivals.pop(step, []):
            seqs.append(d.add(request))
        if not arrivals and not d.scheduler.has_unfinished_requests():
            break
        preempted.append(d.step().preempted_ids)
    return [s.output_token_ids for s in seqs], preempted, d.scheduler.num_preemptions


def test_a_connector_that_matches_nothing_schedules_exactly_as_none() -> None:
    with_none = run_workload(connector=False)
    assert with_none[2] > 0  # the workload preempts
    assert run_workload(connector=True) == with_none


def test_integrity_check_catches_a_loading_request_out_of_place() -> None:
    d = KVDriver()
    req = d.add(make_request("r", 10), available=9)
    d.step()
    req.status = RequestStatus.RUNNING  # as if the load were done, unrecorded
    with pytest.raises(CacheIntegrityError, match="wait for KV"):
        d.scheduler.check_integrity()


def test_request_fields_for_kv_transfer() -> None:
    assert not WAITING_FOR_KV.is_finished
    params = {"do_remote_decode": True}
    request = make_request("r", 5, n=2)
    request.kv_transfer_params = params
    request.kv_transfer_out = {"stale": 1}
    seqs = request.sequences()
    assert [s.kv_transfer_params for s in seqs] == [params, params]
    assert [s.kv_transfer_out for s in seqs] == [None, None]
    seqs[0].kv_transfer_out = {"remote_request_id": "r#0"}
    assert RequestOutput.from_sequences(seqs[::-1]).kv_transfer_params == {
        "remote_request_id": "r#0"}


# ----- random workloads ---------------------------------------------------------------------

kv_specs = st.lists(st.tuples(
    st.integers(0, 10),  # arrival step
    st.integers(1, 24),  # prompt length
    st.integers(1, 6),  # max_tokens
    st.integers(1, 2),  # n
    st.floats(0.0, 1.0),  # share of the prompt offered by the connector
    st.sampled_from(["async", "async", "sync", "hold"]),
    st.one_of(st.none(), st.integers(0, 30)),  # abort at step
), min_size=1, max_size=7)


@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(specs=kv_specs, num_blocks=st.integers(8, 24), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(1, 24), max_seqs=st.integers(1, 5), prefix_cache=st.booleans(),
       seed=st.integers(0, 1000))
def test_random_workloads_with_loads_keep_invariants(specs, num_blocks: int, block_size: int,
                                                     budget: int, max_seqs: int,
                                                     prefix_cache: bool, seed: int) -> None:
    """Loads that finish, fail part-way or are aborted at random steps, held finishes pulled
    later, preemption, n > 1: integrity around every step, the right tokens for every
    sequence that was not aborted, and every block back once the workers report."""
    rng = random.Random(seed)
    d = KVDriver(num_blocks, block_size, budget, max_seqs, prefix_cache=prefix_cache)
    arrivals: dict[int, list[tuple[Request, int, str]]] = {}
    aborts: dict[int, list[str]] = {}
    for i, (step, prompt_len, max_tokens, n, share, kind, abort_at) in enumerate(specs):
        request = make_request(f"r{i}", prompt_len, max_tokens, float(step), n=n)
        arrivals.setdefault(step, []).append((request, int(share * prompt_len), kind))
        if abort_at is not None:
            aborts.setdefault(abort_at, []).append(request.request_id)
    seqs, aborted = drive_random_kv(d, rng, arrivals, aborts)
    for seq in seqs:
        if seq.group_id not in aborted:
            room = d.scheduler.max_model_len - seq.num_prompt_tokens
            assert seq.num_output_tokens == min(seq.sampling_params.max_tokens, room), seq
            assert seq.output_token_ids == expected_tokens(seq)
    assert_all_blocks_free(d.scheduler)
    assert d.scheduler.stats().external_cache_hits >= 0


def drive_random_kv(d: KVDriver, rng: random.Random, arrivals: dict, aborts: dict) -> tuple[
        list[Request], set[str]]:
    scheduler, worker = d.scheduler, d.worker
    seqs: list[Request] = []
    aborted: set[str] = set()
    for step in range(3000):
        for request, available, kind in arrivals.pop(step, []):
            try:
                d.add(request, available, sync=kind == "sync", hold=kind == "hold")
                seqs += scheduler._groups[request.request_id]
            except ValueError:  # could never fit
                pass
        for request_id in aborts.pop(step, []):
            if scheduler.abort_request(request_id):
                aborted.add(request_id)
        for request_id in list(worker.loads):  # loads finish, or fail part-way, at random
            if rng.random() < 0.3:
                good = None if rng.random() < 0.7 else rng.randint(0, 3)
                worker.finish_load(request_id, good)
        for request_id in list(worker.exposed):
            if rng.random() < 0.4:
                worker.pulled(request_id)
        for request_id in list(d.connector.sync):  # some sync loads fail
            if rng.random() < 0.2:
                worker.fail_sync[request_id] = rng.randint(0, 2)
        if not arrivals and not scheduler.has_unfinished_requests() \
                and not scheduler.has_pending_kv_work:
            return seqs, aborted
        d.step()
    raise AssertionError(f"deadlock: {scheduler.stats()}")
