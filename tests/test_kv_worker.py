"""The connector's worker side (``kv_transfer/worker.py``) on tiny caches: a step's ops carried
out in order — saves before anything overwrites the blocks, a host tier spilling to disk,
loads reported done or failed with the blocks that arrived."""

from __future__ import annotations

import time

import torch

from tokenmill.kv_transfer.base import (DropBlocks, KVConnectorMetadata, LoadBlocks, MoveBlocks,
                                        SaveBlocks)
from tokenmill.kv_transfer.blocks import BlockIO
from tokenmill.kv_transfer.store import DiskStore, HostStore
from tokenmill.kv_transfer.worker import ConnectorWorker

BS = 4
TOKENS = tuple(tuple(range(i * BS, (i + 1) * BS)) for i in range(4))


def _caches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, BS, 2, 8, generator=g), torch.randn(8, BS, 2, 8, generator=g))
            for _ in range(2)]


def _finished(worker: ConnectorWorker, request_id: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = worker.get_finished(wait=0.05)
        if request_id in out.finished_recving or request_id in out.failed_recving:
            return out
    raise AssertionError(f"{request_id} was never reported")


def test_blocks_saved_moved_to_disk_and_loaded_back_bit_for_bit(tmp_path):
    caches = _caches(0)
    original = [(k.clone(), v.clone()) for k, v in caches]
    io = BlockIO(caches)
    disk = DiskStore(str(tmp_path), {"model": "tiny"})
    worker = ConnectorWorker(io, {"host": HostStore(), "disk": disk})
    try:
        keys = (11, 12, 13)
        worker.start_step(KVConnectorMetadata((
            SaveBlocks(keys, (1, 2, 3), TOKENS[:3], "host"),
            MoveBlocks(keys[:2], TOKENS[:2], "host", "disk"))))
        for k, v in caches:  # the forward reuses the blocks: the copies must not change
            k[1:4] = 0
            v[1:4] = 0
        worker.start_step(KVConnectorMetadata((
            LoadBlocks("r", keys, (5, 6, 7), TOKENS[:3], ("disk", "disk", "host")),)))
        out = _finished(worker, "r")
        assert out.finished_recving == {"r"} and not out.failed_recving
        for (k, v), (k0, v0) in zip(caches, original):
            assert torch.equal(k[5:8], k0[1:4]) and torch.equal(v[5:8], v0[1:4])
        assert out.tiers["host"].stored_blocks == 1  # two moved out, and a move is no hit
        assert out.tiers["host"].hits == 1
    finally:
        worker.shutdown()
    assert sorted(key for key, _ in DiskStore.scan(str(tmp_path), {"model": "tiny"})) == [11, 12]


def test_a_block_that_is_gone_fails_the_load_after_the_good_ones(tmp_path):
    io = BlockIO(_caches(1))
    worker = ConnectorWorker(io, {"host": HostStore()})
    try:
        worker.start_step(KVConnectorMetadata((
            SaveBlocks((21, 22, 23), (1, 2, 3), TOKENS[:3], "host"),
            DropBlocks((22,), "host"),
            LoadBlocks("r", (21, 22, 23), (5, 6, 7), TOKENS[:3], ("host",) * 3))))
        out = _finished(worker, "r")
        assert out.failed_recving == {"r": 1}
    finally:
        worker.shutdown()


def test_other_tokens_under_a_key_are_a_miss():
    io = BlockIO(_caches(2))
    worker = ConnectorWorker(io, {"host": HostStore()})
    try:
        worker.start_step(KVConnectorMetadata((
            SaveBlocks((31,), (1,), TOKENS[:1], "host"),
            LoadBlocks("r", (31,), (5,), TOKENS[1:2], ("host",)))))
        assert _finished(worker, "r").failed_recving == {"r": 0}
    finally:
        worker.shutdown()


def test_a_disk_slower_than_the_blocks_skips_writes_rather_than_queue_them(tmp_path,
                                                                            monkeypatch):
    from tokenmill.kv_transfer import worker as worker_module

    io = BlockIO(_caches(3))
    monkeypatch.setattr(worker_module, "MAX_PENDING_WRITE_BYTES", 2 * io.block_nbytes)
    disk = DiskStore(str(tmp_path), {"model": "tiny"})
    release = __import__("threading").Event()
    real_put = disk.put

    def slow_put(key, tokens, data):  # the disk: stuck until released
        release.wait(10)
        return real_put(key, tokens, data)

    monkeypatch.setattr(disk, "put", slow_put)
    worker = ConnectorWorker(io, {"disk": disk})
    try:
        worker.start_step(KVConnectorMetadata((
            SaveBlocks((41, 42, 43, 44), (1, 2, 3, 4), TOKENS, "disk"),)))
        assert worker._pending_bytes <= 2 * io.block_nbytes  # two queued, the rest skipped
        release.set()
        worker.start_step(KVConnectorMetadata((
            LoadBlocks("r", (41, 42, 43), (5, 6, 7), TOKENS[:3], ("disk",) * 3),)))
        assert _finished(worker, "r").failed_recving == {"r": 2}  # the third was never written
    finally:
        release.set()
        worker.shutdown()
    assert worker._pending_bytes == 0
