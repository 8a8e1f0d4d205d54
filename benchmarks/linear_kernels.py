"""The CPU matmul questions behind ``Linear.pack_for_cpu`` and ``SMALL_M_ROWS``: time the
projections of one decode step of a model shape with ``F.linear``, with oneDNN on prepacked
weights and with the CPU kernels' ``linear_f32_packed`` (fp32), and in bf16 with ``F.linear``, the CPU kernels' ``linear_bf16_rows`` and their
``linear_bf16_packed`` on weights packed for vdpbf16ps (where the CPU has AVX512-BF16).

    python3 benchmarks/linear_kernels.py                    # SmolLM2-135M shapes, 1/8/32 rows

Random fp32 weights of the model's shapes (fused qkv, o, fused gate/up, down per layer, then
lm_head); prints milliseconds per step for each number of input rows (= sequences in a step).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def step_ms(fn, weights, rows: int, reps: int) -> float:
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=weights[0].dtype) for w in weights}
    fn(xs)  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        fn(xs)
    return (time.perf_counter() - start) / reps * 1000


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
    args = ap.parse_args()
    h, hd = args.hidden, args.hidden // args.heads
    shapes = [(h + 2 * args.kv_heads * hd, h), (h, h), (2 * args.intermediate, h),
              (h, args.intermediate)]
    torch.manual_seed(0)
    dense = [torch.randn(n, k) for _ in range(args.layers) for n, k in shapes]
    dense.append(torch.randn(args.vocab, h))
    packed = [w.to_mkldnn() for w in dense]

    def run_dense(xs):
        for w in dense:
            F.linear(xs[w.shape[1]], w)

    def run_onednn(xs):
        for w in packed:
            torch.ops.mkldnn._linear_pointwise(xs[w.size(1)], w, None, "none", [], "")

    print(f"{len(dense)} projections, {sum(w.numel() for w in dense) * 4 / 1e6:.0f} MB fp32, "
          f"{torch.get_num_threads()} threads")
    from tokenmill.kernels import cpu

    ops = cpu.load()
    cols = getattr(ops, "f32_pack_cols", 0) if ops is not None else 0
    ours = [ops.pack_f32_weight(w) for w in dense] if cols else []

    def run_ours(xs):
        for w, p in zip(dense, ours):
            ops.linear_f32_packed(xs[w.shape[1]], p, None)

    print("rows  F.linear (ms)  oneDNN prepacked (ms)  linear_f32_packed (ms)")
    for rows in (int(r) for r in args.rows.split(",")):
        ours_ms = step_ms(run_ours, dense, rows, args.reps) if ours else float("nan")
        print(f"{rows:4}  {step_ms(run_dense, dense, rows, args.reps):13.1f}  "
              f"{step_ms(run_onednn, dense, rows, args.reps):21.1f}  {ours_ms:22.1f}")
    ours = []  # free the packed copies (the closure above is done with them)
    if ops is None or not ops.has_bf16_dot:
        return
    bf16 = [w.bfloat16() for w in dense]
    dense = packed = []  # free the fp32 weights before the bf16 ones are timed

    def run_bf16(xs):
        for w in bf16:
            F.linear(xs[w.shape[1]], w)

    def run_rows(xs):
        for w in bf16:
            ops.linear_bf16_rows(xs[w.shape[1]], w, None)

    vnni = [ops.pack_bf16_weight(w) for w in bf16] if ops.has_bf16_gemm else []

    def run_packed(xs):
        for w, p in zip(bf16, vnni):
            ops.linear_bf16_packed(xs[w.shape[1]], p, None)

    print("rows  bf16 F.linear (ms)  linear_bf16_rows (ms)  linear_bf16_packed (ms)")
    for rows in (int(r) for r in args.bf16_rows.split(",")):
        few = step_ms(run_rows, bf16, rows, args.reps) if rows <= 16 else float("nan")
        packed_ms = step_ms(run_packed, bf16, rows, args.reps) if vnni else float("nan")
        print(f"{rows:4}  {step_ms(run_bf16, bf16, rows, args.reps):18.1f}  {few:21.1f}  "
              f"{packed_ms:23.1f}")


if __name__ == "__main__":
    main()
