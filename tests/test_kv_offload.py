"""The tiered prefix cache's scheduler side (``kv_transfer/offload.py``): which ops the radix
cache's evictions and a prompt's hits turn into, with no torch and no worker."""

from __future__ import annotations

import pytest

from tokenmill.cache.events import chain_hashes
from tokenmill.config import EngineConfig
from tokenmill.kv_transfer.base import (DropBlocks, KVConnectorOutput, LoadBlocks, MoveBlocks,
                                        SaveBlocks)
from tokenmill.kv_transfer.offload import OffloadScheduler
from tokenmill.request import Request

BS = 4


def _blocks(tokens: list[int], salt: str | None = None) -> tuple[tuple[int, ...], list[int]]:
    return chain_hashes(None, tokens, BS, salt), tokens


def _ops(conn: OffloadScheduler) -> list:
    meta = conn.build_connector_meta()
    return list(meta.ops) if meta is not None else []


def test_host_tier_saves_evicted_blocks_and_drops_its_lru_past_capacity():
    conn = OffloadScheduler([("host", 2)], BS)
    keys, tokens = _blocks(list(range(12)))
    conn.blocks_evicted(keys, tokens, [7, 8, 9])
    save, drop = _ops(conn)
    assert save == SaveBlocks(keys, (7, 8, 9), (tuple(range(4)), tuple(range(4, 8)),
                                                 tuple(range(8, 12))), "host")
    assert drop == DropBlocks((keys[0],), "host")  # the least recently used
    assert [t.keys.keys() for t in conn.tiers][0] == {keys[1], keys[2]}
    conn.blocks_evicted(keys[1:2], tokens[4:8], [3])  # held already: used again, not saved
    assert _ops(conn) == []
    assert list(conn.tiers[0].keys) == [keys[2], keys[1]]


def test_a_full_host_tier_spills_to_disk():
    conn = OffloadScheduler([("host", 1), ("disk", 10)], BS)
    keys, tokens = _blocks(list(range(8)))
    conn.blocks_evicted(keys, tokens, [1, 2])
    save, move = _ops(conn)
    assert save.tier == "host" and save.keys == keys
    assert move == MoveBlocks((keys[0],), (tuple(range(4)),), "host", "disk")
    assert keys[0] in conn.tiers[1] and keys[0] not in conn.tiers[0]


def test_disk_write_through_saves_when_cached_and_not_again_when_evicted():
    conn = OffloadScheduler([("disk", 10)], BS, write_through=True)
    keys, tokens = _blocks(list(range(8)))
    conn.blocks_cached(keys, tokens, [5, 6])
    assert _ops(conn) == [SaveBlocks(keys, (5, 6), (tuple(range(4)), tuple(range(4, 8))),
                                     "disk")]
    conn.blocks_cached(keys, tokens, [9, 10])  # the same blocks computed again elsewhere
    conn.blocks_evicted(keys, tokens, [5, 6])
    assert _ops(conn) == []


def test_disk_past_capacity_deletes_its_least_recently_used():
    conn = OffloadScheduler([("disk", 2)], BS, write_through=True)
    keys, tokens = _blocks(list(range(12)))
    conn.blocks_cached(keys, tokens, [1, 2, 3])
    assert _ops(conn)[-1] == DropBlocks((keys[0],), "disk")


def test_hits_start_after_the_local_prefix_and_stop_at_the_first_gap():
    prompt = list(range(100, 121))  # 21 tokens: 5 whole blocks before the last token
    keys, _ = _blocks(prompt[:20], "tenant")
    known = {"disk": [(keys[i], None) for i in (0, 1, 2, 4)]}
    conn = OffloadScheduler([("disk", 100)], BS, write_through=True, known=known)
    request = Request("r", prompt, cache_salt="tenant")
    assert conn.get_num_new_matched_tokens(request, 0) == (3 * BS, True)
    assert conn.get_num_new_matched_tokens(request, 2 * BS) == (BS, True)
    assert conn.get_num_new_matched_tokens(Request("s", prompt), 0) == (0, True)  # no salt


def test_the_last_token_is_never_a_hit():
    prompt = list(range(8))  # two whole blocks, but the second ends with the last token
    keys, tokens = _blocks(prompt)
    conn = OffloadScheduler([("host", 10)], BS)
    conn.blocks_evicted(keys, tokens, [1, 2])
    assert conn.get_num_new_matched_tokens(Request("r", prompt), 0) == (BS, True)


def test_a_load_pins_its_blocks_until_reported():
    prompt = list(range(13))
    keys, tokens = _blocks(prompt[:12])
    conn = OffloadScheduler([("host", 3)], BS)
    conn.blocks_evicted(keys, tokens, [1, 2, 3])
    _ops(conn)
    request = Request("r", prompt)
    assert conn.get_num_new_matched_tokens(request, 0) == (12, True)
    conn.update_state_after_alloc(request, [4, 5, 6, 7], 0, 12)
    (load,) = _ops(conn)
    assert load == LoadBlocks("r", keys, (4, 5, 6), (tuple(range(4)), tuple(range(4, 8)),
                                                     tuple(range(8, 12))), ("host",) * 3)
    assert conn.has_pending_work
    others, other_tokens = _blocks(list(range(50, 58)))
    conn.blocks_evicted(others, other_tokens, [8, 9])  # over capacity, all others pinned
    assert DropBlocks(others, "host") in _ops(conn)
    conn.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    assert not conn.has_pending_work


def test_a_failed_load_forgets_the_block_that_failed():
    prompt = list(range(13))
    keys, tokens = _blocks(prompt[:12])
    conn = OffloadScheduler([("host", 10)], BS)
    conn.blocks_evicted(keys, tokens, [1, 2, 3])
    request = Request("r", prompt)
    conn.update_state_after_alloc(request, [4, 5, 6, 7], 0, 12)
    _ops(conn)
    conn.update_connector_output(KVConnectorOutput(failed_recving={"r": 1}))
    assert keys[0] in conn.tiers[0] and keys[1] not in conn.tiers[0]
    assert conn.get_num_new_matched_tokens(Request("again", prompt), 0) == (BS, True)


@pytest.mark.parametrize("options, message", [
    (dict(kv_offload="disk", kv_offload_size=1 << 30), "--kv-offload-dir"),
    (dict(kv_offload="host"), "--kv-offload-size"),
    (dict(kv_offload_dir="/tmp/x"), "only with --kv-offload disk"),
    (dict(kv_offload="host", kv_offload_size=1 << 30, kv_offload_host_size=1 << 20),
     "--kv-offload-host-size"),
    (dict(kv_role="decoder"), "kv_role"),
    (dict(kv_offload="host", kv_offload_size=1 << 30, enable_prefix_caching=False),
     "--no-prefix-cache"),
])
def test_settings_that_cannot_work_are_refused_before_anything_loads(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options("smollm2-135m-instruct", **options)
