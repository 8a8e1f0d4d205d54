"""The prefill -> decode side channel (kv_transfer/p2p.py): a KVSender and a KVReceiver over small
caches in one process (one test with the sender in a child process), over TCP and shared
memory: bytes moved bit for bit, every failure a logged count of good leading blocks, no
thread, socket or segment left behind."""

from __future__ import annotations

import contextlib
import glob
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from tokenmill.kv_transfer import p2p_pull
from tokenmill.kv_transfer.base import PullBlocks
from tokenmill.kv_transfer.blocks import BlockIO, layout_fingerprint
from tokenmill.kv_transfer.p2p import KVReceiver, KVSender
from tokenmill.kv_transfer.p2p_wire import (SEGMENT_PREFIX, Chunk, Pull, decode_to_receiver,
                                            encode, host_id, segment_dir)

BLOCK = 4
CHUNK_BLOCKS = 3  # the senders here send 3 blocks a chunk, so 8 blocks take 3 chunks
REMOTE = (9, 2, 5, 11, 0, 7, 3, 14)  # the producer's blocks, in the order pulled
LOCAL = (1, 4, 6, 8, 10, 12, 13, 15)  # the consumer's, pairwise


def make_caches(dtype: torch.dtype = torch.float32, *, seed: int = 0, zero: bool = False,
                row: tuple[int, ...] = (2, 8)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (16, BLOCK, *row)  # (num_blocks, block_size, heads, head_dim)

    def one() -> torch.Tensor:
        if zero:
            return torch.zeros(shape, dtype=dtype)
        if dtype == torch.int8:
            return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
        return torch.randn(shape, generator=g).to(dtype)

    return [(one(), one()) for _ in range(2)]


def fingerprint(caches: list[tuple[torch.Tensor, torch.Tensor]], **changes: object) -> dict:
    fp = layout_fingerprint("test-model", caches, block_size=BLOCK, attention_backend="torch",
                            kv_cache_dtype="auto")
    return {**fp, **changes}


def op(sender: KVSender, request: str = "pre-1", remote: tuple[int, ...] = REMOTE,
       local: tuple[int, ...] = LOCAL) -> PullBlocks:
    return PullBlocks(request_id="dec-" + request, remote_request_id=request,
                      remote_block_ids=remote, block_ids=local, host=sender.host,
                      port=sender.port, engine_id="producer-0")


def our_segments() -> list[str]:
    return glob.glob(os.path.join(segment_dir(), f"{SEGMENT_PREFIX}{os.getpid()}-*"))


def kv_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tokenmill-kv-sender")]


def wait_finished(sender: KVSender, *requests: str, within: float = 5.0) -> float:
    """Seconds until ``take_finished`` named every one of ``requests``; fails after
    ``within``."""
    start, seen = time.monotonic(), set()
    while time.monotonic() - start < within:
        seen |= sender.take_finished()
        if seen >= set(requests):
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"{sorted(set(requests) - seen)} never reported finished")


@contextlib.contextmanager
def channel(src_dtype: torch.dtype = torch.float32, *, row: tuple[int, ...] = (2, 8),
            sender_kw: dict | None = None, receiver_kw: dict | None = None,
            receiver_fp: dict | None = None) -> Iterator[tuple[KVSender, KVReceiver, BlockIO,
                                                                BlockIO]]:
    """A sender over random caches and a receiver over zeroed ones; closed afterwards, which
    must leave no thread and no segment behind."""
    src, dst = make_caches(src_dtype, row=row), make_caches(src_dtype, row=row, zero=True)
    src_io, dst_io = BlockIO(src), BlockIO(dst)
    sender = KVSender(src_io, fingerprint(src), chunk_bytes=CHUNK_BLOCKS * src_io.block_nbytes,
                      **(sender_kw or {}))
    receiver = KVReceiver(dst_io, receiver_fp or fingerprint(dst), **(receiver_kw or {}))
    try:
        yield sender, receiver, src_io, dst_io
    finally:
        receiver.close()
        sender.close()
        assert not kv_threads(), "the sender thread outlived close()"
        assert not our_segments(), "a shared-memory segment outlived close()"


