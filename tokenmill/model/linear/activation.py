"""SiLU·mul, the gated MLP's activation, where the compiled CPU kernels pay and in PyTorch
elsewhere. Here beside the linear kernels because gate/up kernels may apply it themselves
(``Bf16PackedSilu``, or oneDNN's product then this, ``OneDnnRouted``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_ops(x: torch.Tensor, ops):
    """The compiled CPU kernels where they pay: bfloat16/float16 on a CPU, where PyTorch runs
    each elementwise step as several passes (float32 stays on PyTorch's fused, exact ops)."""
    return ops if ops is not None and x.dtype != torch.float32 and x.device.type == "cpu" \
        else None


def silu_and_mul(x: torch.Tensor, ops=None) -> torch.Tensor:
    """silu(gate) * up of a gate/up product ``x`` (..., 2I) -> (..., I). float32 on the CPU
    kernels: PyTorch's ops split over threads by whole rows (``silu_and_mul_rows``), so a row's
    bits do not depend on how many rows share the call, as the fused step computes it."""
    fused = fused_ops(x, ops)
    if fused is not None:
        return fused.silu_and_mul(x)
    if (ops is not None and x.dtype == torch.float32 and x.device.type == "cpu"
            and hasattr(ops, "silu_and_mul_rows")):
        shape = x.shape
        out = ops.silu_and_mul_rows(x.reshape(-1, shape[-1]))  # (rows, I)
        return out.view(*shape[:-1], out.shape[-1])
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
