"""LoRA adapters in the scheduler and the prefix cache, with no model: admission under
``max_loras`` (no deadlock, no starvation, preemption, n > 1, policies, prefill holds), the
adapter stats, and a prefix cache keyed by adapter (no hit across adapters or with the base
model, hits within one adapter, KV events naming the adapter)."""

from __future__ import annotations

import random

import pytest

from tests.test_scheduler import Driver
from tokenmill.cache import KVBlockManager
from tokenmill.cache.events import chain_hashes
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.kv_transfer.offload import OffloadScheduler
from tokenmill.params import SamplingParams
from tokenmill.request import LoRARequest, Request, RequestStatus
from tokenmill.sched import Scheduler, SchedulerOutput
from tokenmill.sched.output import ModelOutput
from tokenmill.sched.lora_slots import AdapterSlots
from tokenmill.sched.scheduler import SHARED_PREFIX_BLOCKS
from tokenmill.util import cdiv

BS = 4
ADAPTERS = {name: LoRARequest(name, i + 1, f"/adapters/{name}", fingerprint=f"fp-{name}")
            for i, name in enumerate(("a", "b", "c", "d", "x"))}


def make_scheduler(max_loras: int | None = 2, num_blocks: int = 128, budget: int = 64,
                   max_seqs: int = 8, policy: str = "fcfs",
                   prefix_cache: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     policy=policy),
                     CacheConfig(block_size=BS, watermark=0.0,
                                 enable_prefix_caching=prefix_cache),
                     num_blocks=num_blocks, eos_token_ids=[2], max_loras=max_loras)


def lora_request(request_id: str, adapter: str | None, prompt_len: int = 10,
                 max_tokens: int = 4, prompt: list[int] | None = None, **kw: object) -> Request:
    prompt = prompt or [10 + (i + len(request_id)) % 50 for i in range(prompt_len)]
    n = kw.pop("n", 1)
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, n=n),
                   lora=None if adapter is None else ADAPTERS[adapter], **kw)


