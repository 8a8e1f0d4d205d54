"""The tiered prefix cache's benchmark (issue 40): where a prompt's KV comes from, and what
a working set larger than the KV cache gains from the host and disk tiers.

    python benchmarks/kv_tiers.py [--parts ttft,working-set] [--prefix-tokens 4096] [--reps 5]
        [--systems 32] [--system-tokens 1024] [--cache-ratio 4] [--requests 128]
        [--concurrency 4] [--offloads none,host,disk] [--json FILE]

``ttft``: the time to the first token of a ``--prefix-tokens`` prefix + a short distinct
question (16 tokens), ``--reps`` times each (median, min, max), its KV

- recomputed: a fresh prefix each time;
- from the KV cache: the same prefix again (a radix-cache hit);
- from the host tier (``--kv-offload host``): two other prompts as long as the prefix pushed it
  out of a KV cache that holds about 1.3 prefixes before each measurement;
- from the disk tier (``--kv-offload disk``, written through when first computed): after
  ``POST /flush_cache``, with the block files in the page cache, then with them dropped from it
  (``os.sync`` + ``posix_fadvise(DONTNEED)`` on each file: read from the device, though a VM's
  host may still cache them);
- from the disk tier after the server restarts on the same directory (one measurement).

``working-set``: ``--systems`` system prompts of ``--system-tokens`` tokens each, and a KV cache
of 1/``--cache-ratio`` of their blocks (``--kv-cache-memory NNNblocks``, block size 16; the
default holds 8 of 32, running requests included). ``--requests`` requests, each a system
prompt picked at random (seeded: the same sequence for every run) + a distinct 32-token user
turn, 16 tokens out (EOS ignored), ``--concurrency`` in flight, once per ``--offloads`` mode
(a fresh server each). Reported: the prefix hit rate (cached / prompt tokens, from the
responses' usage), its local (radix) and external (tier) parts from ``/metrics``, the tier
blocks loaded, req/s, output tok/s and TTFT mean / p50 / p99.

Prompts are text built with the model's tokenizer (``benchmarks/pd.py``'s ``build_prompts``).
The disk tier lives in a temporary directory removed at the end. Every server runs
``--num-threads 2`` (``--threads``) unpinned. Prints markdown tables with the CPU, its
instruction sets and the server's dtypes; ``--json`` writes it all. Logs go to the system's
temporary directory (``tokenmill-kv-tiers-bench-*.log``). Timing: a few minutes per part on
two cores with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import machine  # noqa: E402
from pd import (Call, Server, build_prompts, completion_body, delta, pct_ms,  # noqa: E402
                scrape, server_facts, start_serve, stream, write_json)

DEFAULT_MODEL = "smollm2-135m-instruct"
PARTS = ("ttft", "working-set")
OFFLOADS = ("none", "host", "disk")
BLOCK_SIZE = 16  # tokenmill's default --block-size: the budgets below are counted in it
QUESTION_TOKENS = 16
USER_TOKENS = 32
WS_OUTPUT_TOKENS = 16
LOG_PREFIX = "tokenmill-kv-tiers-bench"
HITS = "tokenmill:prefix_cache_hits_total"
EXTERNAL = "tokenmill:external_prefix_cache_hits_total"
COMPUTED = "tokenmill:prompt_tokens_computed_total"


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_SIZE)


def tier_sum(counters: dict[str, float], name: str) -> float:
    """``tokenmill:<name>_total`` summed over the tiers (p2p is not a tier of this benchmark)."""
    return sum(v for k, v in counters.items() if k.startswith(f"tokenmill:{name}_total{{"))


def serve(name: str, args: argparse.Namespace, extra: Sequence[str]) -> Server:
    return start_serve(name, args.model, args.threads, None,
                       [*args.server_args.split(), *extra], log_prefix=LOG_PREFIX)


def offload_flags(mode: str, disk_dir: str | None) -> list[str]:
    if mode == "host":
        return ["--kv-offload", "host", "--kv-offload-size", "4GiB"]
    if mode == "disk":
        return ["--kv-offload", "disk", "--kv-offload-size", "8GiB", "--kv-offload-dir",
                str(disk_dir)]
    return []


def warm(server: Server) -> None:
    """A short request first, so first-call costs land in no figure."""
    httpx.post(server.url + "/v1/completions", timeout=600, json={
        "prompt": "Warm up, please.", "max_tokens": 2}).raise_for_status()


def flush(server: Server) -> None:
    httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()


def usage_cached(usage: dict | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


# ---------------------------------------------------------------------------- TTFT


def ttft_once(url: str, prompt: str) -> Call:
    """One streamed request for a single token, timed from its send."""
    call = Call("ttft", 0.0)

    async def go() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            call.start = time.perf_counter()
            await stream(http, url, completion_body(prompt, 1), call)

    asyncio.run(go())
    if call.error or call.ttft is None:
        raise RuntimeError(f"request failed: {call.error}")
    return call


def measure(label: str, server: Server, prompts: Sequence[str],
            prepare: Callable[[int], None] | None = None) -> dict:
    """TTFT of each prompt, ``prepare(i)`` run before the i-th; the counters are read around
    each request alone, so what ``prepare`` did stays out of them."""
    samples = []
    for i, prompt in enumerate(prompts):
        if prepare is not None:
            prepare(i)
        before = scrape(server.url)
        call = ttft_once(server.url, prompt)
        time.sleep(0.05)  # the engine's stats snapshot follows its next step
        d = delta(scrape(server.url), before)
        samples.append({"ttft_ms": call.ttft * 1000,
                        "prompt_tokens": (call.usage or {}).get("prompt_tokens"),
                        "cached_tokens": usage_cached(call.usage),
                        "external_tokens": d.get(EXTERNAL, 0.0),
                        "computed_tokens": d.get(COMPUTED, 0.0),
                        "tier_blocks_loaded": tier_sum(d, "kv_tier_hits"),
                        "tier_load_s": tier_sum(d, "kv_tier_load_seconds")})
    ttfts = [s["ttft_ms"] for s in samples]
    row = {"source": label, "n": len(samples), "ttft_median_ms": statistics.median(ttfts),
           "ttft_min_ms": min(ttfts), "ttft_max_ms": max(ttfts), "samples": samples}
    for key in ("cached_tokens", "external_tokens", "computed_tokens", "tier_blocks_loaded"):
        row[key] = statistics.median(s[key] for s in samples)
    print(f"  {label}: TTFT median {row['ttft_median_ms']:.0f} ms", file=sys.stderr)
    return row


@dataclass
class TTFTTexts:
    prefix: str  # the shared prefix: cache, host and disk rows
    fresh: list[str]  # one new prefix per recomputed measurement
    fillers: list[str]  # two prompts as long as the prefix, to push it out of the KV cache
    questions: list[str]  # a distinct tail per measurement

    def ask(self, i: int, prefix: str | None = None) -> str:
        return f"{prefix or self.prefix}\n\n{self.questions[i]}"


def ttft_texts(args: argparse.Namespace) -> TTFTTexts:
    n = args.reps
    long = build_prompts(args.model, 1 + n + 2, args.prefix_tokens, args.seed)
    questions = build_prompts(args.model, 6 * n + 4, QUESTION_TOKENS, args.seed + 1)
    return TTFTTexts(long[0], long[1:1 + n], long[1 + n:], questions)


def ttft_host(args: argparse.Namespace, t: TTFTTexts) -> tuple[list[dict], dict]:
    """Recomputed, KV-cache and host-tier rows, on one server whose KV cache holds the prefix
    and a quarter more (so two fillers evict all of it)."""
    budget = blocks(args.prefix_tokens) * 5 // 4 + 16
    server = serve("ttft-host", args, ["--kv-cache-memory", f"{budget}blocks",
                                       *offload_flags("host", None)])
    n = args.reps
    try:
        warm(server)
        facts = server_facts(server.url)
        rows = [measure("recomputed", server, [t.ask(i, t.fresh[i]) for i in range(n)])]
        ttft_once(server.url, t.ask(n))  # the prefix, computed once
        rows.append(measure("KV cache (radix hit)", server, [t.ask(n + 1 + i) for i in range(n)]))

        def evict(i: int) -> None:
            for filler in t.fillers:
                ttft_once(server.url, f"{filler}\n\n{t.questions[-1]}")

        rows.append(measure("host tier (RAM)", server, [t.ask(2 * n + 1 + i) for i in range(n)],
                            evict))
    finally:
        server.stop()
    return rows, {**facts, "kv_cache_blocks": budget}


def drop_page_cache(root: str) -> int:
    """Write the block files out and ask the kernel to forget their pages (no root needed);
    returns how many files there were."""
    os.sync()
    files = [p for p in Path(root).rglob("*.kvb")]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def wait_for_files(root: str, count: int, timeout_s: float = 60.0) -> int:
    """Saves are asynchronous: wait until ``count`` block files exist (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while (found := sum(1 for _ in Path(root).rglob("*.kvb"))) < count:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return found


def ttft_disk(args: argparse.Namespace, t: TTFTTexts, root: str) -> list[dict]:
    """Disk-tier rows: after a flush (page cache warm, then dropped), and after a restart."""
    n = args.reps
    base = 3 * n + 1  # the questions ttft_host took come first
    extra = ["--kv-cache-memory", f"{blocks(args.prefix_tokens) * 2 + 16}blocks",
             *offload_flags("disk", root)]
    server = serve("ttft-disk", args, extra)
    try:
        warm(server)
        ttft_once(server.url, t.ask(base))  # computed once, written through
        wait_for_files(root, args.prefix_tokens // BLOCK_SIZE)
        rows = [measure("disk tier (page cache)", server,
                        [t.ask(base + 1 + i) for i in range(n)], lambda i: flush(server))]
        rows.append(measure("disk tier (files dropped from the page cache)", server,
                            [t.ask(base + 1 + n + i) for i in range(n)],
                            lambda i: (flush(server), drop_page_cache(root))))
    finally:
        server.stop()
    server = serve("ttft-disk-restarted", args, extra)
    try:
        warm(server)
        rows.append(measure("disk tier after a restart", server, [t.ask(base + 1 + 2 * n)]))
    finally:
        server.stop()
    return rows


def run_ttft(args: argparse.Namespace, root: str) -> dict:
    t = ttft_texts(args)
    host_rows, facts = ttft_host(args, t)
    disk_rows = ttft_disk(args, t, root)
    return {"prefix_tokens": args.prefix_tokens, "reps": args.reps, "server": facts,
            "rows": host_rows + disk_rows}


# ---------------------------------------------------------------------------- working set


def ws_prompts(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The requests' prompts (the same for every mode) and which system prompt each took."""
    systems = build_prompts(args.model, args.systems, args.system_tokens, args.seed + 2)
    users = build_prompts(args.model, args.requests, USER_TOKENS, args.seed + 3)
    rng = random.Random(args.seed)
    picks = [rng.randrange(args.systems) for _ in range(args.requests)]
    return [f"{systems[k]}\n\n{user}" for k, user in zip(picks, users)], picks


async def closed_loop(url: str, prompts: Sequence[str], concurrency: int) -> tuple[list[Call],
                                                                                   float]:
    """``prompts`` in order, ``concurrency`` in flight; (the calls, wall seconds)."""
    calls = [Call("ws", 0.0) for _ in prompts]
    order = iter(range(len(prompts)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def worker() -> None:
            for i in order:  # one iterator shared by the workers: each index goes once
                calls[i].start = time.perf_counter()
                await stream(http, url, completion_body(prompts[i], WS_OUTPUT_TOKENS), calls[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return calls, time.perf_counter() - t0


def ws_summary(mode: str, calls: Sequence[Call], wall: float, d: dict[str, float]) -> dict:
    ok = [c for c in calls if c.done]
    prompt = sum((c.usage or {}).get("prompt_tokens", 0) for c in ok)
    cached = sum(usage_cached(c.usage) for c in ok)
    ttfts = [c.ttft for c in ok if c.ttft is not None]
    return {"offload": mode, "requests": len(calls), "finished": len(ok),
            "errors": len(calls) - len(ok), "wall_s": wall,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "local_hit_tokens": d.get(HITS, 0.0) - d.get(EXTERNAL, 0.0),
            "external_hit_tokens": d.get(EXTERNAL, 0.0),
            "computed_prompt_tokens": d.get(COMPUTED, 0.0),
            "tier_blocks_loaded": tier_sum(d, "kv_tier_hits"),
            "tier_blocks_saved": tier_sum(d, "kv_tier_blocks_saved"),
            "tier_load_s": tier_sum(d, "kv_tier_load_seconds"),
            "req_s": len(ok) / wall, "output_tok_s": sum(len(c.times) for c in ok) / wall,
            "ttft_mean_ms": float(np.mean(ttfts)) * 1000 if ttfts else None,
            "ttft_p50_ms": pct_ms(ttfts, 50), "ttft_p99_ms": pct_ms(ttfts, 99)}


def ws_run(mode: str, args: argparse.Namespace, prompts: Sequence[str], budget: int,
           root: str) -> dict:
    disk_dir = None
    if mode == "disk":
        disk_dir = tempfile.mkdtemp(prefix="ws-", dir=root)  # empty: every run starts cold
    server = serve(f"ws-{mode}", args, ["--kv-cache-memory", f"{budget}blocks",
                                        *offload_flags(mode, disk_dir)])
    try:
        warm(server)
        facts = server_facts(server.url)
        before = scrape(server.url)
        calls, wall = asyncio.run(closed_loop(server.url, prompts, args.concurrency))
        time.sleep(0.05)
        d = delta(scrape(server.url), before)
    finally:
        server.stop()
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    row = ws_summary(mode, calls, wall, d)
    print(f"  {mode}: hit rate {row['hit_rate']:.2f}, {row['req_s']:.2f} req/s",
          file=sys.stderr)
    return {**row, "server": facts}


def run_working_set(args: argparse.Namespace, root: str) -> dict:
    prompts, picks = ws_prompts(args)
    budget = args.systems * blocks(args.system_tokens) // args.cache_ratio
    rows = [ws_run(mode, args, prompts, budget, root) for mode in args.offloads]
    return {"systems": args.systems, "system_tokens": args.system_tokens,
            "requests": args.requests, "concurrency": args.concurrency,
            "kv_cache_blocks": budget, "distinct_systems_used": len(set(picks)), "rows": rows}


# ---------------------------------------------------------------------------- report


def ttft_table(part: dict) -> str:
    lines = [f"{part['prefix_tokens']}-token prefix + {QUESTION_TOKENS}-token question, "
             f"{part['reps']} reps (median, min-max)",
             "| KV from | TTFT ms | min-max ms | cached tokens | tier blocks loaded | "
             "computed tokens |", "|---|---|---|---|---|---|"]
    for r in part["rows"]:
        lines.append(f"| {r['source']} | {r['ttft_median_ms']:.0f} | {r['ttft_min_ms']:.0f}-"
                     f"{r['ttft_max_ms']:.0f} | {r['cached_tokens']:.0f} | "
                     f"{r['tier_blocks_loaded']:.0f} | {r['computed_tokens']:.0f} |")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def ws_table(part: dict) -> str:
    lines = [f"{part['systems']} system prompts x {part['system_tokens']} tokens "
             f"({part['distinct_systems_used']} used), KV cache {part['kv_cache_blocks']} blocks; "
             f"{part['requests']} requests, {part['concurrency']} in flight",
             "| offload | hit rate | local hit tokens | tier hit tokens | tier blocks loaded | "
             "req/s | output tok/s | TTFT mean / p50 / p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in part["rows"]:
        lines.append(f"| {r['offload']} | {r['hit_rate']:.2f} | {r['local_hit_tokens']:.0f} | "
                     f"{r['external_hit_tokens']:.0f} | {r['tier_blocks_loaded']:.0f} | "
                     f"{r['req_s']:.2f} | {r['output_tok_s']:.1f} | {_ms(r['ttft_mean_ms'])} / "
                     f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} | {r['errors']} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5, help="measurements per TTFT row")
    ap.add_argument("--systems", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--cache-ratio", type=int, default=4,
                    help="the system prompts' blocks over the KV cache's")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--offloads", default=",".join(OFFLOADS))
    ap.add_argument("--threads", type=int, default=2, help="--num-threads of each server")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--server-args", default="", help="more flags for every tokenmill serve")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.parts, args.offloads = args.parts.split(","), args.offloads.split(",")
    if unknown := (set(args.parts) - set(PARTS)) | (set(args.offloads) - set(OFFLOADS)):
        ap.error(f"unknown parts / offloads {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    root = tempfile.mkdtemp(prefix="tokenmill-kv-tiers-")
    result: dict = {"benchmark": "kv_tiers", "machine": machine(),
                    "args": {k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items()}}
    try:
        if "ttft" in args.parts:
            result["ttft"] = run_ttft(args, root)
        if "working-set" in args.parts:
            result["working_set"] = run_working_set(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    m = result["machine"]
    facts = (result.get("ttft") or {}).get("server") or \
        result["working_set"]["rows"][0]["server"]
    print(f"CPU: {m.get('cpu')}; instruction sets: {m.get('isa')}; dtype {facts.get('dtype')}, "
          f"KV cache {facts.get('kv_cache_dtype')} ({facts.get('kv_cache_dtype_reason')}); "
          f"{args.threads} threads")
    if "ttft" in result:
        print(ttft_table(result["ttft"]))
    if "working_set" in result:
        print(ws_table(result["working_set"]))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
