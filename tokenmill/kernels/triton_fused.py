"""Fused Triton kernels for a Llama-family decoder layer on a GPU: fewer launches per layer.

PyTorch runs a layer's elementwise work as many small kernels (the residual add and RMSNorm
about eight, RoPE several, the K/V write one more, SiLU·mul two or three), and at decode a small
model's step time is mostly their launch latency. Here each is one launch:

``_rms_norm``: one program per row. With a residual, ``x + residual`` rounded to the model dtype
is the new residual; the row is then normalised in float32 and multiplied by the weight, rounded
where ``RMSNorm.forward``'s PyTorch path rounds (the normalised row to the dtype, then the product
with the weight), so the two agree but for the order in which the squares are summed.

``_silu_and_mul``: silu(gate) rounded to the dtype, times up, from the gate/up GEMM's output
``(tokens, 2I)``: as ``F.silu(gate) * up`` rounds.

``_rope_store_kv``: one program per token of the fused QKV output: rotate-half RoPE of its q and
k heads (the leading ``2 * HALF`` dims of each; partial rotary leaves the rest), computed in
float32 and rounded as ``apply_rope`` does; q is written to a contiguous ``(tokens, heads,
head_dim)``, the rotated k and the v go straight into the paged cache at the token's slot (a
slot < 0 writes nothing: a captured CUDA graph's padding rows), rounded to the cache's dtype as
``kv_quant.as_cache_rows`` does. A quantized cache (int8, fp8) is not written here: the rotated k
comes back and the backend quantizes and stores it as before.

``_norm_qkv_rope_store`` and ``_norm_gate_up_silu`` take the GEMMs in too: residual add +
RMSNorm as the prologue of a ``tl.dot`` loop over the 16-bit weight, then RoPE and the K/V write
(one program per row tile and head, the head's two halves as two accumulators) or SiLU·mul
(gate and up columns as two accumulators) as the epilogue; a layer is then five launches
(``LlamaDecoderLayer._gemm_fused``). Used for eager steps only (``FusedOps.gemm_fuses``): inside
a CUDA graph cuBLAS with the kernels above measured faster on an H100.

Every launch turns floating-point contraction off: PyTorch multiplies and adds in separate
rounded steps, and a fused multiply-add would change the last bit. Nothing here reads a value
on the host, and every allocation depends on shapes alone, so a CUDA graph captures it all.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# cache dtypes holding quantized rows with their scales: stored by the attention backend
_QUANTIZED = (torch.int8, torch.uint8)
_SILU_BLOCK = 1024
# the GEMM-fused kernels: batches up to this many rows, K in steps of this many
GEMM_ROWS = 1024
_GEMM_BK = 64
_DOT_DTYPES = (torch.bfloat16, torch.float16)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _round_for(x, ptr, INTERPRET: tl.constexpr):
    """float32 ``x`` rounded (to nearest even) to the dtype ``ptr`` points to. Triton's
    interpreter truncates float32 to bfloat16: there the bits are rounded here instead."""
    out = x.to(ptr.dtype.element_ty)
    if INTERPRET:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride, n_cols,
              inv_n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
              INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    xf = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=ok, other=0.0).to(tl.float32)
        x = _round_for(xf + r, out_ptr, INTERPRET)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=ok)
        xf = x.to(tl.float32)
    # the mean as PyTorch takes it: the sum times 1/n (a float32 factor)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)
    normed = _round_for(xf * rstd, out_ptr, INTERPRET).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, _round_for(w * normed, out_ptr, INTERPRET),
             mask=ok)


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, x_stride, n_cols, BLOCK: tl.constexpr,
                  INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    # an IEEE division as PyTorch's silu divides (Triton's "/" on float32 is approximate)
    act = _round_for(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), out_ptr, INTERPRET)
    tl.store(out_ptr + row * n_cols + cols, _round_for(act.to(tl.float32) * up, out_ptr,
                                                        INTERPRET), mask=ok)


@triton.jit
def _rotated(src_ptr, cos_ptr, sin_ptr, NUM: tl.constexpr, NUM_PAD: tl.constexpr,
             HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, HALF: tl.constexpr,
             INTERPRET: tl.constexpr):
    """``NUM`` heads from ``src_ptr`` (contiguous heads of ``HEAD_DIM``) as a (NUM_PAD,
    HEAD_PAD) tile in their dtype, the first ``2 * HALF`` dims of each rotated; with the mask
    of real elements and their offsets from ``src_ptr``."""
    offs_h = tl.arange(0, NUM_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    ok = (offs_h < NUM)[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    x = tl.load(src_ptr + offs, mask=ok, other=0.0)
    rot = offs_d < 2 * HALF
    first = offs_d < HALF
    j = tl.where(first, offs_d, offs_d - HALF)  # the frequency of each rotated dim
    partner_d = tl.where(first, offs_d + HALF, offs_d - HALF)
    partner = tl.load(src_ptr + offs_h[:, None] * HEAD_DIM + partner_d[None, :],
                      mask=ok & rot[None, :], other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + j, mask=rot, other=1.0)
    sin = tl.load(sin_ptr + j, mask=rot, other=0.0)
    # first half x1 cos - x2 sin, second half x2 cos + x1 sin: each product rounded, then summed
    signed = tl.where(first[None, :], -partner, partner)
    xf = x.to(tl.float32)
    out = tl.where(rot[None, :], xf * cos[None, :] + signed * sin[None, :], xf)
    return _round_for(out, src_ptr, INTERPRET), ok, offs


@triton.jit
def _rope_store_kv(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                   qkv_stride, cos_stride, sin_stride, NUM_HEADS: tl.constexpr,
                   HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, HALF: tl.constexpr,
                   STORE: tl.constexpr, INTERPRET: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + token * qkv_stride  # q heads, then k heads, then v heads
    cos_row = cos_ptr + token * cos_stride
    sin_row = sin_ptr + token * sin_stride
    q, q_ok, q_offs = _rotated(row, cos_row, sin_row, NUM_HEADS, HEADS_PAD, HEAD_DIM,
                               HEAD_PAD, HALF, INTERPRET)
    tl.store(q_ptr + token * (NUM_HEADS * HEAD_DIM) + q_offs, q, mask=q_ok)
    k, kv_ok, kv_offs = _rotated(row + NUM_HEADS * HEAD_DIM, cos_row, sin_row, NUM_KV_HEADS,
                                 KV_PAD, HEAD_DIM, HEAD_PAD, HALF, INTERPRET)
    if STORE:
        slot = tl.load(slot_ptr + token)
        if slot >= 0:  # new names only in here: a runtime branch may not retype a variable
            dst = slot.to(tl.int64) * (NUM_KV_HEADS * HEAD_DIM) + kv_offs
            k_row = _round_for(k.to(tl.float32), k_cache_ptr, INTERPRET)
            tl.store(k_cache_ptr + dst, k_row, mask=kv_ok)
            v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_offs, mask=kv_ok)
            v_row = _round_for(v.to(tl.float32), v_cache_ptr, INTERPRET)
            tl.store(v_cache_ptr + dst, v_row, mask=kv_ok)
    else:
        tl.store(k_ptr + token * (NUM_KV_HEADS * HEAD_DIM) + kv_offs, k, mask=kv_ok)


@triton.jit
def _normed_tile(x_ptr, res_ptr, ln_ptr, res_out_ptr, rows, row_ok, k, x_stride, res_stride,
                 n_cols, rstd, store_residual, HAS_RESIDUAL: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """A (rows, k) tile of RMSNorm(x [+ residual]) in the dtype, rounded as ``_rms_norm``
    rounds; the sum x + residual (the new residual) written where ``store_residual``."""
    ok = row_ok[:, None] & (k < n_cols)[None, :]
    xf = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=ok, other=0.0)
    xf = xf.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * res_stride + k[None, :], mask=ok, other=0.0)
        x = _round_for(xf + r.to(tl.float32), x_ptr, INTERPRET)
        tl.store(res_out_ptr + rows[:, None] * n_cols + k[None, :], x,
                 mask=ok & store_residual)
        xf = x.to(tl.float32)
    normed = _round_for(xf * rstd[:, None], x_ptr, INTERPRET).to(tl.float32)
    w = tl.load(ln_ptr + k, mask=k < n_cols, other=0.0).to(tl.float32)
    return _round_for(w[None, :] * normed, x_ptr, INTERPRET)


@triton.jit
def _row_rstd(x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, n_cols, inv_n, eps,
              HAS_RESIDUAL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
              INTERPRET: tl.constexpr):
    """1 / RMS of each row of x (+ residual, rounded to the dtype first), in float32."""
    ss = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, n_cols, BK):
        k = k0 + tl.arange(0, BK)
        ok = row_ok[:, None] & (k < n_cols)[None, :]
        xf = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=ok, other=0.0)
        xf = xf.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * res_stride + k[None, :], mask=ok, other=0.0)
            xf = _round_for(xf + r.to(tl.float32), x_ptr, INTERPRET).to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return tl.math.rsqrt(ss * inv_n + eps)


@triton.jit
def _norm_gemm_pair(x_ptr, res_ptr, ln_ptr, res_out_ptr, w_ptr, rows, row_ok, cols_a, cols_b,
                    x_stride, res_stride, n_cols, inv_n, eps, store_residual,
                    HAS_RESIDUAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, INTERPRET: tl.constexpr):
    """RMSNorm(x [+ residual]) times two column tiles of the weight ``w`` ((N, K), rows of
    output features): two (BM, BN) float32 accumulators. The new residual is written where
    ``store_residual`` (one program of a row tile)."""
    rstd = _row_rstd(x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, n_cols, inv_n, eps,
                     HAS_RESIDUAL, BM, BK, INTERPRET)
    acc_a = tl.zeros((BM, BN), dtype=tl.float32)
    acc_b = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, n_cols, BK):
        k = k0 + tl.arange(0, BK)
        a = _normed_tile(x_ptr, res_ptr, ln_ptr, res_out_ptr, rows, row_ok, k, x_stride,
                         res_stride, n_cols, rstd, store_residual, HAS_RESIDUAL, INTERPRET)
        k_ok = (k < n_cols)[:, None]
        wa = tl.load(w_ptr + cols_a[None, :].to(tl.int64) * n_cols + k[:, None], mask=k_ok,
                     other=0.0)
        wb = tl.load(w_ptr + cols_b[None, :].to(tl.int64) * n_cols + k[:, None], mask=k_ok,
                     other=0.0)
        if INTERPRET:  # the interpreter's dot misreads bfloat16 (its products are exact
            a = a.to(tl.float32)  # in float32 anyway)
            wa = wa.to(tl.float32)
            wb = wb.to(tl.float32)
        acc_a = tl.dot(a, wa, acc_a)
        acc_b = tl.dot(a, wb, acc_b)
    return acc_a, acc_b


@triton.jit
def _store_kv_head(cache_ptr, slot_ptr, rows, row_ok, kv_head, lo, hi,
                   NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr):
    """One KV head's two halves (float32 values of the model's dtype) of each row into the
    paged cache at the row's slot (a slot < 0 writes nothing), rounded to the cache's dtype."""
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    keep = row_ok[:, None] & (slot >= 0)[:, None]
    dst = cache_ptr + slot[:, None] * (NUM_KV_HEADS * 2 * HALF) + kv_head * (2 * HALF) + \
        tl.arange(0, HALF)[None, :]
    tl.store(dst, _round_for(lo, cache_ptr, INTERPRET), mask=keep)
    tl.store(dst + HALF, _round_for(hi, cache_ptr, INTERPRET), mask=keep)


@triton.jit(do_not_specialize=["n_rows"])
def _norm_qkv_rope_store(x_ptr, res_ptr, ln_ptr, res_out_ptr, w_ptr, bias_ptr, cos_ptr, sin_ptr,
                         q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, n_rows, x_stride, res_stride,
                         cos_stride, sin_stride, n_cols, inv_n, eps,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                         HALF: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """One decoder layer's attention input in one launch: residual add + RMSNorm, the fused
    QKV GEMM, RoPE of q and k and the K/V write. Program (row tile, head): q heads, then k
    heads, then v heads, each head's two halves the two accumulators."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < n_rows
    rows = rows.to(tl.int64)
    d = tl.arange(0, HALF)
    cols_lo = head * (2 * HALF) + d
    lo, hi = _norm_gemm_pair(x_ptr, res_ptr, ln_ptr, res_out_ptr, w_ptr, rows, row_ok, cols_lo,
                             cols_lo + HALF, x_stride, res_stride, n_cols, inv_n, eps,
                             head == 0, HAS_RESIDUAL, BM, HALF, BK, INTERPRET)
    if HAS_BIAS:
        lo += tl.load(bias_ptr + cols_lo).to(tl.float32)[None, :]
        hi += tl.load(bias_ptr + cols_lo + HALF).to(tl.float32)[None, :]
    # the GEMM's output in the dtype, as qkv_proj's would be
    lo = _round_for(lo, x_ptr, INTERPRET).to(tl.float32)
    hi = _round_for(hi, x_ptr, INTERPRET).to(tl.float32)
    ok = row_ok[:, None]
    if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotate-half RoPE, as _rotated computes it
        cos = tl.load(cos_ptr + rows[:, None] * cos_stride + d[None, :], mask=ok, other=1.0)
        sin = tl.load(sin_ptr + rows[:, None] * sin_stride + d[None, :], mask=ok, other=0.0)
        new_lo = lo * cos - hi * sin
        new_hi = hi * cos + lo * sin
        if head < NUM_HEADS:
            dst = q_ptr + rows[:, None] * (NUM_HEADS * 2 * HALF) + head * (2 * HALF) + d[None, :]
            tl.store(dst, _round_for(new_lo, x_ptr, INTERPRET), mask=ok)
            tl.store(dst + HALF, _round_for(new_hi, x_ptr, INTERPRET), mask=ok)
        else:  # rounded to the dtype as RoPE rounds, then to the cache's
            _store_kv_head(k_cache_ptr, slot_ptr, rows, row_ok, head - NUM_HEADS,
                           _round_for(new_lo, x_ptr, INTERPRET).to(tl.float32),
                           _round_for(new_hi, x_ptr, INTERPRET).to(tl.float32), NUM_KV_HEADS,
                           HALF, INTERPRET)
    else:
        _store_kv_head(v_cache_ptr, slot_ptr, rows, row_ok, head - NUM_HEADS - NUM_KV_HEADS, lo,
                       hi, NUM_KV_HEADS, HALF, INTERPRET)


