"""A KV connector over tensor / pipeline parallel ranks: each rank moves its own shard of every
block (its KV heads, its stage's layers) and reports on its own; the engine hears of a request
once every rank has.

    rank 0   step 7: finished_recving {a}      step 8: failed_recving {b: 3}
    rank 1   step 7: -                         step 8: finished_recving {a, b}
    engine   step 7: nothing yet               step 8: finished {a}, failed {b: 3}

A load that failed on any rank fails with the fewest good blocks any rank wrote, and only once
all ranks are done with it (no rank's thread may still be writing its blocks when they are
reused). Tier counters are each rank's latest, summed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.kv_transfer.base import KVConnectorOutput, TierStats

_ALL = 1 << 62  # "every block": a rank's success, as a count of good blocks


class RankKVReports:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._recv: dict[str, dict[int, int]] = {}  # request -> rank -> good blocks
        self._send: dict[str, set[int]] = {}  # request -> ranks whose consumer is done
        self._tiers: dict[int, dict[str, TierStats]] = {}

    def add(self, rank: int, output: KVConnectorOutput) -> None:
        for request_id in output.finished_recving:
            self._recv.setdefault(request_id, {})[rank] = _ALL
        for request_id, good in output.failed_recving.items():
            self._recv.setdefault(request_id, {})[rank] = good
        for request_id in output.finished_sending:
            self._send.setdefault(request_id, set()).add(rank)
        if output.tiers:
            self._tiers[rank] = output.tiers

    def take(self) -> KVConnectorOutput:
        """What every rank has reported since, as one report (the rest waits for the others)."""
        out = KVConnectorOutput()
        for request_id, ranks in list(self._recv.items()):
            if len(ranks) == self.world_size:
                del self._recv[request_id]
                good = min(ranks.values())
                if good == _ALL:
                    out.finished_recving.add(request_id)
                else:
                    out.failed_recving[request_id] = good
        for request_id, ranks in list(self._send.items()):
            if len(ranks) == self.world_size:
                del self._send[request_id]
                out.finished_sending.add(request_id)
        for tiers in self._tiers.values():
            for name, stats in tiers.items():
                out.tiers.setdefault(name, TierStats()).add(stats)
        return out


def merge_connector_info(infos: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ranks' start-up findings as one (rank 0 first): a block's bytes are every rank's
    shards together, the side channel is rank 0's (rank r listens at port + r), and a block
    is on disk when every rank's shard of it is."""
    first = infos[0]
    merged = dict(first)
    merged["block_nbytes"] = sum(info["block_nbytes"] for info in infos)
    on_all = set.intersection(*({key for key, _ in info["disk_known"]} for info in infos))
    merged["disk_known"] = [(key, size) for key, size in first["disk_known"] if key in on_all]
    return merged
