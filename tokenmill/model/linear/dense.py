"""Kernels on an unpacked or oneDNN-packed weight: PyTorch's ``F.linear``, oneDNN's prepacked
float32 inner product, and the CPU kernels' bf16 linear for a few rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.linear.base import LinearKernel, dtype_name, on_rows

# Rows of input up to which the CPU kernels' bf16 linear (on the plain weight; the layers that
# cannot be packed) beats oneDNN's on AVX512-BF16 (1.2-1.9x at 1-4 rows alone,
# benchmarks/linear_kernels.py; in the whole default model's forward it is still 1.1-1.35x
# faster at 5-8 rows, the sizes a speculative verification of 4-7 drafts runs at; about even at
# 9, oneDNN ahead from 16 -- AMD EPYC Zen 4, 2 cores)
SMALL_M_ROWS = 8


class Dense(LinearKernel):
    """``F.linear`` on the weight as loaded: the reference, and what runs where nothing faster
    takes the weight (a GPU, float16, a size no packed kernel takes)."""

    family = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def weight_format(self) -> str:
        return dtype_name(self.weight.dtype)


class OneDnn(LinearKernel):
    """float32 on oneDNN's prepacked weight: MKL's dense sgemm streams a [N, K] weight poorly
    when only a few rows of input come in; oneDNN's inner product on the same weights is
    1.4-1.7x faster at 1-32 rows (benchmarks/model_speed.py)."""

    family = "onednn"

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None):
        self.packed, self.bias = packed, bias

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> OneDnn | None:
        if (weight.dtype != torch.float32 or weight.device.type != "cpu"
                or not torch.backends.mkldnn.is_available()):
            return None
        return cls(weight.detach().to_mkldnn(), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight_format(self) -> str:
        return "float32"


class Bf16Rows(LinearKernel):
    """bf16 on AVX512-BF16 for a weight the packed GEMM cannot take (N not a multiple of 16):
    up to ``max_rows`` rows (decode at small batch) one pass over the weight at memory speed
    (``linear_bf16_rows``), more through ``F.linear``. ``max_rows`` None: every batch on
    ``linear_bf16_rows``, whose sums for a row do not depend on the others (batch-invariant
    mode), at its pace for prompts."""

    family = "bf16-rows"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops,
                 max_rows: int | None = SMALL_M_ROWS):
        self.weight, self.bias, self.ops, self.max_rows = weight, bias, ops, max_rows

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, ops,
              max_rows: int | None = SMALL_M_ROWS) -> Bf16Rows | None:
        if (ops is None or not ops.has_bf16_dot or weight.dtype != torch.bfloat16
                or weight.device.type != "cpu" or weight.shape[0] % 4):
            return None
        return cls(weight, bias, ops, max_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and (self.max_rows is None or x.shape[0] <= self.max_rows):
            return on_rows(self.ops.linear_bf16_rows, x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def weight_format(self) -> str:
        return "bfloat16"
