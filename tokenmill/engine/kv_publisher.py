"""The engine's KV-event publisher: the prefix cache's changes, sent over ZMQ as vLLM sends them.

Once per engine step the engine takes the cache's event log (``cache/events.py``) and hands it
here as one ``KVEventBatch``; a thread of this module's own encodes it and sends it, so the
step loop never waits on ZMQ or msgpack::

    engine thread                 publisher thread (owns both sockets)
      publish(events) --queue-->    seq += 1; payload = msgpack(batch)
                                    PUB     [topic, seq (8 bytes big-endian), payload]
                                    ring    the last buffer_steps (seq, payload)
                                    ROUTER  request [start seq] -> [seq, payload] for each
                                            buffered seq >= start, then [-1, b""] (the end)

A subscriber that sees a gap in ``seq`` (PUB drops what a slow subscriber cannot take) asks
the replay socket for what it missed. Endpoints follow vLLM's rule: a wildcard host (``*``,
``::``), an ``ipc://`` or ``inproc://`` address, or port 0 (a free port) binds; any other
address connects (to a forwarder that binds). ``data_parallel_rank`` stamps every batch and
moves a fixed port up by the rank, so replicas given one config do not collide.

Under tensor or pipeline parallel ranks the scheduler, and with it the prefix cache, lives in
the engine's process, so this publisher runs there and nowhere else.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from tokenmill.config import KVEventsConfig
from tokenmill.kv_events import (END_OF_REPLAY, KVCacheEvent, KVEventBatch, encode_batch,
                                 seq_bytes, seq_of)

logger = logging.getLogger("tokenmill.engine")

# The publisher thread's longest wait for a batch before it looks at the replay socket again:
# what a replay request may wait at most while no step runs.
_POLL_SECONDS = 0.05
_TCP = re.compile(r"tcp://(?P<host>\[[^\]]*\]|[^:/]*):(?P<port>\d+|\*)")
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


class KVEventPublisher:
    """ZMQ PUB of KV-event batches, with a replay ROUTER over the last ``buffer_steps``.
    Sockets are bound (or connected) in the constructor, so a busy port fails at start-up;
    ``endpoint`` and ``replay_endpoint`` are then the addresses actually bound."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.topic = config.topic
        self.block_size = block_size
        self._rank = config.data_parallel_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = _open(self._pub, _offset(config.endpoint, self._rank))
            self.replay_endpoint = self._open_replay(config.replay_endpoint)
        except ValueError:
            self._close_sockets()
            self._ctx.term()
            raise
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-events",
                                        daemon=True)
        self._thread.start()

    def _open_replay(self, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        self._replay = self._ctx.socket(zmq.ROUTER)
        address = _offset(endpoint, self._rank)
        try:
            self._replay.bind(address)  # always bound: requests come to a known address
        except zmq.ZMQError as e:
            raise ValueError(f"KV events: cannot bind the replay endpoint {address}: {e}") \
                from None
        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def describe(self) -> dict[str, object]:
        """What a consumer needs to subscribe (``EngineInfo.kv_events``, ``/server_info``)."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.topic, "block_size": self.block_size}

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue one batch (the engine thread). Blocks only while ``max_queue_size`` batches
        wait, which a PUB socket, dropping rather than waiting, never lets happen. After
        ``close`` (or a broken socket ended the thread) batches are dropped: nothing would
        ever take them off the queue."""
        if self._thread.is_alive():
            self._queue.put(KVEventBatch(time.time(), list(events), self._rank))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, stop the thread, close the sockets; idempotent."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                logger.warning("KV events: the publisher thread is stuck; closing anyway")
            self._thread.join(timeout)
        if not self._thread.is_alive() and not self._ctx.closed:
            self._ctx.term()

    # ----- the publisher thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                try:
                    batch = self._queue.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    batch = False  # nothing to send: only replay requests to look at
                if batch is None:
                    return
                if batch:
                    self._send(batch)
                self._serve_replays()
        except Exception:  # a broken socket: events stop, the engine goes on
            logger.exception("KV events: the publisher thread stopped")
        finally:
            self._close_sockets()

    def _send(self, batch: KVEventBatch) -> None:
        seq, self._seq = self._seq, self._seq + 1
        payload = encode_batch(batch)
        self._buffer.append((seq, payload))  # replayable even if PUB drops it
        self._pub.send_multipart((self.topic.encode(), seq_bytes(seq), payload))

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            # [identity, b"", start] from a REQ (or a DEALER that adds the delimiter), else
            # [identity, start]; replies go back in the envelope the request came in.
            envelope, start = frames[:-1], frames[-1]
            if len(start) != 8 or not 1 <= len(envelope) <= 2:
                logger.warning("KV events: ignored a replay request of %d frames", len(frames))
                continue
            first = seq_of(start)
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((*envelope, seq_bytes(seq), payload))
            self._replay.send_multipart((*envelope, END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


def _open(sock: zmq.Socket, endpoint: str) -> str:
    """Bind or connect by vLLM's rule (see the module docstring); the address in use."""
    m = _TCP.match(endpoint)
    wildcard = m is not None and (m["host"] in _WILDCARD_HOSTS or m["port"] in ("0", "*"))
    bind = wildcard or endpoint.startswith(("ipc://", "inproc://")) or "::" in endpoint
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise ValueError(f"KV events: cannot {'bind' if bind else 'connect'} {endpoint}: "
                         f"{e}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _offset(endpoint: str, rank: int | None) -> str:
    """A data-parallel replica's own address: a fixed TCP port moved up by its rank, an ipc or
    inproc name suffixed with it; port 0 (any free port) stays 0."""
    if not rank:
        return endpoint
    m = _TCP.match(endpoint)
    if m is None:
        return f"{endpoint}_dp{rank}"
    if m["port"] in ("0", "*"):
        return endpoint
    return f"tcp://{m['host']}:{int(m['port']) + rank}{endpoint[m.end():]}"


def advertised(kv_events: dict[str, object] | None, host: str) -> dict[str, object] | None:
    """``EngineInfo.kv_events`` as a client elsewhere connects to it: a wildcard host (bound on
    every interface) becomes the server's own ``--host`` when that names one, else 127.0.0.1."""
    if kv_events is None:
        return None
    reach = "127.0.0.1" if host in _WILDCARD_HOSTS else host
    if ":" in reach and not reach.startswith("["):  # an IPv6 address in a URL
        reach = f"[{reach}]"
    return {**kv_events, **{key: _with_host(kv_events[key], reach)
                            for key in ("endpoint", "replay_endpoint")}}


def _with_host(endpoint: object, host: str) -> object:
    m = _TCP.match(endpoint) if isinstance(endpoint, str) else None
    if m is None or m["host"] not in _WILDCARD_HOSTS:
        return endpoint
    return f"tcp://{host}:{m['port']}{endpoint[m.end():]}"
