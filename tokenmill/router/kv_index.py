"""The router's mirror of its workers' prefix caches, fed by their KV-cache events.

Workers publish (``tokenmill/kv_events.py``) which blocks they stored and dropped, keyed by
their own 64-bit block hashes. Those hashes are opaque — each engine hashes differently — so
the index rebuilds, per worker, a *local* chain hash for every block from what the event says:
the parent block's local hash, the LoRA adapter and the block's tokens. A local hash therefore
names a whole prefix (every token from the start of the prompt to the end of the block, under
one adapter), and ``match`` can walk a new prompt block by block, computing the same hashes,
until a worker lacks one: the tokens before that are in its cache.

A block whose parent the index never saw (the router subscribed after the parent was stored,
or a gap the replay buffer could not fill) is recorded under the ``_UNREACHABLE`` marker, as are
its descendants: its tokens are not the start of a prompt, so hashing it as a root would claim
cache hits that are not there, and without its parent's hash there is no true chain for it.
Its removal is still mirrored; it simply never matches.

A LoRA adapter is known by its name: each worker numbers its adapters itself (``lora_id``), so
the same adapter has different ids on two replicas, and a request names it, not a number. A
block whose event carries ``lora_name`` is filed under that name and matches requests under
that adapter on every worker. An event with only ``lora_id`` (a vLLM release that sends no
name) is filed under the id, apart from every name and from the base model: such blocks match
only a caller that passes that worker's id, so the router, which knows requests by name, never
counts them as hits (no wrong hit; the worker is scored as holding nothing for the adapter).

The index is written from one subscriber thread per worker and read on the router's event
loop, so every method takes one ``threading.Lock``. A batch's ``data_parallel_rank`` is not
read: the router's unit is a worker URL, and one URL is one cache.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                 decode_batch, seq_bytes, seq_of)

if TYPE_CHECKING:
    import zmq

log = logging.getLogger("tokenmill.router")

_ROOT = bytes(16)  # the parent of a prompt's first block
_UNREACHABLE = None  # the local hash of a block whose chain does not reach a root
LocalHash = bytes | None
Adapter = int | str | None  # the LoRA a block was computed under (None: the base model)
BlockKey = tuple[str | None, int]  # (medium, the worker's block hash): GPU and CPU copies differ


def chain_hash(parent: bytes, adapter: Adapter, tokens: Sequence[int]) -> bytes:
    """The local hash of a block: depends on the whole prefix (through ``parent``), on the
    adapter (a block computed under one LoRA never serves another) and on the tokens."""
    return _link(parent, _adapter_tag(adapter), _pack(tokens))


def _pack(tokens: Sequence[int]) -> bytes:
    """8 bytes a token, the same for a stored block and a prompt (both sides of a match)."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _link(parent: bytes, tag: bytes, raw_tokens: bytes) -> bytes:
    return hashlib.blake2b(parent + tag + raw_tokens, digest_size=16).digest()


def _adapter_tag(adapter: Adapter) -> bytes:
    """Unambiguous bytes per adapter: an id and a name never collide."""
    if adapter is None:
        return b"\0"
    if isinstance(adapter, int):
        return b"\1" + adapter.to_bytes(8, "big", signed=True)
    name = adapter.encode()
    return b"\2" + len(name).to_bytes(4, "big") + name


def adapter_of(event: BlockStored) -> Adapter:
    """The adapter by name when the event gives one (the same on every worker), else by the
    worker's own ``lora_id`` (None: the base model)."""
    name = getattr(event, "lora_name", None)
    return name if name is not None else event.lora_id


@dataclass
class _WorkerBlocks:
    """One worker's blocks: its hash -> local hash, and how many of its blocks hold each
    local hash (the same prefix may be stored twice, e.g. on GPU and offloaded to CPU)."""

    block_size: int = 0
    by_key: dict[BlockKey, LocalHash] = field(default_factory=dict)
    held: Counter[bytes] = field(default_factory=Counter)
    mediums: set[str | None] = field(default_factory=set)

    def put(self, key: BlockKey, local: LocalHash) -> None:
        self.drop(key)
        self.by_key[key] = local
        self.mediums.add(key[0])
        if local is not None:
            self.held[local] += 1

    def drop(self, key: BlockKey) -> None:
        if key not in self.by_key:
            return  # stored before the router listened, or already gone
        local = self.by_key.pop(key)
        if local is not None:
            self.held[local] -= 1
            if self.held[local] <= 0:
                del self.held[local]

    def parent_local(self, medium: str | None, parent: int | None) -> LocalHash:
        """A parent is looked up on the block's own medium first, then on any other."""
        if parent is None:
            return _ROOT
        for m in (medium, *(m for m in self.mediums if m != medium)):
            if (m, parent) in self.by_key:
                return self.by_key[(m, parent)]
        return _UNREACHABLE


