"""The worker side of every connector: carries out a step's ops beside the KV cache tensors.

    start_step(meta), before the forward, in op order:
      SaveBlocks   copy the blocks out now (the forward may overwrite them) -> host: stored at
                   once; disk: handed to the writer thread (readable meanwhile as pending)
      MoveBlocks   host -> disk: the host copy goes to the writer
      DropBlocks   host: dropped now; disk: the writer deletes the file
      LoadBlocks   -> loader thread: each block from host / pending / disk, its tokens and
                   checksum checked, copied into the request's blocks; reported done or failed
      PullBlocks   -> loader thread: fetched from the producer (``p2p.KVReceiver``)
      ExposeBlocks -> the side channel (``p2p.KVSender``) serves them until pulled or timed out
    get_finished(): what the threads finished since, plus each tier's counters

Host-tier stores happen on the step's thread, so a load queued after a save always finds the
block; disk writes overlap the next steps, and a load of a block still being written reads the
pending copy. The loader thread writes only blocks its request holds and nobody else reads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tokenmill.kv_transfer.base import (DropBlocks, ExposeBlocks, KVConnectorMetadata,
                                        KVConnectorOutput, KVConnectorWorker, LoadBlocks,
                                        MoveBlocks, PullBlocks, SaveBlocks, TierStats)

if TYPE_CHECKING:
    from tokenmill.kv_transfer.blocks import BlockIO
    from tokenmill.kv_transfer.p2p import KVReceiver, KVSender
    from tokenmill.kv_transfer.store import BlockStore

logger = logging.getLogger("tokenmill.kv_transfer")

_STOP = object()
# How long a step that runs no forward (the engine only waits for loads or pulls) waits for one
# to finish before it returns: the engine's loop polls instead of spinning.
IDLE_POLL_SECONDS = 0.005
# Disk writes queued at most (bytes of blocks): past it new ones are skipped, not queued
MAX_PENDING_WRITE_BYTES = 1 << 30


class ConnectorWorker(KVConnectorWorker):
    """``stores``: the offload tiers by name ("host", "disk"); ``sender`` / ``receiver``: the
    producer's and consumer's ends of prefill/decode transfer (None where unused)."""

    def __init__(self, io: BlockIO, stores: Mapping[str, BlockStore] | None = None, *,
                 sender: KVSender | None = None, receiver: KVReceiver | None = None,
                 fingerprint: Mapping[str, Any] | None = None) -> None:
        self.io = io
        self.fingerprint = dict(fingerprint or {})  # the block layout (blocks.py)
        self.stores = dict(stores or {})
        self.sender = sender
        self.receiver = receiver
        self._pending: dict[int, tuple[tuple[int, ...], bytes]] = {}  # disk writes queued
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._last_backlog_warning = -float("inf")
        self._done = threading.Condition()
        self._finished: set[str] = set()
        self._failed: dict[str, int] = {}
        self._in_flight = 0  # loads and pulls queued or running
        self._writes: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run, args=(q, fn), daemon=True, name=n)
                         for q, fn, n in ((self._writes, self._write, "tokenmill-kv-writer"),
                                          (self._loads, self._load, "tokenmill-kv-loader"))]
        for thread in self._threads:
            thread.start()
        self._closed = False

    # ----- the step's thread --------------------------------------------------------------

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        for op in metadata.ops:
            if isinstance(op, SaveBlocks):
                self._save(op)
            elif isinstance(op, MoveBlocks):
                self._move(op)
            elif isinstance(op, DropBlocks):
                self._drop(op)
            elif isinstance(op, ExposeBlocks):
                self._require(self.sender, "expose").expose(op.request_id, op.block_ids,
                                                            op.timeout)
            else:  # LoadBlocks, PullBlocks
                with self._done:
                    self._in_flight += 1
                self._loads.put(op)

    def _save(self, op: SaveBlocks) -> None:
        data = self.io.gather(op.block_ids).numpy()  # (n, block_nbytes) uint8, a copy
        if op.tier == "host":
            store = self.stores["host"]
            for key, tokens, row in zip(op.keys, op.tokens, data):
                store.put(key, tokens, memoryview(row))  # the store keeps its own copy
            return
        for key, tokens, row in zip(op.keys, op.tokens, data):
            self._queue_write(key, tokens, row.tobytes())

    def _queue_write(self, key: int, tokens: tuple[int, ...], data: bytes) -> None:
        """A disk write for the writer thread; past ``MAX_PENDING_WRITE_BYTES`` queued (a disk
        slower than the blocks come) it is skipped: a later load of the block is a miss and
        computes it, where an unbounded queue would grow until memory ran out."""
        with self._pending_lock:
            if self._pending_bytes + len(data) > MAX_PENDING_WRITE_BYTES:
                self._warn_backlog()
                return
            self._unpend(key)
            self._pending[key] = (tokens, data)
            self._pending_bytes += len(data)
        self._writes.put(("put", key, tokens, data))

    def _unpend(self, key: int, entry: tuple | None = None) -> None:
        """Forget a queued write (only ``entry``, when given); under ``_pending_lock``."""
        current = self._pending.get(key)
        if current is not None and (entry is None or current is entry):
            del self._pending[key]
            self._pending_bytes -= len(current[1])

    def _warn_backlog(self) -> None:
        now = time.monotonic()
        if now - self._last_backlog_warning > 60:
            self._last_backlog_warning = now
            logger.warning("the disk tier's writes are %d MiB behind: new blocks are not "
                           "written until it catches up", self._pending_bytes >> 20)

    def _move(self, op: MoveBlocks) -> None:
        src = self.stores[op.src]  # the host tier: the only one above another
        for key, tokens in zip(op.keys, op.tokens):
            data = src.take(key, tokens)
            if data is not None:
                self._queue_write(key, tokens, bytes(data))

    def _drop(self, op: DropBlocks) -> None:
        if op.tier == "host":
            for key in op.keys:
                self.stores["host"].delete(key)
            return
        for key in op.keys:
            with self._pending_lock:
                self._unpend(key)
            self._writes.put(("delete", key, (), b""))

    @staticmethod
    def _require(part: Any, what: str) -> Any:
        if part is None:
            raise RuntimeError(f"a KV op needs this worker to {what}, but it has no side "
                               "channel (--kv-role)")
        return part

    def get_finished(self, wait: float = 0.0) -> KVConnectorOutput:
        with self._done:
            if wait and not (self._finished or self._failed):  # a step with no forward:
                self._done.wait(wait)  # the engine would spin; a load's end wakes it early
            out = KVConnectorOutput(finished_recving=self._finished, failed_recving=self._failed)
            self._finished, self._failed = set(), {}
        if self.sender is not None:
            out.finished_sending = self.sender.take_finished()
        out.tiers = self._tier_stats()
        return out

    def _tier_stats(self) -> dict[str, TierStats]:
        tiers = {name: TierStats(**vars(store.stats)) for name, store in self.stores.items()}
        ends = [end.stats for end in (self.receiver, self.sender) if end is not None]
        if ends:  # the pulls' counts and the sends', as each end keeps them
            p2p = tiers["p2p"] = TierStats()
            for stats in ends:
                p2p.add(stats)
        return tiers

    # ----- the threads --------------------------------------------------------------------

    def _run(self, work: queue.Queue, handle) -> None:
        while True:
            item = work.get()
            if item is _STOP:
                return
            try:
                handle(item)
            except Exception:  # a store's bug must not kill the thread: the op is lost
                logger.exception("a KV transfer op failed")

    def _write(self, item: tuple) -> None:
        kind, key, tokens, data = item
        disk = self.stores["disk"]
        if kind == "delete":
            disk.delete(key)
            return
        with self._pending_lock:
            current = self._pending.get(key)
        if current is None or current[1] is not data:
            return  # dropped or written again since: the later op decides
        disk.put(key, tokens, data)
        with self._pending_lock:
            self._unpend(key, current)

    def _load(self, op: LoadBlocks | PullBlocks) -> None:
        good = 0
        try:
            good = self._pull(op) if isinstance(op, PullBlocks) else self._load_tiers(op)
        finally:
            with self._done:
                self._in_flight -= 1
                if good == len(op.block_ids):
                    self._finished.add(op.request_id)
                else:
                    self._failed[op.request_id] = good
                self._done.notify_all()

    def _pull(self, op: PullBlocks) -> int:
        return self._require(self.receiver, "pull").pull(op)  # which counts it

    def _load_tiers(self, op: LoadBlocks) -> int:
        rows: list[bytes | memoryview] = []
        for key, tokens, tier in zip(op.keys, op.tokens, op.tiers):
            data = self._read(key, tokens, tier)
            if data is None:
                logger.warning("KV block %016x missing from the %s tier: %s computes it",
                               key, tier, op.request_id)
                break
            rows.append(data)
        if rows:
            self.io.scatter(op.block_ids[:len(rows)], bytearray().join(rows))  # writable
        return len(rows)

    def _read(self, key: int, tokens: tuple[int, ...], tier: str) -> bytes | memoryview | None:
        if tier == "disk":
            with self._pending_lock:
                pending = self._pending.get(key)
            if pending is not None and pending[0] == tokens:
                return pending[1]
        return self.stores[tier].get(key, tokens)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"tiers": sorted(self.stores)}
        if self.sender is not None:
            info["side_channel"] = f"{self.sender.host}:{self.sender.port}"
        return info

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for work in (self._loads, self._writes):  # the writer last: pending saves are written
            work.put(_STOP)
        for thread in self._threads:
            thread.join(timeout=30)
        for part in (self.sender, self.receiver, *self.stores.values()):
            if part is not None:
                part.close()
