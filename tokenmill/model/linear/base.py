"""What every linear kernel is: ``y = x @ W.T + b`` by one way of multiplying, chosen once at
load (``plan.py``) and holding its own weights; ``Linear.forward`` is one call to it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepWeight:
    """What the fused CPU step (``runner/cpu_step.py``, ``csrc/decoder_step.h``) multiplies a
    linear with: its weight packed for one of the kernels' GEMMs, its bias and, where batches
    of ``dense_from_rows`` rows go to oneDNN, the dense weight they multiply."""

    gemm: str  # "bf16" (bf16_gemm.h) or "f32" (f32_gemm.h, 4/8-bit and a8 layouts included)
    packed: torch.Tensor
    bias: torch.Tensor | None
    applies_silu: bool = False  # gate/up: silu(gate) * up in the GEMM's epilogue
    dense: torch.Tensor | None = None
    dense_from_rows: int | None = None
    amx: bool = False  # bf16: multiplied on AMX tiles (Bf16Amx)
    # bf16: from this many rows on float32 FMAs over the widened weight, the same bits as
    # vdpbf16ps (csrc/bf16_gemm.h's WidenRows); 0: vdpbf16ps at every row count
    widen_from: int = 0


class LinearKernel:
    """One way of multiplying. Subclasses set ``family`` (the plan's name for it) and implement
    ``__call__``; a kernel the fused CPU step can run says so through ``step_weight``."""

    family = ""
    # a gate/up kernel that returns silu(gate) * up (half the width) rather than the product
    applies_silu = False
    # multiplies x rounded to int8 (per row or per group of 32): close to the float product,
    # not equal to it
    int8_activations = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight_format(self) -> str:
        """The weight as the kernel holds it: a dtype ("float32") or a quantized kind ("q4_1")."""
        raise NotImplementedError

    def step_weight(self) -> StepWeight | None:
        """The weights for the fused CPU step; None: this kernel does not run there."""
        return None

    def describe(self) -> str:
        a8 = ", int8 activations" if self.int8_activations else ""
        return f"{self.family} ({self.weight_format}{a8})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def on_rows(kernel: Callable, x: torch.Tensor, packed: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    """A packed-weight kernel (it takes (rows, K) with a unit inner stride) over ``x``'s rows,
    any leading dimensions."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    shape = x.shape
    out = kernel(x.reshape(-1, shape[-1]), packed, bias)  # (rows, N)
    return out.view(*shape[:-1], out.shape[-1])
