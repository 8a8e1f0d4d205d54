"""Quantized KV caches: int8 (or fp8) values with one float16 scale per (token, KV head).

A token's K (or V) vector of one KV head, ``x`` of ``head_dim`` values, is stored as

    scale = absmax(x) / 127, rounded *up* to float16      (0 for an all-zero vector)
    q     = clamp(round_half_even(x / scale), -127, 127)  int8, so x ~= q * scale

Rounding the scale up keeps ``|x| / scale <= 127``, so no value is clipped and every element's
error is at most ``scale / 2``. float16 saturates at 65504: vectors with ``absmax > 127 * 65504``
(~8.3e6, far beyond any working model's K/V) would be clipped. The compiled CPU kernels
(``kernels/csrc/cpu_ops.cpp``, ``quantize_row``) compute exactly the same bytes.

The scale lives in the same int8 tensor as the values: a cache of ``head_dim`` values per
(token, head) becomes ``head_dim + SCALE_BYTES`` int8 bytes, the last two holding the scale's
float16 bits. Which bytes hold what inside a block is each backend's layout (see
``runner/kv_cache.py``); the helpers here are for the reference layout, token-major rows of
``(..., head_dim + SCALE_BYTES)``. Pure torch ops: they run on any device.

fp8 (``--kv-cache-dtype fp8``, read by the torch and triton backends) is the same layout in a
uint8 tensor: the values are float8 e4m3 bits, ``scale = absmax(x) / 448`` (e4m3's largest
finite value) rounded up to float16, ``q = float8_e4m3(x / scale)`` rounded to nearest, so each
element keeps 3 mantissa bits (relative error at most 2^-4; below 2^-6 * scale, e4m3's
subnormals, an absolute error of at most 2^-10 * scale).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # a float16 scale after each (token, head)'s int8 values
_HALF_MAX_BITS = 0x7BFF  # 65504, the largest finite float16
FP8_MAX = 448.0  # the largest finite float8 e4m3
# cache tensor dtype -> the largest quantized value
QUANT_MAX = {torch.int8: 127.0, torch.uint8: FP8_MAX}


def is_quantized(cache: torch.Tensor) -> bool:
    """int8 values, or fp8 (e4m3) bits in uint8, each row ending in its float16 scale."""
    return cache.dtype in QUANT_MAX


def cache_head_dim(cache: torch.Tensor) -> int:
    """head_dim of the K/V vectors a cache tensor holds (its last dim, less the scale bytes)."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache) else 0)


def round_up_half(s: torch.Tensor) -> torch.Tensor:
    """float32 ``s >= 0`` -> the smallest float16 >= s (saturating at 65504)."""
    h = s.to(torch.float16)
    bits = h.view(torch.int16) + (h.float() < s).to(torch.int16)  # next float16 up
    return bits.clamp_(max=_HALF_MAX_BITS).view(torch.float16)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype = torch.int8
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., D) float -> (values (..., D) in ``cache_dtype``: int8, or fp8 bits as uint8;
    float16 scales (...))."""
    xf = x.float()
    absmax = xf.abs().amax(-1)
    # divided by a tensor, not a Python number: CUDA divides by a number as a multiply by its
    # rounded reciprocal, which is off by an ulp for about half the rows and, where the exact
    # quotient is a float16, moves the scale up a step; the bytes would then depend on the device
    scale = round_up_half(absmax / torch.full_like(absmax, QUANT_MAX[cache_dtype]))
    s = scale.float().unsqueeze(-1)
    scaled = xf / torch.where(s > 0, s, 1.0)
    if cache_dtype == torch.uint8:
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale
    return torch.round(scaled).clamp_(-127, 127).to(torch.int8), scale


def pack(x: torch.Tensor, cache_dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """``x`` (..., D) float -> quantized rows (..., D + SCALE_BYTES) of ``cache_dtype`` (int8,
    or uint8 holding fp8), the reference layout."""
    q, scale = quantize(x, cache_dtype)
    return torch.cat([q, scale.unsqueeze(-1).view(cache_dtype)], dim=-1)


def as_cache_rows(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """K or V rows (..., D) as ``cache`` stores them in the reference layout: quantized with
    their scales (int8 / fp8), else in the cache's dtype (a bfloat16 cache under float32:
    rounded to nearest even)."""
    return pack(x, cache.dtype) if is_quantized(cache) else x.to(cache.dtype)


def unpack(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows (..., D + SCALE_BYTES), int8 or fp8-in-uint8 (last dim contiguous) -> dequantized
    (..., D) ``dtype`` (multiplied in float32, rounded once to ``dtype``)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].view(torch.float16)  # (..., 1)
    values = rows[..., :d]
    if rows.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
    return (values.float() * scale.float()).to(dtype)
