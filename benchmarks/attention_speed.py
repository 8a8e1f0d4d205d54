"""Attention backends timed on the default model's shapes (9 query heads, 3 KV heads, head_dim 64):
decode batches at several context lengths, a shared-prefix decode batch (cascade), and prompt
chunks. One layer per call; per-step cost is ~30x (the model's layers). A call stores the new
K/V and attends: on the cpu backend the kernels store_kv and paged_attention (the shared prefix
merged in a second pass), on the torch backend the reference they replace
(tokenmill/kernels/ladder.py).

    python3 benchmarks/attention_speed.py [--dtype float32|bfloat16] [--backends torch,cpu]
                                          [--kv-cache-dtype auto|int8|bfloat16] [--layers 30]
                                          [--cases "prefill 1 x 1024;..."] [--min-time 0.5]
                                          [--widen-from trial|0|N]
                                          [--vllm-python /path/to/vllm/venv/bin/python]

One layer's K/V fits in L3, a step's do not: with ``--layers L`` each call attends with the next
of L copies of the cache (the batch's metadata built once per L calls, as a step builds it
once), so K/V come from memory as in a real step and the figure is the mean per layer. bf16 on
the cpu backend takes the route the loader's trial picks for these heads (vdpbf16ps or float32
FMAs with its bits, attention/cpu_trial.py); ``--widen-from 0`` times vdpbf16ps alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ imports tests.*

from machine import machine  # noqa: E402  (benchmarks/machine.py)
from vllm_attention import time_call  # noqa: E402  (benchmarks/peers/: one loop for both)
from tests.test_attention import make_case  # noqa: E402  (random paged batches)

from tokenmill.attention import get_backend  # noqa: E402
from tokenmill.runner.batch import build_flat_batch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
VLLM_BLOCK = 128  # vLLM's CPU default (platforms/cpu.py)
CASES = {
    "decode 32 x ctx 256": dict(shapes=[(255, 1)] * 32),
    "decode 32 x ctx 1100": dict(shapes=[(1099, 1)] * 32),
    "decode 32 x ctx 1100, 1024 shared": dict(shapes=[(1099, 1)] * 32, shared_blocks=64),
    "decode 1 x ctx 256": dict(shapes=[(255, 1)]),
    "prefill 4 x 128": dict(shapes=[(0, 128)] * 4),
    "prefill 1 x 1024": dict(shapes=[(0, 1024)]),
    "chunk 64 after 1024 cached x 8": dict(shapes=[(1024, 64)] * 8, shared_blocks=64),
    # a prompt chunk beside decode rows: the work items differ in cost (share_tasks)
    "prefill 512 + decode 31 x ctx 256": dict(shapes=[(0, 512)] + [(255, 1)] * 31),
}


def choose_route(widen_from: str) -> int:
    """Set the cpu kernel's route for bf16 products as ``--widen-from`` says; the rows set."""
    from tokenmill.attention import cpu_trial

    ops = get_backend("cpu").ops
    rows = (cpu_trial.choose_widen_rows(ops, HEADS, KV_HEADS, HEAD_DIM) or 0
            if widen_from == "trial" else int(widen_from))
    ops.set_attention_widen_from(rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backends", default="torch,cpu")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "bfloat16"])
    ap.add_argument("--layers", type=int, default=1,
                    help="copies of the cache attended in turn (30: K/V from memory)")
    ap.add_argument("--cases", default=";".join(CASES),
                    help="case names separated by ';' (names hold commas; default: all)")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds timed per case")
    ap.add_argument("--vllm-python", default=None,
                    help="also time vLLM's CPU attention ops (cpu_attention_with_kv_cache) on the "
                         "same cases with this Python of vLLM's environment, in vLLM's default "
                         "block size (benchmarks/peers/vllm_attention.py)")
    ap.add_argument("--vllm-block-size", type=int, default=VLLM_BLOCK)
    ap.add_argument("--widen-from", default="trial",
                    help="cpu backend, bf16: work items of at least this many rows take float32 "
                         "FMAs with vdpbf16ps's bits (0: vdpbf16ps only); 'trial': the load's "
                         "choice (attention/cpu_trial.py)")
    args = ap.parse_args()
    import random

    dtype = getattr(torch, args.dtype)
    widen_from = choose_route(args.widen_from) if "cpu" in args.backends.split(",") else None
    results = {"machine": machine(), "threads": torch.get_num_threads(), "dtype": args.dtype,
               "kv_cache_dtype": args.kv_cache_dtype, "layers": args.layers,
               "widen_from": widen_from, "ms_per_layer": {}}
    unknown = set(args.cases.split(";")) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {list(CASES)}")
    for name in args.cases.split(";"):
        case = CASES[name]
        row = {}
        for backend in args.backends.split(","):
            be = get_backend(backend)
            chunks, kv, q, k, v, _ = make_case(random.Random(0), heads=HEADS, kv_heads=KV_HEADS,
                                               head_dim=HEAD_DIM, block_size=BLOCK, dtype=dtype,
                                               backend=backend,
                                               kv_cache_dtype=args.kv_cache_dtype, **case)

            caches = [kv] + [tuple(t.clone() for t in kv) for _ in range(args.layers - 1)]

            def call():
                meta = build_flat_batch(chunks, BLOCK, "cpu").meta
                for cache in caches:
                    be.forward(q, k, v, cache, meta, HEAD_DIM ** -0.5)

            with torch.inference_mode():
                row[backend] = round(time_call(call, args.min_time) * 1e3 / len(caches), 3)
        results["ms_per_layer"][name] = row
        print(f"{name:36} " + "  ".join(f"{b} {ms:8.3f} ms" for b, ms in row.items()), flush=True)
    if args.vllm_python:
        results["vllm"] = time_vllm(args, args.cases.split(";"))
        for name, ms in results["vllm"]["ms_per_layer"].items():
            results["ms_per_layer"][name]["vllm"] = ms
            print(f"{name:36} vllm {ms:8.3f} ms", flush=True)
    print(json.dumps(results))


def time_vllm(args: argparse.Namespace, names: list[str]) -> dict:
    """vLLM's figures for these cases: ``peers/vllm_attention.py`` in its own environment
    (the K/V cache in the model's dtype; the shared prefix in whole blocks of vLLM's size)."""
    if args.kv_cache_dtype not in ("auto", args.dtype):
        raise SystemExit("--vllm-python: the K/V cache in the model's dtype only")
    cases = {n: dict(shapes=CASES[n]["shapes"],
                     shared_tokens=CASES[n].get("shared_blocks", 0) * BLOCK) for n in names}
    spec = dict(cases=cases, dtype=args.dtype, layers=args.layers, min_time=args.min_time,
                heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block=args.vllm_block_size)
    script = Path(__file__).resolve().parent / "peers" / "vllm_attention.py"
    done = subprocess.run([args.vllm_python, str(script), json.dumps(spec)],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"vLLM's attention timing exited {done.returncode}:\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