class KVIndex:
    """Every worker's cached blocks as its KV events describe them; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, _WorkerBlocks] = {}

    def apply(self, worker_url: str, batch: KVEventBatch) -> None:
        with self._lock:
            blocks = self._workers.setdefault(worker_url, _WorkerBlocks())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    _store(blocks, event, worker_url)
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        blocks.drop((event.medium, block_hash))
                elif isinstance(event, AllBlocksCleared):
                    self._workers[worker_url] = blocks = _WorkerBlocks(blocks.block_size)

    def match(self, token_ids: Sequence[int], adapter: Adapter = None) -> dict[str, int]:
        """Per worker that has events, how many leading tokens of ``token_ids`` (whole blocks)
        its cache holds under ``adapter``: a LoRA adapter's name (an int: one worker's id, for
        events without names), None for the base model."""
        prompt = _PromptChains(token_ids, adapter)
        with self._lock:
            out: dict[str, int] = {}
            for url, blocks in self._workers.items():
                size = blocks.block_size
                n = 0
                if size > 0 and blocks.held:
                    while (link := prompt.link(size, n)) is not None and link in blocks.held:
                        n += 1
                out[url] = n * size
            return out

    def workers(self) -> set[str]:
        """Workers the index has had events from (an emptied cache still counts)."""
        with self._lock:
            return set(self._workers)

    def block_size(self, url: str) -> int | None:
        with self._lock:
            blocks = self._workers.get(url)
            return blocks.block_size if blocks and blocks.block_size > 0 else None

    def blocks(self, url: str) -> int:
        """How many of the worker's blocks a prompt can reach (unreachable ones excluded)."""
        with self._lock:
            blocks = self._workers.get(url)
            return sum(blocks.held.values()) if blocks else 0

    def forget_worker(self, url: str) -> None:
        with self._lock:
            self._workers.pop(url, None)


class _PromptChains:
    """A prompt's local hashes per block size, computed only as far as some worker matches
    and shared by the workers of one block size."""

    def __init__(self, token_ids: Sequence[int], adapter: Adapter) -> None:
        self._raw = _pack(token_ids)
        self._tokens = len(token_ids)
        self._tag = _adapter_tag(adapter)
        self._chains: dict[int, list[bytes]] = {}

    def link(self, size: int, n: int) -> bytes | None:
        """The local hash of block ``n`` (blocks of ``size``); None past the last whole one."""
        chain = self._chains.setdefault(size, [])
        while len(chain) <= n:
            i = len(chain)
            if (i + 1) * size > self._tokens:
                return None
            parent = chain[i - 1] if i else _ROOT
            chain.append(_link(parent, self._tag, self._raw[i * size * 8:(i + 1) * size * 8]))
        return chain[n]


def _store(blocks: _WorkerBlocks, event: BlockStored, url: str) -> None:
    """Chain the event's blocks from its parent; a malformed event's blocks are recorded (so
    their removal is mirrored) but unreachable."""
    size = event.block_size
    if size <= 0 or len(event.token_ids) != size * len(event.block_hashes):
        log.warning("kv events from %s: a BlockStored with %d hashes, %d tokens, block size %d; "
                    "its blocks will not match", url, len(event.block_hashes),
                    len(event.token_ids), size)
    if size > 0:
        blocks.block_size = size
    parent = blocks.parent_local(event.medium, event.parent_block_hash)
    adapter = adapter_of(event)
    for i, block_hash in enumerate(event.block_hashes):
        tokens = event.token_ids[i * size:(i + 1) * size] if size > 0 else []
        if parent is not None and len(tokens) == size > 0:
            parent = chain_hash(parent, adapter, tokens)
        else:
            parent = _UNREACHABLE
        blocks.put((event.medium, block_hash), parent)


