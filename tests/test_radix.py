"""The radix prefix cache, without torch: insert / match / split / lock / evict, cache_salt
isolation, and the block manager's integrity check after every scenario."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.cache import BlockPool, CacheIntegrityError, KVBlockManager
from tokenmill.cache.radix import NullPrefixCache, RadixPrefixCache
from tokenmill.params import SamplingParams
from tokenmill.request import Request

BS = 4


def toks(*blocks: int) -> list[int]:
    """One block of BS token ids per argument, e.g. toks(1, 2) -> [1, 1, 1, 1, 2, 2, 2, 2]."""
    return [b for b in blocks for _ in range(BS)]


def cache_with(num_blocks: int = 32) -> tuple[BlockPool, RadixPrefixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixPrefixCache(pool, BS)


def put(pool: BlockPool, cache: RadixPrefixCache, tokens: list[int], salt=None) -> list[int]:
    """Allocate blocks for ``tokens`` as a request would, cache them, drop the request's refs."""
    blocks = [pool.allocate() for _ in range(len(tokens) // BS)]
    cache.insert(tokens, blocks, salt)
    for b in blocks:
        pool.free(b)
    return blocks


def check(pool: BlockPool, cache: RadixPrefixCache, *tables: list[int]) -> None:
    """Pool invariants, and every reference is the tree's or a listed table's."""
    pool.check_integrity()
    held = cache.references()
    for t in tables:
        held.update(t)
    for b in range(1, pool.num_blocks):
        assert pool.ref_count(b) == held[b] >= 0, b


def paths(cache: RadixPrefixCache) -> set[tuple[int, ...]]:
    """The path blocks of every tree node."""
    return {blocks for _, _, blocks in cache.entries()}


def eviction_order(cache: RadixPrefixCache) -> list[tuple[int, ...]]:
    """Evict one block at a time until nothing is left; the path tokens of each dropped node."""
    order = []
    while cache.num_evictable_blocks:
        before = {tokens for _, tokens, _ in cache.entries()}
        cache.evict(1)
        (gone,) = before - {tokens for _, tokens, _ in cache.entries()}
        order.append(gone)
    return order


def test_insert_then_match_longest_prefix_at_block_granularity() -> None:
    pool, cache = cache_with()
    blocks = put(pool, cache, toks(1, 2, 3))
    assert cache.num_cached_blocks == 3 and pool.num_free_blocks == 31 - 3
    h = cache.match(toks(1, 2, 3, 4))
    assert h.num_tokens == 12 and list(h.blocks) == blocks
    h = cache.match(toks(1, 2) + [3, 3])  # the third block is not whole: not matched
    assert h.num_tokens == 8 and list(h.blocks) == blocks[:2]
    assert cache.match(toks(9, 2)).num_tokens == 0
    assert cache.match(toks(1, 2, 3)[:5]).num_tokens == 4
    check(pool, cache)


def test_partial_match_leaves_the_tree_alone_and_lock_splits() -> None:
    pool, cache = cache_with()
    a = put(pool, cache, toks(1, 2, 3, 4))
    b = put(pool, cache, toks(1, 2, 7))  # shares two blocks: split after them
    assert cache.insert(toks(1, 2, 7), [99, 98, 97]) == 0  # already cached: adopts nothing
    assert list(cache.match(toks(1, 2, 3, 4)).blocks) == a
    assert list(cache.match(toks(1, 2, 7)).blocks) == a[:2] + b[2:]
    assert cache.num_cached_blocks == 5  # b's copies of blocks 1, 2 were not adopted
    check(pool, cache)
    # A match that ends inside a node changes nothing; locking it splits the node there.
    before = cache.entries()
    h = cache.match(toks(1))
    assert list(h.blocks) == a[:1] and cache.entries() == before
    cache.lock(h)
    assert paths(cache) == {tuple(a[:1]), tuple(a[:2]), tuple(a), tuple(a[:2] + b[2:])}
    assert cache.num_evictable_blocks == 4
    check(pool, cache)
    with pytest.raises(CacheIntegrityError):
        cache.unlock(cache.match(toks(1, 2, 3)))  # never locked: ends inside a node
    cache.unlock(h)
    assert cache.num_evictable_blocks == 5
    check(pool, cache)


def test_locked_blocks_are_never_evicted() -> None:
    pool, cache = cache_with(num_blocks=8)
    put(pool, cache, toks(1, 2, 3))
    put(pool, cache, toks(5, 6))
    h = cache.match(toks(1, 2, 3))
    cache.lock(h)
    assert cache.num_evictable_blocks == 2
    assert cache.evict(10) == 2  # only the unlocked branch goes
    assert list(cache.match(toks(1, 2, 3)).blocks) == list(h.blocks)
    assert cache.match(toks(5, 6)).num_tokens == 0
    check(pool, cache)
    cache.unlock(h)
    assert cache.num_evictable_blocks == 3
    assert cache.flush() == 3 and cache.num_cached_blocks == 0
    assert pool.num_free_blocks == 7
    check(pool, cache)


def test_locking_a_split_child_protects_the_whole_path() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2, 3))
    h = cache.match(toks(1, 2, 3))
    cache.lock(h)
    put(pool, cache, toks(1, 9))  # splits the locked node after one block
    assert cache.evict(10) == 1  # only block "9" is free to go
    assert cache.match(toks(1, 2, 3)).num_tokens == 12
    check(pool, cache)
    cache.unlock(h)
    with pytest.raises(CacheIntegrityError):
        cache.unlock(h)  # lock counts never go negative
    check(pool, cache)


