"""KV block manager: each sequence's block table, grown on demand from the ``BlockPool``.

Block layout and slot mapping (block_size = 4 here, 16 by default)::

    KV cache per layer: [num_blocks, block_size, num_kv_heads, head_dim]; slot = flat row

             +-----------+------------+------------+------------+------------+----
    block    |  0 (null) |     1      |     2      |     3      |     4      | ...
    token    |  padding  | A0 A1 A2 A3| B0 B1 -- --| A4 A5 -- --| P0 P1 P2 P3|
    slot     |   0 .. 3  |   4 .. 7   |   8 .. 11  |  12 .. 15  |  16 .. 19  |
             +-----------+------------+------------+------------+------------+----

    request A  block_table = [1, 3]     token i -> block block_table[i // 4], offset i % 4
                                        token 5 -> block 3, offset 1 -> slot 3 * 4 + 1 = 13
    request B  block_table = [2]        grows by one block when token 4 is scheduled, not before
    n = 2      "r#0": [4, 5], "r#1": [4, 6]   full prompt block 4 shared (ref count 2); each
                                        sequence computes its prompt tail in a block of its own

Blocks are never over-allocated: a table always holds exactly ceil(tokens / block_size) blocks
for the tokens computed so far (including those scheduled this step); only a drafter's lookahead
runs ahead of that, within a step.

Prefix caching (``cache/radix.py``): on admission ``acquire_cached_prefix`` starts a table with
the cached blocks of the longest matching prefix (one more reference each, the tree path
locked); ``free`` gives a finished or preempted sequence's full blocks to the tree before
dropping its references. Free blocks = the pool's free queue + what the tree could evict.
Entries are keyed by ``Request.prefix_namespace``: the cache salt and the LoRA adapter, so KV
computed under one adapter never serves another adapter or the base model.

Lookahead (a drafting model): before a step is scheduled, ``reserve_lookahead`` grows a
running sequence's table over the positions its drafter is about to write (the draft model's
cache tensors are indexed by the same block ids), so draft KV is allocated, shared, trimmed and
freed with the sequence's blocks. The scheduler's allocation then finds those blocks there;
``release_lookahead`` gives back what the step did not use, so between steps a table holds
exactly the blocks of its computed tokens again.

Rollback (speculative decoding): a step may write KV for draft tokens that verification then
rejects. ``trim`` shrinks the table back to the verified tokens and frees the blocks that held
only rejected ones. Blocks reach the prefix cache only after that (the scheduler caches after
trimming), so the tree never holds a rejected token's KV, and a trim never reaches into a
shared block::

    before the step   [A: 4 verified]  [B: v v v d1]  [C: d2 d3 -- --]     d = draft token
    d1 accepted, d2 rejected -> trim to 8 tokens:  [A] [B]   C back to the free queue

Sliding window (``sliding_window``, which the engine sets for a model every layer of which slides,
``ModelConfig.every_layer_windowed``, and leaves None under speculative decoding, whose drafter
writes through the same tables, and with a KV connector, which may read any block): when a
sequence's next chunk is allocated, ``release_behind`` drops its references to the blocks wholly
before the first key the chunk's first query sees; their table entries become the null block 0,
which the attention kernels never read (they start at the window's first block)::

    window 6, next query at position 12: keys 7.. visible    [0] [0] [B2] [B3]
                                                               0-3 4-7 8-11 12-

A released block goes back to the free queue unless the prefix cache or a sibling still holds
it. Releasing also gives up the sequence's lock on its cached prefix (that path stays cached,
now evictable), and a table with released entries inserts nothing more into the cache (a
cached path must start at the first block). Models mixing local and global layers (Gemma 3,
gpt-oss) release nothing: one block table serves every layer, and a global layer reads all of it.
"""

from __future__ import annotations

from collections import Counter

from tokenmill.cache.block_pool import NULL_BLOCK, BlockPool, CacheIntegrityError
from tokenmill.cache.radix import PrefixHandle, make_prefix_cache
from tokenmill.request import Request
from tokenmill.util import cdiv


