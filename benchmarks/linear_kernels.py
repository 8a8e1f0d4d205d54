"""The timing rung of the linear kernel ladder (``tokenmill/model/linear/``): the projections
of one decode step of a model shape through each kernel the plan may pick, against ``Dense``
(``F.linear``, the reference they replace; their tests: tests/test_linear_kernels.py).

    python3 benchmarks/linear_kernels.py                    # SmolLM2-135M shapes
    python3 benchmarks/linear_kernels.py --kernels Bf16PackedF32 --bf16-rows 512,2048

float32: ``Dense``, ``OneDnn`` (oneDNN's prepacked weights), ``F32Packed`` (the CPU kernels'
GEMM) and ``F32Blocks4`` / ``F32Blocks8`` (4/8-bit groups of 32 widened to float32 on it);
bf16 (where the CPU has AVX512-BF16): ``Dense``, ``Bf16Rows`` (a few rows, on the plain
weight; ``SMALL_M_ROWS``), ``Bf16Packed`` and ``Bf16PackedF32`` (its weight's rows as float32
FMAs, the same bits), ``Bf16Blocks4`` / ``Bf16Blocks8`` (the weights in 4/8-bit groups of 32
on the packed bf16 GEMM: ``--quantization`` in bf16) and ``Bf16Blocks4F32`` (those rows as
float32 FMAs), ``Bf16Amx`` (the packed weight on AMX tiles, where the CPU has them) and
``QuantA8-4`` / ``QuantA8-8`` (the 4/8-bit weights from their bytes at every row count with x's
rows rounded to int8, on AVX512-VNNI). bf16's ``Dense`` is oneDNN's GEMM (on AMX tiles where the
CPU has them). Random weights of the model's shapes (fused qkv, o, fused gate/up, down per
layer, then lm_head); prints milliseconds per step for each number of
input rows (= sequences in a step).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tokenmill.kernels import cpu
from tokenmill.model.linear.dense import Bf16Rows, Dense, OneDnn
from tokenmill.model.linear.packed import Bf16Amx, Bf16Blocks, Bf16Packed, F32Packed
from tokenmill.model.linear.quantized import QuantBytes
from tokenmill.model.quant import quantize_int4, quantize_int8, use_int8_activations


def step_ms(kernels: list, rows: int, reps: int, dtype: torch.dtype) -> float:
    """Milliseconds for one pass of ``rows`` rows through every kernel (nan if one is None)."""
    if not kernels or any(k is None for k in kernels):
        return float("nan")
    xs = {w: torch.randn(rows, w).to(dtype) for _, w in kernels}
    run = lambda: [k(xs[w]) for k, w in kernels]  # noqa: E731
    run()  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - start) / reps * 1000


def built(build: Callable, weights: list[torch.Tensor]) -> list:
    """(``build(weight)``, its input width) for each weight (None where it refuses)."""
    out = []
    for w in weights:
        k = build(w)
        out.append(None if k is None else (k, w.shape[1]))
    return out


def table(title: str, builders: dict[str, Callable], weights: list[torch.Tensor],
          rows: list[int], reps: int, dtype: torch.dtype, only: set[str]) -> None:
    """ms per step of each kernel ``builders`` names (those in ``only`` where it names any)
    built over ``weights``, at each row count."""
    ladder = {name: built(build, weights) for name, build in builders.items()
              if not only or name in only}
    if not ladder:
        return
    print(f"{title}\nrows  " + "  ".join(f"{name:>14}" for name in ladder))
    for n in rows:
        print(f"{n:4}  " + "  ".join(f"{step_ms(ks, n, reps, dtype):14.1f}"
                                      for ks in ladder.values()))


def shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    h, hd = args.hidden, args.hidden // args.heads
    layer = [(h + 2 * args.kv_heads * hd, h), (h, h), (2 * args.intermediate, h),
             (h, args.intermediate)]
    return layer * args.layers + [(args.vocab, h)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--bf16-rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", default="", help="comma-separated columns (default: all)")
    args = ap.parse_args()
    only = set(filter(None, args.kernels.split(",")))
    torch.manual_seed(0)
    ops = cpu.load()
    weights = [torch.randn(n, k) for n, k in shapes(args)]
    print(f"{len(weights)} projections, {sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB "
          f"fp32, {torch.get_num_threads()} threads")
    table("float32 (ms per step)", {
        "Dense": lambda w: Dense(w, None),
        "OneDnn": lambda w: OneDnn.build(w, None),
        "F32Packed": lambda w: F32Packed.build(w, None, ops),
        "F32Blocks4": lambda w: f32_blocks(w, quantize_int4, ops),
        "F32Blocks8": lambda w: f32_blocks(w, quantize_int8, ops),
    }, weights, [int(r) for r in args.rows.split(",")], args.reps, torch.float32, only)
    if ops is None or not ops.has_bf16_dot:
        return
    weights = [w.bfloat16() for w in weights]
    table("bfloat16 (ms per step; Bf16Rows past SMALL_M_ROWS is F.linear)", {
        "Dense": lambda w: Dense(w, None),
        "Bf16Rows": lambda w: Bf16Rows(w, None, ops),
        "Bf16Packed": lambda w: Bf16Packed.build(w, None, ops),
        "Bf16PackedF32": lambda w: widened(Bf16Packed.build(w, None, ops)),
        "Bf16Blocks4": lambda w: blocks(w, quantize_int4, ops),
        "Bf16Blocks4F32": lambda w: widened(blocks(w, quantize_int4, ops)),
        "Bf16Blocks8": lambda w: blocks(w, quantize_int8, ops),
        "Bf16Amx": lambda w: Bf16Amx.build(w, None, ops),
        "QuantA8-4": lambda w: int8_rows(w, quantize_int4, ops),
        "QuantA8-8": lambda w: int8_rows(w, quantize_int8, ops),
    }, weights, [int(r) for r in args.bf16_rows.split(",")], args.reps, torch.bfloat16, only)


def blocks(w: torch.Tensor, quantize: Callable, ops) -> Bf16Blocks | None:
    return Bf16Blocks.build_quantized(quantize(w), None, ops)


def f32_blocks(w: torch.Tensor, quantize: Callable, ops) -> F32Packed | None:
    """The 4/8-bit weight in its bits on the float32 GEMM (widened to float32 as multiplied:
    the default on a CPU without native bf16 for a GGUF's Q4_1 / Q8_0 blocks)."""
    return F32Packed.build_quantized(quantize(w), None, ops, int8_activations=False)


def int8_rows(w: torch.Tensor, quantize: Callable, ops) -> QuantBytes | None:
    """The 4/8-bit weight from its bytes at every row count, x's rows rounded to int8 (the
    ``quant-a8`` kernel a CPU with AVX512-VNNI but no bf16 blocks plans), None without it."""
    if not getattr(ops, "has_int8_dot", False):
        return None
    qw = quantize(w)
    use_int8_activations(qw)
    return QuantBytes(qw, None, ops, dense_rows=None)


def widened(kernel: Bf16Packed | None) -> Bf16Packed | None:
    """``kernel`` with every row count on float32 FMAs (vdpbf16ps's bits; csrc/bf16_gemm.h's
    WidenRows), as the load routes prompt rows where its trial measures them faster."""
    if kernel is not None:
        kernel.widen_from = 1
    return kernel


if __name__ == "__main__":
    main()
