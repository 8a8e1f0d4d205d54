"""Automatic prefix caching: a radix tree over token ids whose nodes hold full KV blocks.

    root("")                       one root per cache_salt: different salts never share
     +- [sys prompt: 4 blocks]     node key = token ids of whole blocks, value = their block ids
         +- [user A: 2 blocks]     a request matching sys + A takes 6 blocks by reference
         +- [user B: 1 block]      inserting sys + B split nothing; inserting half of sys
                                   (or locking a match that ends inside it) would split the
                                   first node in two; a match alone never changes the tree

Ownership: the tree holds one pool reference on every block it stores; a request that uses a
cached block holds one more (its block table), and locks the node path it matched so that the
tree never evicts what is in use. Unlocked leaves are evicted least-recently-used, and only when
the pool runs out of free blocks (the ``KVBlockManager`` asks). The candidates live in a heap
kept up to date as nodes change, so an eviction costs O(log n) per node, not a walk of the tree.

KV events (``enable_events``, off by default): each node also holds a chained 64-bit hash per
block (``cache/events.py``); a new leaf logs one ``BlockStored``, an evicted one a
``BlockRemoved``, a flush that empties the tree ``AllBlocksCleared``. The engine takes the log
once per step and publishes it, so a consumer's mirror holds exactly the tree's blocks.

Block listener (``set_block_listener``, a KV connector's offload tiers): told of every block the
tree adopts and every block it evicts for room, by hash, tokens and block id, while the block
still holds its KV (the listener copies it out before the block is written again). A flush
tells it nothing: flushed blocks are dropped, not kept elsewhere.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tokenmill.cache.block_pool import BlockPool, CacheIntegrityError

if TYPE_CHECKING:  # imported by enable_events: msgspec's import costs a cache without events
    from tokenmill.cache.events import CacheEventLog
    from tokenmill.kv_events import KVCacheEvent
    from tokenmill.request import LoRARequest

Salt = str | None
CacheEntry = tuple[Salt, tuple[int, ...], tuple[int, ...]]  # salt, path tokens, path blocks

# The eviction heap is rebuilt once it holds this many entries per node (plus a little), so
# stale entries cost O(nodes) memory and O(1) amortised time per push.
_HEAP_ENTRIES_PER_NODE = 4
_HEAP_SLACK = 64


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]  # token ids of whole blocks (len == len(blocks) * block_size)
    blocks: list[int]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # by first block
    lock_ref: int = 0  # locks on this node or any descendant
    last_access: int = 0
    # Set once evicted: its heap entries are stale. It keeps ``parent`` so that a handle that
    # still points at it can walk up to the locked path above it.
    dropped: bool = False
    # one chained hash per block while KV events are on, else empty (a tuple: the empty one is
    # shared, and slicing it in a split costs nothing)
    hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefixHandle:
    """A matched prefix: ``blocks`` hold the KV of the first ``num_tokens`` tokens. The blocks
    are only safe to use while the handle is locked (or the caller holds its own references).
    ``node`` is where the match ended, possibly inside it; the last block, found walking up
    from it, is where lock and unlock start (splits keep the lower part's identity)."""

    num_tokens: int = 0
    blocks: tuple[int, ...] = ()
    node: _Node | None = field(default=None, repr=False)


EMPTY_HANDLE = PrefixHandle()


class BlockListener(Protocol):
    """What a ``RadixPrefixCache`` tells about blocks entering and leaving it (``hashes[i]``
    names block ``blocks[i]``, which holds ``tokens[i * block_size:(i + 1) * block_size]``)."""

    def blocks_cached(self, hashes: Sequence[int], tokens: Sequence[int],
                      blocks: Sequence[int]) -> None: ...

    def blocks_evicted(self, hashes: Sequence[int], tokens: Sequence[int],
                       blocks: Sequence[int]) -> None: ...


class PrefixCache(ABC):
    """Maps token-id prefixes (whole blocks, per salt) to KV blocks.

    Invariants: a cached block is referenced by the tree exactly once; a locked node is never
    evicted, and neither is any ancestor of it; lock counts never go negative; evicting only
    ever drops the tree's own reference.
    """

    @abstractmethod
    def match(self, token_ids: Sequence[int], salt: Salt = None) -> PrefixHandle:
        """The longest cached prefix of ``token_ids`` (whole blocks). Only reads the tree: no
        split, no LRU touch, so it is safe to call speculatively (cache-aware scheduling).
        Takes no reference: lock the handle before another allocation could evict its blocks
        (inserts in between are fine)."""

    @abstractmethod
    def lock(self, handle: PrefixHandle) -> None:
        """Protect the handle's blocks from eviction and mark them recently used. May split the
        node the match ended inside, so that a locked path ends exactly at the handle's last
        block."""

    @abstractmethod
    def unlock(self, handle: PrefixHandle) -> None:
        """Undo one ``lock`` (exactly the path it locked); the blocks become evictable when no
        lock is left."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], salt: Salt = None,
               lora: LoRARequest | None = None) -> int:
        """Cache the full blocks ``blocks`` holding ``token_ids`` (whole blocks). Prefixes already
        cached keep their blocks (the caller's duplicates stay the caller's to free); new blocks
        get one tree reference. Returns the number of blocks adopted. ``lora``: the adapter the
        KV was computed under, which KV events name (the salt already keeps adapters apart)."""

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``num_blocks`` blocks went
        back to the free queue or nothing is evictable. Returns the blocks freed."""

    @property
    @abstractmethod
    def num_evictable_blocks(self) -> int:
        """Cached blocks on unlocked nodes (what ``evict`` could free at most)."""

    @property
    @abstractmethod
    def num_cached_blocks(self) -> int:
        ...

    @abstractmethod
    def references(self) -> Counter[int]:
        """Pool references the cache holds, per block, after checking the tree's own invariants
        (raises ``CacheIntegrityError``). For ``check_integrity``; O(nodes)."""

    @abstractmethod
    def entries(self) -> list[CacheEntry]:
        """One ``(salt, tokens, blocks)`` per tree node, depth first: the whole path from the
        root to the end of that node. Read-only, O(nodes * depth); for tests and debugging."""

    def flush(self) -> int:
        """Drop every unlocked entry; returns the number of blocks dropped."""
        return self.evict(self.num_evictable_blocks)

    def enable_events(self) -> None:
        """Log KV events from now on (``take_events``). A cache that holds nothing has nothing
        to log: the null cache ignores this."""

    def take_events(self) -> list[KVCacheEvent]:
        """The events logged since the last call, oldest first ([] while events are off)."""
        return []

    def set_block_listener(self, listener: BlockListener) -> None:
        """Tell ``listener`` of blocks cached and evicted from now on (the null cache has none
        to tell of)."""


class NullPrefixCache(PrefixCache):
    """Caches nothing: what ``enable_prefix_caching=False`` (``--no-prefix-cache``) selects."""

    def match(self, token_ids: Sequence[int], salt: Salt = None) -> PrefixHandle:
        return EMPTY_HANDLE

    def lock(self, handle: PrefixHandle) -> None:
        pass

    def unlock(self, handle: PrefixHandle) -> None:
        pass

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], salt: Salt = None,
               lora: LoRARequest | None = None) -> int:
        return 0

    def evict(self, num_blocks: int) -> int:
        return 0

    @property
    def num_evictable_blocks(self) -> int:
        return 0

    @property
    def num_cached_blocks(self) -> int:
        return 0

    def references(self) -> Counter[int]:
        return Counter()

    def entries(self) -> list[CacheEntry]:
        return []


