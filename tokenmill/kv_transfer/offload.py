"""The tiered prefix cache, scheduler side: what the radix cache evicts goes down a tier, and a
prompt whose next blocks a tier holds loads them back instead of computing them.

    KV cache (radix tree)   --evicted-->   host tier (RAM)   --LRU victim-->   disk tier
         ^                                      |                                  |
         +--------- loaded back on a hit -------+----------------------------------+

    --kv-offload host    tiers: [host]          evicted blocks kept in RAM, LRU beyond the size
    --kv-offload disk    tiers: [host?, disk]   every block the tree adopts is also written to
                                                disk (write-through: the files survive a crash
                                                or restart); an optional RAM tier in front
                                                holds evicted blocks for faster reloads

Blocks are named by the radix cache's chained hashes (``cache/events.py``; the prefix-cache
namespace, cache salt and LoRA adapter, enters the first), so a hit needs no token comparison
here: the worker checks each block's stored tokens when it loads it. This side is the
authority on what each tier holds (an ordered dict per tier, least recently used first); the
workers only carry out the ops it emits, in order, so their stores mirror it exactly. A key
a load still needs is pinned: no tier drops it first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.cache.events import chain_hashes
from tokenmill.kv_transfer.base import (DropBlocks, KVConnectorOutput, LoadBlocks,
                                        MoveBlocks, QueuedOpsScheduler, SaveBlocks, TierStats)
from tokenmill.request import Request

Tokens = tuple[int, ...] | None  # None: a block found on disk at start-up


class TierIndex:
    """What one tier holds: key -> the block's tokens, least recently used first."""

    def __init__(self, name: str, capacity_blocks: int) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.keys: OrderedDict[int, Tokens] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def add(self, key: int, tokens: Tokens) -> None:
        self.keys[key] = tokens
        self.keys.move_to_end(key)

    def touch(self, key: int) -> None:
        self.keys.move_to_end(key)

    def victims(self, pinned: Counter[int]) -> list[int]:
        """Least recently used unpinned keys past the capacity (taken out of the index)."""
        over = len(self.keys) - self.capacity_blocks
        out: list[int] = []
        if over <= 0:
            return out
        for key in self.keys:
            if len(out) == over:
                break
            if not pinned[key]:
                out.append(key)
        return out


