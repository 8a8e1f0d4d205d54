"""PyTorch reference attention over the paged KV cache (CPU, and any device as a fallback).

Decode tokens of all requests are attended in one batched call; requests with several new
tokens (prompt chunks) are attended one by one, where the work is compute-bound anyway.
Grouped-query attention is done by folding the query heads that share a KV head into the
query-length axis, so K/V are never repeated per query head.

Cache layout: token-major, ``(num_blocks, block_size, num_kv_heads, head_dim)`` in the compute
dtype (or bfloat16, widened to it as read); or int8 ``(num_blocks, block_size, num_kv_heads,
head_dim + 2)``, each (token, head) row its int8 values then its float16 scale (``kv_quant``).
An int8 cache is dequantized as it is gathered (only the blocks a call reads), so the attention
itself is the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.attention.kv_quant import is_quantized, unpack
from tokenmill.util import cdiv


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.store_kv(k, v, kv_cache, meta.slot_mapping)
        if meta.is_pure_decode:
            return _decode_attention(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist() if meta.num_reqs > 1 else [0, q.shape[0]]
        decode_rows = [r for r, n in enumerate(meta.query_lens_host) if n == 1]
        if decode_rows:
            _decode_subset(q, out, kv_cache, meta, scale, decode_rows, starts)
        for r, qlen in enumerate(meta.query_lens_host):
            if qlen > 1:
                s = starts[r]
                out[s:s + qlen] = _prefill_one(q[s:s + qlen], kv_cache, meta, r, scale)
        return out


def _read_blocks(cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``ids`` of a cache, (len(ids), block_size, kv_heads, head_dim), in ``dtype``."""
    blocks = cache.index_select(0, ids)
    return unpack(blocks, dtype) if is_quantized(cache) else blocks.to(dtype)


def _gather_kv(kv_cache, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype):
    """K/V of one request's first seq_len tokens, read through its block table."""
    k_cache, v_cache = kv_cache
    block_size = k_cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    ids = block_table[:num_blocks]
    k = _read_blocks(k_cache, ids, dtype).flatten(0, 1)[:seq_len]  # (seq_len, kvh, head_dim)
    v = _read_blocks(v_cache, ids, dtype).flatten(0, 1)[:seq_len]
    return k, v


def _prefill_one(q: torch.Tensor, kv_cache, meta: AttentionMetadata, r: int,
                 scale: float) -> torch.Tensor:
    qlen, num_heads, head_dim = q.shape
    seq_len = meta.seq_lens_host[r]
    k, v = _gather_kv(kv_cache, meta.block_tables[r], seq_len, q.dtype)
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Query i sits at absolute position ctx + i and may see keys 0..ctx+i.
    ctx = seq_len - qlen
    q_pos = torch.arange(ctx, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]  # (qlen, seq_len)
    # Fold the group of query heads sharing a KV head into the row axis.
    qg = q.view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (kvh, g, qlen, d)
    qg = qg.reshape(num_kv_heads, group * qlen, head_dim)
    mask = mask.repeat(group, 1)  # (g * qlen, seq_len)
    o = F.scaled_dot_product_attention(qg, k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale)  # (kvh, g * qlen, d)
    o = o.view(num_kv_heads, group, qlen, head_dim).permute(2, 0, 1, 3)
    return o.reshape(qlen, num_heads, head_dim)


def _decode_attention(q: torch.Tensor, kv_cache, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    return _batched_decode(q, kv_cache, meta.block_tables, meta.seq_lens,
                           max(meta.seq_lens_host), scale)


def _decode_subset(q, out, kv_cache, meta: AttentionMetadata, scale: float,
                   rows: list[int], starts: list[int]) -> None:
    idx = torch.tensor(rows, device=q.device)
    tok = torch.tensor([starts[r] for r in rows], device=q.device)
    max_len = max(meta.seq_lens_host[r] for r in rows)
    out[tok] = _batched_decode(q[tok], kv_cache, meta.block_tables[idx], meta.seq_lens[idx],
                               max_len, scale)


def _batched_decode(q: torch.Tensor, kv_cache, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """One query token per request; keys read from each request's blocks up to max_len."""
    k_cache, v_cache = kv_cache
    num_reqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = cdiv(max_len, block_size)
    ids = block_tables[:, :num_blocks].reshape(-1)
    kv_shape = (num_reqs, num_blocks * block_size, num_kv_heads, head_dim)
    # (reqs, blocks * block_size, kvh, d) -> (reqs, kvh, L, d)
    k = _read_blocks(k_cache, ids, q.dtype).view(kv_shape)[:, :max_len].transpose(1, 2)
    v = _read_blocks(v_cache, ids, q.dtype).view(kv_shape)[:, :max_len].transpose(1, 2)
    mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # (reqs, L)
    qg = q.view(num_reqs, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(num_reqs, num_heads, head_dim)
