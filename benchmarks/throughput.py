"""Offline throughput: N requests with fixed input/output lengths through one engine.

    python benchmarks/throughput.py [MODEL] --num-prompts 32 --input-len 128 --output-len 128

Reports output tokens/s, requests/s, peak memory, and the scheduler's own share of step time.
Prompts are random token ids (fixed seed) so every run has exact lengths; EOS is ignored.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              attention_backend=args.attention_backend,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype)
    rng = random.Random(args.seed)
    vocab = llm.engine.info.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    engine = llm.engine
    before = engine.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    step_s = after.step_seconds - before.step_seconds
    result = {
        "model": engine.info.model, "device": args.device, "dtype": engine.info.dtype,
        "kv_cache_dtype": engine.info.kv_cache_dtype,
        "attention_backend": engine.info.attention_backend, **engine.info.hardware,
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "elapsed_s": round(elapsed, 2),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "total_tokens_per_s": round((out_tokens + args.num_prompts * args.input_len) / elapsed, 1),
        "requests_per_s": round(args.num_prompts / elapsed, 3),
        "steps": after.num_steps - before.num_steps,
        "scheduler_share_of_step": round(
            (after.scheduler_seconds - before.scheduler_seconds) / step_s, 4),
        "forward_share_of_step": round(
            (after.forward_seconds - before.forward_seconds) / step_s, 4),
        "preemptions": engine.num_preemptions,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
