"""The linear layers of one decode step of the default model, quantized and not, by batch rows.

    python benchmarks/quant_linear.py [--rows 1,8,16,24,32,64]

121 distinct weights in the default model's shapes (30 x qkv, o, gate/up, down, and the 49,152 x
576 output layer), so they stream from memory as in a real step. Prints ms per step for: bf16
through oneDNN, the bf16 rows kernel (<= 8 rows), int8 and int4 from the bytes (weights only),
int8 and int4 with int8 activations (AVX512-VNNI), and int4 dequantized + GEMM (the path above
model/linear/quantized.py: DENSE_ROWS).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model import quant as Q

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def timed(f, repeats: int = 3) -> float:
    f()
    t = time.perf_counter()
    for _ in range(repeats):
        f()
    return round((time.perf_counter() - t) / repeats * 1e3, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,24,32,64")
    args = ap.parse_args()
    ops = cpu_kernels.load()
    ws = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    dense = [w.bfloat16() for w in ws]
    int8, int4 = [Q.quantize_int8(w) for w in ws], [Q.quantize_int4(w) for w in ws]
    int8_a8, int4_a8 = [Q.quantize_int8(w) for w in ws], [Q.quantize_int4(w) for w in ws]
    if ops.has_int8_dot:
        for q in int8_a8 + int4_a8:
            Q.use_int8_activations(q)
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}

        def direct(qs):  # from the bytes, whatever the row count
            return lambda: [ops.quant_linear(xs[q.shape[1]], q.qweight, q.scales, q.zeros,
                                             q.bits, q.group_size, None) for q in qs]

        row = {"rows": m, "bf16_onednn": timed(lambda: [torch.nn.functional.linear(
            xs[w.shape[1]], w) for w in dense])}
        if m <= 8 and ops.has_bf16_dot:
            row["bf16_rows_kernel"] = timed(lambda: [ops.linear_bf16_rows(
                xs[w.shape[1]], w, None) for w in dense])
        row["int8_weights_only"] = timed(direct(int8))
        row["int4_weights_only"] = timed(direct(int4))
        if ops.has_int8_dot:
            row["int8_a8"] = timed(lambda: [ops.quant_linear_w8a8(
                xs[q.shape[1]], q.qweight, q.scales, q.act_offsets, None) for q in int8_a8])
            row["int4_a8"] = timed(lambda: [ops.quant_linear_w4a8(
                xs[q.shape[1]], q.qweight, q.scales, q.zeros, None) for q in int4_a8])
        row["int4_dequantize_gemm"] = timed(lambda: [torch.nn.functional.linear(
            xs[q.shape[1]], ops.quant_dequantize(q.qweight, q.scales, q.zeros, 4, 32,
                                                 torch.bfloat16)) for q in int4])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
