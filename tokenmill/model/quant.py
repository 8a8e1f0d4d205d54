"""Quantized weights: int8 and int4 linear layers, and GGUF's Q8_0 / Q4_0 / Q4_1 kept as they are.

One format holds them all (``QuantWeight``): a weight of N output and K input features is stored
row by row as 8-bit signed or 4-bit unsigned integers, with a scale (and for 4 bits an offset)
per group of input features:

    8 bits: w = scale * q,         q int8    per-channel (group = K) or GGUF Q8_0 (group = 32)
    4 bits: w = scale * q + zero,  q 0..15   groups of 32: GGUF Q4_0 (zero = -8 scale), Q4_1,
                                             or tokenmill's own min/max quantization

fp8 (``--quantization fp8``, for Hopper GPUs): ``w = scale * q`` with q float8 e4m3 and one
float32 scale per output feature (absmax / 448); the activations are quantized to e4m3 per row
(token) on the fly and the product runs through ``torch._scaled_mm`` with both scales.

A 4-bit row keeps each 32 weights in 16 bytes, weight j in the low nibble of byte j and weight
j + 16 in its high nibble -- the order of GGUF's Q4 blocks, so a GGUF tensor's quantized bytes
are copied, not re-quantized, and its float16 scales are kept exactly. The compiled CPU kernel
(``kernels/csrc/quant_ops.h``) multiplies from these bytes; elsewhere (no compiler, a GPU) the
weight is dequantized here with PyTorch ops. The kernels that multiply each format are in
``model/linear/`` (``QuantBytes``, ``F32Packed``, ``Fp8``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

import numpy as np
import torch

QUANTIZATIONS = ("none", "auto", "int8", "int4", "fp8")
FP8_MAX = 448.0  # the largest finite float8 e4m3
INT4_GROUP = 32  # input features per scale and offset (GGUF's block)
# int8's scales per 32 inputs (as Q8_0): perplexity of the default model +0.84% with one scale
# per output feature, -0.4% (noise) with these (docs/performance.md)
INT8_GROUP = 32


@dataclass
class QuantWeight:
    qweight: torch.Tensor  # int8 (N, K), uint8 (N, K / 2) for 4 bits, float8_e4m3fn for fp8
    scales: torch.Tensor  # (N, K / group_size), float16 or float32
    zeros: torch.Tensor | None  # 4 bits: like scales
    bits: int
    group_size: int
    kind: str  # how it was made: "int8", "int4", "q8_0", "q4_0", "q4_1", "fp8"
    # int8 in groups of 32 multiplied with int8 activations (W8A8): per row, the sum over its
    # groups of scale * sum of q (float32), which takes the activations' offset back out
    act_offsets: torch.Tensor | None = None
    # multiplied with rows of x quantized to int8 (use_int8_activations)
    int8_activations: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight's rows ``index`` (output features, or vocabulary entries)."""
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return QuantWeight(pick(self.qweight), pick(self.scales), pick(self.zeros), self.bits,
                           self.group_size, self.kind)

    def to(self, device: torch.device | str) -> QuantWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, qweight=move(self.qweight), scales=move(self.scales),
                       zeros=move(self.zeros), act_offsets=move(self.act_offsets))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.zeros) if t is not None)


