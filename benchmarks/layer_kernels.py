"""The CPU kernels of a decoder layer that the other benchmarks do not time, each beside the
PyTorch code it replaces (tokenmill/kernels/ladder.py), on the default model's shapes (hidden
576, 9 + 3 + 3 heads of 64, intermediate 1536), by rows of input (tokens in a step):

    python benchmarks/layer_kernels.py [--rows 1,8,32,256] [--min-time 0.2]

bfloat16: rms_norm (with the residual), rope_, silu_and_mul against the layers' PyTorch paths
(RMSNorm, apply_rope, silu_and_mul without the kernels), and linear_bf16_packed_silu against
F.linear then SiLU·mul. float32: rms_norm_f32 against
F.rms_norm, linear_f32_packed_add against F.linear + the residual, and linear_f32_packed over a
gate/up weight kept in 4 or 8 bits (pack_f32_quant_weight), or times int8 rows of x
(pack_a8_weight), against F.linear on the dequantized weight. In both dtypes: LoRABank's add_
(a rank-16 LoRA on gate/up, every row under one adapter) against model/lora/slots.py's PyTorch
reference, and (bf16) silu_and_mul_interleaved against silu_and_mul. Prints one JSON object per
row count: microseconds per call, kernel and reference, for each kernel this machine has.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.config import RopeScaling
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model import quant as Q
from tokenmill.model.layers import RMSNorm, RotaryEmbedding, apply_rope
from tokenmill.model.linear.activation import silu_and_mul
from tokenmill.model.lora.slots import lora_reference

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def us_per_call(fn: Callable[[], object], min_time: float) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time:
        fn()
        n += 1
    return round((time.perf_counter() - start) / n * 1e6, 1)


def bf16_cases(ops, rows: int) -> dict[str, tuple[Callable, Callable]]:
    bf = torch.bfloat16
    x, res = torch.randn(rows, HIDDEN, dtype=bf), torch.randn(rows, HIDDEN, dtype=bf)
    norm = RMSNorm(HIDDEN, 1e-5)  # without cpu_ops: the PyTorch path
    norm.weight.data = torch.rand(HIDDEN, dtype=bf) + 0.5
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=bf)
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    cos_sin = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, RopeScaling())(torch.arange(rows))
    cos, sin = (t.squeeze(1) for t in cos_sin)  # (rows, HEAD_DIM / 2), as the kernel takes
    gate_up = torch.randn(rows, 2 * INTER, dtype=bf)
    cases = {
        "rms_norm": (lambda: ops.rms_norm(x, res, norm.weight, 1e-5), lambda: norm(x, res)),
        "rope_": (lambda: ops.rope_(qk, cos, sin), lambda: apply_rope(qk, cos_sin)),
        "silu_and_mul": (lambda: ops.silu_and_mul(gate_up), lambda: silu_and_mul(gate_up)),
    }
    if getattr(ops, "has_bf16_gemm", False):
        dense = torch.randn(2 * INTER, HIDDEN, dtype=bf) / 8
        # gate and up column blocks of 16 interleaved, as Linear packs a gate/up weight
        packed = ops.pack_bf16_weight(dense.view(2, -1, 16, HIDDEN).transpose(0, 1)
                                      .reshape(2 * INTER, HIDDEN))
        cases["linear_bf16_packed_silu"] = (lambda: ops.linear_bf16_packed_silu(x, packed, None),
                                            lambda: silu_and_mul(F.linear(x, dense)))
    cases.update(lora_cases(ops, x, gate_up))
    # gate/up's column blocks of 16 interleaved: (rows, 2, I / 16, 16) -> (rows, I / 16, 2, 16)
    inter = gate_up.view(rows, 2, -1, 16).transpose(1, 2).reshape(rows, -1).contiguous()
    cases["silu_and_mul_interleaved"] = (lambda: ops.silu_and_mul_interleaved(inter, 16),
                                         lambda: silu_and_mul(gate_up))
    return cases


def lora_cases(ops, x: torch.Tensor, gate_up: torch.Tensor,
               suffix: str = "") -> dict[str, tuple[Callable, Callable]]:
    """A rank-16 LoRA on gate/up (one slice each) added to every row, as one adapter in a
    step: the bank's add_ against the PyTorch reference (both add into ``gate_up``)."""
    r, rows, dtype = 16, x.shape[0], x.dtype
    a = (torch.randn(2 * r, HIDDEN) / 24).to(dtype)
    b = torch.zeros(2 * r, 2 * INTER)
    b[:r, :INTER], b[r:, INTER:] = torch.randn(r, INTER) / 10, torch.randn(r, INTER) / 10
    b = b.to(dtype)
    segments = [(0, r, 0, 0, INTER), (r, r, INTER, INTER, INTER)]
    bank = ops.LoRABank(1, 1)
    bank.set(0, 0, 2, a, b, torch.tensor(segments), None)  # slot 0, layer 0, role gate_up
    rows_idx = torch.arange(rows)
    bank.set_step(rows_idx, torch.tensor([0, rows]), [0])
    return {f"LoRABank{suffix}": (lambda: bank.add_(0, 2, x, gate_up, False),
                                  lambda: lora_reference(x, gate_up, rows_idx, a, b, segments))}


def f32_cases(ops, rows: int) -> dict[str, tuple[Callable, Callable]]:
    x, res = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN)
    cases = {"rms_norm_f32": (lambda: ops.rms_norm_f32(x, res[0], 1e-5),
                              lambda: F.rms_norm(x, (HIDDEN,), res[0], 1e-5))}
    if not getattr(ops, "f32_pack_cols", 0):
        return cases
    o = torch.randn(HIDDEN, HIDDEN)
    o_packed = ops.pack_f32_weight(o)
    cases["linear_f32_packed_add"] = (lambda: ops.linear_f32_packed_add(x, o_packed, None, res),
                                      lambda: F.linear(x, o) + res)
    w = torch.randn(2 * INTER, HIDDEN) * 0.02
    for bits, quantize in ((4, Q.quantize_int4), (8, Q.quantize_int8)):
        qw = quantize(w)
        dense = Q.dequantize(qw)
        packs = {"pack_f32_quant_weight": ops.pack_f32_quant_weight}
        if getattr(ops, "a8_pack_cols", 0):
            packs["pack_a8_weight"] = ops.pack_a8_weight
        for name, pack in packs.items():
            p = pack(qw.qweight, qw.scales, qw.zeros, bits, qw.group_size)
            cases[f"{name} int{bits}"] = (lambda p=p: ops.linear_f32_packed(x, p, None),
                                          lambda d=dense: F.linear(x, d))
    cases.update(lora_cases(ops, x, torch.randn(x.shape[0], 2 * INTER), " f32"))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    args = ap.parse_args()
    ops = cpu_kernels.load()
    if ops is None:
        raise SystemExit("the CPU kernels are not available here (no compiler?)")
    torch.manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        row = {"rows": rows, "threads": torch.get_num_threads()}
        with torch.inference_mode():
            for name, (kernel, reference) in {**bf16_cases(ops, rows),
                                              **f32_cases(ops, rows)}.items():
                row[name] = {"kernel_us": us_per_call(kernel, args.min_time),
                             "reference_us": us_per_call(reference, args.min_time)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
