"""A fixed pool of KV blocks: O(1) allocate/free through a free queue, shared by ref counts.

Block 0 is reserved as the null block: it is never handed out, so the runner can pad block
tables with 0 and send the KV writes of padding tokens there without corrupting a live request.
"""

from __future__ import annotations

from collections import Counter, deque

NULL_BLOCK = 0


class CacheIntegrityError(RuntimeError):
    """The pool's or a block table's bookkeeping is inconsistent (a bug, never user error)."""


class BlockPool:
    """Blocks ``1 .. num_blocks-1``; each is either in the free queue or referenced, never both."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # FIFO reuse: a freed block goes to the back, so recently freed KV lingers longest
        # (what a prefix cache will want to find again).
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced, 0.0 .. 1.0."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self) -> int:
        """Take a block from the free queue with one reference."""
        if not self._free:
            raise CacheIntegrityError("allocate() on an empty pool: check num_free_blocks first")
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """One more owner of a referenced block (sharing a prompt prefix)."""
        if self._ref_counts[block_id] <= 0:
            raise CacheIntegrityError(f"incref of unreferenced block {block_id}")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; the block returns to the free queue when none is left."""
        count = self._ref_counts[block_id]
        if count <= 0 or block_id == NULL_BLOCK:
            raise CacheIntegrityError(f"free of unreferenced block {block_id} (double free?)")
        self._ref_counts[block_id] = count - 1
        if count == 1:
            self._free.append(block_id)

    def check_integrity(self) -> None:
        """O(num_blocks): for tests and debugging, never on the step path."""
        in_queue = Counter(self._free)
        if NULL_BLOCK in in_queue or self._ref_counts[NULL_BLOCK] != 0:
            raise CacheIntegrityError("the null block 0 was handed out")
        for block_id in range(1, self.num_blocks):
            self._check_block(block_id, self._ref_counts[block_id], in_queue[block_id])

    @staticmethod
    def _check_block(block_id: int, count: int, times_free: int) -> None:
        if count < 0:
            raise CacheIntegrityError(f"block {block_id} has negative ref count {count}")
        if times_free > 1:
            raise CacheIntegrityError(f"block {block_id} is {times_free} times in the free queue")
        if count > 0 and times_free:
            raise CacheIntegrityError(f"block {block_id} is both free and referenced ({count})")
        if count == 0 and not times_free:
            raise CacheIntegrityError(f"block {block_id} is neither free nor referenced (leaked)")
