"""The scheduler's bookkeeping for a KV connector: which sequences wait for KV, which finished
sequences' blocks wait for a consumer, which aborted loads' blocks wait for a worker.

A connector fills some of a request's tokens from elsewhere (another instance's prefill, a
host or disk tier) and keeps a finished request's blocks readable for another instance::

    admission   local prefix (cached) + external tokens (ext) the connector fills:
                blocks for them allocated, update_state_after_alloc, num_computed = cached + ext
      sync      RUNNING: the step's chunk (the rest) runs after the worker fills the blocks
      async     WAITING_FOR_REMOTE_KVS in ``running``: a seat and blocks, never scheduled,
                never preempted, until the workers report the load
    report      finished_recving   RUNNING, its full loaded blocks shared with the prefix cache
                failed_recving     keep the local prefix and the good leading loaded blocks,
                                   trim the rest, RUNNING: it recomputes them
    finish      request_finished -> held (blocks kept, shared with the cache) until
                finished_sending names it; aborted while loading -> orphaned: blocks kept
                (a worker thread may be writing them) until the load is reported, then freed
                without caching

A sync load that fails is reported with the step that ran on it: that step's chunk read wrong
KV, so its samples are dropped and the sequence recomputes from the good blocks. Without a
connector the scheduler holds no ``RemoteKV`` and does none of this.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.cache import CacheIntegrityError, KVBlockManager
from tokenmill.request import Request, RequestStatus
from tokenmill.sched.output import ScheduledChunk

if TYPE_CHECKING:  # the types only: the connector's package may grow heavier imports
    from tokenmill.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Load:
    request: Request
    local: int  # tokens from the local prefix cache (whole blocks)
    external: int  # tokens after them the connector fills
    first: bool  # this admission set the request's num_cached_tokens


class RemoteKV:
    """Holds the connector and the requests whose blocks it has a say in."""

    def __init__(self, connector: KVConnectorScheduler, block_manager: KVBlockManager) -> None:
        self.connector = connector
        self._blocks = block_manager
        self.loading: dict[str, _Load] = {}  # async loads: WAITING_FOR_REMOTE_KVS, in running
        self.held: dict[str, Request] = {}  # finished; blocks readable until finished_sending
        self.orphans: dict[str, Request] = {}  # aborted while loading; blocks until reported
        self._sync: dict[str, _Load] = {}  # sync loads the latest schedule() started
        self.external_cache_hits = 0  # tokens filled at admission (less those that failed)

    # ----- admission -----------------------------------------------------------------------

    def num_external(self, request: Request, num_local: int) -> tuple[int, bool]:
        """Tokens after the local prefix the connector fills, and whether asynchronously;
        never the last token (it is computed, for logits)."""
        ext, is_async = self.connector.get_num_new_matched_tokens(request, num_local)
        ext = min(ext, request.num_tokens - 1 - num_local)
        return (ext, bool(is_async)) if ext > 0 else (0, False)

    def start_load(self, request: Request, num_local: int, num_external: int, is_async: bool,
                   first: bool) -> None:
        """The request was admitted with blocks for its external tokens: the connector queues
        the load; an async one leaves the request waiting for it."""
        table = tuple(self._blocks.block_table(request.request_id))
        self.connector.update_state_after_alloc(request, table, num_local, num_external)
        request.num_computed_tokens = num_local + num_external
        self.external_cache_hits += num_external
        load = _Load(request, num_local, num_external, first)
        if is_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.loading[request.request_id] = load
        else:
            self._sync[request.request_id] = load

    def fills_now(self, request_id: str) -> bool:
        """Whether the step being scheduled fills the request's blocks (a sync load): nobody
        may share them before the load is known to be good."""
        return request_id in self._sync

    # ----- what the workers report ---------------------------------------------------------

    def update(self, output: KVConnectorOutput | None,
               chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Apply what the workers finished; returns the step's chunks less those of sequences
        whose sync load failed (they ran on wrong KV: their samples are dropped)."""
        sync, self._sync = self._sync, {}
        if output is None:
            return chunks
        self.connector.update_connector_output(output)
        # Failures first: a request several ranks report both ways failed.
        redo = {rid for rid, good in output.failed_recving.items() if self._failed(rid, good, sync)}
        for request_id in output.finished_recving:
            self._loaded(request_id)
        for request_id in output.finished_sending:
            request = self.held.pop(request_id, None)
            if request is not None:
                self._blocks.free(request, request.num_computed_tokens)
        return [c for c in chunks if c.request_id not in redo] if redo else chunks

    def _loaded(self, request_id: str) -> None:
        load = self.loading.pop(request_id, None)
        if load is not None:
            load.request.status = RequestStatus.RUNNING
            self._blocks.cache_computed(load.request)
        elif (orphan := self.orphans.pop(request_id, None)) is not None:
            self._blocks.free(orphan)

    def _failed(self, request_id: str, num_good_blocks: int, sync: Mapping[str, _Load]) -> bool:
        """Keep what loaded well, recompute the rest; True for a sync load (drop its chunk)."""
        load = self.loading.pop(request_id, None)
        if load is None:
            if (orphan := self.orphans.pop(request_id, None)) is not None:
                self._blocks.free(orphan)
                return False
            load = sync.get(request_id)
            if load is None:  # a sync load reported after its step ran on it: too late
                logger.error("KV load of %s reported failed, but no load awaits it", request_id)
                return False
            if load.request.status is not RequestStatus.RUNNING:  # aborted during the step
                return False
        request, loaded = load.request, load.local + load.external
        keep = min(load.local + num_good_blocks * self._blocks.block_size, loaded)
        logger.warning("KV load of %s failed after %d blocks: recomputing %d of its %d tokens",
                       request_id, num_good_blocks, request.num_tokens - keep, request.num_tokens)
        request.num_computed_tokens = keep
        self._blocks.trim(request, keep)
        if load.first:
            request.num_cached_tokens = keep
        self.external_cache_hits -= loaded - keep
        request.status = RequestStatus.RUNNING
        self._blocks.cache_computed(request)
        return request_id in sync

    # ----- finishing -----------------------------------------------------------------------

    def finish(self, request: Request) -> bool:
        """A sequence ended (its status says how): tell the connector. True when its blocks
        stay allocated (held for a consumer, or a worker may be writing them)."""
        request_id = request.request_id
        load = self.loading.pop(request_id, None)
        if load is not None or request.status is RequestStatus.FINISHED_ABORTED:
            self.connector.request_aborted(request)
            if load is not None:
                self.orphans[request_id] = request
            return load is not None
        table = tuple(self._blocks.block_table(request_id))
        delay, request.kv_transfer_out = self.connector.request_finished(request, table)
        if delay:
            self.held[request_id] = request
            self._blocks.cache_computed(request)  # readable by others meanwhile too
        return delay

    def owns_any(self, request_ids: Iterable[str]) -> bool:
        """Whether an ended sequence of one of these ids still holds blocks here."""
        return any(i in self.held or i in self.orphans for i in request_ids)

    # ----- state -----------------------------------------------------------------------------

    @property
    def has_pending_work(self) -> bool:
        return bool(self.loading or self.held or self.orphans) or self.connector.has_pending_work

    def counters(self) -> dict[str, int]:
        """``SchedulerStats`` fields."""
        return {"num_loading": len(self.loading), "num_held": len(self.held),
                "external_cache_hits": self.external_cache_hits}

    def check_integrity(self, running: Iterable[Request], live: Mapping[str, Request]) -> set[str]:
        """Loading sequences are running and wait; held and orphaned ones ended and are no
        longer live. Returns the ids of ended sequences that may hold blocks."""
        waiting = {r.request_id: r for r in running
                   if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS}
        _require(waiting == {i: load.request for i, load in self.loading.items()},
                 f"loading {sorted(self.loading)} but {sorted(waiting)} wait for KV in running")
        ended = {**self.held, **self.orphans}
        _require(len(ended) == len(self.held) + len(self.orphans), "held and orphaned at once")
        for request_id, request in ended.items():
            _require(request.is_finished and request_id not in live,
                     f"{request_id} holds blocks for KV transfer but is {request.status}")
        return set(ended)

def _require(ok: bool, message: str) -> None:
    if not ok:
        raise CacheIntegrityError(message)
