"""Prefill -> decode: a producer's worker exposes the blocks of a finished prefill, a consumer's
worker pulls them into blocks of its own (an external cache hit), through a side channel.

The sender is a zmq ROUTER served by a thread of its own; each pull opens a DEALER to it. After
the first message every one names the transfer by ``xfer``; messages are ``p2p_wire``'s::

    receiver (KVReceiver.pull)                     sender (KVSender's thread)
      Pull(request, block ids, fingerprint) ---->   layout checked; an unknown request waits
                                                    a few s for its expose, then is refused
                                       <----------  Refused(reason)                  -- or --
                                       <----------  Chunk(start 0, n) + bytes | shm segment
      Next(start n)   (sent before writing the chunk: the sender gathers the next one
                       while the receiver scatters this one)
                                       <----------  Chunk(start n, m) ...
      Done(ok)        ---------------------------->  request released: take_finished() names it

A chunk holds at most ``chunk_bytes`` (8 MiB) of whole blocks, in ``BlockIO.gather``'s layout:
over TCP in a second frame, through shared memory as a ``/dev/shm`` file the receiver reads
and unlinks (``auto``: shared memory when both sides report the same ``host_id``; a segment the
receiver cannot open turns the rest of the transfer to TCP). The sender removes the segments
of a request once it is released, and any segment older than ``segment_ttl`` (a receiver that
died before reading it); it never waits on a receiver.

The sender reads blocks while the engine's forward runs: the blocks of an exposed request are
held for it (nobody writes them), and once its expose times out or is acknowledged no chunk is
gathered from them again, before ``take_finished`` lets the engine free them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from tokenmill.kv_transfer.base import TierStats
from tokenmill.kv_transfer.blocks import BlockIO, fingerprint_mismatch
from tokenmill.kv_transfer.p2p_pull import KVReceiver
from tokenmill.kv_transfer.p2p_wire import (Chunk, Done, Next, Pull, Refused, as_sent,
                                            check_transport, decode_to_sender, encode, endpoint,
                                            host_id, new_segment_name, segment_dir,
                                            sweep_dead_segments, unlink_quietly, write_segment)

__all__ = ["CHUNK_BYTES", "KVReceiver", "KVSender"]

logger = logging.getLogger("tokenmill.kv_transfer")

CHUNK_BYTES = 8 << 20
# The sender thread's longest sleep: how late an expiry or a stale segment may be noticed.
_POLL_MS = 100
_MAX_PENDING = 4096  # pulls waiting for their expose; more are refused at once
_RELEASED_MEMORY = 4096  # released request ids kept to answer a late pull at once
_MAX_INCOMING = 1 << 24  # bytes of one message to the sender (a Pull of ~2M block ids)
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")


@dataclass
class _Exposed:
    block_ids: frozenset[int]
    deadline: float  # time.monotonic() past which the blocks are released unpulled
    sent: int = 0  # blocks sent so far (fail_after_blocks)


@dataclass
class _Transfer:
    request_id: str
    block_ids: tuple[int, ...]
    shm: bool


class KVSender:
    """Producer, worker side: a side channel (zmq ROUTER on its own thread) from which
    consumers pull the blocks of finished prefills.

    ``stats``: ``blocks_saved`` / ``bytes_saved`` count what was sent, ``stored_blocks`` the
    blocks exposed now. ``fail_after_blocks`` (tests only) sends that many blocks of each
    request, then ignores the request's pulls: a transfer killed mid-way."""

    def __init__(self, io: BlockIO, fingerprint: dict[str, Any], *, host: str = "127.0.0.1",
                 port: int = 0, transport: str = "auto", fail_after_blocks: int | None = None,
                 chunk_bytes: int = CHUNK_BYTES, unknown_wait: float = 3.0,
                 segment_ttl: float = 60.0) -> None:
        check_transport(transport)
        self._io, self._fingerprint = io, as_sent(fingerprint)
        self._transport, self._fail_after = transport, fail_after_blocks
        self._chunk_blocks = max(1, chunk_bytes // io.block_nbytes)
        self._unknown_wait, self._segment_ttl = unknown_wait, segment_ttl
        self._host_id, self._segment_dir = host_id(), segment_dir()
        self.stats = TierStats()
        self._lock = threading.Lock()  # guards _exposed, _finished, _closed
        self._exposed: dict[str, _Exposed] = {}
        self._finished: set[str] = set()
        self._closed = False
        # Owned by the sender thread.
        self._transfers: dict[tuple[bytes, int], _Transfer] = {}
        self._pending: list[tuple[float, bytes, Pull]] = []
        self._released: OrderedDict[str, str] = OrderedDict()
        self._segments: dict[str, tuple[str, float]] = {}  # path -> (request id, deadline)
        self._segment_count = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_INCOMING)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.host, self.port = self._bind(host, port)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        sweep_dead_segments(self._segment_dir)
        self._thread = threading.Thread(target=self._run, name=f"tokenmill-kv-sender-{self.port}",
                                        daemon=True)
        self._thread.start()

    def _bind(self, host: str, port: int) -> tuple[str, int]:
        """Binds ``host:port`` (port 0: a free one); returns the address consumers dial."""
        wildcard = host in _WILDCARD_HOSTS
        self._sock.setsockopt(zmq.IPV6, int(":" in host))
        address = endpoint("*" if wildcard else host, port or "*")
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise ValueError(f"KV transfer: cannot bind {address}: {e}") from None
        bound = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        return (_reachable_address() if wildcard else host), bound

    def describe(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "transport": self._transport,
                "host_id": self._host_id}

    def expose(self, request_id: str, block_ids: Sequence[int], timeout: float) -> None:
        """Let consumers pull ``block_ids`` of ``request_id`` until one acknowledges or
        ``timeout`` s pass; the caller holds the blocks until ``take_finished`` names it."""
        with self._lock:
            if self._closed:  # nobody will serve it: free the blocks at once
                self._finished.add(request_id)
                return
            if request_id in self._exposed:
                logger.warning("KV transfer: request %s exposed twice; the later blocks win",
                               request_id)
            self._exposed[request_id] = _Exposed(frozenset(block_ids),
                                                 time.monotonic() + timeout)
            self.stats.stored_blocks = sum(len(e.block_ids) for e in self._exposed.values())
            self._wake()  # under the lock: close() cannot have closed the pipe meanwhile

    def take_finished(self) -> set[str]:
        """Requests whose blocks may be freed now: pulled (acknowledged), given up by their
        consumer, or not pulled within their timeout. Thread-safe."""
        with self._lock:
            done, self._finished = self._finished, set()
        return done

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread, close the socket, remove the segments; exposed requests are
        reported finished. Idempotent."""
        with self._lock:
            self._closed = True
            self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV transfer: the sender thread did not stop within %.1f s", timeout)
            return
        if not self._ctx.closed:
            self._ctx.term()
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes the thread anyway
                os.write(self._wake_w, b"w")

    # ----- the sender thread --------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closed:
                ready = dict(poller.poll(_POLL_MS))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if self._sock in ready:
                    self._serve_socket()
                now = time.monotonic()
                self._serve_pending(now)
                self._expire(now)
        except Exception:  # a broken socket: transfers stop, exposed blocks are freed
            logger.exception("KV transfer: the sender thread stopped")
        finally:
            self._stop_serving()

    def _stop_serving(self) -> None:
        self._sock.close(linger=0)
        for path in self._segments:
            unlink_quietly(path)
        self._segments.clear()
        with self._lock:
            self._closed = True
            self._finished |= self._exposed.keys()
            self._exposed.clear()
            self.stats.stored_blocks = 0

    def _serve_socket(self) -> None:
        for _ in range(64):  # then look at expiries again
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            logger.warning("KV transfer: ignored a message of %d frames", len(frames))
            return
        identity, payload = frames
        try:
            message = decode_to_sender(payload)
        except ValueError as e:
            logger.warning("KV transfer: ignored a malformed message: %s", e)
            return
        try:
            if isinstance(message, Pull):
                self._on_pull(identity, message)
            elif isinstance(message, Next):
                self._on_next(identity, message)
            else:
                self._on_done(identity, message)
        except zmq.ZMQError:
            raise  # the socket is broken: the thread ends
        except Exception as e:  # one transfer fails (the receiver recomputes), not the thread
            logger.exception("KV transfer: serving a pull failed")
            self._refuse(identity, message.xfer, f"the sender failed: {e}")

    def _on_pull(self, identity: bytes, pull: Pull) -> None:
        reason = self._refusal(pull)
        if reason is not None:
            self._refuse(identity, pull.xfer, reason)
        elif not self._start(identity, pull):
            if len(self._pending) >= _MAX_PENDING:
                self._refuse(identity, pull.xfer, "too many pulls wait for their requests")
            else:  # its expose may come with the producer's next step
                self._pending.append((time.monotonic() + self._unknown_wait, identity, pull))

    def _refusal(self, pull: Pull) -> str | None:
        difference = fingerprint_mismatch(self._fingerprint, pull.fingerprint)
        if difference is not None:
            return f"the KV layouts differ: {difference}"
        if pull.block_nbytes != self._io.block_nbytes:
            return (f"a block is {self._io.block_nbytes} bytes here, "
                    f"{pull.block_nbytes} at the receiver")
        return None if pull.block_ids else "no blocks asked for"

    def _start(self, identity: bytes, pull: Pull) -> bool:
        """Begins the transfer (or refuses it); False while its request is not exposed yet."""
        with self._lock:
            exposed = self._exposed.get(pull.request_id)
        if exposed is None:
            why = self._released.get(pull.request_id)
            if why is not None:
                self._refuse(identity, pull.xfer, f"request {pull.request_id} was {why}")
            return why is not None
        foreign = set(pull.block_ids) - exposed.block_ids
        if foreign:
            self._refuse(identity, pull.xfer, f"blocks {sorted(foreign)[:8]} are not exposed "
                                              f"for request {pull.request_id}")
            return True
        transfer = _Transfer(pull.request_id, tuple(pull.block_ids), self._use_shm(pull))
        self._transfers[(identity, pull.xfer)] = transfer
        self._send_chunk(identity, pull.xfer, transfer, 0)
        return True

    def _use_shm(self, pull: Pull) -> bool:
        settings = (self._transport, pull.transport)
        if "tcp" in settings:
            return False
        return "shm" in settings or pull.host_id == self._host_id

    def _serve_pending(self, now: float) -> None:
        waiting, self._pending = self._pending, []
        for deadline, identity, pull in waiting:
            if self._start(identity, pull):
                continue
            if deadline <= now:
                self._refuse(identity, pull.xfer, f"unknown request {pull.request_id} (not "
                                                  f"exposed within {self._unknown_wait:g} s)")
            else:
                self._pending.append((deadline, identity, pull))

    def _on_next(self, identity: bytes, message: Next) -> None:
        transfer = self._transfers.get((identity, message.xfer))
        if transfer is None:
            self._refuse(identity, message.xfer, "unknown transfer")
            return
        with self._lock:
            live = transfer.request_id in self._exposed
        if not live:
            why = self._released.get(transfer.request_id, "released")
            self._refuse(identity, message.xfer, f"request {transfer.request_id} was {why}")
        elif not 0 <= message.start < len(transfer.block_ids):
            self._refuse(identity, message.xfer, f"no block at index {message.start}")
        else:
            transfer.shm = transfer.shm and not message.tcp_only
            self._send_chunk(identity, message.xfer, transfer, message.start)

    def _on_done(self, identity: bytes, message: Done) -> None:
        transfer = self._transfers.pop((identity, message.xfer), None)
        if transfer is not None:
            self._release(transfer.request_id,
                          "pulled" if message.ok else "given up by its consumer")

    def _send_chunk(self, identity: bytes, xfer: int, transfer: _Transfer, start: int) -> None:
        ids = transfer.block_ids[start:start + self._chunk_blocks]
        if self._fail_after is not None:
            with self._lock:
                exposed = self._exposed[transfer.request_id]
            ids = ids[:max(0, self._fail_after - exposed.sent)]
            if not ids:
                return  # tests: the transfer dies here, the receiver times out
            exposed.sent += len(ids)
        shm = self._new_segment(transfer, ids) if transfer.shm else ""
        header = encode(Chunk(xfer, start, len(ids), shm))
        if shm:
            self._sock.send_multipart([identity, header])
        else:
            data = self._io.gather(ids)  # (n, block_nbytes) uint8: a copy
            view = memoryview(data.numpy()).cast("B")  # (n * block_nbytes,)
            self._sock.send_multipart([identity, header, view], copy=False)
        self.stats.blocks_saved += len(ids)
        self.stats.bytes_saved += len(ids) * self._io.block_nbytes

    def _new_segment(self, transfer: _Transfer, ids: Sequence[int]) -> str:
        """The chunk's blocks gathered straight into a new segment; "" (send them in frames)
        when that fails."""
        self._segment_count += 1
        name = new_segment_name(self._segment_count)
        path = os.path.join(self._segment_dir, name)

        def fill(view: memoryview) -> None:
            out = torch.frombuffer(view, dtype=torch.uint8).view(len(ids), -1)  # (n, bytes)
            self._io.gather(ids, out=out)
            del out  # the mapping closes only once nothing points into it

        try:
            write_segment(path, len(ids) * self._io.block_nbytes, fill)
        except OSError as e:  # /dev/shm full: the bytes still go, over TCP
            logger.warning("KV transfer: cannot write a shared-memory segment (%s); sending "
                           "request %s over TCP", e, transfer.request_id)
            transfer.shm = False
            return ""
        self._segments[path] = (transfer.request_id, time.monotonic() + self._segment_ttl)
        return name

    def _refuse(self, identity: bytes, xfer: int, reason: str) -> None:
        logger.info("KV transfer: refused a pull: %s", reason)
        self._sock.send_multipart([identity, encode(Refused(xfer, reason))])

    def _release(self, request_id: str, why: str) -> None:
        """No chunk of ``request_id`` is gathered from here on; its blocks may be freed."""
        with self._lock:
            if self._exposed.pop(request_id, None) is not None:
                self._finished.add(request_id)
            self.stats.stored_blocks = sum(len(e.block_ids) for e in self._exposed.values())
        self._released[request_id] = why
        while len(self._released) > _RELEASED_MEMORY:
            self._released.popitem(last=False)
        for key in [k for k, t in self._transfers.items() if t.request_id == request_id]:
            del self._transfers[key]
        for path in [p for p, (rid, _) in self._segments.items() if rid == request_id]:
            unlink_quietly(path)
            del self._segments[path]
        logger.debug("KV transfer: request %s %s", request_id, why)

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [rid for rid, e in self._exposed.items() if e.deadline <= now]
        for request_id in late:
            logger.warning("KV transfer: request %s was not pulled in time; its blocks are "
                           "freed", request_id)
            self._release(request_id, "not pulled in time")
        for path in [p for p, (_, deadline) in self._segments.items() if deadline <= now]:
            unlink_quietly(path)  # its receiver never read it
            del self._segments[path]


def _reachable_address() -> str:
    """The address a sender bound on every interface advertises: the host name's."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
