"""tokenmill.lang against plain requests, and prompt scoring's rate, on a running server.

    tokenmill serve smollm2-135m-instruct --port 8000 &
    python benchmarks/lang_bench.py --url http://127.0.0.1:8000

Parts (medians of ``--rounds``, the prefix cache flushed before each timed run):

- ``fork``: ``fork(4)`` over a shared ``--prefix-words`` context, each branch generating
  ``--gen-tokens`` greedy tokens, against four independent requests carrying the same context,
  sent at once (wall seconds);
- ``loglikelihood``: lm-eval's scoring requests (``echo``, ``logprobs: 1``, ``--max-tokens``:
  0 scores without generating, 1 is what lm-eval's ``local-completions`` sends):
  ``--items`` four-choice items as one request per choice, ``--concurrency`` at a time
  (requests per second). Any OpenAI-compatible server that returns prompt logprobs can be
  timed this way (vLLM: ``benchmarks/peers/peers.py serve vllm``).

Prints one JSON object with the CPU model (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from machine import machine  # benchmarks/machine.py

from tokenmill import lang

WORDS = ("the model reads a long shared context before it answers each question about the "
         "story of a city by the sea where ships arrive at dawn").split()


def context(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\nQuestion: "


def flush(url: str) -> None:
    httpx.post(f"{url}/flush_cache", timeout=60)


@lang.function
def branches(s, ctx: str, n: int, tokens: int) -> None:
    s += ctx
    forks = s.fork(n)
    forks += [f"part {i}: " for i in range(n)]
    forks += lang.gen("out", max_tokens=tokens, temperature=0)
    forks.join()


def independent(url: str, model: str, ctx: str, n: int, tokens: int) -> None:
    def one(i: int) -> None:
        httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": ctx + f"part {i}: ", "max_tokens": tokens,
            "temperature": 0}).raise_for_status()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def fork_part(args, model: str) -> dict:
    backend = lang.Endpoint(args.url)
    fork_s, plain_s = [], []
    for r in range(args.rounds):
        ctx = context(args.prefix_words, r)
        flush(args.url)
        t0 = time.perf_counter()
        branches.run(ctx=ctx, n=4, tokens=args.gen_tokens, backend=backend)
        fork_s.append(time.perf_counter() - t0)
        flush(args.url)
        t0 = time.perf_counter()
        independent(args.url, model, ctx, 4, args.gen_tokens)
        plain_s.append(time.perf_counter() - t0)
    f, p = statistics.median(fork_s), statistics.median(plain_s)
    return {"fork4_s": round(f, 3), "independent4_s": round(p, 3), "speedup": round(p / f, 2)}


def loglikelihood_part(args, model: str) -> dict:
    rng = random.Random(0)
    bodies = [{"model": model, "prompt": context(60, i) + " answer: " + rng.choice(WORDS),
               "echo": True, "logprobs": 1, "max_tokens": args.max_tokens}
              for i in range(args.items) for _ in range(4)]
    flush(args.url)

    def one(body: dict) -> None:
        r = httpx.post(f"{args.url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        assert r.json()["choices"][0]["logprobs"]["token_logprobs"][1] is not None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, bodies))
    elapsed = time.perf_counter() - t0
    return {"requests": len(bodies), "seconds": round(elapsed, 2),
            "requests_per_s": round(len(bodies) / elapsed, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--parts", default="fork,loglikelihood")
    ap.add_argument("--prefix-words", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=0, help="loglikelihood: 0 or 1")
    args = ap.parse_args()
    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    out: dict = {"machine": machine(), "model": model, "settings": vars(args)}
    if "fork" in args.parts:
        out["fork"] = fork_part(args, model)
    if "loglikelihood" in args.parts:
        out["loglikelihood"] = loglikelihood_part(args, model)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
