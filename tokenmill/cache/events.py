"""Block hashes and the change log behind KV events: what the prefix cache stored and dropped.

A consumer (``tokenmill router``, Dynamo, llm-d) mirrors a worker's cache from its events, so
every cached block needs a name that stays the same while the block stays cached, whatever the
tree does to its nodes (a split keeps each block's hash). The name is a 64-bit hash chained on
the parent block's, so equal tokens under different parents, or different prefix-cache
namespaces (``cache_salt`` and LoRA adapter, ``Request.prefix_namespace``), never share one::

    root block   h0 = blake2b8(salt?, tokens[0:bs])      parent_block_hash = None
    next block   h1 = blake2b8(h0, tokens[bs:2bs])       parent_block_hash = h0 (in BlockStored)

Hashes are only computed while events are on (``RadixPrefixCache.enable_events``): a cache
without them stores no hash and logs nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import TYPE_CHECKING

from tokenmill.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from tokenmill.request import LoRARequest

# blake2b's personalisation keeps the three kinds of input apart: a root block without a salt,
# a root block under a salt, and a block continuing a parent, can never hash the same bytes.
_ROOT, _SALTED_ROOT, _CHILD = b"tm-root", b"tm-salted", b"tm-child"


def block_hash(parent: int | None, block: Sequence[int], salt: str | None = None) -> int:
    """The unsigned 64-bit hash of one block of token ids: chained on ``parent``'s hash, or,
    for a root block (``parent`` None), on the request's ``salt``."""
    if parent is not None:
        h = blake2b(parent.to_bytes(8, "big"), digest_size=8, person=_CHILD)
    elif salt is None:
        h = blake2b(digest_size=8, person=_ROOT)
    else:
        raw = salt.encode()
        h = blake2b(len(raw).to_bytes(8, "big") + raw, digest_size=8, person=_SALTED_ROOT)
    h.update(array("q", block).tobytes())
    return int.from_bytes(h.digest(), "big")


def chain_hashes(parent: int | None, tokens: Sequence[int], block_size: int,
                 salt: str | None = None) -> tuple[int, ...]:
    """Hashes of the whole blocks of ``tokens``, each chained on the one before (the first on
    ``parent``); the salt only enters a root block, whose hash the rest then carry."""
    hashes = []
    for start in range(0, len(tokens), block_size):
        parent = block_hash(parent, tokens[start:start + block_size], salt)
        hashes.append(parent)
    return tuple(hashes)


class CacheEventLog:
    """The cache's changes since the engine last took them, in the order they happened (a
    consumer replays them in order, so a block stored and then evicted in one step nets out)."""

    def __init__(self, block_size: int, record: bool = True) -> None:
        self.block_size = block_size
        # False: blocks are hashed (a KV connector names them so) but no events are kept
        self.record = record
        self._events: list[KVCacheEvent] = []

    def stored(self, parent: int | None, tokens: Sequence[int], salt: str | None,
               lora: LoRARequest | None = None) -> tuple[int, ...]:
        """Log a new run of whole blocks continuing ``parent`` (None: at a root, under
        ``salt``), computed under ``lora`` (None: the base model); returns their hashes, which
        the tree keeps beside the blocks."""
        hashes = chain_hashes(parent, tokens, self.block_size, salt)
        if self.record:
            lora_id, lora_name = (None, None) if lora is None else (lora.lora_int_id,
                                                                    lora.lora_name)
            self._events.append(BlockStored(list(hashes), parent, list(tokens), self.block_size,
                                            lora_id=lora_id, lora_name=lora_name))
        return hashes

    def removed(self, hashes: Sequence[int]) -> None:
        if self.record:
            self._events.append(BlockRemoved(list(hashes)))

    def mark(self) -> int:
        """A position to ``cleared`` back to."""
        return len(self._events)

    def cleared(self, since: int) -> None:
        """Every block is gone: the removals logged since ``since`` say nothing a consumer
        needs beyond one ``AllBlocksCleared`` (stores before them still come first)."""
        del self._events[since:]
        if self.record:
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
