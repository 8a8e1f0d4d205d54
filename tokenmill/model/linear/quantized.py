"""Kernels on quantized weights as ``model/quant.py`` holds them: int8 / int4 / GGUF blocks
multiplied from their bytes (``csrc/quant_ops.h``), and fp8."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.linear.base import LinearKernel
from tokenmill.model.quant import QuantWeight, dequantize, fp8_linear

# Rows of input above which a quantized layer is dequantized into the compute dtype and run
# through PyTorch's GEMM (prefill, large batches), rather than multiplied from the quantized
# bytes. For the default model's layers on 2 Zen 4 cores (int4 with int8 activations, a step's
# 120 layers) the two are even at 16 rows (49 / 47 ms) and the GEMM ahead from 24 (77 / 48 ms;
# benchmarks/quant_linear.py).
DENSE_ROWS = 16


class QuantBytes(LinearKernel):
    """A 4/8-bit weight multiplied from its bytes by the CPU kernels up to ``dense_rows`` rows
    (with x's rows rounded to int8 on AVX512-VNNI where the weight was prepared for it:
    ``use_int8_activations``), through a dequantized copy in x's dtype above; without the
    kernels (``ops`` None: no compiler), dequantized by PyTorch every call. ``dense_rows``
    None: every batch from the bytes, whose sums for a row do not depend on the others
    (batch-invariant mode)."""

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, ops,
                 dense_rows: int | None = DENSE_ROWS):
        self.qw, self.bias, self.dense_rows = qw, bias, dense_rows
        self.ops = ops if qw.qweight.device.type == "cpu" else None
        self.int8_activations = bool(self.ops is not None and qw.int8_activations
                                     and self.ops.has_int8_dot)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        qw, ops = self.qw, self.ops
        if ops is None:
            return F.linear(x, dequantize(qw, x.dtype), self.bias)
        if self.dense_rows is not None and x.shape[0] > self.dense_rows:
            w = ops.quant_dequantize(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size,
                                     x.dtype)
            return F.linear(x, w, self.bias)
        if self.int8_activations and qw.bits == 4:
            return ops.quant_linear_w4a8(x, qw.qweight, qw.scales, qw.zeros, self.bias)
        if self.int8_activations:
            return ops.quant_linear_w8a8(x, qw.qweight, qw.scales, qw.act_offsets, self.bias)
        return ops.quant_linear(x, qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size,
                                self.bias)

    @property
    def family(self) -> str:
        if self.ops is None:
            return "quant-torch"
        return "quant-a8" if self.int8_activations else "quant"

    @property
    def weight_format(self) -> str:
        return self.qw.kind


class Fp8(LinearKernel):
    """float8 e4m3 weights with per-output-feature scales times x quantized to e4m3 per row
    (``fp8_linear``: ``torch._scaled_mm``; Hopper / Ada GPUs, PyTorch's reference on a CPU)."""

    family = "fp8"

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None):
        self.qw, self.bias = qw, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.qw, self.bias)

    @property
    def weight_format(self) -> str:
        return "fp8"