def slot_of(block_table: list[int], pos: int, block_size: int) -> int:
    """Flat KV slot of token ``pos``: block_table[pos // block_size] * block_size + offset."""
    return block_table[pos // block_size] * block_size + pos % block_size


class KVBlockManager:
    """Maps request ids to block tables; the only code that takes blocks from the pool."""

    sliding_window: int | None = None  # blocks behind it are released (see above)

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # Kept free when admitting new requests so running ones can still grow a little.
        self.watermark_blocks = int(watermark * self.pool.num_usable_blocks)
        self._tables: dict[str, list[int]] = {}
        self.prefix_cache = make_prefix_cache(enable_prefix_caching, self.pool, block_size)
        self._handles: dict[str, PrefixHandle] = {}  # locked cached prefix per sequence

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: the free queue plus unlocked cached blocks."""
        return self.pool.num_free_blocks + self.prefix_cache.num_evictable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.pool.num_usable_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The live table (empty when the request holds no blocks). Read it, don't mutate it."""
        return self._tables.get(request_id, [])

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(self.block_table(request.request_id)))

    def can_allocate(self, request: Request, num_new_tokens: int, watermark: bool = True) -> bool:
        """Whether the next ``num_new_tokens`` fit, keeping ``watermark_blocks`` free if asked."""
        reserve = self.watermark_blocks if watermark else 0
        needed = self.num_blocks_needed(request, num_new_tokens)
        return needed <= self.num_free_blocks - reserve

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the table to cover ``num_computed_tokens + num_new_tokens``, evicting cached
        prefixes if the free queue is short; False (and no new blocks) when still too few.
        Under a sliding window the blocks behind the chunk's window are released first."""
        if self.sliding_window is not None:  # the chunk's first query is at num_computed_tokens
            self.release_behind(request, request.num_computed_tokens - self.sliding_window + 1)
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            self.prefix_cache.evict(needed - self.pool.num_free_blocks)
        if needed > self.pool.num_free_blocks:
            return False
        table = self._tables.setdefault(request.request_id, [])
        for _ in range(needed):
            table.append(self.pool.allocate())
        return True

    def reserve_lookahead(self, request: Request, num_positions: int, keep_free: int = 0) -> bool:
        """Grow a running sequence's table to cover its first ``num_positions`` positions before
        the step is scheduled: a drafting model writes its KV for the coming tokens there (its
        cache tensors are indexed by the same block ids). The scheduler's allocation for the
        step finds these blocks already there; ``release_lookahead``, ``trim`` and ``free``
        return them. False, taking nothing, when fewer than ``keep_free`` blocks would be left
        free (what the running sequences' own tokens need: lookahead must not preempt them)."""
        table = self._tables.get(request.request_id)
        if not table:
            raise CacheIntegrityError(f"lookahead for {request.request_id!r}, which holds no "
                                      "blocks: only a running sequence reserves ahead")
        needed = max(0, cdiv(num_positions, self.block_size) - len(table))
        if needed > self.num_free_blocks - keep_free:
            return False
        if needed > self.pool.num_free_blocks:
            self.prefix_cache.evict(needed - self.pool.num_free_blocks)
        if needed > self.pool.num_free_blocks:
            return False
        for _ in range(needed):
            table.append(self.pool.allocate())
        return True

    def release_lookahead(self, request: Request) -> int:
        """Give back the blocks past the sequence's computed tokens (a lookahead the step did
        not use); returns how many. No-op for a sequence holding no more than those."""
        table = self._tables.get(request.request_id)
        if not table or len(table) <= cdiv(request.num_computed_tokens, self.block_size):
            return 0
        return self.trim(request, request.num_computed_tokens)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Roll the table back to cover only the first ``num_tokens`` tokens (rejected draft
        tokens give their KV slots back); returns the number of blocks freed.

        Only blocks this sequence owns alone can go or be written again: a block shared with
        the prefix cache or a sibling (n > 1) is full and holds verified KV, so a trim that would
        drop one, or leave one partly covered (the next write would land in it), is a bug and
        raises ``CacheIntegrityError`` without changing anything."""
        table = self._tables.get(request.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if num_tokens < 0 or keep > len(table):
            raise CacheIntegrityError(f"trim of {request.request_id!r} to {num_tokens} tokens, "
                                      f"but it holds {len(table)} blocks")
        first_writable = num_tokens // self.block_size  # the block the next token goes to
        shared = [b for b in table[first_writable:] if self.pool.ref_count(b) != 1]
        if shared:
            raise CacheIntegrityError(f"trim of {request.request_id!r} to {num_tokens} tokens "
                                      f"would drop or rewrite shared blocks {shared}")
        dropped = table[keep:]
        del table[keep:]
        for block_id in reversed(dropped):
            self.pool.free(block_id)
        if not table:
            del self._tables[request.request_id]
        return len(dropped)

    def release_behind(self, request: Request, first_visible: int) -> int:
        """Release the sequence's blocks wholly before position ``first_visible`` (the first key
        its next query sees under a sliding window); returns how many it released."""
        table = self._tables.get(request.request_id)
        if not table:
            return 0
        released = 0
        for i in range(min(first_visible // self.block_size, len(table))):
            if table[i] != NULL_BLOCK:
                self.pool.free(table[i])
                table[i] = NULL_BLOCK
                released += 1
        handle = self._handles.pop(request.request_id, None) if released else None
        if handle is not None:  # it no longer holds that path's first blocks
            self.prefix_cache.unlock(handle)
        return released

    def _cacheable_blocks(self, table: list[int], num_full: int) -> int:
        """How many of the first ``num_full`` blocks the prefix cache may take: none once the
        window released the table's first ones (a cached path starts at the first block)."""
        return 0 if table and table[0] == NULL_BLOCK else num_full

    def cacheable_prefix_len(self, request: Request) -> int:
        """Tokens a cache hit may cover: whole blocks short of the last known token, which must
        be computed to have logits to sample from."""
        return (request.num_tokens - 1) // self.block_size * self.block_size

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of the request the cache holds now (what ``acquire_cached_prefix`` would take)."""
        tokens = request.token_ids_slice(0, self.cacheable_prefix_len(request))
        return self.prefix_cache.match(tokens, request.prefix_namespace).num_tokens

    def acquire_cached_prefix(self, request: Request) -> int:
        """Start the (empty) table of ``request`` with its longest cached prefix, locked; returns
        the number of tokens whose KV it already has."""
        if request.request_id in self._tables:
            raise CacheIntegrityError(f"{request.request_id!r} already holds blocks")
        tokens = request.token_ids_slice(0, self.cacheable_prefix_len(request))
        handle = self.prefix_cache.match(tokens, request.prefix_namespace)
        if not handle.blocks:
            return 0
        self.prefix_cache.lock(handle)
        for block_id in handle.blocks:
            self.pool.incref(block_id)
        self._tables[request.request_id] = list(handle.blocks)
        self._handles[request.request_id] = handle
        return handle.num_tokens

    def cache_computed(self, request: Request) -> None:
        """Share a running sequence's full computed blocks (its KV is written) through the cache
        now, so that requests arriving meanwhile hit them; the sequence locks the new path."""
        table = self._tables.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        num_full = self._cacheable_blocks(table, num_full)
        old = self._handles.get(request.request_id)
        if num_full * self.block_size <= (old.num_tokens if old else 0):
            return
        tokens = request.token_ids_slice(0, num_full * self.block_size)
        self.prefix_cache.insert(tokens, table[:num_full], request.prefix_namespace,
                                 request.lora)
        handle = self.prefix_cache.match(tokens, request.prefix_namespace)
        if not handle.blocks:  # the null cache
            return
        self.prefix_cache.lock(handle)
        if old is not None:
            self.prefix_cache.unlock(old)
        self._handles[request.request_id] = handle

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give ``child`` the parent's first ``num_tokens`` (whole blocks) by reference."""
        if num_tokens % self.block_size or num_tokens > parent.num_computed_tokens:
            raise ValueError(f"can only share whole computed blocks, got {num_tokens} tokens")
        if self.block_table(child.request_id):
            raise CacheIntegrityError(f"fork into {child.request_id!r}, which already has blocks")
        shared = self.block_table(parent.request_id)[:num_tokens // self.block_size]
        for block_id in shared:
            if block_id != NULL_BLOCK:  # released behind the window: the child skips it too
                self.pool.incref(block_id)
        if shared:
            self._tables[child.request_id] = shared

    def free(self, request: Request, num_cacheable_tokens: int = 0) -> None:
        """Release every block of the request (finish, abort, preemption); no-op when none.
        The full blocks of its first ``num_cacheable_tokens`` tokens (whose KV is written) go to
        the prefix cache first."""
        table = self._tables.pop(request.request_id, [])
        num_full = min(num_cacheable_tokens // self.block_size, len(table))
        num_full = self._cacheable_blocks(table, num_full)
        if num_full:
            tokens = request.token_ids_slice(0, num_full * self.block_size)
            self.prefix_cache.insert(tokens, table[:num_full], request.prefix_namespace,
                                     request.lora)
        handle = self._handles.pop(request.request_id, None)
        if handle is not None:
            self.prefix_cache.unlock(handle)
        # Tail first: with prefix caching, the most specific blocks should be evicted first.
        for block_id in reversed(table):
            if block_id != NULL_BLOCK:
                self.pool.free(block_id)

    def flush_prefix_cache(self) -> int:
        """Drop every unlocked cached prefix; returns the number of blocks dropped."""
        return self.prefix_cache.flush()

    def owners(self) -> list[str]:
        return list(self._tables)

    def check_integrity(self) -> None:
        """Pool invariants, and every reference is held by exactly the tables that list it and
        the prefix cache."""
        self.pool.check_integrity()
        held: Counter[int] = self.prefix_cache.references()
        if set(self._handles) - set(self._tables):
            raise CacheIntegrityError("a sequence without blocks holds a prefix lock")
        for request_id, table in self._tables.items():
            # released entries (null) only before the live ones
            live = table[next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table)):]
            if not table or NULL_BLOCK in live or len(set(live)) != len(live):
                raise CacheIntegrityError(f"bad block table for {request_id!r}: {table}")
            held.update(live)
        for block_id in range(1, self.pool.num_blocks):
            if held[block_id] != self.pool.ref_count(block_id):
                raise CacheIntegrityError(
                    f"block {block_id}: ref count {self.pool.ref_count(block_id)} but "
                    f"{held[block_id]} tables and the prefix cache hold it")
