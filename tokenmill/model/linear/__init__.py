"""Linear kernels as strategies, and the plan that picks them.

Each way of multiplying ``x @ W.T + b`` is a small object holding its own weights, built once
at load; ``Linear.forward`` is one call to it:

    dense.py      Dense (F.linear), OneDnn (oneDNN-prepacked float32), Bf16Rows (bf16, a few rows)
    packed.py     F32Packed (float32 GEMM; 4/8-bit weights in their bits; int8 activations),
                  Bf16Packed, Bf16PackedSilu (gate/up with SiLU·mul in the epilogue)
    quantized.py  QuantBytes (4/8-bit from the bytes, int8 activations on VNNI), Fp8
    routed.py     OneDnnRouted: from N rows oneDNN on the dense weight, else the packed kernel
    plan.py       LinearPlan, plan_linears(machine, dtype, quantization): every choice, made
                  without the machine
    setup.py      a loaded model's layers put in the plan's formats and kernels

A new kernel is a class here, a family name in ``plan.py``'s chains and a builder in
``setup.py``; one the fused CPU step runs also returns its ``StepWeight``.
"""

from tokenmill.model.linear.base import LinearKernel, StepWeight
from tokenmill.model.linear.plan import LinearPlan, plan_linears

__all__ = ["LinearKernel", "LinearPlan", "StepWeight", "plan_linears"]