def assert_moved(src_io: BlockIO, dst_io: BlockIO, count: int) -> None:
    """The first ``count`` pairs arrived bit for bit; every other block of ours is untouched."""
    assert torch.equal(dst_io.gather(LOCAL[:count]), src_io.gather(REMOTE[:count]))
    others = [b for b in range(16) if b not in LOCAL[:count]]
    assert not dst_io.gather(others).any()


@pytest.mark.parametrize("transport, dtype, row", [
    ("tcp", torch.float32, (2, 8)),
    ("shm", torch.bfloat16, (2, 8)),
    ("auto", torch.int8, (2, 10)),  # int8 K/V rows carry their scale: head_dim + 2
])
def test_pull_moves_blocks_bit_for_bit(transport, dtype, row, caplog):
    kw = {"transport": transport}
    with channel(dtype, row=row, sender_kw=kw, receiver_kw=kw) as (sender, receiver, src, dst):
        sender.expose("pre-1", REMOTE, timeout=30)
        with caplog.at_level(logging.DEBUG, logger="tokenmill.kv_transfer"):
            assert receiver.pull(op(sender)) == len(LOCAL)
        assert_moved(src, dst, len(LOCAL))
        wait_finished(sender, "pre-1")  # the acknowledgement releases it
        expected = "tcp" if transport == "tcp" else "shm"  # auto: one host, shared memory
        assert f"over {expected}" in caplog.text
        assert sender.stats.blocks_saved == len(REMOTE) and receiver.stats.hits == len(LOCAL)
        assert not our_segments()  # the receiver unlinked each one it read