def test_eviction_is_lru_over_leaves() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2))
    put(pool, cache, toks(1, 3))
    put(pool, cache, toks(1, 4))
    h = cache.match(toks(1, 2))  # using "1 2" makes it the most recent
    cache.lock(h)
    cache.unlock(h)
    assert cache.evict(1) == 1
    assert cache.match(toks(1, 3)).num_tokens == 4  # the oldest leaf went first
    assert cache.match(toks(1, 4)).num_tokens == 8
    assert cache.evict(1) == 1
    assert cache.match(toks(1, 4)).num_tokens == 4
    assert cache.match(toks(1, 2)).num_tokens == 8
    # The inner node "1" is only evictable once its children are gone.
    assert cache.evict(2) == 2 and cache.num_cached_blocks == 0
    check(pool, cache)


def test_evicting_a_block_a_request_still_holds_frees_nothing() -> None:
    pool, cache = cache_with(num_blocks=4)
    blocks = [pool.allocate() for _ in range(2)]
    cache.insert(toks(1, 2), blocks)  # the request keeps its references (like n > 1 siblings)
    assert cache.evict(2) == 0 and cache.num_cached_blocks == 0
    check(pool, cache, blocks)


def test_cache_salt_isolates_equal_prompts() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2), salt="tenant-a")
    assert cache.match(toks(1, 2), "tenant-b").num_tokens == 0
    assert cache.match(toks(1, 2)).num_tokens == 0
    assert cache.match(toks(1, 2), "tenant-a").num_tokens == 8
    put(pool, cache, toks(1, 2), salt="tenant-b")
    a, b = cache.match(toks(1, 2), "tenant-a"), cache.match(toks(1, 2), "tenant-b")
    assert not set(a.blocks) & set(b.blocks)
    check(pool, cache)


def test_null_cache_caches_nothing() -> None:
    pool = BlockPool(8)
    cache = NullPrefixCache()
    b = pool.allocate()
    assert cache.insert(toks(1), [b]) == 0 and cache.match(toks(1)).num_tokens == 0
    assert cache.evict(5) == 0 and cache.flush() == 0 and not cache.references()
    pool.free(b)
    pool.check_integrity()


def test_match_has_no_side_effects() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2, 3, 4))
    put(pool, cache, toks(1, 2, 7))
    put(pool, cache, toks(1, 2, 3), salt="s")
    put(pool, cache, toks(5))
    before = (cache.entries(), cache.references(), cache.num_evictable_blocks)
    prompts = [toks(1), toks(1, 2, 3), toks(1, 2, 3, 4, 5), toks(1, 9), toks(1, 2) + [3],
               toks(1, 2, 7, 7), toks(5, 5), toks(6), []]
    for prompt in prompts:
        for salt in (None, "s", "other"):
            cache.match(prompt, salt)
    assert (cache.entries(), cache.references(), cache.num_evictable_blocks) == before
    # Nor does a match count as a use: the oldest leaf still goes first.
    assert eviction_order(cache)[0] == tuple(toks(1, 2, 3, 4))
    check(pool, cache)