def _unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K / 2) packed bytes -> (N, K) values 0..15 in the weights' order."""
    n, half = qweight.shape
    blocks = qweight.view(n, half // 16, 16)
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).reshape(n, half * 2)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def dequantize(qw: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight in ``dtype``: scale * q (+ zero), computed in float32 (the reference; the
    compiled kernel gives the same values)."""
    n, k = qw.shape
    q = _unpack_int4(qw.qweight) if qw.bits == 4 else qw.qweight
    per_group = q.float().view(n, k // qw.group_size, qw.group_size)
    w = per_group * qw.scales.float().unsqueeze(-1)
    if qw.zeros is not None:
        w = w + qw.zeros.float().unsqueeze(-1)
    return w.view(n, k).to(dtype)


def quantize_int8(w: torch.Tensor, group_size: int | None = INT8_GROUP) -> QuantWeight:
    """Symmetric int8 with a scale (absmax / 127) per group of ``group_size`` inputs: float16
    scales in groups of 32 (GGUF's Q8_0 layout; the default), or one float32 scale per output
    feature with ``group_size=None`` (per-channel). Groups of 32 where K allows, else
    per-channel."""
    w = w.detach().float()
    n, k = w.shape
    if group_size is None or k % group_size:
        scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(
            torch.finfo(torch.float32).tiny)
        q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
        return QuantWeight(q.contiguous(), scales.contiguous(), None, 8, k, "int8")
    g = w.view(n, k // group_size, group_size)
    scales = g.abs().amax(dim=-1) / 127.0  # 0 for an all-zero group
    if not _fits_half(scales):
        return quantize_int8(w, None)
    scales = scales.half()
    step = scales.float().unsqueeze(-1)
    q = torch.round(g / torch.where(step > 0, step, 1.0)).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(q.view(n, k).contiguous(), scales.contiguous(), None, 8, group_size,
                       "int8")


def quantize_fp8(w: torch.Tensor) -> QuantWeight:
    """float8 e4m3 with one float32 scale per output feature (absmax / 448: no value
    saturates; each keeps 3 mantissa bits)."""
    w = w.detach().float()
    n, k = w.shape
    scales = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(
        torch.finfo(torch.float32).tiny)
    q = (w / scales).to(torch.float8_e4m3fn)
    return QuantWeight(q.contiguous(), scales.contiguous(), None, 8, k, "fp8")


def fp8_linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with x quantized to e4m3 per row (dynamic scales) and W fp8."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_scale = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    xq = (x2.float() / x_scale).to(torch.float8_e4m3fn)
    out = _scaled_mm_rows(xq, qw.qweight.t(), x_scale, qw.scales.t(), x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.shape[-1])


def _scaled_mm_rows(xq: torch.Tensor, wq_t: torch.Tensor, x_scale: torch.Tensor,
                    w_scale_t: torch.Tensor, out_dtype: torch.dtype,
                    rowwise: bool | None = None) -> torch.Tensor:
    """``(xq * x_scale) @ (wq_t * w_scale_t)`` in ``out_dtype``: fp8 operands, float32 scales
    per row of x and per column of W, both in ``torch._scaled_mm`` where it takes them; on a
    CPU whose backend takes per-tensor scales only (PyTorch 2.11) the fp8 product is summed in
    float32 and scaled after (``rowwise`` False forces that way, True the other)."""
    if rowwise is None:
        rowwise = xq.device.type != "cpu" or _cpu_scaled_mm_takes_rows()
    if rowwise:
        return torch._scaled_mm(xq, wq_t, scale_a=x_scale, scale_b=w_scale_t,
                                out_dtype=out_dtype)
    one = torch.ones((), dtype=torch.float32, device=xq.device)
    out = torch._scaled_mm(xq, wq_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (out * x_scale * w_scale_t).to(out_dtype)


@cache
def _cpu_scaled_mm_takes_rows() -> bool:
    """Whether this PyTorch's CPU ``_scaled_mm`` takes row-wise scales (2.13 does; 2.11
    asserts per-tensor scales)."""
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP) -> QuantWeight:
    """Asymmetric 4 bits per group of ``group_size`` inputs: the group's minimum as the offset,
    (max - min) / 15 as the scale. Scales and offsets are float16 where every one of them is
    a normal float16 number (5 bits per weight in all, like GGUF's Q4_1), else float32."""
    w = w.detach().float()
    n, k = w.shape
    if k % group_size or group_size % 32:
        raise ValueError(f"int4 needs input features ({k}) in groups of {group_size}, a "
                         "multiple of 32")
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = (hi - lo) / 15.0  # 0 for a constant group: every weight is its offset
    store = torch.float16 if _fits_half(scales) and _fits_half(lo) else torch.float32
    scales, zeros = scales.to(store), lo.to(store)
    step = scales.float().unsqueeze(-1)
    q = torch.round((g - zeros.float().unsqueeze(-1)) / torch.where(step > 0, step, 1.0))
    q = q.clamp_(0, 15).view(n, k)
    return QuantWeight(_pack_int4(q), scales.contiguous(), zeros.contiguous(), 4, group_size,
                       "int4")


def _fits_half(t: torch.Tensor) -> bool:
    mag = t.abs()
    nonzero = mag[mag > 0]
    return bool(mag.max() <= 65504) and (nonzero.numel() == 0 or bool(nonzero.min() >= 2.0 ** -14))


# GGUF block formats kept quantized: (bytes per 32 weights, has an offset)
GGUF_BLOCKS = {"Q8_0": (34, False), "Q4_0": (18, False), "Q4_1": (20, True)}


def from_gguf_blocks(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantWeight:
    """A GGUF tensor of Q8_0, Q4_0 or Q4_1 blocks as a ``QuantWeight``, bytes and float16
    scales copied as they are. ``data``: the raw blocks, ``shape``: (rows, columns)."""
    block_bytes, has_min = GGUF_BLOCKS[qtype]
    n, k = shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // 32, block_bytes)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(n, k // 32))
    if qtype == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return QuantWeight(q, d, None, 8, 32, "q8_0")
    start = 4 if has_min else 2
    q = torch.from_numpy(blocks[..., start:].copy().reshape(n, k // 2))
    if has_min:
        zeros = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, k // 32))
    else:
        zeros = d * -8.0  # exact in float16: a power of two
    return QuantWeight(q, d, zeros, 4, 32, qtype.lower())


def concat_rows(parts: Sequence[QuantWeight]) -> QuantWeight | None:
    """Stack weights of one format along the output features (fused q/k/v, gate/up); None when
    they differ in format (bits, group size, scale dtype, offsets)."""
    first = parts[0]
    if any((p.bits, p.group_size, p.scales.dtype, p.zeros is None, p.shape[1])
           != (first.bits, first.group_size, first.scales.dtype, first.zeros is None,
               first.shape[1]) for p in parts):
        return None
    cat = lambda ts: None if ts[0] is None else torch.cat(ts).contiguous()  # noqa: E731
    kinds = sorted({p.kind for p in parts})
    return QuantWeight(cat([p.qweight for p in parts]), cat([p.scales for p in parts]),
                       cat([p.zeros for p in parts]), first.bits, first.group_size,
                       "+".join(kinds))


def takes_int8_activations(qw: QuantWeight) -> bool:
    """Whether the int8-activation kernels take this format: groups of 32, float16 scales."""
    return qw.group_size == 32 and qw.scales.dtype == torch.float16


def use_int8_activations(qw: QuantWeight) -> None:
    """Prepare this weight (int8 or int4 in groups of 32 with float16 scales: int8, int4,
    Q8_0, Q4_0, Q4_1) for rows of x quantized to int8 on the fly (dynamic per-token scales) by
    the CPU kernels' VNNI ones (``QuantBytes`` where ``has_int8_dot``): an 8-bit weight's
    per-row offsets."""
    if not takes_int8_activations(qw):
        raise ValueError("int8 activations need weights in groups of 32 with float16 scales")
    qw.int8_activations = True
    if qw.bits == 4:
        return
    n, k = qw.shape
    offsets = torch.empty(n, dtype=torch.float32)
    for start in range(0, n, 4096):  # sum() widens its input first: a slice at a time
        q = qw.qweight[start:start + 4096].view(-1, k // 32, 32)
        sums = q.sum(dim=-1, dtype=torch.int32).double()
        offsets[start:start + 4096] = (sums * qw.scales[start:start + 4096].double()).sum(1)
    qw.act_offsets = offsets.to(qw.qweight.device)


def embedding_rows(ids: torch.Tensor, qw: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Embedding lookup from a quantized table: only the looked-up rows are dequantized."""
    return dequantize(qw.rows(ids), dtype)