class OffloadScheduler(QueuedOpsScheduler):
    """``tiers``: fastest first, ``(name, capacity in blocks)``; ``write_through``: blocks the
    radix cache adopts are saved to the last tier at once (disk), not only when evicted.
    ``known``: keys (with tokens) a persistent tier already holds at start-up, oldest first."""

    def __init__(self, tiers: Sequence[tuple[str, int]], block_size: int, *,
                 write_through: bool = False,
                 known: Mapping[str, Sequence[tuple[int, Tokens]]] | None = None) -> None:
        if not tiers:
            raise ValueError("an offload connector needs at least one tier")
        super().__init__()
        self.block_size = block_size
        self.tiers = [TierIndex(name, capacity) for name, capacity in tiers]
        self.write_through = write_through
        for tier in self.tiers:
            for key, tokens in (known or {}).get(tier.name, ()):
                tier.add(key, tokens)
        self._pinned: Counter[int] = Counter()  # keys a queued or running load reads
        self._loads: dict[str, tuple[int, ...]] = {}  # request id -> keys it pinned
        self._hashes: dict[str, tuple[int, tuple[int, ...]]] = {}  # request -> (tokens, keys)
        self._stats: dict[str, TierStats] = {}

    # ----- the radix cache's listener -----------------------------------------------------

    def blocks_cached(self, hashes: Sequence[int], tokens: Sequence[int],
                      blocks: Sequence[int]) -> None:
        if not self.write_through:
            return
        last = self.tiers[-1]
        new = [i for i, key in enumerate(hashes) if key not in last]
        self._save(last, [hashes[i] for i in new], [blocks[i] for i in new],
                   [self._block_tokens(tokens, i) for i in new])

    def blocks_evicted(self, hashes: Sequence[int], tokens: Sequence[int],
                       blocks: Sequence[int]) -> None:
        first = self.tiers[0]
        if self.write_through and len(self.tiers) == 1:
            for key in hashes:  # on disk already (written when cached): only used again
                if key in first:
                    first.touch(key)
            return
        new = []
        for i, key in enumerate(hashes):
            if key in first:
                first.touch(key)
            else:
                new.append(i)
        self._save(first, [hashes[i] for i in new], [blocks[i] for i in new],
                   [self._block_tokens(tokens, i) for i in new])

    def _block_tokens(self, tokens: Sequence[int], i: int) -> Tokens:
        return tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

    def _save(self, tier: TierIndex, keys: list[int], blocks: list[int],
              tokens: list[Tokens]) -> None:
        if not keys:
            return
        self._ops.append(SaveBlocks(tuple(keys), tuple(blocks), tuple(tokens), tier.name))
        for key, toks in zip(keys, tokens):
            tier.add(key, toks)
        self._spill(self.tiers.index(tier))

    def _spill(self, level: int) -> None:
        """Past its capacity, a tier's LRU blocks go to the next tier (or are dropped)."""
        tier = self.tiers[level]
        victims = tier.victims(self._pinned)
        if not victims:
            return
        tokens = [tier.keys.pop(key) for key in victims]
        below = self.tiers[level + 1] if level + 1 < len(self.tiers) else None
        if below is None:
            self._ops.append(DropBlocks(tuple(victims), tier.name))
            return
        moving = [i for i, key in enumerate(victims) if key not in below]
        staying = [key for key in victims if key in below]
        if staying:  # the tier below has them already (written through): drop the copies
            self._ops.append(DropBlocks(tuple(staying), tier.name))
            for key in staying:
                below.touch(key)
        if moving:
            keys = tuple(victims[i] for i in moving)
            self._ops.append(MoveBlocks(keys, tuple(tokens[i] for i in moving), tier.name,
                                        below.name))
            for i in moving:
                below.add(victims[i], tokens[i])
            self._spill(level + 1)

    # ----- admission ----------------------------------------------------------------------

    def _keys(self, request: Request) -> tuple[int, ...]:
        """Chained hashes of the request's whole blocks short of its last token (cached per
        request while its token count stays the same)."""
        n = (request.num_tokens - 1) // self.block_size * self.block_size
        cached = self._hashes.get(request.request_id)
        if cached is None or cached[0] != n:
            keys = chain_hashes(None, request.token_ids_slice(0, n), self.block_size,
                                request.prefix_namespace)
            cached = self._hashes[request.request_id] = (n, keys)
        return cached[1]

    def _tier_of(self, key: int) -> TierIndex | None:
        return next((tier for tier in self.tiers if key in tier), None)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        keys = self._keys(request)
        first = num_computed_tokens // self.block_size
        found = 0
        while first + found < len(keys) and self._tier_of(keys[first + found]) is not None:
            found += 1
        return found * self.block_size, True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        first = num_local_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        keys = self._keys(request)[first:last]
        tiers = [self._tier_of(key) for key in keys]
        for key, tier in zip(keys, tiers):
            tier.touch(key)
            self._pinned[key] += 1
        self._loads[request.request_id] = keys
        bs = self.block_size
        tokens = tuple(tuple(request.token_ids_slice(i * bs, (i + 1) * bs))
                       for i in range(first, last))
        self._ops.append(LoadBlocks(request.request_id, keys, tuple(block_ids[first:last]),
                                    tokens, tuple(tier.name for tier in tiers)))

    # ----- each step ----------------------------------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id, good in output.failed_recving.items():
            self._forget_bad(request_id, good)
        for request_id in output.finished_recving | output.failed_recving.keys():
            self._unpin(request_id)
        if output.tiers:
            self._stats = dict(output.tiers)

    def _forget_bad(self, request_id: str, good: int) -> None:
        """The first block a worker could not load (corrupt, truncated, removed behind our
        back) is no hit any more: the worker dropped its copy, and the index forgets it."""
        keys = self._loads.get(request_id, ())
        if good < len(keys):
            for tier in self.tiers:
                tier.keys.pop(keys[good], None)

    def _unpin(self, request_id: str) -> None:
        for key in self._loads.pop(request_id, ()):
            self._pinned[key] -= 1
            if not self._pinned[key]:
                del self._pinned[key]

    def request_finished(self, request: Request,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        self._hashes.pop(request.request_id, None)
        return False, None

    def request_aborted(self, request: Request) -> None:
        self._hashes.pop(request.request_id, None)

    @property
    def has_pending_work(self) -> bool:
        return bool(self._ops or self._loads)

    def stats(self) -> Mapping[str, TierStats]:
        return self._stats

    def describe(self) -> dict[str, Any]:
        return {"offload": [{"tier": t.name, "capacity_blocks": t.capacity_blocks,
                             "blocks": len(t.keys)} for t in self.tiers],
                "write_through": self.write_through}