@pytest.mark.parametrize("split_at", [1, 2, 3])
def test_lock_after_an_insert_split_locks_exactly_the_matched_blocks(split_at: int) -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2, 3, 4))
    h = cache.match(toks(1, 2, 3))  # ends inside the one node
    put(pool, cache, toks(*range(1, split_at + 1), 9))  # splits it before/at the match's end
    cache.lock(h)
    for b in h.blocks:  # the request's own references, as KVBlockManager takes them
        pool.incref(b)
    assert cache.num_evictable_blocks == cache.num_cached_blocks - 3
    assert cache.evict(100) == 2  # block "4" and block "9": nothing on the matched path
    assert paths(cache) >= {h.blocks} and cache.num_cached_blocks == 3
    check(pool, cache, list(h.blocks))
    cache.unlock(h)
    for b in h.blocks:
        pool.free(b)
    assert cache.num_evictable_blocks == 3 and cache.flush() == 3
    check(pool, cache)


def test_a_split_after_the_match_end_leaves_the_lock_where_it_was() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2, 3, 4))
    h = cache.match(toks(1, 2))
    put(pool, cache, toks(1, 2, 3, 9))  # splits after three blocks, one past the match
    cache.lock(h)
    assert cache.num_evictable_blocks == cache.num_cached_blocks - 2
    assert cache.evict(100) == 3 and paths(cache) == {h.blocks}
    cache.unlock(h)
    assert cache.flush() == 2
    check(pool, cache)


def test_a_locked_handle_outlives_the_eviction_of_the_node_it_ended_in() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2, 3))
    h = cache.match(toks(1, 2))
    cache.lock(h)  # splits off block "3", which h.node still points at
    assert cache.evict(1) == 1 and paths(cache) == {h.blocks}
    cache.unlock(h)
    assert cache.num_evictable_blocks == 2 and cache.flush() == 2
    check(pool, cache)
    with pytest.raises(CacheIntegrityError):
        cache.lock(h)  # its blocks are gone: evicted before it was locked again


def test_lru_order_across_lock_unlock_and_insert_touches() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2))
    put(pool, cache, toks(1, 3))
    put(pool, cache, toks(1, 4))
    put(pool, cache, toks(5, 6))
    put(pool, cache, toks(7, 7))
    pinned = cache.match(toks(7, 7))
    cache.lock(pinned)  # stays locked: never evicted
    h = cache.match(toks(1, 3))
    cache.lock(h)  # "1 3" used now
    put(pool, cache, toks(1, 2))  # "1 2" touched by an insert, after "1 3"
    cache.unlock(h)  # unlocking is not a use
    assert eviction_order(cache) == [tuple(toks(1, 4)), tuple(toks(5, 6)), tuple(toks(1, 3)),
                                     tuple(toks(1, 2)), tuple(toks(1))]
    assert paths(cache) == {pinned.blocks}
    cache.unlock(pinned)
    check(pool, cache)


def test_a_parent_is_evicted_after_its_children_at_its_own_last_use() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2))
    put(pool, cache, toks(1, 3))  # "1" last used here
    put(pool, cache, toks(8))
    assert eviction_order(cache) == [tuple(toks(1, 2)), tuple(toks(1, 3)), tuple(toks(1)),
                                     tuple(toks(8))]
    put(pool, cache, toks(1, 2))
    put(pool, cache, toks(1, 3))
    put(pool, cache, toks(8))
    h = cache.match(toks(1))
    cache.lock(h)  # "1" used after "8"
    cache.unlock(h)
    assert eviction_order(cache) == [tuple(toks(1, 2)), tuple(toks(1, 3)), tuple(toks(8)),
                                     tuple(toks(1))]
    check(pool, cache)


