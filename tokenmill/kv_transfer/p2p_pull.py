"""The consumer's half of the prefill -> decode transfer (``p2p.py`` holds the protocol and
the producer's half): ``KVReceiver.pull`` dials the producer's side channel, asks for a
finished prefill's blocks and writes them into blocks of its own as they arrive.

Each pull has a socket and a deadline of its own: pulls of several requests may run on
several threads at once, and none outlives the receiver's ``timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from tokenmill.kv_transfer.base import PullBlocks, TierStats
from tokenmill.kv_transfer.blocks import BlockIO
from tokenmill.kv_transfer.p2p_wire import (Chunk, Done, Next, Pull, Refused, as_sent,
                                            check_transport, decode_to_receiver, encode,
                                            endpoint, host_id, read_segment, segment_dir,
                                            unlink_quietly)

logger = logging.getLogger("tokenmill.kv_transfer")

_ACK_LINGER_MS = 500  # how long a closed socket still tries to deliver its Done


@dataclass
class _PullState:
    """One pull in progress: ``written`` leading blocks are in our cache."""

    op: PullBlocks
    sock: zmq.Socket
    xfer: int
    deadline: float
    written: int = 0
    tcp_only: bool = False
    transport_used: str = "tcp"


class KVReceiver:
    """Consumer, worker side: pulls a producer's exposed blocks into our own.

    Pulls may run on several threads at once (each opens its own socket). Rank ``rank`` of a
    tensor-parallel consumer dials ``port + rank`` (the producer's rank of the same shard).
    ``stats``: ``hits`` / ``bytes_loaded`` / ``load_seconds`` count what arrived, ``misses`` the
    blocks asked for that did not."""

    def __init__(self, io: BlockIO, fingerprint: dict[str, Any], *, transport: str = "auto",
                 timeout: float = 10.0, rank: int = 0) -> None:
        check_transport(transport)
        self._io, self._fingerprint = io, as_sent(fingerprint)
        self._transport, self._timeout, self._rank = transport, timeout, rank
        self._host_id = host_id()
        self._ctx = zmq.Context()
        self._closed = False
        self._stats_lock = threading.Lock()
        self.stats = TierStats()

    def pull(self, op: PullBlocks) -> int:
        """Fetch ``op.remote_block_ids`` into ``op.block_ids`` (pairwise) and acknowledge;
        returns how many leading blocks were written (all of them on success). Any failure is
        logged, never raised, and no pull lasts past ``timeout`` s (plus the socket's close)."""
        total = len(op.block_ids)
        if total != len(op.remote_block_ids) or total == 0 or self._closed:
            logger.warning("KV transfer: pull of request %s skipped (%d local, %d remote "
                           "blocks%s)", op.request_id, total, len(op.remote_block_ids),
                           ", receiver closed" if self._closed else "")
            self._count(0, total, 0.0)
            return 0
        started = time.monotonic()
        state: _PullState | None = None
        try:
            state = self._open(op, started + self._timeout)
            self._transfer(state)
        except Exception as e:  # noqa: BLE001 - a failed pull is a recompute, never a crash
            logger.warning("KV transfer: pull of request %s from %s:%d failed: %s",
                           op.request_id, op.host, op.port + self._rank, e)
        finally:
            if state is not None:
                self._finish(state)
        written = state.written if state is not None else 0
        self._count(written, total, time.monotonic() - started)
        if written == total:
            logger.debug("KV transfer: pulled %d blocks of %s over %s in %.1f ms", total,
                         op.remote_request_id, state.transport_used,
                         (time.monotonic() - started) * 1e3)
        return written

    def close(self) -> None:
        """Ends pulls in progress (they return what they wrote) and the zmq context;
        idempotent."""
        self._closed = True
        if not self._ctx.closed:
            self._ctx.term()  # returns once every pull closed its socket

    def _open(self, op: PullBlocks, deadline: float) -> _PullState:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, _ACK_LINGER_MS)
        sock.setsockopt(zmq.IPV6, int(":" in op.host))
        state = _PullState(op, sock, secrets.randbits(63), deadline)
        sock.connect(endpoint(op.host, op.port + self._rank))
        sock.send(encode(Pull(state.xfer, op.remote_request_id, list(op.remote_block_ids),
                              self._fingerprint, self._io.block_nbytes, self._host_id,
                              self._transport)))
        return state

    def _transfer(self, state: _PullState) -> None:
        total = len(state.op.block_ids)
        while state.written < total:
            reply = self._receive(state)
            if reply is None:
                logger.warning("KV transfer: no answer from %s:%d for request %s within "
                               "%.1f s (%d of %d blocks arrived)", state.op.host,
                               state.op.port + self._rank, state.op.remote_request_id,
                               self._timeout, state.written, total)
                return
            header, data = reply
            if isinstance(header, Refused):
                logger.warning("KV transfer: %s:%d refused request %s: %s", state.op.host,
                               state.op.port + self._rank, state.op.remote_request_id,
                               header.reason)
                return
            if not self._take(state, header, data):
                return

    def _receive(self, state: _PullState) -> tuple[Chunk | Refused, memoryview | None] | None:
        """The next reply of this transfer; None once the deadline passed."""
        while True:
            remaining = state.deadline - time.monotonic()
            if remaining <= 0 or not state.sock.poll(int(remaining * 1000) + 1):
                return None
            frames = state.sock.recv_multipart(copy=False)
            header = decode_to_receiver(frames[0].bytes)
            if header.xfer == state.xfer:
                return header, (frames[1].buffer if len(frames) > 1 else None)
            if isinstance(header, Chunk) and header.shm:  # not ours: still remove it
                unlink_quietly(os.path.join(segment_dir(), header.shm))

    def _take(self, state: _PullState, chunk: Chunk, data: memoryview | None) -> bool:
        """Writes one chunk into the cache; False when the transfer cannot go on."""
        end, nbytes = chunk.start + chunk.count, chunk.count * self._io.block_nbytes
        if chunk.start != state.written or chunk.count <= 0 or end > len(state.op.block_ids):
            logger.warning("KV transfer: unexpected chunk %d..%d of request %s (expected "
                           "one from %d)", chunk.start, end, state.op.remote_request_id,
                           state.written)
            if chunk.shm:
                unlink_quietly(os.path.join(segment_dir(), chunk.shm))
            return False
        payload: memoryview
        mapped = None
        if chunk.shm:
            try:
                mapped = read_segment(chunk.shm, nbytes)
            except (OSError, ValueError) as e:
                return self._segment_failed(state, chunk, e)
            payload = memoryview(mapped)
            state.transport_used = "shm"
        elif data is None or data.nbytes != nbytes:
            logger.warning("KV transfer: a chunk of request %s holds %d bytes, expected %d",
                           state.op.remote_request_id, 0 if data is None else data.nbytes,
                           nbytes)
            return False
        else:
            payload = data
        if end < len(state.op.block_ids):  # the sender gathers the next chunk meanwhile
            state.sock.send(encode(Next(state.xfer, end, state.tcp_only)))
        try:
            self._io.scatter(state.op.block_ids[chunk.start:end], payload)
        finally:
            if mapped is not None:  # the cache holds its own copy now
                payload.release()
                mapped.close()
        state.written = end
        return True

    def _segment_failed(self, state: _PullState, chunk: Chunk, error: Exception) -> bool:
        """A segment we cannot read (another /dev/shm, another user): ask for the chunk again
        over TCP when that is allowed (True), else give up (False)."""
        if self._transport == "shm" or state.tcp_only:
            logger.warning("KV transfer: cannot read segment %s: %s", chunk.shm, error)
            return False
        logger.info("KV transfer: cannot read segment %s (%s); pulling the rest of request %s "
                    "over TCP", chunk.shm, error, state.op.remote_request_id)
        state.tcp_only = True
        state.sock.send(encode(Next(state.xfer, chunk.start, True)))
        return True

    def _finish(self, state: _PullState) -> None:
        """Tell the sender the transfer is over (it frees the blocks), close the socket."""
        ok = state.written == len(state.op.block_ids)
        with contextlib.suppress(zmq.ZMQError):
            state.sock.send(encode(Done(state.xfer, ok)), zmq.NOBLOCK)
        state.sock.close()

    def _count(self, written: int, total: int, seconds: float) -> None:
        with self._stats_lock:
            self.stats.hits += written
            self.stats.misses += total - written
            self.stats.bytes_loaded += written * self._io.block_nbytes
            self.stats.load_seconds += seconds
