"""Block bytes (BlockIO, fingerprints) and the offload tiers (HostStore, DiskStore)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tokenmill.kv_transfer.blocks import (
    BlockIO,
    fingerprint_digest,
    fingerprint_mismatch,
    layout_fingerprint,
    model_identity,
)
from tokenmill.kv_transfer.store import DiskStore, HostStore

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 6, 4, 2, 8, 3


def random_caches(dtype: torch.dtype, row: int = HEAD_DIM, num_blocks: int = NUM_BLOCKS,
                  seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Caches whose every byte is random (so a misplaced byte is seen), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, HEADS, row)

    def one() -> torch.Tensor:
        nbytes = torch.empty(shape, dtype=dtype).nbytes
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        return raw.view(dtype).view(shape)

    return [(one(), one()) for _ in range(LAYERS)]


def fingerprint(caches: list, **kw: object) -> dict:
    args = dict(block_size=BLOCK_SIZE, attention_backend="torch", kv_cache_dtype="auto")
    args.update(kw)
    return layout_fingerprint("model-a", caches, **args)  # type: ignore[arg-type]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- BlockIO -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,row", [(torch.float32, HEAD_DIM), (torch.bfloat16, HEAD_DIM),
                                       (torch.int8, HEAD_DIM + 2)])
def test_gather_scatter_round_trip_bit_for_bit(dtype: torch.dtype, row: int) -> None:
    src, dst = random_caches(dtype, row, seed=1), random_caches(dtype, row, seed=2)
    before = [(k.clone(), v.clone()) for k, v in dst]
    io_src, io_dst = BlockIO(src), BlockIO(dst)
    element = torch.empty(0, dtype=dtype).element_size()
    assert io_src.block_nbytes == 2 * LAYERS * BLOCK_SIZE * HEADS * row * element
    rows = io_src.gather([4, 1, 3])
    assert rows.dtype == torch.uint8 and rows.is_contiguous() and rows.device.type == "cpu"
    assert rows.shape == (3, io_src.block_nbytes)
    io_dst.scatter([0, 5, 2], rows)
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before):
        for s, d, b in ((sk, dk, bk), (sv, dv, bv)):
            for i, j in ((4, 0), (1, 5), (3, 2)):
                assert same_bits(s[i], d[j])
            for untouched in (1, 3, 4):
                assert same_bits(d[untouched], b[untouched])


def test_gather_row_layout_is_layer_k_then_v() -> None:
    caches = random_caches(torch.float32)
    io = BlockIO(caches)
    row = io.gather([2])[0]
    expected = torch.cat([t[2].reshape(-1).view(torch.uint8) for pair in caches for t in pair])
    assert torch.equal(row, expected)


def test_gather_is_a_copy() -> None:
    caches = random_caches(torch.float32)
    io = BlockIO(caches)
    rows = io.gather([0, 1])
    saved = rows.clone()
    for k, v in caches:
        k.zero_()
        v.zero_()
    assert torch.equal(rows, saved)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "tensor"])
def test_scatter_accepts_buffers(kind: str) -> None:
    src, dst = random_caches(torch.bfloat16, seed=3), random_caches(torch.bfloat16, seed=4)
    rows = BlockIO(src).gather([1, 2])
    data = {"bytes": lambda: rows.numpy().tobytes(),
            "bytearray": lambda: bytearray(rows.numpy().tobytes()),
            "memoryview": lambda: memoryview(rows.numpy().tobytes()),
            "tensor": lambda: rows.reshape(-1)}[kind]()
    BlockIO(dst).scatter([3, 0], data)
    assert same_bits(src[0][0][1], dst[0][0][3]) and same_bits(src[-1][1][2], dst[-1][1][0])


def test_empty_and_bad_requests() -> None:
    io = BlockIO(random_caches(torch.float32))
    assert io.gather([]).shape == (0, io.block_nbytes)
    io.scatter([], b"")
    with pytest.raises(ValueError, match="out of range"):
        io.gather([NUM_BLOCKS])
    with pytest.raises(ValueError, match="out of range"):
        io.scatter([-1], bytes(io.block_nbytes))
    with pytest.raises(ValueError, match="bytes for 2 blocks"):
        io.scatter([0, 1], bytes(io.block_nbytes))


def test_non_contiguous_cache_is_refused() -> None:
    k = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        BlockIO([(k, k)])


# --- fingerprints --------------------------------------------------------------------------

def test_fingerprint_equal_and_stable() -> None:
    a = fingerprint(random_caches(torch.float32))
    b = fingerprint(random_caches(torch.float32, num_blocks=NUM_BLOCKS + 10))
    assert a == b  # the number of blocks is not part of the layout
    assert json.loads(json.dumps(a)) == a
    assert fingerprint_mismatch(a, b) is None
    digest = fingerprint_digest(a)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert fingerprint_digest(dict(reversed(list(a.items())))) == digest


@pytest.mark.parametrize("change,named", [
    (lambda: fingerprint(random_caches(torch.bfloat16)), "bfloat16"),
    (lambda: fingerprint(random_caches(torch.float32), block_size=8), "block_size"),
    (lambda: fingerprint(random_caches(torch.float32), rank=1, world_size=2), "rank"),
    (lambda: fingerprint(random_caches(torch.int8, HEAD_DIM + 2), kv_cache_dtype="int8"),
     "kv_cache_dtype"),
])
def test_fingerprint_differs(change, named: str) -> None:
    mine = fingerprint(random_caches(torch.float32))
    theirs = change()
    assert mine != theirs
    assert fingerprint_digest(mine) != fingerprint_digest(theirs)
    reason = fingerprint_mismatch(mine, theirs)
    assert reason is not None and named in reason


def test_fingerprint_mismatch_names_both_values() -> None:
    mine = fingerprint(random_caches(torch.float32))
    theirs = dict(mine, model="model-b", layers=mine["layers"][:2])
    reason = fingerprint_mismatch(mine, theirs)
    assert reason is not None
    assert "'model-a' here, 'model-b' there" in reason and "3 layers here, 2 there" in reason


def test_model_identity(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(os.urandom(3 << 20))
    same = tmp_path / "copy" / "m.gguf"
    same.parent.mkdir()
    same.write_bytes(f.read_bytes())
    assert model_identity(str(f)) == model_identity(str(same))
    tail_changed = bytearray(f.read_bytes())
    tail_changed[-1] ^= 1
    same.write_bytes(tail_changed)
    assert model_identity(str(f)) != model_identity(str(same))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(b"x" * 10)
    first = model_identity(str(d))
    (d / "config.json").write_text('{"a": 2}')
    assert model_identity(str(d)) != first
    assert model_identity("no/such/model") == "name:no/such/model"


# --- HostStore -----------------------------------------------------------------------------

def test_host_store_put_get_delete(caplog: pytest.LogCaptureFixture) -> None:
    store = HostStore()
    buf = bytearray(b"abcdef")
    assert store.put(7, [1, 2], memoryview(buf))
    buf[0] = 0  # the store kept its own copy
    assert 7 in store and bytes(store.get(7, [1, 2])) == b"abcdef"
    assert store.get(8, [1, 2]) is None
    assert (store.stats.hits, store.stats.misses, store.stats.stored_blocks) == (1, 1, 1)
    assert store.put(7, [1, 2], b"xy") and store.stats.stored_bytes == 2
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_transfer"):
        assert store.get(7, [1, 3]) is None
    assert 7 not in store and "other tokens" in caplog.text
    store.put(9, [5], b"z")
    store.delete(9)
    store.delete(9)
    assert 9 not in store and store.stats.stored_blocks == 0 and store.stats.stored_bytes == 0


# --- DiskStore -----------------------------------------------------------------------------

FP = {"format": 1, "model": "m", "layers": ["k=float32[4] v=float32[4]"], "block_size": 4}
TOKENS = [11, 12, 13, 14]


def test_disk_store_survives_a_restart(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path), FP)
    payload = os.urandom(1000)
    assert store.put(0xA1B2C3D4E5F60718, TOKENS, memoryview(payload))
    assert store.put(5, [1, 2, 3, 4], b"second")
    store.close()
    again = DiskStore(str(tmp_path), FP)
    assert again.stats.stored_blocks == 2
    assert bytes(again.get(0xA1B2C3D4E5F60718, TOKENS)) == payload
    assert bytes(again.get(5, [1, 2, 3, 4])) == b"second"
    assert again.stats.hits == 2 and again.stats.bytes_loaded == 1006
    directory = tmp_path / fingerprint_digest(FP)
    assert json.loads((directory / "fingerprint.json").read_text()) == FP
    assert (directory / "a1" / "a1b2c3d4e5f60718.kvb").is_file()
    assert not list(directory.rglob("*.tmp"))


def test_scan_is_lru_first_and_get_touches(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path), FP)
    for key, age in ((1, 300), (2, 100), (3, 200)):
        store.put(key, TOKENS, b"p" * key)
        t = 1_000_000 - age
        os.utime(store.path(key), (t, t))
    assert DiskStore.scan(str(tmp_path), FP) == [
        (1, store.path(1).stat().st_size), (3, store.path(3).stat().st_size),
        (2, store.path(2).stat().st_size)]
    assert store.get(1, TOKENS) is not None
    assert [key for key, _ in DiskStore.scan(str(tmp_path), FP)] == [3, 2, 1]
    assert sum(size for _, size in DiskStore.scan(str(tmp_path), FP)) == store.stats.stored_bytes


def corrupt_then_get(tmp_path: Path, damage, tokens=TOKENS) -> tuple[DiskStore, object, Path]:
    store = DiskStore(str(tmp_path), FP)
    store.put(42, TOKENS, os.urandom(500))
    path = store.path(42)
    raw = bytearray(path.read_bytes())
    path.write_bytes(damage(raw))
    return store, store.get(42, tokens), path


def flip_last(raw: bytearray) -> bytes:
    raw[-1] ^= 0x10
    return bytes(raw)


@pytest.mark.parametrize("damage,reason", [
    (flip_last, "checksum"),
    (lambda raw: bytes(raw[:-7]), "payload bytes"),
    (lambda raw: bytes(raw[:10]), "truncated"),
    (lambda raw: b"", "truncated"),
])
def test_a_damaged_file_is_a_logged_miss_and_removed(tmp_path: Path, damage, reason: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_transfer"):
        store, got, path = corrupt_then_get(tmp_path, damage)
    assert got is None and not path.exists() and 42 not in store
    assert reason in caplog.text and "000000000000002a" in caplog.text
    assert store.stats.misses == 1 and store.stats.hits == 0 and store.stats.stored_blocks == 0


def test_wrong_tokens_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_transfer"):
        store, got, path = corrupt_then_get(tmp_path, bytes, tokens=[11, 12, 13, 99])
    assert got is None and not path.exists() and "other tokens" in caplog.text


def test_warned_once_per_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_transfer"):
        store, _, path = corrupt_then_get(tmp_path, flip_last)
        store.put(42, TOKENS, b"again")
        path.write_bytes(flip_last(bytearray(path.read_bytes())))
        assert store.get(42, TOKENS) is None
    assert caplog.text.count("checksum") == 1 and store.stats.misses == 2


def test_a_file_of_another_key_or_layout_is_refused(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path), FP)
    store.put(1, TOKENS, b"one")
    os.replace(store.path(1), store.path(2).parent / store.path(2).name)  # same subdir "00"
    assert store.get(2, TOKENS) is None and 2 not in store


def test_another_fingerprint_is_never_read(tmp_path: Path) -> None:
    DiskStore(str(tmp_path), FP).put(3, TOKENS, b"mine")
    other = DiskStore(str(tmp_path), dict(FP, block_size=8))
    assert other.get(3, TOKENS) is None and 3 not in other
    assert DiskStore.scan(str(tmp_path), dict(FP, block_size=8)) == []
    assert other.stats.stored_blocks == 0
    assert [k for k, _ in DiskStore.scan(str(tmp_path), FP)] == [3]


def test_missing_files_and_concurrent_removal(tmp_path: Path) -> None:
    a, b = DiskStore(str(tmp_path), FP), DiskStore(str(tmp_path), FP)
    assert a.get(9, TOKENS) is None and a.stats.misses == 1
    a.put(9, TOKENS, b"shared")
    assert bytes(b.get(9, TOKENS)) == b"shared"  # another server's file
    b.delete(9)
    assert a.get(9, TOKENS) is None
    a.delete(9)  # already gone: a no-op
    assert DiskStore.scan(str(tmp_path / "nothing"), FP) == []


def test_scan_skips_strangers_and_removes_stale_temp_files(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path), FP)
    store.put(0x0102, TOKENS, b"x")
    sub = store.path(0x0102).parent
    (sub / "README").write_text("hi")
    (sub / "ABCDEF0123456789.kvb").write_bytes(b"")  # upper case: not a name put() gives
    (sub / "ff00000000000000.kvb").write_bytes(b"")  # in the wrong subdirectory
    stale, fresh = sub / ".x.kvb.old.tmp", sub / ".y.kvb.new.tmp"
    stale.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(stale, (1, 1))
    assert [k for k, _ in DiskStore.scan(str(tmp_path), FP)] == [0x0102]
    assert not stale.exists() and fresh.exists()


def test_put_failure_returns_false(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(str(tmp_path), FP)
    blocker = store.path(0xAB).parent
    blocker.write_text("a file where the subdirectory should be")
    with caplog.at_level(logging.WARNING, logger="tokenmill.kv_transfer"):
        assert not store.put(0xAB, TOKENS, b"x")
    assert "could not write" in caplog.text and store.stats.blocks_saved == 0


def test_bad_keys_are_refused(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path), FP)
    for key in (-1, 1 << 64):
        with pytest.raises(ValueError):
            store.path(key)


def test_fingerprint_file_is_left_alone_when_unchanged(tmp_path: Path) -> None:
    DiskStore(str(tmp_path), FP)
    path = tmp_path / fingerprint_digest(FP) / "fingerprint.json"
    os.utime(path, (5, 5))
    DiskStore(str(tmp_path), FP)
    assert path.stat().st_mtime == 5


@pytest.mark.parametrize("store_kind", ["host", "disk"])
def test_blocks_through_a_store_and_back(tmp_path: Path, store_kind: str) -> None:
    src, dst = random_caches(torch.int8, HEAD_DIM + 2, seed=5), random_caches(torch.int8,
                                                                             HEAD_DIM + 2)
    io_src, io_dst = BlockIO(src), BlockIO(dst)
    store = HostStore() if store_kind == "host" else DiskStore(str(tmp_path), FP)
    for key, row in zip((10, 11), io_src.gather([2, 5]).numpy()):
        assert store.put(key, TOKENS, row)
    for key, block in ((11, 0), (10, 1)):
        io_dst.scatter([block], store.get(key, TOKENS))
    assert same_bits(src[1][0][5], dst[1][0][0]) and same_bits(src[2][1][2], dst[2][1][1])


def test_concurrent_writers_and_readers_see_whole_blocks(tmp_path: Path) -> None:
    versions = [bytes([i]) * 4096 for i in range(4)]
    stores = [DiskStore(str(tmp_path), FP) for _ in range(2)]
    seen: list[bytes] = []

    def work(store: DiskStore, i: int) -> None:
        for _ in range(30):
            store.put(7, TOKENS, versions[i])
            got = store.get(7, TOKENS)
            if got is not None:
                seen.append(bytes(got))

    threads = [threading.Thread(target=work, args=(stores[i % 2], i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen and all(data in versions for data in seen)
    assert not list((tmp_path / fingerprint_digest(FP)).rglob("*.tmp"))


def test_store_module_does_not_import_torch() -> None:
    code = ("import sys, tokenmill.kv_transfer.store, tokenmill.kv_transfer.fingerprint; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
