"""oneDNN row routing: from some number of rows a batch multiplies on the dense weight through
oneDNN (``F.linear``), below it on the packed kernel. Where oneDNN is faster for large batches
(a bf16 model on a CPU with AMX, whose tiles oneDNN uses and the packed GEMM does not) the
loader times both at load (``time_packed_and_dense``) and picks the rows (``dense_rows_from``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from tokenmill.model.linear.activation import silu_and_mul
from tokenmill.model.linear.base import LinearKernel, StepWeight

# Rows of input at which the loader times the packed GEMM against oneDNN's, and how much faster
# oneDNN must be to take them: decode batches of 16 sequences and more, and prompt chunks (on a
# 2-core AMX Xeon a 32-sequence decode step took 64-68 ms through oneDNN, layer by layer,
# against 83-95 ms fused on the packed weights)
ONEDNN_TRIAL_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
ONEDNN_MARGIN = 1.15


class OneDnnRouted(LinearKernel):
    """A packed kernel and the dense weight beside it: inputs of ``from_rows`` rows or more go
    to oneDNN on the dense weight (then SiLU·mul, for a gate/up kernel that applies it), fewer
    to the packed kernel."""

    family = "onednn-routed"

    def __init__(self, packed: LinearKernel, weight: torch.Tensor, bias: torch.Tensor | None,
                 from_rows: int, ops):
        self.packed, self.weight, self.bias, self.ops = packed, weight, bias, ops
        self.from_rows = from_rows
        self.applies_silu = packed.applies_silu
        self.int8_activations = packed.int8_activations

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= self.from_rows * x.shape[-1]:
            return self.dense(x)
        return self.packed(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(self.weight.dtype), self.weight, self.bias)
        return silu_and_mul(out, self.ops) if self.applies_silu else out

    @property
    def weight_format(self) -> str:
        return self.packed.weight_format

    def step_weight(self) -> StepWeight | None:
        inner = self.packed.step_weight()
        return None if inner is None else replace(inner, dense=self.weight.detach(),
                                                  dense_from_rows=self.from_rows)

    def describe(self) -> str:
        return f"{self.packed.describe()}, oneDNN from {self.from_rows} rows"


def dense_rows_from(timings: dict[int, tuple[float, float]],
                    margin: float = ONEDNN_MARGIN) -> int | None:
    """From ``{rows: (packed seconds, oneDNN seconds)}``: the fewest rows from which oneDNN was
    at least ``margin`` times faster at every row count timed, or None (packed throughout)."""
    start = None
    for rows in sorted(timings, reverse=True):
        packed, dense = timings[rows]
        if packed < dense * margin:
            break
        start = rows
    return start


def time_packed_and_dense(candidates: list[OneDnnRouted], rows: tuple[int, ...] = ONEDNN_TRIAL_ROWS,
                          repeats: int = 2) -> dict[int, tuple[float, float]]:
    """``{rows: (packed seconds, oneDNN seconds)}`` for one forward through every candidate,
    best of ``repeats``."""
    return time_two_ways(candidates, [c.weight.shape[1] for c in candidates],
                         candidates[0].weight.dtype, lambda c, x: c.packed(x),
                         lambda c, x: c.dense(x), rows, repeats)


def time_two_ways(kernels: list, widths: list[int], dtype: torch.dtype, first: Callable,
                  second: Callable, rows: tuple[int, ...],
                  repeats: int = 2) -> dict[int, tuple[float, float]]:
    """``{rows: (seconds first, seconds second)}``: ``way(kernel, x)`` over every kernel, x of
    that many rows of its width (``widths``), best of ``repeats`` after a warm-up round."""
    timings = {}
    with torch.inference_mode():
        for n in rows:
            xs = [torch.randn(n, width).to(dtype) for width in widths]
            best = [math.inf, math.inf]
            for _ in range(repeats + 1):  # the first round warms up
                for i, way in enumerate((first, second)):
                    start = time.perf_counter()
                    for k, x in zip(kernels, xs):
                        way(k, x)
                    best[i] = min(best[i], time.perf_counter() - start)
            timings[n] = (best[0], best[1])
    return timings


# Rows at which the loader times vdpbf16ps against WidenRows' float32 FMAs (csrc/bf16_gemm.h;
# the same bits) for packed bf16 weights, and how much faster the FMAs must be to take a row
# count and every larger one: on a 2-core Xeon with AVX512-BF16 and no AMX exposed, the default
# model's bf16 linears ran 1.1-1.5x faster on them from 4 rows, at par at 2, slower at 1
WIDEN_TRIAL_ROWS = (4, 8, 16, 32, 64, 128, 256, 512)
WIDEN_MARGIN = 1.05


def widened_exact(kernels: list, rows: tuple[int, ...] = (1, 9, 70)) -> bool:
    """Whether the float32 FMAs give vdpbf16ps's bits on this CPU for every kernel (packed
    bf16 ones), on random rows: the instruction's definition says they must; a CPU that rounds
    its pairs otherwise keeps vdpbf16ps throughout."""
    with torch.inference_mode():
        for n in rows:
            for k in kernels:
                x = torch.randn(n, k.in_features).to(torch.bfloat16)
                dot, wide = (k.ops.linear_bf16_packed(x, k.packed, k.bias, widen_from=start)
                             for start in (0, 1))
                if not torch.equal(dot.view(torch.int16), wide.view(torch.int16)):
                    return False
    return True
