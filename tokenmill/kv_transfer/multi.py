"""Prefill/decode hand-over and offload tiers in one engine: a decode instance that also keeps
its prefix cache in RAM or on disk (``--kv-role`` with ``--kv-offload``).

A request's external tokens come from one of them: the hand-over when it carries a producer's
``kv_transfer_params``, else the tiers. Each step's ops are the tiers' first, then the hand-
over's: a block the tiers save as it is evicted is copied out before a pull can write into it
(a block is only ever written after the eviction that freed it was decided).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.kv_transfer.base import (KVConnectorMetadata, KVConnectorOutput,
                                        KVConnectorScheduler, TierStats)
from tokenmill.kv_transfer.offload import OffloadScheduler
from tokenmill.kv_transfer.pd import PDScheduler
from tokenmill.request import Request


class PDWithOffload(KVConnectorScheduler):
    def __init__(self, pd: PDScheduler, offload: OffloadScheduler) -> None:
        self.pd = pd
        self.offload = offload
        self.role = pd.role
        self._source: dict[str, KVConnectorScheduler] = {}  # request -> who fills it

    # the radix cache's listener: the tiers'
    def blocks_cached(self, hashes: Sequence[int], tokens: Sequence[int],
                      blocks: Sequence[int]) -> None:
        self.offload.blocks_cached(hashes, tokens, blocks)

    def blocks_evicted(self, hashes: Sequence[int], tokens: Sequence[int],
                       blocks: Sequence[int]) -> None:
        self.offload.blocks_evicted(hashes, tokens, blocks)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        for source in (self.pd, self.offload):  # the hand-over first: it covers the prompt
            ext, is_async = source.get_num_new_matched_tokens(request, num_computed_tokens)
            if ext:
                self._source[request.request_id] = source
                return ext, is_async
        self._source.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        source = self._source.pop(request.request_id, None)
        if source is not None:
            source.update_state_after_alloc(request, block_ids, num_local_tokens,
                                            num_external_tokens)

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        ops = [op for source in (self.offload, self.pd)
               for meta in (source.build_connector_meta(),) if meta is not None
               for op in meta.ops]
        return KVConnectorMetadata(tuple(ops)) if ops else None

    def request_finished(self, request: Request,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        self._source.pop(request.request_id, None)
        self.offload.request_finished(request, block_ids)
        return self.pd.request_finished(request, block_ids)

    def request_aborted(self, request: Request) -> None:
        self._source.pop(request.request_id, None)
        self.offload.request_aborted(request)
        self.pd.request_aborted(request)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.offload.update_connector_output(output)
        self.pd.update_connector_output(output)

    @property
    def has_pending_work(self) -> bool:
        return self.offload.has_pending_work or self.pd.has_pending_work

    def stats(self) -> Mapping[str, TierStats]:
        return {**self.offload.stats(), **self.pd.stats()}

    def describe(self) -> dict[str, Any]:
        return {**self.pd.describe(), **self.offload.describe()}
