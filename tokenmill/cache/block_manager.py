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
for the tokens computed so far (including those scheduled this step).
"""

from __future__ import annotations

from collections import Counter

from tokenmill.cache.block_pool import NULL_BLOCK, BlockPool, CacheIntegrityError
from tokenmill.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_of(block_table: list[int], pos: int, block_size: int) -> int:
    """Flat KV slot of token ``pos``: block_table[pos // block_size] * block_size + offset."""
    return block_table[pos // block_size] * block_size + pos % block_size


class KVBlockManager:
    """Maps request ids to block tables; the only code that takes blocks from the pool."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # Kept free when admitting new requests so running ones can still grow a little.
        self.watermark_blocks = int(watermark * self.pool.num_usable_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

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
        return needed <= self.pool.num_free_blocks - reserve

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the table to cover ``num_computed_tokens + num_new_tokens``; False (and no change)
        when the pool has too few free blocks."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        table = self._tables.setdefault(request.request_id, [])
        for _ in range(needed):
            table.append(self.pool.allocate())
        return True

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give ``child`` the parent's first ``num_tokens`` (whole blocks) by reference."""
        if num_tokens % self.block_size or num_tokens > parent.num_computed_tokens:
            raise ValueError(f"can only share whole computed blocks, got {num_tokens} tokens")
        if self.block_table(child.request_id):
            raise CacheIntegrityError(f"fork into {child.request_id!r}, which already has blocks")
        shared = self.block_table(parent.request_id)[:num_tokens // self.block_size]
        for block_id in shared:
            self.pool.incref(block_id)
        if shared:
            self._tables[child.request_id] = shared

    def free(self, request: Request) -> None:
        """Release every block of the request (finish, abort, preemption); no-op when none."""
        # Tail first: with prefix caching, the most specific blocks should be evicted first.
        for block_id in reversed(self._tables.pop(request.request_id, [])):
            self.pool.free(block_id)

    def owners(self) -> list[str]:
        return list(self._tables)

    def check_integrity(self) -> None:
        """Pool invariants, and every reference is held by exactly the tables that list it."""
        self.pool.check_integrity()
        held: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            if not table or NULL_BLOCK in table or len(set(table)) != len(table):
                raise CacheIntegrityError(f"bad block table for {request_id!r}: {table}")
            held.update(table)
        for block_id in range(1, self.pool.num_blocks):
            if held[block_id] != self.pool.ref_count(block_id):
                raise CacheIntegrityError(
                    f"block {block_id}: ref count {self.pool.ref_count(block_id)} but "
                    f"{held[block_id]} tables list it")