@triton.jit(do_not_specialize=["n_rows"])
def _norm_gate_up_silu(x_ptr, res_ptr, ln_ptr, res_out_ptr, w_ptr, bias_ptr, out_ptr, n_rows,
                       x_stride, res_stride, n_cols, inv_n, eps, size,
                       HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr):
    """The MLP's first half in one launch: residual add + RMSNorm, the gate/up GEMM (gate
    rows ``[0, size)`` of the weight, up rows ``[size, 2 size)``) and silu(gate) * up."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < n_rows
    rows = rows.to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < size
    cols = tl.where(col_ok, cols, 0)  # masked columns read row 0 and are not stored
    gate, up = _norm_gemm_pair(x_ptr, res_ptr, ln_ptr, res_out_ptr, w_ptr, rows, row_ok, cols,
                               cols + size, x_stride, res_stride, n_cols, inv_n, eps,
                               tl.program_id(1) == 0, HAS_RESIDUAL, BM, BN, BK, INTERPRET)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + cols + size).to(tl.float32)[None, :]
    gate = _round_for(gate, x_ptr, INTERPRET).to(tl.float32)
    up = _round_for(up, x_ptr, INTERPRET).to(tl.float32)
    act = _round_for(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), x_ptr, INTERPRET)
    tl.store(out_ptr + rows[:, None] * size + cols[None, :],
             _round_for(act.to(tl.float32) * up, x_ptr, INTERPRET),
             mask=row_ok[:, None] & col_ok[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along its last dim (rows may be strided: a slice of a GEMM's)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class FusedOps:
    """The fused kernels as a decoder layer calls them; the loader hands one to the Llama
    family's modules when they run on a GPU with the Triton attention backend (``gpu_ops``).
    ``device_types``: where ``takes`` says yes (the tests add "cpu", under the interpreter)."""

    def __init__(self, device_types: tuple[str, ...] = ("cuda",), gemm_rows: int | None = None):
        self.device_types = device_types
        # eager batches of up to this many tokens take the GEMM-fused kernels
        # (``norm_qkv_rope``, ``norm_gate_up_silu``); a long prompt's rows stay on cuBLAS
        self.gemm_rows = GEMM_ROWS if gemm_rows is None else gemm_rows

    def takes(self, x: torch.Tensor) -> bool:
        return x.device.type in self.device_types

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm of ``x`` (tokens, size), or of ``x + residual``: (output, the sum or None)."""
        x = _rows(x)
        n, size = x.shape
        out = torch.empty((n, size), dtype=x.dtype, device=x.device)
        res_out = None if residual is None else torch.empty_like(out)
        if n == 0:
            return out, res_out
        res = x if residual is None else _rows(residual)
        block = _next_pow2(size)
        _rms_norm[(n,)](x, res, weight, out, out if res_out is None else res_out,
                        x.stride(0), res.stride(0), size, 1.0 / size, eps,
                        HAS_RESIDUAL=residual is not None, BLOCK=block,
                        INTERPRET=INTERPRETED, num_warps=min(16, max(1, block // 256)),
                        enable_fp_fusion=False)
        return out, res_out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate/up product ``x`` (tokens, 2I) -> (tokens, I)."""
        x = _rows(x)
        n, size = x.shape[0], x.shape[1] // 2
        out = torch.empty((n, size), dtype=x.dtype, device=x.device)
        if n == 0:
            return out
        block = min(_SILU_BLOCK, _next_pow2(size))
        _silu_and_mul[(n, triton.cdiv(size, block))](x, out, x.stride(0), size, BLOCK=block,
                                                     INTERPRET=INTERPRETED,
                                                     enable_fp_fusion=False)
        return out

    def rope_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 heads: int, kv_heads: int, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 slot_mapping: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
        """RoPE of the q and k heads of ``qkv`` (tokens, (heads + 2 kv_heads) * head_dim),
        with ``rope``'s cos and sin (tokens, 1, rotary_dim / 2), and the K/V write:
        ``(q, k, v, stored)``. ``stored``: K/V are in the cache already (k and v are then
        None); a quantized cache is left to the backend, with the rotated k and v to store."""
        qkv = _rows(qkv)
        cos, sin = rope
        n = qkv.shape[0]
        head_dim = qkv.shape[1] // (heads + 2 * kv_heads)
        k_cache, v_cache = kv_cache
        store = k_cache.dtype not in _QUANTIZED
        q = torch.empty((n, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k = None if store else torch.empty((n, kv_heads, head_dim), dtype=qkv.dtype,
                                           device=qkv.device)
        # (tokens, kv_heads, head_dim): a view of the GEMM's output, for the backend to store
        v = None if store else qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
        if n > 0:
            # (tokens, rotary_dim / 2)
            cos, sin = _rows(cos.reshape(n, -1)), _rows(sin.reshape(n, -1))
            _rope_store_kv[(n,)](
                qkv, cos, sin, q, q if k is None else k, k_cache, v_cache, slot_mapping,
                qkv.stride(0), cos.stride(0), sin.stride(0), NUM_HEADS=heads,
                HEADS_PAD=_next_pow2(heads), NUM_KV_HEADS=kv_heads, KV_PAD=_next_pow2(kv_heads),
                HEAD_DIM=head_dim, HEAD_PAD=_next_pow2(head_dim), HALF=cos.shape[1], STORE=store,
                INTERPRET=INTERPRETED, enable_fp_fusion=False)
        return q, k, v, store

    def gemm_fuses(self, x: torch.Tensor, weight: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether ``x``'s rows go through the GEMM-fused kernels with this 16-bit weight
        (float32 stays on cuBLAS: ``tl.dot`` would take it as TF32) and KV cache (a quantized
        one is stored by the backend)."""
        if not (x.shape[0] <= self.gemm_rows and x.device.type in self.device_types
                and weight.dtype in _DOT_DTYPES and x.dtype == weight.dtype
                and kv_cache[0].dtype not in _QUANTIZED):
            return False
        # Eager steps only. In a captured CUDA graph a launch costs the host nothing, and
        # there cuBLAS's GEMMs with the separate norm / RoPE / SiLU kernels measured faster on
        # an H100 (docs/benchmarks.md); an eager step (a prompt, a batch no graph holds) is
        # bound by the host's launches, which these halve.
        return not (x.is_cuda and torch.cuda.is_current_stream_capturing())

    def norm_qkv_rope(self, x: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                      heads: int, kv_heads: int, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_layernorm`` (of ``x + residual``), the QKV GEMM with ``weight`` ((heads +
        2 kv_heads) * head_dim, hidden) and ``bias``, RoPE (every dim rotated) and the K/V
        write into a 16-bit cache, in one launch: ``(q (tokens, heads, head_dim), the new
        residual)``."""
        x = _rows(x)
        n, size = x.shape
        cos, sin = rope
        half = cos.shape[-1]
        q = torch.empty((n, heads, 2 * half), dtype=x.dtype, device=x.device)
        res, res_out = _residual_io(x, residual)
        if n == 0:
            return q, res_out
        cos, sin = _rows(cos.reshape(n, half)), _rows(sin.reshape(n, half))
        k_cache, v_cache = kv_cache
        bm = _row_block(n)
        _norm_qkv_rope_store[(triton.cdiv(n, bm), heads + 2 * kv_heads)](
            x, res, norm_weight, res_out, weight, weight if bias is None else bias, cos, sin, q,
            k_cache, v_cache, slot_mapping, n, x.stride(0), res.stride(0), cos.stride(0),
            sin.stride(0), size, 1.0 / size, eps, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads,
            HALF=half, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BM=bm,
            BK=_GEMM_BK, INTERPRET=INTERPRETED, enable_fp_fusion=False)
        return q, res_out

    def norm_gate_up_silu(self, x: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``post_attention_layernorm`` (of ``x + residual``), the gate/up GEMM with
        ``weight`` (2 I, hidden) and silu(gate) * up, in one launch: ``((tokens, I), the new
        residual)``."""
        x = _rows(x)
        n, size = x.shape
        inter = weight.shape[0] // 2
        out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
        res, res_out = _residual_io(x, residual)
        if n == 0:
            return out, res_out
        bm = _row_block(n)
        bn = 32 if n <= 16 else 64  # one row: more, narrower column tiles
        _norm_gate_up_silu[(triton.cdiv(n, bm), triton.cdiv(inter, bn))](
            x, res, norm_weight, res_out, weight, weight if bias is None else bias, out, n,
            x.stride(0), res.stride(0), size, 1.0 / size, eps, inter,
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BM=bm, BN=bn,
            BK=_GEMM_BK, INTERPRET=INTERPRETED, enable_fp_fusion=False)
        return out, res_out


def _residual_io(x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the GEMM-fused kernels: the residual they read (``x`` itself when there is none:
    not read then) and the new residual they write (``x`` when there is none: the first
    layer's input is its residual, nothing to write)."""
    if residual is None:
        return x, x
    return _rows(residual), torch.empty_like(x)


def _row_block(n: int) -> int:
    """Rows per program of the GEMM-fused kernels (``tl.dot`` takes 16 at least)."""
    return 16 if n <= 16 else 32 if n <= 32 else 64


__all__ = ["FusedOps"]
