"""Triton paged attention: the whole flat batch in one kernel, K/V read in place.

Two kernels, pure Triton (they run wherever torch and triton do; the tests run them on a CPU
under ``TRITON_INTERPRET=1``):

``_store_kv``: one program per new token copies its K and V rows (all KV heads, or the packed
int8 / fp8 rows with their scales) to the token's cache slot. A slot < 0 writes nothing: the
padded rows of a captured CUDA graph (``runner/cuda_graphs.py``). Not launched where the
Llama family's fused RoPE kernel wrote K/V already (``kernels/triton_fused.py``,
``forward(..., kv_stored=True)``).

``_paged_attention``: one program per (query tile, KV head, KV split). A query tile is up to
``BLOCK_Q`` consecutive new tokens of one sequence times the ``GROUP`` query heads that share
the KV head, so a tile is a ``(BLOCK_Q * GROUP_PAD, head_dim)`` matrix and one K/V block is
loaded once for all of them (GQA without repeating K/V):

    rows of a tile:  token 0 head 0, token 0 head 1, ..., token 1 head 0, ...

Tiles are numbered over the whole batch without a host-side list: sequence ``s`` owns the tile
numbers from ``query_start_loc[s] // BLOCK_Q + s`` on (a bound that leaves a few programs
idle), and a program finds its sequence by binary search over ``query_start_loc``. So the grid
depends only on the batch's token and sequence counts, which a CUDA graph fixes. Decode rows,
prompt chunks and chunks after a cached prefix are the same case: new token ``i`` of a sequence
of ``seq_len`` tokens, ``qlen`` of them new, sits at position ``seq_len - qlen + i`` and sees the
keys up to it.

Split-KV (flash-decoding): with few query tiles (decode at small batch) the keys of each tile are
cut into ``num_splits`` ranges of whole blocks, attended by separate programs; each writes its
partial output and log-sum-exp, and ``_merge_splits`` combines them. A sequence with no keys
(``seq_len`` 0: a padded graph row) comes out as zeros.

A sliding window (``window`` > 0, a runtime argument so one compiled kernel serves every
window) gives each row a lower key bound too, and a tile's block range starts at the first
block its first token sees, so blocks behind the window are never read. Sinks (one logit per
query head, in the denominator only) join a program's running softmax after its blocks, in
split 0 only, so merging the splits counts each once.

Caches: the reference layout (``attention/base.py``), token-major ``(blocks, block_size,
kv_heads, head_dim)`` in the compute dtype (or bfloat16 under float32, widened as loaded), or
quantized rows of ``head_dim`` int8 / fp8 (e4m3) values followed by their float16 scale
(``kv_quant``), dequantized as they are loaded.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenmill.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.attention.kv_quant import as_cache_rows, is_quantized

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Query rows per tile (tokens x padded group), and at most this many KV splits.
TILE_ROWS = 16
MAX_SPLITS = 16
# Split the keys while the batch has at most this many query tiles per KV head.
SPLIT_BELOW_TILES = 128
# tl.dot's smallest inner dimension on a GPU: narrower heads and smaller blocks are padded to it
MIN_DOT = 16


@triton.jit
def _store_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
              ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        cols = tl.arange(0, ROW_PAD)
        mask = cols < ROW
        src = token.to(tl.int64) * ROW + cols
        dst = slot.to(tl.int64) * ROW + cols
        tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _load_kv_block(cache_ptr, scale_ptr, block, kv_head, offs_n, n_ok, offs_d, d_ok,
                   BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr):
    """(KEY_PAD, HEAD_PAD) K or V rows of one block and KV head: as stored, or dequantized
    to float32; rows and columns outside ``n_ok`` / ``d_ok`` are zeros and read nothing."""
    row_len = HEAD_DIM + 2 if KV_FORMAT != 0 else HEAD_DIM  # bytes: values then the scale
    rows = (block.to(tl.int64) * BLOCK_SIZE + offs_n) * NUM_KV_HEADS + kv_head  # (KEY_PAD,)
    x = tl.load(cache_ptr + rows[:, None] * row_len + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0)
    # one return at the end: the compiler (unlike the interpreter) goes on past a return inside
    # a constexpr branch and would compile the fp8 bitcast of a bf16 / fp32 cache too
    if KV_FORMAT != 0:
        # the float16 scale sits after the values: element HEAD_DIM // 2 of the row read as fp16
        scale = tl.load(scale_ptr + rows * (row_len // 2) + HEAD_DIM // 2, mask=n_ok,
                        other=0).to(tl.float32)
        if KV_FORMAT == 1:
            vals = x.to(tl.float32)
        else:
            vals = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        x = vals * scale[:, None]
    return x


@triton.jit
def _attend_block(q, m, l, acc, b, seq, low, visible, num_keys, offs_d, d_ok, kv_head,
                  k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                  table_stride, scale, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr, PRECISION: tl.constexpr,
                  KEY_PAD: tl.constexpr):
    """One step of online softmax: the tile's rows against the keys of block ``b`` of ``seq``.
    The products run in q's dtype (bf16 / fp16 on tensor cores; float32 exactly, not TF32),
    accumulated in float32. A block of fewer than 16 keys is padded to ``KEY_PAD`` = 16 rows
    (masked): the compiled ``tl.dot`` takes no smaller inner dimension."""
    offs_n = tl.arange(0, KEY_PAD)
    block = tl.load(block_tables_ptr + seq.to(tl.int64) * table_stride + b)
    key_pos = b * BLOCK_SIZE + offs_n
    n_ok = (offs_n < BLOCK_SIZE) & (key_pos < num_keys)
    k = _load_kv_block(k_cache_ptr, k_scale_ptr, block, kv_head, offs_n, n_ok, offs_d, d_ok,
                       BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, KV_FORMAT).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (ROWS, KEY_PAD)
    seen = (key_pos[None, :] <= visible[:, None]) & (key_pos[None, :] >= low[:, None])
    seen = seen & n_ok[None, :]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    v = _load_kv_block(v_cache_ptr, v_scale_ptr, block, kv_head, offs_n, n_ok, offs_d, d_ok,
                       BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, KV_FORMAT).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, acc


# the batch's sizes change every step: not specialised on (a value of 1, a multiple of 16), so
# one compiled variant serves every batch instead of a compile mid-serving per new combination
@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _paged_attention(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_out_ptr,
        part_lse_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr,
        num_seqs, num_tokens, table_stride, scale, window,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        KV_FORMAT: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
        KEY_PAD: tl.constexpr, HAS_SINKS: tl.constexpr, INTERPRET: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # the sequence owning this tile: the last s with query_start[s] // BLOCK_Q + s <= tile
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # the tile's first new token
    if first < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len  # tokens before the new ones

        ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
        offs_r = tl.arange(0, ROWS)
        tok = first + offs_r // GROUP_PAD  # new-token index within the sequence
        head = kv_head * GROUP + offs_r % GROUP_PAD
        row_ok = (tok < q_len) & (offs_r % GROUP_PAD < GROUP)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_DIM
        token = (q_start + tok).to(tl.int64)
        q_off = (token * NUM_HEADS + head)[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)

        # keys this tile needs: up to the position of its last new token; this split's part
        last = tl.minimum(first + BLOCK_Q, q_len)
        num_keys = ctx + last
        num_blocks = tl.cdiv(num_keys, BLOCK_SIZE)
        visible = ctx + tok  # a row sees keys low..visible
        low = tl.where(window > 0, visible - window + 1, 0)
        # the first block the tile's first token sees (its window's start)
        block_first = tl.maximum(ctx + first - window + 1, 0) // BLOCK_SIZE
        block_first = tl.where(window > 0, block_first, 0)
        per_split = tl.cdiv(num_blocks - block_first, NUM_SPLITS)
        block_lo = block_first + split * per_split
        block_hi = tl.minimum(block_lo + per_split, num_blocks)

        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
        if INTERPRET:  # the interpreter's scalars are 1-element arrays, which range() refuses
            b = block_lo
            while b < block_hi:
                m, l, acc = _attend_block(
                    q, m, l, acc, b, seq, low, visible, num_keys, offs_d, d_ok, kv_head,
                    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                    table_stride, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, KV_FORMAT,
                    PRECISION, KEY_PAD)
                b += 1
        else:
            for b in range(block_lo, block_hi):
                m, l, acc = _attend_block(
                    q, m, l, acc, b, seq, low, visible, num_keys, offs_d, d_ok, kv_head,
                    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                    table_stride, scale, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, KV_FORMAT,
                    PRECISION, KEY_PAD)

        if HAS_SINKS:
            if split == 0:  # the sink as one more key, whose value is zero
                sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
                m_new = tl.maximum(m, sink)
                alpha = tl.exp(m - m_new)
                acc = acc * alpha[:, None]
                l = l * alpha + tl.exp(sink - m_new)
                m = m_new
        out_mask = row_ok[:, None] & d_ok[None, :]
        o = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row without keys: zeros
        if NUM_SPLITS == 1:
            tl.store(out_ptr + q_off, o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # partial results, (splits, tokens, heads, HEAD_PAD) and (splits, tokens, heads)
            row = (split * num_tokens + token) * NUM_HEADS + head
            tl.store(part_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], o,
                     mask=out_mask)
            lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + row, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, num_tokens,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                  NUM_SPLITS: tl.constexpr):
    """One (token, head): out = sum_s o_s exp(lse_s - M) / sum_s exp(lse_s - M), with o_s the
    split's normalised output and M the largest lse (an empty split has lse -inf: weight 0)."""
    row = tl.program_id(0)  # token * NUM_HEADS + head
    parts = tl.arange(0, NUM_SPLITS) * num_tokens * NUM_HEADS + row
    lse = tl.load(part_lse_ptr + parts)
    top = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(w, axis=0)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    o = tl.load(part_out_ptr + parts[:, None] * HEAD_PAD + offs_d[None, :],
                mask=(lse > float("-inf"))[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kv_format(cache: torch.Tensor) -> int:
    """0: the compute dtype; 1: int8 rows with scales; 2: fp8 (e4m3) rows with scales."""
    if not is_quantized(cache):
        return 0
    return 1 if cache.dtype == torch.int8 else 2


class TritonPagedBackend(AttentionBackend):
    """The flat batch's attention in one Triton launch (plus a merge when KV is split). Reads
    only device tensors and shapes from the metadata, so a CUDA graph can capture it."""

    name = "triton"

    def store_kv(self, k, v, kv_cache, slot_mapping):
        k_cache, v_cache = kv_cache
        k, v = as_cache_rows(k, k_cache), as_cache_rows(v, v_cache)
        n = k.shape[0]
        if n == 0:
            return
        row = k_cache.shape[-2] * k_cache.shape[-1]
        _store_kv[(n,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping,
                        ROW=row, ROW_PAD=_next_pow2(row))

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, *,
                window: int | None = None, sinks: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        """``kv_stored``: the new K/V are in the cache already (written by the fused RoPE
        kernel, ``kernels/triton_fused.py``); ``k`` and ``v`` are then not read."""
        if not kv_stored:
            self.store_kv(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        block_size = k_cache.shape[1]
        num_seqs = meta.seq_lens.shape[0]
        group = num_heads // num_kv_heads
        group_pad = _next_pow2(group)
        block_q = max(1, TILE_ROWS // group_pad)
        num_tiles = num_tokens // block_q + num_seqs
        splits = num_splits(num_tiles)
        fmt = kv_format(k_cache)
        # products in q's dtype; float32 (exact, not TF32) for float32, and for bfloat16 under
        # the interpreter, whose bfloat16 dot is wrong (float16's is right: the same code path)
        dot_fp32 = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16)
        out = torch.empty_like(q)
        head_pad = max(MIN_DOT, _next_pow2(head_dim))  # the inner dimension of q @ k^T
        part_out, part_lse = split_buffers(splits, num_tokens, num_heads, head_pad, q.device) \
            if splits > 1 else (out, out)  # unused without splits
        k_scale = k_cache.view(torch.float16) if fmt else k_cache
        v_scale = v_cache.view(torch.float16) if fmt else v_cache
        tables = meta.block_tables
        _paged_attention[(num_tiles, num_kv_heads, splits)](
            q.contiguous(), k_cache, v_cache, k_scale, v_scale, out, part_out, part_lse,
            meta.query_start_loc, meta.seq_lens, tables,
            q if sinks is None else sinks.float().contiguous(), num_seqs, num_tokens,
            tables.stride(0), scale, window or 0,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad,
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_Q=block_q, BLOCK_SIZE=block_size,
            NUM_SPLITS=splits, KV_FORMAT=fmt, PRECISION="ieee" if dot_fp32 else "tf32",
            DOT_FP32=dot_fp32, KEY_PAD=max(MIN_DOT, _next_pow2(block_size)),
            HAS_SINKS=sinks is not None, INTERPRET=INTERPRETED)
        if splits > 1:
            _merge_splits[(num_tokens * num_heads,)](
                part_out, part_lse, out, num_tokens, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                HEAD_PAD=head_pad, NUM_SPLITS=splits)
        return out


def split_buffers(splits: int, num_tokens: int, num_heads: int, head_pad: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partial outputs and log-sum-exps, uninitialised (no fill kernel): every
    (split, token, head) of a real token is written, since each token lies in a tile whose
    programs all run, and a split without keys writes an lse of -inf."""
    part_out = torch.empty((splits, num_tokens, num_heads, head_pad), dtype=torch.float32,
                           device=device)
    part_lse = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=device)
    return part_out, part_lse


def num_splits(num_tiles: int) -> int:
    """KV splits per tile: enough programs to fill the GPU when the batch has few tiles (a
    function of the batch's shape alone, so a captured graph keeps it)."""
    if num_tiles >= SPLIT_BELOW_TILES:
        return 1
    return min(MAX_SPLITS, _next_pow2(max(1, SPLIT_BELOW_TILES // num_tiles)))


__all__ = ["TritonPagedBackend", "kv_format", "num_splits"]