def test_stale_heap_entries_are_compacted() -> None:
    pool, cache = cache_with()
    put(pool, cache, toks(1, 2))
    h = cache.match(toks(1, 2))
    for _ in range(1000):  # every unlock pushes the leaf again
        cache.lock(h)
        cache.unlock(h)
    check(pool, cache)  # references() bounds the heap by the node count
    assert cache.flush() == 2
    check(pool, cache)


# ----- property: random operations against a brute-force LRU ---------------------------------

def brute_force_evict(cache: RadixPrefixCache, pool: BlockPool,
                      num_blocks: int) -> tuple[set[tuple[int, ...]], int]:
    """What ``evict(num_blocks)`` must drop (path blocks of each node) and free, found by
    walking the whole tree for the least recently used unlocked leaf each time."""
    path, stack = {}, [(root, ()) for root in cache._roots.values()]
    while stack:
        node, blocks = stack.pop()
        path[node] = blocks
        stack.extend((c, blocks + tuple(c.blocks)) for c in node.children.values())
    alive = {n for n in path if n.parent is not None}
    dropped, freed = set(), 0
    while freed < num_blocks:
        leaves = [n for n in alive if not n.lock_ref and not alive & set(n.children.values())]
        if not leaves:
            break
        victim = min(leaves, key=lambda n: n.last_access)
        assert [n.last_access for n in leaves].count(victim.last_access) == 1  # no ties
        alive.remove(victim)
        dropped.add(path[victim])
        freed += sum(pool.ref_count(b) == 1 for b in victim.blocks)
    return dropped, freed


class Model:
    """A cache, its pool, and requests that hold a locked handle plus a pool reference on each
    of its blocks (as KVBlockManager does). Handles matched but not yet locked are pending:
    they are locked before anything evicts, as the PrefixCache contract asks."""

    def __init__(self) -> None:
        self.pool, self.cache = cache_with(num_blocks=20)
        self.pending: list = []
        self.held: list = []

    def insert(self, values: list[int], salt: str | None) -> None:
        short = len(values) - self.pool.num_free_blocks
        if short > 0:
            self.evict(short)
        if len(values) <= self.pool.num_free_blocks:
            put(self.pool, self.cache, toks(*values), salt)

    def match(self, values: list[int], salt: str | None) -> bool:
        before = (self.cache.entries(), self.cache.references(), self.cache.num_evictable_blocks)
        h = self.cache.match(toks(*values) + [values[0]], salt)  # a partial last block too
        assert (self.cache.entries(), self.cache.references(),
                self.cache.num_evictable_blocks) == before
        if h.blocks:
            self.pending.append(h)
        return bool(h.blocks)

    def use(self, values: list[int], salt: str | None) -> None:
        """Match and lock at once, as a request admitted with nothing in between does."""
        if self.match(values, salt):
            self.lock(-1)

    def lock(self, index: int) -> None:
        if self.pending:
            h = self.pending.pop(index % len(self.pending))
            self.cache.lock(h)
            for b in h.blocks:
                self.pool.incref(b)
            self.held.append(h)

    def unlock(self, index: int) -> None:
        if self.held:
            h = self.held.pop(index % len(self.held))
            self.cache.unlock(h)
            for b in h.blocks:
                self.pool.free(b)

    def evict(self, num_blocks: int) -> None:
        while self.pending:
            self.lock(0)
        before = paths(self.cache)
        expected = brute_force_evict(self.cache, self.pool, num_blocks)
        freed = self.cache.evict(num_blocks)
        assert (before - paths(self.cache), freed) == expected

    def check(self) -> None:
        check(self.pool, self.cache, *[list(h.blocks) for h in self.held])
        locked = set().union(*[h.blocks for h in self.held])  # exactly these are locked
        assert self.cache.num_evictable_blocks == self.cache.num_cached_blocks - len(locked)