class RadixPrefixCache(PrefixCache):
    """The radix tree. Matching and inserting cost O(prompt length), locking O(path length);
    evicting O(log n) per node evicted (a heap of unlocked leaves whose stale entries are
    skipped when popped)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._roots: dict[Salt, _Node] = {}
        self._clock = itertools.count(1)
        self._num_cached = 0
        self._num_evictable = 0
        self._num_nodes = 0  # roots excluded
        # (last_access, push order, node): an entry is current while its node is still an
        # attached unlocked leaf last used at that time. Nodes are pushed when they become one
        # or are used again, rather than the tree being searched when blocks are needed.
        self._heap: list[tuple[int, int, _Node]] = []
        self._pushes = itertools.count()
        self._log: CacheEventLog | None = None  # block hashes (and KV events, when enabled)
        self._listener: BlockListener | None = None

    def enable_events(self) -> None:
        self._hash_blocks().record = True

    def set_block_listener(self, listener: BlockListener) -> None:
        self._hash_blocks()
        self._listener = listener

    def _hash_blocks(self) -> CacheEventLog:
        """Name every block by its chained hash from now on (events recorded or not)."""
        from tokenmill.cache.events import CacheEventLog

        if self._log is None:
            if self._num_cached:  # blocks cached before would have no hash to name them by
                raise CacheIntegrityError("block hashes (KV events, a KV connector) must be "
                                          "enabled while the cache is empty")
            self._log = CacheEventLog(self.block_size, record=False)
        return self._log

    def take_events(self) -> list[KVCacheEvent]:
        return self._log.take() if self._log is not None else []

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    # ----- lookup -----------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], salt: Salt = None) -> PrefixHandle:
        node, blocks = self._roots.get(salt), []
        if node is None:
            return EMPTY_HANDLE
        tokens = tuple(token_ids[:len(token_ids) // self.block_size * self.block_size])
        while len(blocks) * self.block_size < len(tokens):
            child = node.children.get(self._block(tokens, len(blocks)))
            if child is None:
                break
            same = self._common_blocks(child.key, tokens, len(blocks) * self.block_size)
            node = child
            blocks += child.blocks[:same]
            if same < len(child.blocks):
                break  # ends inside ``child``: lock() splits it, not us
        if not blocks:
            return EMPTY_HANDLE
        return PrefixHandle(len(blocks) * self.block_size, tuple(blocks), node)

    def lock(self, handle: PrefixHandle) -> None:
        if not handle.blocks:
            return
        node, index = self._holder(handle)
        if index + 1 < len(node.blocks):
            node = self._split(node, index + 1)  # unlock finds the path by where it ends
        now = next(self._clock)
        for n in self._path(node):
            if n.lock_ref == 0:
                self._num_evictable -= len(n.blocks)
            n.lock_ref += 1
            n.last_access = now

    def unlock(self, handle: PrefixHandle) -> None:
        if not handle.blocks:
            return
        node, index = self._holder(handle)
        if index + 1 < len(node.blocks) or node.lock_ref <= 0:
            raise CacheIntegrityError(f"unlock of an unlocked prefix ending at block "
                                      f"{handle.blocks[-1]}")
        # An ancestor holds at least its children's locks, so none of these goes negative.
        for n in self._path(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_evictable += len(n.blocks)
                self._push(n)

    def _holder(self, handle: PrefixHandle) -> tuple[_Node, int]:
        """The tree node holding the handle's last block, and that block's index in it. A split
        only adds a node above the part it cuts, so it is ``handle.node`` or above it."""
        last, node = handle.blocks[-1], handle.node
        while node is not None and node.parent is not None:
            if not node.dropped and last in node.blocks:
                return node, node.blocks.index(last)
            node = node.parent
        raise CacheIntegrityError(f"prefix block {last} is no longer cached (evicted before "
                                  "the handle was locked?)")

    # ----- insert -----------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], salt: Salt = None,
               lora: LoRARequest | None = None) -> int:
        tokens = tuple(token_ids)
        if len(tokens) != len(blocks) * self.block_size:
            raise ValueError(f"{len(tokens)} tokens are not {len(blocks)} whole blocks")
        if not blocks:
            return 0
        node = self._roots.setdefault(salt, _Node((), [], None))
        done, now = 0, next(self._clock)
        while done < len(blocks):
            child = node.children.get(self._block(tokens, done))
            if child is None:
                self._add_leaf(node, tokens[done * self.block_size:], list(blocks[done:]), now,
                               salt, lora)
                return len(blocks) - done
            same = self._common_blocks(child.key, tokens, done * self.block_size)
            if same < len(child.blocks):
                child = self._split(child, same)
            child.last_access = now
            self._push(child)
            node, done = child, done + same
        return 0

    def _add_leaf(self, parent: _Node, key: tuple[int, ...], blocks: list[int], now: int,
                  salt: Salt, lora: LoRARequest | None) -> None:
        for block_id in blocks:
            self.pool.incref(block_id)
        leaf = _Node(key, blocks, parent, last_access=now)
        if self._log is not None:  # a root's children have no parent hash: the salt instead
            leaf.hashes = self._log.stored(parent.hashes[-1] if parent.hashes else None, key,
                                           salt, lora)
        parent.children[key[:self.block_size]] = leaf
        if self._listener is not None:
            self._listener.blocks_cached(leaf.hashes, key, blocks)
        self._num_cached += len(blocks)
        self._num_evictable += len(blocks)
        self._num_nodes += 1
        self._push(leaf)

    def _split(self, node: _Node, num_blocks: int) -> _Node:
        """Cut ``node`` after ``num_blocks`` blocks; the new upper part is returned. The lower
        part keeps its identity, so handles that point at it stay valid (and so do its heap
        entries: it is still a leaf or not, last used when it was)."""
        cut = num_blocks * self.block_size
        upper = _Node(node.key[:cut], node.blocks[:num_blocks], node.parent,
                      lock_ref=node.lock_ref, last_access=node.last_access,
                      hashes=node.hashes[:num_blocks])
        node.parent.children[upper.key[:self.block_size]] = upper
        node.key, node.blocks, node.parent = node.key[cut:], node.blocks[num_blocks:], upper
        node.hashes = node.hashes[num_blocks:]
        upper.children[node.key[:self.block_size]] = node
        self._num_nodes += 1
        return upper

    # ----- eviction ---------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        freed = 0
        while freed < num_blocks and self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if self._is_current(node, last_access):
                freed += self._drop(node)
        self._maybe_compact()
        return freed

    def _drop(self, leaf: _Node) -> int:
        parent = leaf.parent
        del parent.children[leaf.key[:self.block_size]]
        leaf.dropped = True
        if self._log is not None:
            self._log.removed(leaf.hashes)
        if self._listener is not None:
            self._listener.blocks_evicted(leaf.hashes, leaf.key, leaf.blocks)
        freed = 0
        for block_id in reversed(leaf.blocks):
            freed += self.pool.ref_count(block_id) == 1  # else a request still holds it
            self.pool.free(block_id)
        self._num_cached -= len(leaf.blocks)
        self._num_evictable -= len(leaf.blocks)
        self._num_nodes -= 1
        self._push(parent)  # left childless, it is a candidate at its own last use
        return freed

    def flush(self) -> int:
        """As the base class; a flush that empties the tree logs one ``AllBlocksCleared``
        instead of a removal per node."""
        mark = self._log.mark() if self._log is not None else 0
        listener, self._listener = self._listener, None  # flushed blocks are not kept
        try:
            freed = self.evict(self.num_evictable_blocks)
        finally:
            self._listener = listener
        if self._log is not None and not self._num_cached:
            self._log.cleared(mark)
        return freed

    def _push(self, node: _Node) -> None:
        """Make ``node`` an eviction candidate at its current ``last_access``, if it can be one."""
        if self._evictable_leaf(node):
            heapq.heappush(self._heap, (node.last_access, next(self._pushes), node))
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Drop stale entries (and duplicates) once they far outnumber the nodes."""
        if len(self._heap) <= _HEAP_ENTRIES_PER_NODE * self._num_nodes + _HEAP_SLACK:
            return
        current = {id(n): (t, k, n) for t, k, n in self._heap if self._is_current(n, t)}
        self._heap = list(current.values())
        heapq.heapify(self._heap)

    @staticmethod
    def _evictable_leaf(node: _Node) -> bool:
        return (node.parent is not None and not node.dropped and not node.children
                and node.lock_ref == 0)

    def _is_current(self, node: _Node, last_access: int) -> bool:
        return self._evictable_leaf(node) and node.last_access == last_access

    # ----- helpers ----------------------------------------------------------------------------

    def _nodes(self) -> list[_Node]:
        stack, nodes = list(self._roots.values()), []
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    @staticmethod
    def _path(node: _Node | None) -> list[_Node]:
        """``node`` and its ancestors, roots excluded."""
        path = []
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        return path

    def _block(self, tokens: tuple[int, ...], index: int) -> tuple[int, ...]:
        return tokens[index * self.block_size:(index + 1) * self.block_size]

    def _common_blocks(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Whole blocks ``key`` shares with ``tokens[start:]`` (the first one is known equal)."""
        bs, n = self.block_size, 1
        while (n * bs < len(key) and start + (n + 1) * bs <= len(tokens)
               and key[n * bs:(n + 1) * bs] == tokens[start + n * bs:start + (n + 1) * bs]):
            n += 1
        return n

    # ----- introspection ----------------------------------------------------------------------

    def entries(self) -> list[CacheEntry]:
        found: list[CacheEntry] = []
        stack = [(salt, root, (), ()) for salt, root in self._roots.items()]
        while stack:
            salt, node, tokens, blocks = stack.pop()
            if node.parent is not None:
                found.append((salt, tokens, blocks))
            stack.extend((salt, child, tokens + child.key, blocks + tuple(child.blocks))
                         for child in node.children.values())
        return found

    def references(self) -> Counter[int]:
        held: Counter[int] = Counter()
        evictable = 0
        nodes = self._nodes()
        for node in nodes:
            if node.parent is None:
                _check(not node.blocks and node.lock_ref == 0, "a root holds blocks or locks")
            else:
                self._check_node(node)
                evictable += 0 if node.lock_ref else len(node.blocks)
            held.update(node.blocks)
        _check(all(c == 1 for c in held.values()), "a block is cached twice")
        _check(sum(held.values()) == self._num_cached, "cached block count is off")
        _check(evictable == self._num_evictable, "evictable block count is off")
        _check(len(nodes) - len(self._roots) == self._num_nodes, "node count is off")
        self._check_heap(nodes)
        return held

    def _check_node(self, node: _Node) -> None:
        _check(bool(node.blocks) and len(node.key) == len(node.blocks) * self.block_size,
               f"node key of {len(node.key)} tokens for {len(node.blocks)} blocks")
        _check(node.parent.children.get(node.key[:self.block_size]) is node, "orphan node")
        _check(not node.dropped, f"evicted node {node.blocks} is still in the tree")
        _check(node.lock_ref >= 0, f"negative lock count {node.lock_ref}")
        _check(node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
               "a node has fewer locks than its children")
        _check(self._log is None or len(node.hashes) == len(node.blocks),
               f"node {node.blocks} has {len(node.hashes)} block hashes")

    def _check_heap(self, nodes: list[_Node]) -> None:
        current = {id(n) for t, _, n in self._heap if self._is_current(n, t)}
        missing = [n.blocks for n in nodes if self._evictable_leaf(n) and id(n) not in current]
        _check(not missing, f"unlocked leaves {missing} are not eviction candidates")
        _check(len(self._heap) <= _HEAP_ENTRIES_PER_NODE * self._num_nodes + _HEAP_SLACK,
               f"{len(self._heap)} heap entries for {self._num_nodes} nodes")


def make_prefix_cache(enabled: bool, pool: BlockPool, block_size: int) -> PrefixCache:
    return RadixPrefixCache(pool, block_size) if enabled else NullPrefixCache()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise CacheIntegrityError(message)