class LoRADriver(Driver):
    """``Driver`` plus two LoRA checks on every step: no more than ``max_loras`` adapters in a
    step's chunks, and every chunk reads only KV written under its own adapter (each block
    remembers the namespace of the sequence that last wrote it)."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.written: dict[int, str | None] = {}
        self.adapters_per_step: list[set[str]] = []
        execute = self.runner.execute

        def checked(out: SchedulerOutput, *args: object) -> ModelOutput:
            self.check_adapters(out)
            return execute(out, *args)

        self.runner.execute = checked

    def check_adapters(self, out: SchedulerOutput) -> None:
        names = {c.request.lora.lora_name for c in out.scheduled if c.request.lora is not None}
        limit = self.scheduler.max_loras
        assert limit is None or len(names) <= limit, names
        self.adapters_per_step.append(names)
        for c in out.scheduled:
            namespace = c.request.prefix_namespace
            for block in c.block_table[:cdiv(c.start_pos, BS)]:  # KV it reads
                assert self.written[block] == namespace, (c.request_id, block)
            first, end = c.start_pos // BS, cdiv(c.start_pos + c.num_tokens, BS)
            for block in c.block_table[first:end]:  # KV it writes
                self.written[block] = namespace

    def first_step_of(self, request_id: str) -> int:
        return next(i for i, out in enumerate(self.outputs)
                    if any(c.request_id == request_id for c in out.scheduled))


def finished(sequences: list[Request]) -> bool:
    return all(s.status is RequestStatus.FINISHED_LENGTH for s in sequences)


# ----- admission under max_loras -----------------------------------------------------------

def test_four_adapters_times_64_requests_under_max_loras_2_all_finish() -> None:
    scheduler = make_scheduler(max_loras=2, num_blocks=96, max_seqs=16)
    rng = random.Random(0)
    arrivals: dict[int, list[Request]] = {}
    for i in range(4 * 64):
        adapter = "abcd"[i % 4]
        step = rng.randrange(120)
        arrivals.setdefault(step, []).append(
            lora_request(f"{adapter}{i}", adapter, rng.randrange(3, 30),
                         max_tokens=rng.randrange(1, 12)))
    driver = LoRADriver(scheduler)
    done = driver.run(arrivals, max_steps=3000)
    assert len(done) == 256 and finished(done)
    assert max(map(len, driver.adapters_per_step)) == 2  # both slots were used
    assert {n for names in driver.adapters_per_step for n in names} == set("abcd")


def test_a_steady_stream_of_one_adapter_cannot_starve_another() -> None:
    scheduler = make_scheduler(max_loras=1, max_seqs=4)
    stream = {step: [lora_request(f"a{step}", "a", 12, max_tokens=6, arrival_time=step)]
              for step in range(300)}
    stream[5].append(lora_request("x", "x", 12, max_tokens=6, arrival_time=5.5))
    driver = LoRADriver(scheduler)
    done = driver.run(stream, max_steps=5000)
    assert finished(done)
    x_starts = driver.first_step_of("x")
    # x waits only for the a's that arrived before it, never for later ones
    later = [driver.first_step_of(f"a{step}") for step in range(6, 300)]
    assert x_starts < min(later) and x_starts < 40, x_starts


def test_with_nothing_running_the_head_always_gets_a_slot() -> None:
    for max_loras in (1, 2):
        scheduler = make_scheduler(max_loras=max_loras)
        for adapter in "abcdx":
            scheduler.add_request(lora_request(adapter, adapter))
        first = LoRADriver(scheduler).step()
        assert [c.request_id for c in first.scheduled] == list("abcdx"[:max_loras])
    with pytest.raises(ValueError, match="max_loras"):
        make_scheduler(max_loras=0)


def test_base_requests_take_no_slot_and_pass_a_blocked_adapter() -> None:
    scheduler = make_scheduler(max_loras=1)
    for request in (lora_request("a0", "a"), lora_request("x0", "x"), lora_request("a1", "a"),
                    lora_request("base", None)):
        scheduler.add_request(request)
    first = LoRADriver(scheduler).step()
    # x0 finds no slot; a1 arrived after it and must not keep a's slot busy; base runs
    assert [c.request_id for c in first.scheduled] == ["a0", "base"]
    assert scheduler.stats().running_loras == ("a",)
    assert scheduler.stats().waiting_loras == ("a", "x")


def test_unlimited_without_max_loras() -> None:
    scheduler = make_scheduler(max_loras=None)
    for adapter in "abcdx":
        scheduler.add_request(lora_request(adapter, adapter))
    assert len(LoRADriver(scheduler).step().scheduled) == 5


def test_a_request_that_arrived_before_the_blocked_one_is_still_admitted() -> None:
    """Under ``priority`` the admission order is not the arrival order: after x finds no
    slot, a0 (of the running adapter, arrived before x) is admitted, a2 (arrived after) not."""
    scheduler = make_scheduler(max_loras=1, policy="priority")
    requests = [lora_request("a0", "a", arrival_time=0.0, priority=5),
                lora_request("x", "x", arrival_time=1.0, priority=0),
                lora_request("a2", "a", arrival_time=2.0, priority=5),
                lora_request("base", None, arrival_time=3.0, priority=9)]
    running = lora_request("a-run", "a", arrival_time=-1.0, priority=0)
    scheduler.add_request(running)
    driver = LoRADriver(scheduler)
    driver.step()
    for request in requests:
        scheduler.add_request(request)
    assert [c.request_id for c in driver.step().scheduled] == ["a-run", "a0", "base"]
    driver.run()
    assert driver.first_step_of("x") < driver.first_step_of("a2")


def test_adapter_slots_cutoff_is_the_earliest_blocked_arrival() -> None:
    slots = AdapterSlots(2, [ADAPTERS["a"]])
    r = {name: lora_request(name, adapter, arrival_time=t) for name, adapter, t in
         [("b", "b", 1.0), ("c", "c", 3.0), ("d", "d", 2.0), ("a1", "a", 1.5),
          ("b2", "b", 2.5), ("base", None, 9.0)]}
    assert slots.allows(r["b"])
    slots.admitted(r["b"])
    assert not slots.allows(r["c"])  # no slot left: cutoff 3.0
    assert not slots.allows(r["d"])  # cutoff 2.0
    assert slots.allows(r["a1"]) and not slots.allows(r["b2"]) and slots.allows(r["base"])


def test_kv_head_of_line_still_stops_admission() -> None:
    """A request of a running adapter that does not fit in KV stops admission: a later base
    request does not overtake it."""
    scheduler = make_scheduler(max_loras=1, num_blocks=12, budget=128)
    scheduler.add_request(lora_request("a0", "a", 20, max_tokens=10))
    driver = LoRADriver(scheduler)
    driver.step()
    scheduler.add_request(lora_request("a1", "a", max_tokens=10, prompt=list(range(300, 330))))
    scheduler.add_request(lora_request("base", None, 4, max_tokens=2))
    assert [c.request_id for c in driver.step().scheduled] == ["a0"]
    driver.run()


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
def test_preemption_with_adapters_finishes_everything(policy: str) -> None:
    scheduler = make_scheduler(max_loras=2, num_blocks=20, budget=32, policy=policy)
    rng = random.Random(1)
    arrivals = {step: [lora_request(f"r{step}-{k}", rng.choice(["a", "b", "c", None]),
                                    rng.randrange(4, 16), max_tokens=rng.randrange(8, 24),
                                    priority=rng.randrange(3))
                       for k in range(2)] for step in range(0, 40, 3)}
    driver = LoRADriver(scheduler)
    done = driver.run(arrivals, max_steps=3000)
    assert finished(done) and scheduler.num_preemptions > 0


def test_n_sequences_share_their_adapter_slot() -> None:
    scheduler = make_scheduler(max_loras=1)
    scheduler.add_request(lora_request("r", "a", 12, max_tokens=5, n=3))
    scheduler.add_request(lora_request("x", "x", 12))
    driver = LoRADriver(scheduler)
    driver.step()
    second = driver.step()
    assert sorted(c.request_id for c in second.scheduled) == ["r#0", "r#1", "r#2"]
    done = driver.run()
    assert finished(done) and driver.first_step_of("x") > 2


def test_a_shared_prefix_is_held_only_for_the_same_adapter() -> None:
    shared = [7 + i % 40 for i in range(SHARED_PREFIX_BLOCKS * BS + 8)]
    scheduler = make_scheduler(max_loras=2, budget=256)
    for rid, adapter in (("a0", "a"), ("b0", "b"), ("a1", "a"), ("base", None)):
        scheduler.add_request(lora_request(rid, adapter, prompt=shared + [300 + len(rid)]))
    driver = LoRADriver(scheduler)
    # a1 waits for a0's prefix; b0 and the base request compute their own
    assert [c.request_id for c in driver.step().scheduled] == ["a0", "b0", "base"]
    a1 = {c.request_id: c for c in driver.step().scheduled}["a1"]
    assert a1.start_pos == len(shared) // BS * BS
    driver.run()


def test_stats_name_running_and_waiting_adapters() -> None:
    scheduler = make_scheduler(max_loras=2)
    assert scheduler.stats().running_loras == () and scheduler.stats().waiting_loras == ()
    for rid, adapter in (("b0", "b"), ("a0", "a"), ("b1", "b"), ("c0", "c"), ("n", None)):
        scheduler.add_request(lora_request(rid, adapter))
    assert scheduler.stats().waiting_loras == ("a", "b", "c")
    driver = LoRADriver(scheduler)
    driver.step()
    stats = scheduler.stats()
    assert stats.running_loras == ("a", "b") and stats.waiting_loras == ("c",)
    driver.run()
    assert scheduler.stats().running_loras == () == scheduler.stats().waiting_loras


# ----- the prefix cache, keyed by adapter ------------------------------------------------------

PROMPT = list(range(100, 121))  # 21 tokens: 5 whole blocks before the last token


def cache_prompt(manager: KVBlockManager, request: Request) -> None:
    """Compute the request's prompt in fresh blocks and give them to the prefix cache."""
    assert manager.acquire_cached_prefix(request) == 0
    assert manager.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.free(request, request.num_tokens)