values = st.lists(st.integers(1, 3), min_size=1, max_size=5)
salts = st.sampled_from([None, "s"])
operations = st.lists(st.one_of(
    st.tuples(st.just("insert"), values, salts),
    st.tuples(st.just("match"), values, salts),
    st.tuples(st.just("use"), values, salts),
    st.tuples(st.just("lock"), st.integers(0, 7)),
    st.tuples(st.just("unlock"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(1, 6)),
), min_size=10, max_size=60)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_random_operations_keep_invariants_and_evict_lru(ops: list[tuple]) -> None:
    model = Model()
    for name, *args in ops:
        getattr(model, name)(*args)
        model.check()
    while model.pending:
        model.lock(0)
    while model.held:
        model.unlock(0)
    model.evict(model.cache.num_evictable_blocks)
    assert model.cache.num_cached_blocks == 0
    assert model.pool.num_free_blocks == model.pool.num_usable_blocks
    model.check()


# ----- through the block manager ----------------------------------------------------------------

def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def run_prefill(manager: KVBlockManager, r: Request) -> int:
    """Admit ``r`` as the scheduler does: cached prefix, then blocks for the rest."""
    cached = manager.acquire_cached_prefix(r)
    r.num_computed_tokens = cached
    assert manager.allocate_slots(r, r.num_tokens - cached)
    r.num_computed_tokens = r.num_tokens
    return cached


def test_manager_hit_is_capped_below_the_last_token() -> None:
    manager = KVBlockManager(num_blocks=16, block_size=BS, watermark=0.0)
    first = req("a", toks(1, 2, 3))
    assert run_prefill(manager, first) == 0
    manager.free(first, first.num_computed_tokens)
    manager.check_integrity()
    again = req("b", toks(1, 2, 3))  # whole prompt cached: the last block is recomputed
    assert run_prefill(manager, again) == 8
    mid = req("c", toks(1, 2) + [3, 3])  # prefix ends mid-block: whole blocks only
    assert run_prefill(manager, mid) == 8
    manager.check_integrity()
    assert manager.block_table("b")[:2] == manager.block_table("c")[:2]
    for r in (again, mid):
        manager.free(r, r.num_computed_tokens)
    manager.check_integrity()


def test_manager_evicts_cached_blocks_only_under_memory_pressure() -> None:
    manager = KVBlockManager(num_blocks=9, block_size=BS, watermark=0.0)  # 8 usable
    cache = manager.prefix_cache
    for i in range(4):  # 4 cached two-block prefixes fill the pool
        r = req(f"r{i}", toks(10 + i, 20 + i))
        run_prefill(manager, r)
        manager.free(r, 8)
    assert manager.pool.num_free_blocks == 0 and cache.num_cached_blocks == 8
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    user = req("u", toks(10, 20, 7))  # hits r0's prefix, locks it, needs 1 block more
    assert run_prefill(manager, user) == 8
    manager.check_integrity()
    assert cache.num_cached_blocks == 6  # one LRU leaf (r1: 2 blocks) evicted for 1 block
    assert cache.match(toks(11, 20 + 1)).num_tokens == 0
    big = req("big", toks(*range(30, 35)))  # 5 blocks: 1 free + 4 evicted, all but r0 go
    assert manager.acquire_cached_prefix(big) == 0
    assert manager.allocate_slots(big, 20)
    manager.check_integrity()
    assert cache.match(toks(10, 20)).num_tokens == 8  # locked by "u": kept
    assert not manager.allocate_slots(req("x", toks(1)), 4)  # nothing left to evict
    manager.free(big)  # aborted: nothing cached
    manager.free(user, user.num_computed_tokens)
    manager.check_integrity()
    assert cache.num_cached_blocks == 3  # r0's two blocks + the third block of "u"
    assert manager.flush_prefix_cache() == 3
    assert cache.num_cached_blocks == 0 and manager.pool.num_free_blocks == 8
    manager.check_integrity()


def test_manager_salts_never_share() -> None:
    manager = KVBlockManager(num_blocks=16, block_size=BS, watermark=0.0)
    a = req("a", toks(1, 2, 3), salt="x")
    run_prefill(manager, a)
    manager.free(a, a.num_computed_tokens)
    assert run_prefill(manager, req("b", toks(1, 2, 3), salt="y")) == 0
    assert run_prefill(manager, req("c", toks(1, 2, 3), salt="x")) == 8
    manager.check_integrity()


def test_integrity_check_counts_tree_references() -> None:
    manager = KVBlockManager(num_blocks=8, block_size=BS, watermark=0.0)
    a = req("a", toks(1, 2))
    run_prefill(manager, a)
    manager.free(a, 8)
    manager.check_integrity()
    leaked = manager.prefix_cache.match(toks(1)).blocks[0]
    manager.pool.incref(leaked)
    with pytest.raises(CacheIntegrityError):
        manager.check_integrity()


# ----- through the scheduler (fake runner: checks every chunk reads the KV it expects) -------

def sched_req(rid: str, prompt: list[int], max_tokens: int = 3, salt: str | None = None,
              arrival: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, cache_salt=salt)


def test_scheduler_prefills_only_the_uncached_rest() -> None:
    from tests.test_scheduler import Driver, make_scheduler

    scheduler = make_scheduler(num_blocks=32, block_size=BS, budget=64)
    driver = Driver(scheduler)
    system = list(range(100, 118))  # 18 tokens: 4 whole blocks + 2
    driver.run({0: [sched_req("a", system + [1, 2])]})
    b, c, d = (sched_req("b", system + [3, 4, 5]), sched_req("c", system[:10]),
               sched_req("d", system + [1, 2], salt="other"))
    driver.run({0: [b, c, d]})
    first = {ch.request_id: ch for o in reversed(driver.outputs) for ch in o.scheduled}
    assert b.num_cached_tokens == 16 and first["b"].start_pos == 16
    assert c.num_cached_tokens == 8 and first["c"].start_pos == 8  # prefix ending mid-block
    assert d.num_cached_tokens == 0 and first["d"].start_pos == 0  # another salt
    stats = scheduler.stats()
    assert stats.prefix_cache_hits == 24 and stats.prefix_cache_queries == 20 + 21 + 10 + 20


def test_whole_prompt_cached_still_computes_the_last_token() -> None:
    from tests.test_scheduler import Driver, make_scheduler

    scheduler = make_scheduler(num_blocks=32, block_size=BS, budget=64)
    driver = Driver(scheduler)
    prompt = list(range(50, 66))  # exactly 4 blocks
    driver.run({0: [sched_req("a", prompt)]})
    again = sched_req("b", prompt)
    driver.run({0: [again]})
    chunk = next(ch for ch in driver.outputs[-3].scheduled if ch.request_id == "b")
    assert again.num_cached_tokens == 12 and chunk.start_pos == 12 and chunk.num_tokens == 4


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    from tests.test_scheduler import Driver, make_scheduler

    scheduler = make_scheduler(num_blocks=32, block_size=BS, budget=64, max_seqs=1,
                               policy="lpm")
    driver = Driver(scheduler)
    shared = list(range(200, 216))
    driver.run({0: [sched_req("warm", shared + [1])]})
    cold = sched_req("cold", list(range(300, 317)), arrival=1.0)
    hot = sched_req("hot", shared + [2], arrival=2.0)  # arrived later, but cached
    driver.run({0: [cold, hot]})
    order = [ch.request_id for o in driver.outputs for ch in o.scheduled]
    assert order.index("hot") < order.index("cold")  # max_seqs=1: hot ran to the end first
    assert hot.num_cached_tokens == 16 and cold.num_cached_tokens == 0


def test_lpm_falls_back_to_fcfs_on_long_queues() -> None:
    from tokenmill.sched.policy import LPM_MAX_WAITING

    from tests.test_scheduler import Driver, make_scheduler

    scheduler = make_scheduler(num_blocks=64, block_size=BS, budget=8, max_seqs=1,
                               policy="lpm")
    driver = Driver(scheduler)
    shared = list(range(200, 216))
    driver.run({0: [sched_req("warm", shared + [1])]})
    cold = [sched_req(f"c{i}", [400 + i, 1, 2], max_tokens=1, arrival=1.0 + i)
            for i in range(LPM_MAX_WAITING)]
    hot = sched_req("hot", shared + [2], max_tokens=1, arrival=1000.0)
    for r in (*cold, hot):
        scheduler.add_request(r)
    driver.step()  # 129 waiting: FCFS, the first cold request goes first
    assert [ch.request_id for ch in driver.outputs[-1].scheduled] == ["c0"]
