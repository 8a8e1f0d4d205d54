"""BlockPool and KVBlockManager: free queue, ref counts, exact table growth, integrity checks."""

from __future__ import annotations

import pytest

from tokenmill.cache import NULL_BLOCK, BlockPool, CacheIntegrityError, KVBlockManager, slot_of
from tokenmill.request import Request


def make_request(request_id: str = "r", prompt_len: int = 5) -> Request:
    return Request(request_id, list(range(prompt_len)))


# ----- BlockPool ---------------------------------------------------------------------------

def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(4)
    got = [pool.allocate() for _ in range(3)]
    assert NULL_BLOCK not in got and sorted(got) == [1, 2, 3]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(CacheIntegrityError):
        pool.allocate()
    pool.check_integrity()


def test_too_small_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_free_returns_block_only_at_zero_references() -> None:
    pool = BlockPool(3)
    block = pool.allocate()
    pool.incref(block)
    assert pool.ref_count(block) == 2
    pool.free(block)
    assert pool.num_free_blocks == 1 and pool.ref_count(block) == 1
    pool.free(block)
    assert pool.num_free_blocks == 2 and pool.usage == 0.0
    pool.check_integrity()


def test_freed_blocks_are_reused_last() -> None:
    pool = BlockPool(4)
    a = pool.allocate()
    pool.free(a)
    assert [pool.allocate() for _ in range(3)][-1] == a


def test_double_free_and_incref_of_free_block_raise() -> None:
    pool = BlockPool(3)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(CacheIntegrityError):
        pool.free(block)
    with pytest.raises(CacheIntegrityError):
        pool.incref(block)
    with pytest.raises(CacheIntegrityError):
        pool.free(NULL_BLOCK)


def corrupt_leak(pool: BlockPool) -> None:
    pool._free.popleft()


def corrupt_both(pool: BlockPool) -> None:
    pool._ref_counts[pool._free[0]] = 1


def corrupt_twice_free(pool: BlockPool) -> None:
    pool._free.append(pool._free[0])


def corrupt_negative(pool: BlockPool) -> None:
    block = pool.allocate()
    pool._ref_counts[block] = -1


def corrupt_null(pool: BlockPool) -> None:
    pool._free.append(NULL_BLOCK)


@pytest.mark.parametrize("corrupt, message", [
    (corrupt_leak, "neither free nor referenced"), (corrupt_both, "both free and referenced"),
    (corrupt_twice_free, "2 times in the free queue"), (corrupt_negative, "negative"),
    (corrupt_null, "null block"),
])
def test_integrity_check_catches_corruption(corrupt, message: str) -> None:
    pool = BlockPool(5)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(CacheIntegrityError, match=message):
        pool.check_integrity()


# ----- KVBlockManager ----------------------------------------------------------------------

def test_slot_mapping_matches_the_diagram() -> None:
    assert slot_of([1, 3], 5, 4) == 13
    assert [slot_of([7, 2], p, 2) for p in range(4)] == [14, 15, 4, 5]


def test_tables_grow_one_block_at_a_time_never_ahead() -> None:
    manager = KVBlockManager(num_blocks=10, block_size=4, watermark=0.0)
    request = make_request()
    for computed in range(0, 13):
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        assert len(manager.block_table("r")) == (computed + 1 + 3) // 4
    assert manager.num_free_blocks == 9 - 4
    manager.check_integrity()
    manager.free(request)
    assert manager.num_free_blocks == 9 and manager.block_table("r") == []
    manager.check_integrity()


def test_allocate_slots_fails_without_side_effects() -> None:
    manager = KVBlockManager(num_blocks=4, block_size=4, watermark=0.0)
    request = make_request()
    assert not manager.allocate_slots(request, 13)  # needs 4 blocks, 3 usable
    assert manager.block_table("r") == [] and manager.num_free_blocks == 3
    assert manager.allocate_slots(request, 12)
    assert manager.usage == 1.0
    manager.check_integrity()


def test_can_allocate_keeps_watermark_only_when_asked() -> None:
    manager = KVBlockManager(num_blocks=11, block_size=4, watermark=0.2)  # 2 of 10 kept free
    request = make_request()
    assert manager.can_allocate(request, 32) and not manager.can_allocate(request, 33)
    assert manager.can_allocate(request, 40, watermark=False)
    assert not manager.can_allocate(request, 41, watermark=False)


def test_fork_shares_whole_blocks_by_reference() -> None:
    manager = KVBlockManager(num_blocks=10, block_size=4, watermark=0.0)
    parent, child = make_request("p", 10), make_request("c", 10)
    manager.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    manager.fork(parent, child, 8)
    shared = manager.block_table("p")[:2]
    assert manager.block_table("c") == shared
    assert [manager.pool.ref_count(b) for b in shared] == [2, 2]
    manager.check_integrity()
    with pytest.raises(ValueError):
        manager.fork(parent, make_request("x"), 6)  # not whole blocks
    manager.free(parent)
    assert [manager.pool.ref_count(b) for b in shared] == [1, 1]
    manager.free(child)
    assert manager.num_free_blocks == 9
    manager.check_integrity()