class KVEventSubscriber:
    """One worker's event stream into a ``KVIndex``: a ZMQ SUB socket on a daemon thread.

    Frames are ``[topic, seq, payload]``; seqs count up from 0 per publisher. A missing seq is
    asked of the replay endpoint (the publisher's ROUTER): this side's DEALER sends
    ``[b"", start seq]`` and reads ``[b"", seq, payload]`` per buffered batch from ``start`` on,
    then one with an empty payload that ends the replay. The first message counts as a gap
    from 0, so a subscriber that joins late (or loses ZMQ's slow-joiner race) still gets what
    the publisher buffered. A seq at or below the last one the SUB socket delivered means the
    publisher restarted: its cache is empty, so is the mirror.
    """

    POLL_MS = 100  # how promptly close() is noticed
    REPLAY_TIMEOUT_S = 2.0  # a publisher that stops answering a replay mid-way

    def __init__(self, index: KVIndex, worker_url: str, endpoint: str,
                 replay_endpoint: str | None = None, topic: str = "") -> None:
        self.index = index
        self.worker_url = worker_url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.applied = 0  # batches mirrored
        self.gaps = 0  # batches lost for good (not in the replay buffer, or no replay)
        self.bad_payloads = 0
        self._next_seq = 0
        self._last_sub_seq = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-events {self.worker_url}")
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        import zmq  # here, so importing the router's policies does not load pyzmq

        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if sub.poll(self.POLL_MS):
                    self._receive(sub.recv_multipart())
        except zmq.ZMQError:
            log.exception("kv events from %s: the subscription failed", self.worker_url)
        finally:
            sub.close(0)

    def _receive(self, frames: list[bytes]) -> None:
        """One SUB message: sequence checks, replay, apply. Never raises (a bad message must
        not end the stream)."""
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(f"{len(frames)} frames, expected [topic, seq, payload]")
            seq = seq_of(frames[1])
            if seq <= self._last_sub_seq:
                log.warning("kv events from %s: seq went back to %d, publisher restarted",
                            self.worker_url, seq)
                self.index.apply(self.worker_url, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
                self._next_seq = 0
            self._last_sub_seq = seq
            if seq > self._next_seq and self.replay_endpoint:
                self._replay(self._next_seq)
            if seq >= self._next_seq:
                self._apply(seq, frames[2])
        except Exception:
            log.exception("kv events from %s: message skipped", self.worker_url)
            self.bad_payloads += 1

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq > self._next_seq:
            # Joining a running worker loses its early batches by design: no warning for that.
            level = logging.WARNING if self.applied else logging.INFO
            log.log(level, "kv events from %s: batches %d..%d lost", self.worker_url,
                    self._next_seq, seq - 1)
            self.gaps += seq - self._next_seq
        self._next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except ValueError:
            log.warning("kv events from %s: batch %d is not a KV event batch", self.worker_url,
                        seq)
            self.bad_payloads += 1
            return
        self.index.apply(self.worker_url, batch)
        self.applied += 1

    def _replay(self, start: int) -> None:
        """Ask the publisher for its buffered batches from ``start``; apply them in order."""
        import zmq

        assert self.replay_endpoint is not None
        sock = zmq.Context.instance().socket(zmq.DEALER)  # a fresh one: no stale replies
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", seq_bytes(start)])
            while (frames := self._replay_message(sock)) is not None:
                seq_frame, payload = frames
                if not payload:
                    return  # the end marker
                seq = seq_of(seq_frame)
                if seq >= self._next_seq:
                    self._apply(seq, payload)
        finally:
            sock.close(0)

    def _replay_message(self, sock: zmq.Socket) -> tuple[bytes, bytes] | None:
        """The next ``(seq, payload)`` of a replay; None on timeout, close() or a malformed
        reply (the replay is abandoned; the gap stays)."""
        waited = 0.0
        while not self._stop.is_set() and waited < self.REPLAY_TIMEOUT_S:
            if sock.poll(self.POLL_MS):
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the ROUTER's envelope delimiter (seqs are 8 bytes)
                if len(frames) == 2:
                    return frames[0], frames[1]
                log.warning("kv events from %s: a replay reply of %d frames", self.worker_url,
                            len(frames))
                return None
            waited += self.POLL_MS / 1000
        if waited >= self.REPLAY_TIMEOUT_S:
            log.warning("kv events from %s: replay timed out", self.worker_url)
        return None
