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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along its last dim (rows may be strided: a slice of a GEMM's)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class FusedOps:
    """The fused kernels as a decoder layer calls them; the loader hands one to the Llama
    family's modules when they run on a GPU with the Triton attention backend (``gpu_ops``).
    ``device_types``: where ``takes`` says yes (the tests add "cpu", under the interpreter)."""

    def __init__(self, device_types: tuple[str, ...] = ("cuda",)):
        self.device_types = device_types

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


__all__ = ["FusedOps"]
