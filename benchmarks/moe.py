"""The timing rung of the grouped-experts kernel (``csrc/moe.h``, ``MoEExperts``): one decode
step's routed experts of a tiny-but-wide mixture-of-experts layer (random weights; default 8
experts, top-2, hidden 1024, expert width 2048) at 1 / 8 / 32 rows, three ways:

- ``per-expert loop``: transformers' way (the reference it replaces), a Python loop over the
  experts hit, each one's rows gathered, ``F.linear`` on its dense weights, SiLU·mul, down,
  ``index_add_``;
- ``torch grouped``: ``model/moe.py``'s ``grouped_experts`` (slots sorted by expert, each
  expert's own packed kernel): the path where the C++ kernel is not built (and on CUDA);
- ``MoEExperts``: the C++ grouped kernel over the same packed weights.

    python3 benchmarks/moe.py [--dtypes float32,bfloat16] [--quantization none,int8]

Prints milliseconds per call (best of --repeats means) with the CPU model, its flags and the
thread count. Their tests: tests/test_moe.py::test_grouped_kernel_equals_torch_loop.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.config import ModelConfig
from tokenmill.kernels import cpu
from tokenmill.model.linear import plan_linears
from tokenmill.model.linear.setup import apply_formats, build_kernels
from tokenmill.model.llama import LlamaMLP
from tokenmill.model.moe import SparseMoE, build_grouped, grouped_experts, route
from tokenmill.platform import Machine


def make_layer(args, dtype: str, quantization: str, ops) -> tuple[SparseMoE, list]:
    """A random MoE layer with its experts on the plan's kernels, and their dense weights
    (gate/up, down) for the per-expert loop."""
    cfg = ModelConfig(architecture="mixtral", vocab_size=16, hidden_size=args.hidden,
                      intermediate_size=args.inter, num_layers=1, num_heads=8, num_kv_heads=8,
                      head_dim=args.hidden // 8, num_experts=args.experts,
                      num_experts_per_tok=args.top_k, moe_intermediate_size=args.inter,
                      extra=dict(norm_topk_prob=True))
    torch.manual_seed(0)
    moe = SparseMoE(cfg, LlamaMLP)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    moe = moe.to(getattr(torch, dtype))
    dense = [(e.gate_up_proj.weight.detach().clone(), e.down_proj.weight.detach().clone())
             for e in moe.experts]
    plan = plan_linears(Machine.detect("cpu", kernels_built=True), dtype, quantization)
    apply_formats(moe, plan)
    build_kernels(moe, plan, ops, ops)
    for module in moe.modules():  # as the loader does: the kernels' SiLU·mul below float32
        if hasattr(module, "cpu_ops"):
            module.cpu_ops = ops
    return moe, dense


def per_expert_loop(dense: list, x: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """transformers' expert loop: every expert hit, its rows, F.linear on dense weights."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tokens, slot = torch.where(ids == e)
        gate, up = F.linear(x[tokens], dense[e][0]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, dense[e][1]) * weights[tokens, slot, None].to(x.dtype)
        out.index_add_(0, tokens, y)
    return out


def best_ms(fn: Callable[[], object], reps: int, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps * 1000)
    return best


def bench(args, dtype: str, quantization: str, ops) -> None:
    moe, dense = make_layer(args, dtype, quantization, ops)
    kind = moe.experts[0].gate_up_proj.kernel.describe()
    grouped = build_grouped(moe, ops)  # None: kernels it does not take (QuantBytes)
    print(f"\n{dtype}, --quantization {quantization}: experts on {kind}")
    print(f"{'rows':>5} {'per-expert loop':>16} {'torch grouped':>14} {'MoEExperts':>11} "
          f"{'speed-up':>9}")
    for rows in args.batches:
        x = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(rows))
        x = x.to(getattr(torch, dtype))
        weights, ids = route(moe.gate(x), args.top_k, True, True)
        with torch.inference_mode():
            loop = best_ms(lambda: per_expert_loop(dense, x, weights, ids), args.reps,
                           args.repeats)
            torch_grouped = best_ms(lambda: grouped_experts(moe.experts, x, weights, ids),
                                    args.reps, args.repeats)
            fused = best_ms(lambda: grouped.forward(x, ids, weights), args.reps,
                            args.repeats) if grouped is not None else float("nan")
        print(f"{rows:>5} {loop:>13.3f} ms {torch_grouped:>11.3f} ms {fused:>8.3f} ms "
              f"{loop / fused:>8.2f}x")


def cpu_line() -> str:
    name, flags = platform.processor() or platform.machine(), ""
    try:
        info = open("/proc/cpuinfo").read()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                    if line.startswith("model name"))
        have = set(next(line for line in info.splitlines() if line.startswith("flags")).split())
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
                         if f in have)
    except (OSError, StopIteration):
        pass
    return f"{name} [{flags}], torch {torch.__version__}, {torch.get_num_threads()} threads"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")],
                   default=[1, 8, 32])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--quantization", default="none,int8")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    ops = cpu.load()
    if ops is None or not hasattr(ops, "MoEExperts"):
        raise SystemExit("the CPU kernels (with MoEExperts) are not built on this machine")
    print(f"MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
          f"expert width {args.inter}; {cpu_line()}")
    for dtype in args.dtypes.split(","):
        if dtype == "bfloat16" and not getattr(ops, "has_bf16_gemm", False):
            print("\nbfloat16: no bf16 GEMM on this CPU (AVX512-BF16), skipped")
            continue
        for quantization in args.quantization.split(","):
            bench(args, dtype, quantization, ops)


if __name__ == "__main__":
    main()
