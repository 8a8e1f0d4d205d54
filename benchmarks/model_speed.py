"""Load time, resident memory and single-request decode speed of one model.

    python benchmarks/model_speed.py [MODEL] [--prompt-len 128] [--new-tokens 128] [--device cpu]
        [--dtype float32] [--quantization none|auto|int8|int4] [--kv-cache-dtype auto|int8]

Decoding is greedy through the paged KV cache (one request, no batching), the figure the
model-runtime issue asks for. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from tokenmill.util import cdiv


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none", choices=["none", "auto", "int8", "int4"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    t0 = time.perf_counter()
    import torch

    from tokenmill.model.loader import load_model
    from tokenmill.runner.batch import Chunk
    from tokenmill.runner.model_runner import ModelRunner

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    if args.dtype == "auto":  # what the engine picks for this machine
        from tokenmill.platform import choose_dtype

        args.dtype, _ = choose_dtype(args.device)
    loaded = load_model(args.model, args.device, args.dtype, quantization=args.quantization)
    t_load = time.perf_counter() - t1
    rss_after_load = rss_mib()
    total = args.prompt_len + args.new_tokens
    runner = ModelRunner(loaded, num_blocks=1 + cdiv(total, 16), block_size=16, device=args.device,
                         kv_cache_dtype=args.kv_cache_dtype)
    prompt = [(7 * i + 11) % loaded.config.vocab_size for i in range(args.prompt_len)]
    runner.greedy_generate(prompt, 8)  # warm-up

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    prefill_s, decode_tps = [], []
    for _ in range(args.repeats):
        table = list(range(runner.num_blocks))
        sync()
        t = time.perf_counter()
        token = int(runner.forward([Chunk(prompt, 0, table)])[0].argmax())
        sync()
        prefill_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(args.new_tokens - 1):
            token = int(runner.forward([Chunk([token], args.prompt_len + i, table)])[0].argmax())
        sync()
        decode_tps.append((args.new_tokens - 1) / (time.perf_counter() - t))
    result = {
        "model": str(loaded.source.path), "device": args.device, "dtype": args.dtype,
        "weights": loaded.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "threads": torch.get_num_threads(),
        "import_s": round(t_import, 2), "load_s": round(t_load, 2),
        "rss_after_load_mib": round(rss_after_load), "peak_rss_mib":
            round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "prefill_ms": round(1000 * min(prefill_s), 1),
        "decode_tokens_per_s": round(max(decode_tps), 2),
        "decode_ms_per_token": round(1000 / max(decode_tps), 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