def test_concurrent_pulls_of_several_requests():
    with channel() as (sender, receiver, src, dst):
        parts = [(REMOTE[i:i + 3], LOCAL[i:i + 3]) for i in (0, 3, 6)]
        for i, (remote, _) in enumerate(parts):
            sender.expose(f"pre-{i}", remote, timeout=30)
        results: dict[int, int] = {}
        threads = [threading.Thread(target=lambda i=i, rl=rl: results.__setitem__(
            i, receiver.pull(op(sender, f"pre-{i}", *rl)))) for i, rl in enumerate(parts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert results == {0: 3, 1: 3, 2: 2}
        assert_moved(src, dst, len(LOCAL))
        wait_finished(sender, "pre-0", "pre-1", "pre-2")


def test_fingerprint_mismatch_is_refused_with_the_reason(caplog):
    dst_fp = fingerprint(make_caches(), block_size=8)
    with channel(receiver_fp=dst_fp) as (sender, receiver, src, dst):
        sender.expose("pre-1", REMOTE, timeout=30)
        assert receiver.pull(op(sender)) == 0
        assert_moved(src, dst, 0)
    assert "block_size is 4 here, 8 there" in caplog.text


def test_unknown_request_is_refused_after_the_wait(caplog):
    with channel(sender_kw={"unknown_wait": 0.3}) as (sender, receiver, src, dst):
        start = time.monotonic()
        assert receiver.pull(op(sender, "never-exposed")) == 0
        assert 0.25 < time.monotonic() - start < 3.0
        assert_moved(src, dst, 0)
    assert "unknown request never-exposed" in caplog.text


def test_pull_before_expose_waits_for_it():
    with channel() as (sender, receiver, src, dst):
        timer = threading.Timer(0.3, sender.expose, ("pre-1", REMOTE, 30.0))
        timer.start()
        assert receiver.pull(op(sender)) == len(LOCAL)
        timer.join()
        assert_moved(src, dst, len(LOCAL))
        wait_finished(sender, "pre-1")


def test_transfer_killed_midway_returns_the_good_blocks():
    kw = {"fail_after_blocks": 2, "transport": "tcp"}
    with channel(sender_kw=kw, receiver_kw={"timeout": 1.0}) as (sender, receiver, src, dst):
        sender.expose("pre-1", REMOTE, timeout=30)
        start = time.monotonic()
        assert receiver.pull(op(sender)) == 2
        assert 0.9 < time.monotonic() - start < 3.0
        assert_moved(src, dst, 2)  # blocks 3.. untouched
        wait_finished(sender, "pre-1")  # the receiver's Done(ok=False) releases it


def test_expose_timeout_releases_the_blocks_and_refuses_late_pulls(caplog):
    with channel(sender_kw={"unknown_wait": 5.0}) as (sender, receiver, src, dst):
        sender.expose("pre-1", REMOTE, timeout=0.2)
        assert 0.1 < wait_finished(sender, "pre-1") < 3.0
        start = time.monotonic()
        assert receiver.pull(op(sender)) == 0  # answered at once, not after unknown_wait
        assert time.monotonic() - start < 2.0
        assert_moved(src, dst, 0)
    assert "pre-1 was not pulled in time" in caplog.text


def test_blocks_not_exposed_are_refused(caplog):
    with channel() as (sender, receiver, src, dst):
        sender.expose("pre-1", REMOTE[:4], timeout=30)
        assert receiver.pull(op(sender)) == 0
        assert_moved(src, dst, 0)
        assert receiver.pull(op(sender, remote=REMOTE[:4], local=LOCAL[:4])) == 4
    assert "are not exposed for request pre-1" in caplog.text


def test_unreadable_segment_falls_back_to_tcp(monkeypatch, caplog):
    real, calls = p2p_pull.read_segment, []

    def first_fails(name: str, nbytes: int) -> bytearray:
        calls.append(name)
        if len(calls) == 1:
            raise FileNotFoundError(name)  # as from another /dev/shm: the sender removes it
        return real(name, nbytes)

    monkeypatch.setattr(p2p_pull, "read_segment", first_fails)
    caplog.set_level(logging.INFO, logger="tokenmill.kv_transfer")
    with channel() as (sender, receiver, src, dst):  # auto on one host: shared memory first
        sender.expose("pre-1", REMOTE, timeout=30)
        assert receiver.pull(op(sender)) == len(LOCAL)
        assert_moved(src, dst, len(LOCAL))
        wait_finished(sender, "pre-1")
        assert len(calls) == 1 and not our_segments()
    assert "over TCP" in caplog.text


def test_receiver_failing_midway_leaves_no_segment(monkeypatch):
    with channel(receiver_kw={"transport": "shm"}) as (sender, receiver, src, dst):
        real, calls = dst.scatter, []

        def second_fails(block_ids, data) -> None:
            calls.append(block_ids)
            if len(calls) == 2:
                raise RuntimeError("the receiver broke")
            real(block_ids, data)

        monkeypatch.setattr(dst, "scatter", second_fails)
        sender.expose("pre-1", REMOTE, timeout=30)
        assert receiver.pull(op(sender)) == CHUNK_BLOCKS
        assert_moved(src, dst, CHUNK_BLOCKS)
        wait_finished(sender, "pre-1")  # its Done(ok=False) also removes the prefetched chunk
        assert not our_segments()


def test_sender_removes_segments_a_receiver_never_read():
    with channel(sender_kw={"segment_ttl": 0.2}) as (sender, receiver, src, dst):
        sender.expose("pre-1", REMOTE, timeout=30)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        try:  # a receiver that asks, then dies before reading its segment
            sock.connect(f"tcp://{sender.host}:{sender.port}")
            sock.send(encode(Pull(1, "pre-1", list(REMOTE), fingerprint(make_caches()),
                                  src.block_nbytes, host_id(), "shm")))
            assert sock.poll(5000)
            chunk = decode_to_receiver(sock.recv())
            assert isinstance(chunk, Chunk) and chunk.shm and len(our_segments()) == 1
            deadline = time.monotonic() + 3.0
            while our_segments() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not our_segments()
        finally:
            sock.close(linger=0)
            ctx.term()


def test_close_is_prompt_and_ends_pulls_in_progress():
    kw = {"fail_after_blocks": 2}
    with channel(sender_kw=kw, receiver_kw={"timeout": 30.0}) as (sender, receiver, src, dst):
        sender.expose("pre-1", REMOTE, timeout=30)
        result: list[int] = []
        puller = threading.Thread(target=lambda: result.append(receiver.pull(op(sender))))
        puller.start()
        time.sleep(0.5)  # two blocks arrived; the pull waits for the rest
        start = time.monotonic()
        receiver.close()
        puller.join(3.0)
        assert not puller.is_alive() and result == [2]
        assert receiver.pull(op(sender)) == 0  # closed: refused at once
        sender.close()
        assert time.monotonic() - start < 2.0
        assert "pre-1" in sender.take_finished()  # a closed sender frees what it exposed
        sender.expose("pre-2", REMOTE, timeout=30)  # and anything exposed later at once
        assert sender.take_finished() == {"pre-2"}


def test_unreachable_sender_times_out(caplog):
    with channel(receiver_kw={"timeout": 0.5}) as (sender, receiver, src, dst):
        pull = op(sender)
        sender.close()  # nobody listens on its port any more
        start = time.monotonic()
        assert receiver.pull(pull) == 0
        assert time.monotonic() - start < 2.5
    assert "no answer from" in caplog.text


def _serve_in_child(ports: multiprocessing.Queue) -> None:
    caches = make_caches(seed=7)
    io = BlockIO(caches)
    sender = KVSender(io, fingerprint(caches), transport="tcp",
                      chunk_bytes=CHUNK_BLOCKS * io.block_nbytes)
    sender.expose("child-1", REMOTE, timeout=60)
    ports.put(sender.port)
    finished: set[str] = set()
    deadline = time.monotonic() + 60
    while "child-1" not in finished and time.monotonic() < deadline:
        finished |= sender.take_finished()
        time.sleep(0.01)
    sender.close()
    ports.put(sorted(finished))


def test_sender_in_a_child_process():
    mp = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue = mp.Queue()
    child = mp.Process(target=_serve_in_child, args=(ports,), daemon=True)
    child.start()
    try:
        port = ports.get(timeout=120)
        dst_caches = make_caches(zero=True)
        dst = BlockIO(dst_caches)
        receiver = KVReceiver(dst, fingerprint(dst_caches), transport="tcp", timeout=30)
        pull = PullBlocks("dec-1", "child-1", REMOTE, LOCAL, "127.0.0.1", port, "child")
        assert receiver.pull(pull) == len(LOCAL)
        receiver.close()
        assert_moved(BlockIO(make_caches(seed=7)), dst, len(LOCAL))
        assert ports.get(timeout=30) == ["child-1"]  # our acknowledgement reached it
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


def test_a_failing_gather_fails_that_pull_only(monkeypatch, caplog):
    with channel() as (sender, receiver, src, dst):
        real = src.gather

        def broken(block_ids, out=None):
            if 5 in block_ids:
                raise RuntimeError("gather broke")
            return real(block_ids, out=out)

        monkeypatch.setattr(src, "gather", broken)
        sender.expose("pre-1", REMOTE, timeout=30)
        assert receiver.pull(op(sender)) == 0  # block 5 is in the first chunk
        wait_finished(sender, "pre-1")  # given up by its consumer: freed
        sender.expose("pre-2", REMOTE[3:], timeout=30)
        assert receiver.pull(op(sender, "pre-2", REMOTE[3:], LOCAL[3:])) == 5
    assert "the sender failed: gather broke" in caplog.text
