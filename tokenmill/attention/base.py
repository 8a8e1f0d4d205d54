"""The attention backend interface and the flat-batch metadata every backend reads.

A step's batch is flat: the new tokens of all requests are concatenated, with no padding.

    input tokens   | r0: 5 prompt tokens | r1: 1 decode | r2: 3 tokens after a cached prefix |
    query_start_loc  0                   5              6                                   9
    seq_lens         5                   37             19   (cached + new tokens)

Each new token's K/V is written to the paged cache at ``slot_mapping[t]``; attention for request
``r`` then reads its first ``seq_lens[r]`` tokens through ``block_tables[r]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from tokenmill.attention.kv_quant import as_cache_rows


@dataclass
class AttentionMetadata:
    """Device tensors describing one flat batch, plus host copies for Python-side decisions."""

    query_start_loc: torch.Tensor  # (num_reqs + 1,) int64, cumulative new-token counts
    seq_lens: torch.Tensor  # (num_reqs,) int64, cached + new tokens per request
    block_tables: torch.Tensor  # (num_reqs, max_blocks) int64, padded with 0
    slot_mapping: torch.Tensor  # (num_tokens,) int64, cache slot of every new token
    query_lens_host: list[int]
    seq_lens_host: list[int]
    block_size: int
    block_tables_host: list[list[int]] | None = None  # unpadded, when the builder has them
    # per request, its prompt + output tokens when the step was scheduled, drafts not counted
    # (LongRoPE picks its factors by it); None where the builder does not know them
    known_lens_host: list[int] | None = None
    # whatever a backend derives from this batch once per step (not per layer), by its name
    plans: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_host)


class AttentionBackend(ABC):
    """Computes causal attention of a flat batch over a paged KV cache.

    ``kv_cache`` is ``(k_cache, v_cache)``, each ``(num_blocks, block_size, num_kv_heads,
    head_dim)`` in the compute dtype (or bfloat16 under a float32 model), or int8
    ``(..., head_dim + kv_quant.SCALE_BYTES)``: values with a float16 scale per (token, head)
    (``runner/kv_cache.py``). ``forward`` first stores the new ``k``/``v`` at
    ``meta.slot_mapping`` (quantizing or rounding them to the cache's dtype), then attends
    each request's queries to all of its cached keys (prefix included), causally. Every backend
    reads every kind of cache.
    """

    name: str = "abstract"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """Write K/V of tokens at their slots, in this backend's layout inside a block (the
        reference: token-major, as the cache's shape reads; int8 rows hold their scale)."""
        k_cache, v_cache = kv_cache
        row_shape = k_cache.shape[-2:]  # (num_kv_heads, head_dim [+ SCALE_BYTES])
        k, v = as_cache_rows(k, k_cache), as_cache_rows(v, v_cache)
        k_cache.view(-1, *row_shape).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *row_shape).index_copy_(0, slot_mapping, v)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        ...
