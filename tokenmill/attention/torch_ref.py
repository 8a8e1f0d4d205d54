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

A sliding ``window`` only narrows the boolean mask (a query at p sees keys j with p - j <
window); ``sinks`` (per query head logits that join each softmax's denominator, gpt-oss) take
an explicit float32 softmax instead of SDPA, so an ordinary layer runs exactly as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.attention.kv_quant import is_quantized, unpack
from tokenmill.util import cdiv


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, *,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.store_kv(k, v, kv_cache, meta.slot_mapping)
        mask = _Masking(window, sinks)
        if meta.is_pure_decode:
            return _decode_attention(q, kv_cache, meta, scale, mask)
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist() if meta.num_reqs > 1 else [0, q.shape[0]]
        decode_rows = [r for r, n in enumerate(meta.query_lens_host) if n == 1]
        if decode_rows:
            _decode_subset(q, out, kv_cache, meta, scale, decode_rows, starts, mask)
        for r, qlen in enumerate(meta.query_lens_host):
            if qlen > 1:
                s = starts[r]
                out[s:s + qlen] = _prefill_one(q[s:s + qlen], kv_cache, meta, r, scale, mask)
        return out


class _Masking:
    """A layer's window and sinks, applied the same way by the prefill and decode paths."""

    def __init__(self, window: int | None, sinks: torch.Tensor | None):
        self.window, self.sinks = window, sinks

    def visible(self, k_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Which keys each query sees: causal, and inside the window when there is one."""
        mask = k_pos <= q_pos
        if self.window is not None:
            mask &= q_pos - k_pos < self.window
        return mask

    def attend(self, q, k, v, mask, scale: float, head_sinks: torch.Tensor | None):
        """SDPA, or with sinks the same softmax written out with the sink logit in each
        denominator; ``head_sinks`` is the sinks arranged to broadcast against the scores."""
        if head_sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        top = torch.maximum(scores.amax(-1, keepdim=True), head_sinks)
        p = torch.exp(scores - top)
        denom = p.sum(-1, keepdim=True) + torch.exp(head_sinks - top)
        return ((p / denom) @ v.float()).to(q.dtype)


def _read_blocks(cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``ids`` of a cache, (len(ids), block_size, kv_heads, head_dim), in ``dtype``."""
    blocks = cache.index_select(0, ids)
    return unpack(blocks, dtype) if is_quantized(cache) else blocks.to(dtype)


def _gather_kv(kv_cache, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype,
               skip: int = 0):
    """K/V of one request's first seq_len tokens after its first ``skip`` blocks, read
    through its block table."""
    k_cache, v_cache = kv_cache
    block_size = k_cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    ids = block_table[skip:num_blocks]
    n = seq_len - skip * block_size
    k = _read_blocks(k_cache, ids, dtype).flatten(0, 1)[:n]  # (n, kvh, head_dim)
    v = _read_blocks(v_cache, ids, dtype).flatten(0, 1)[:n]
    return k, v


def _prefill_one(q: torch.Tensor, kv_cache, meta: AttentionMetadata, r: int,
                 scale: float, masking: _Masking) -> torch.Tensor:
    qlen, num_heads, head_dim = q.shape
    seq_len = meta.seq_lens_host[r]
    ctx = seq_len - qlen
    # blocks wholly behind the first query's window are skipped (and may have been freed)
    skip = 0 if masking.window is None else max(0, ctx - masking.window + 1) // meta.block_size
    k, v = _gather_kv(kv_cache, meta.block_tables[r], seq_len, q.dtype, skip)
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Query i sits at absolute position ctx + i and may see keys 0..ctx+i.
    q_pos = torch.arange(ctx, seq_len, device=q.device)
    k_pos = torch.arange(skip * meta.block_size, seq_len, device=q.device)
    mask = masking.visible(k_pos[None, :], q_pos[:, None])  # (qlen, seq_len)
    # Fold the group of query heads sharing a KV head into the row axis.
    qg = q.view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (kvh, g, qlen, d)
    qg = qg.reshape(num_kv_heads, group * qlen, head_dim)
    mask = mask.repeat(group, 1)  # (g * qlen, seq_len)
    sinks = masking.sinks
    if sinks is not None:  # (heads,) -> (kvh, g * qlen, 1), the row order of qg
        sinks = sinks.float().view(num_kv_heads, group, 1).repeat_interleave(qlen, 1)
    o = masking.attend(qg, k.transpose(0, 1), v.transpose(0, 1), mask, scale,
                       sinks)  # (kvh, g * qlen, d)
    o = o.view(num_kv_heads, group, qlen, head_dim).permute(2, 0, 1, 3)
    return o.reshape(qlen, num_heads, head_dim)


def _decode_attention(q: torch.Tensor, kv_cache, meta: AttentionMetadata,
                      scale: float, masking: _Masking) -> torch.Tensor:
    return _batched_decode(q, kv_cache, meta.block_tables, meta.seq_lens,
                           max(meta.seq_lens_host), scale, masking)


def _decode_subset(q, out, kv_cache, meta: AttentionMetadata, scale: float,
                   rows: list[int], starts: list[int], masking: _Masking) -> None:
    idx = torch.tensor(rows, device=q.device)
    tok = torch.tensor([starts[r] for r in rows], device=q.device)
    max_len = max(meta.seq_lens_host[r] for r in rows)
    out[tok] = _batched_decode(q[tok], kv_cache, meta.block_tables[idx], meta.seq_lens[idx],
                               max_len, scale, masking)


def _batched_decode(q: torch.Tensor, kv_cache, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, max_len: int, scale: float,
                    masking: _Masking) -> torch.Tensor:
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
    # each request's one query sits at position seq_len - 1
    mask = masking.visible(torch.arange(max_len, device=q.device)[None, :],
                           seq_lens[:, None] - 1)  # (reqs, L)
    qg = q.view(num_reqs, num_kv_heads, group, head_dim)
    sinks = masking.sinks
    if sinks is not None:  # (heads,) -> (1, kvh, g, 1), the layout of qg
        sinks = sinks.float().view(1, num_kv_heads, group, 1)
    o = masking.attend(qg, k, v, mask[:, None, None, :], scale, sinks)
    return o.reshape(num_reqs, num_heads, head_dim)