def test_manager_integrity_catches_table_refcount_mismatch() -> None:
    manager = KVBlockManager(num_blocks=6, block_size=4, watermark=0.0)
    request = make_request()
    manager.allocate_slots(request, 8)
    manager.pool.incref(manager.block_table("r")[0])  # a reference nobody holds
    with pytest.raises(CacheIntegrityError, match="ref count 2 but 1 tables"):
        manager.check_integrity()


def test_manager_integrity_catches_duplicate_block_in_table() -> None:
    manager = KVBlockManager(num_blocks=6, block_size=4, watermark=0.0)
    request = make_request()
    manager.allocate_slots(request, 4)
    table = manager._tables["r"]
    manager.pool.incref(table[0])
    table.append(table[0])
    with pytest.raises(CacheIntegrityError, match="bad block table"):
        manager.check_integrity()


# ----- lookahead (a drafting model writes ahead of the scheduler) --------------------------

def running_request(manager: KVBlockManager, prompt_len: int, request_id: str = "r") -> Request:
    """A decoding sequence: KV for all but its last token."""
    request = make_request(request_id, prompt_len)
    assert manager.allocate_slots(request, prompt_len - 1)
    request.num_computed_tokens = prompt_len - 1
    return request


def test_lookahead_grows_the_table_and_the_step_finds_it_there() -> None:
    manager = KVBlockManager(num_blocks=10, block_size=4, watermark=0.0)
    request = running_request(manager, 6)  # 5 computed: 2 blocks
    assert manager.reserve_lookahead(request, 6 + 3 - 1)  # the drafts of k = 3 written
    table = list(manager.block_table("r"))
    assert len(table) == 2 and manager.reserve_lookahead(request, 11)  # 8 fit; 11 takes one
    assert len(manager.block_table("r")) == 3 and manager.block_table("r")[:2] == table
    free = manager.num_free_blocks
    assert manager.allocate_slots(request, 1 + 3)  # the scheduled step: last token + 3 drafts
    assert manager.num_free_blocks == free  # nothing more to take
    request.num_computed_tokens += 4
    assert manager.release_lookahead(request) == 0  # all of it used
    manager.trim(request, 7)  # one draft accepted
    assert len(manager.block_table("r")) == 2
    manager.check_integrity()


def test_unused_lookahead_goes_back_and_free_takes_it_too() -> None:
    manager = KVBlockManager(num_blocks=10, block_size=4, watermark=0.0)
    request = running_request(manager, 6)
    assert manager.reserve_lookahead(request, 16)
    assert manager.num_free_blocks == 9 - 4
    assert manager.release_lookahead(request) == 2  # the step verified none of it
    assert len(manager.block_table("r")) == 2
    assert manager.num_free_blocks == 9 - 2 and manager.release_lookahead(request) == 0
    manager.check_integrity()
    assert manager.reserve_lookahead(request, 16)
    manager.free(request, num_cacheable_tokens=request.num_computed_tokens)  # preempted
    assert manager.num_free_blocks == 9 and manager.prefix_cache.num_cached_blocks == 1
    assert manager.release_lookahead(request) == 0  # no table: nothing to do
    manager.check_integrity()


def test_lookahead_leaves_free_what_it_is_asked_to() -> None:
    manager = KVBlockManager(num_blocks=6, block_size=4, watermark=0.0)  # 5 usable
    request = running_request(manager, 6)  # 2 blocks, 3 free
    assert not manager.reserve_lookahead(request, 16, keep_free=2)  # would take 2 of 3
    assert len(manager.block_table("r")) == 2 and manager.num_free_blocks == 3
    assert manager.reserve_lookahead(request, 16, keep_free=1)
    assert not manager.reserve_lookahead(request, 21)  # 6 blocks: more than the pool has
    with pytest.raises(CacheIntegrityError, match="holds no blocks"):
        manager.reserve_lookahead(make_request("waiting"), 4)
    manager.check_integrity()


def test_lookahead_evicts_cached_prefixes_like_any_allocation() -> None:
    manager = KVBlockManager(num_blocks=6, block_size=4, watermark=0.0)
    old = running_request(manager, 9, "old")  # 8 computed: 2 full blocks
    manager.free(old, num_cacheable_tokens=8)  # into the prefix cache
    request = running_request(manager, 6)  # takes 2 of the 3 free
    assert manager.pool.num_free_blocks == 1 and manager.num_free_blocks == 3
    assert manager.reserve_lookahead(request, 20)  # 5 blocks: 3 more, 2 of them evicted
    assert manager.prefix_cache.num_cached_blocks == 0 and manager.num_free_blocks == 0
    manager.check_integrity()
