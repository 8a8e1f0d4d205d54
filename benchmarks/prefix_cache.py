"""Shared-prefix workload through the offline engine, prefix cache on vs off.

    python benchmarks/prefix_cache.py                       # 64 requests, 16 prefixes of 1,024
    python benchmarks/prefix_cache.py --num-requests 16 --num-prefixes 4 --prefix-len 256

Every request is ``prefix[i % num_prefixes] + unique suffix`` (random token ids, fixed seed),
all added at once, ``output_len`` tokens each with ignore_eos. Reports total time, TTFT p50/p99
(add_request to the step that returned the first token) and the prefix hit rate (prompt tokens
served from the cache / prompt tokens looked up).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.params import SamplingParams


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size - 100) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    return [prefixes[i % args.num_prefixes] + tokens(args.suffix_len)
            for i in range(args.num_requests)]


def run(args: argparse.Namespace, enable: bool) -> dict[str, float]:
    from tokenmill.engine.llm_engine import LLMEngine

    config = EngineConfig.from_options(
        args.model, device=args.device, num_blocks=args.num_blocks,
        enable_prefix_caching=enable, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, policy=args.policy)
    engine = LLMEngine.from_config(config)
    prompts = make_prompts(args, engine.info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    added: dict[str, float] = {}
    for i, prompt in enumerate(prompts):
        added[str(i)] = time.perf_counter()
        engine.add_request(str(i), prompt, params)
    ttft: dict[str, float] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = now - added[out.request_id]
    total = time.perf_counter() - start
    stats = engine.scheduler.stats()
    values = sorted(ttft.values())
    return {"total_s": total, "ttft_p50_s": statistics.median(values),
            "ttft_p99_s": values[min(len(values) - 1, int(0.99 * len(values)))],
            "hit_rate": stats.prefix_cache_hit_rate,
            "prompt_tokens_computed": engine.stats().num_prompt_tokens_computed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--policy", default="lpm", choices=["fcfs", "priority", "lpm"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(f"{args.num_requests} requests, {args.num_prefixes} prefixes x {args.prefix_len} "
          f"tokens, suffix {args.suffix_len}, output {args.output_len}, policy {args.policy}")
    print(f"{'cache':6} {'total s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'hit rate':>9} "
          f"{'prompt tok computed':>20}")
    for enable in (True, False):
        r = run(args, enable)
        print(f"{'on' if enable else 'off':6} {r['total_s']:8.2f} {r['ttft_p50_s']:9.3f} "
              f"{r['ttft_p99_s']:9.3f} {r['hit_rate']:9.1%} {r['prompt_tokens_computed']:20d}",
              flush=True)


if __name__ == "__main__":
    main()
