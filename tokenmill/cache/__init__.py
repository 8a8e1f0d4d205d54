"""Paged KV cache bookkeeping (no torch): the block pool and the per-request block tables."""

from tokenmill.cache.block_manager import KVBlockManager, slot_of
from tokenmill.cache.block_pool import NULL_BLOCK, BlockPool, CacheIntegrityError

__all__ = ["NULL_BLOCK", "BlockPool", "CacheIntegrityError", "KVBlockManager", "slot_of"]