def with_lora(request_id: str, lora: LoRARequest | None, salt: str | None = None) -> Request:
    return Request(request_id, list(PROMPT), cache_salt=salt, lora=lora)


def test_the_same_prompt_never_hits_across_adapters_or_the_base_model() -> None:
    a, b = ADAPTERS["a"], ADAPTERS["b"]
    for first in (a, b, None):
        manager = KVBlockManager(64, BS)
        cache_prompt(manager, with_lora("first", first))
        for other in (a, b, None):
            hit = manager.cached_prefix_len(with_lora("next", other))
            assert hit == (20 if other == first else 0), (first, other)
    # the salt and the adapter both count
    manager = KVBlockManager(64, BS)
    cache_prompt(manager, with_lora("first", a, "tenant"))
    assert manager.cached_prefix_len(with_lora("same", a, "tenant")) == 20
    assert manager.cached_prefix_len(with_lora("no salt", a)) == 0
    assert manager.cached_prefix_len(with_lora("no lora", None, "tenant")) == 0


def test_same_name_different_weights_never_share() -> None:
    old = LoRARequest("a", 1, "/adapters/a", fingerprint="1111")
    new = LoRARequest("a", 7, "/adapters/a", fingerprint="2222")  # re-loaded, other weights
    again = LoRARequest("a", 9, "/adapters/a", fingerprint="1111")  # the same files again
    manager = KVBlockManager(64, BS)
    cache_prompt(manager, with_lora("old", old))
    assert manager.cached_prefix_len(with_lora("new", new)) == 0
    assert manager.cached_prefix_len(with_lora("again", again)) == 20


def test_scheduler_hits_only_within_an_adapter() -> None:
    scheduler = make_scheduler(max_loras=None)
    driver = LoRADriver(scheduler)
    driver.run({0: [lora_request("a0", "a", prompt=list(PROMPT))]})
    driver.run({0: [lora_request("b0", "b", prompt=list(PROMPT)),
                    lora_request("base", None, prompt=list(PROMPT))]})
    assert scheduler.stats().prefix_cache_hits == 0
    driver.run({0: [lora_request("a1", "a", prompt=list(PROMPT))]})
    assert scheduler.stats().prefix_cache_hits == 20


def test_base_model_hashes_and_events_are_unchanged_and_adapters_are_named() -> None:
    manager = KVBlockManager(64, BS)
    manager.prefix_cache.enable_events()
    base, adapted = with_lora("base", None, "s"), with_lora("lora", ADAPTERS["b"], "s")
    assert base.prefix_namespace == "s"
    cache_prompt(manager, base)
    cache_prompt(manager, adapted)
    stored_base, stored_lora = manager.prefix_cache.take_events()
    assert tuple(stored_base.block_hashes) == chain_hashes(None, PROMPT[:20], BS, "s")
    assert stored_base.lora_id is None and stored_base.lora_name is None
    assert stored_lora.lora_id == 2 and stored_lora.lora_name == "b"
    assert not set(stored_lora.block_hashes) & set(stored_base.block_hashes)


def test_offload_tiers_are_keyed_by_adapter() -> None:
    keys = chain_hashes(None, PROMPT[:20], BS, with_lora("k", ADAPTERS["a"]).prefix_namespace)
    conn = OffloadScheduler([("disk", 100)], BS, known={"disk": [(k, None) for k in keys]})
    assert conn.get_num_new_matched_tokens(with_lora("a", ADAPTERS["a"]), 0) == (20, True)
    assert conn.get_num_new_matched_tokens(with_lora("b", ADAPTERS["b"]), 0) == (0, True)
    assert conn.get_num_new_matched_tokens(with_lora("base", None), 0) == (0, True)


def test_longest_prefix_first_cannot_starve_an_adapter_either() -> None:
    """Under ``lpm`` a's requests hit the cache and are always ordered first: the free slot
    still goes to x, which arrived first, once a's slot is empty."""
    scheduler = make_scheduler(max_loras=1, max_seqs=4, policy="lpm")
    head = [7 + i % 40 for i in range(16)]
    stream = {step: [lora_request(f"a{step}", "a", max_tokens=6, arrival_time=step,
                                  prompt=head + [300 + step])] for step in range(300)}
    stream[5].append(lora_request("x", "x", 12, max_tokens=6, arrival_time=5.5))
    driver = LoRADriver(scheduler)
    assert finished(driver.run(stream, max_steps=5000))
    later = [driver.first_step_of(f"a{step}") for step in range(6, 300)]
    assert driver.first_step_of("x") < min(later)
