"""Holding requests whose shared prefix is being computed (``sched/scheduler.py``), on and off.

    python3 benchmarks/shared_prefix_hold.py [--order grouped|interleaved] [--rounds 2]

compare.py's shared-prefix workload offline: 4 groups x 16 requests, a 1,024-token system prompt
per group plus a 64-token question, 64 output tokens (EOS ignored, greedy), at most 32 requests
in flight (a new one arrives as one finishes). The engine is stepped by hand so that each
request's time to first token is measured from its own arrival. ``grouped``: a group's
requests arrive one after another; ``interleaved``: the groups take turns. Holding is turned off
by raising ``SHARED_PREFIX_BLOCKS`` past any prompt; the prefix cache is flushed between runs.

``--breakdown`` adds where the steps' time went: per kind of step (prompt tokens only, decode
rows only, both) the steps, seconds, prompt tokens and decode rows, and the median decode-only
step at full concurrency (each step's chunks as ``schedule()`` returned them).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict

import tokenmill.sched.scheduler as sched
from tokenmill import LLM, SamplingParams


def workload(seed: int, order: str) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 49000) for _ in range(1024)] for _ in range(4)]
    pairs = [(g, i) for g in range(4) for i in range(16)] if order == "grouped" else \
        [(g, i) for i in range(16) for g in range(4)]
    return [systems[g] + [rng.randrange(100, 49000) for _ in range(64)] for g, _ in pairs]


class StepLog:
    """The chunks each ``schedule()`` returned, for the step that runs them: (prompt tokens,
    decode rows); steps are paired with schedules in order (the CPU engine steps one at a
    time)."""

    def __init__(self, scheduler) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.seconds: list[float] = []
        schedule = scheduler.schedule

        def logged():
            out = schedule()
            decode = sum(1 for c in out.scheduled if c.num_tokens == 1 and c.num_logits == 1)
            self.shapes.append((out.num_batched_tokens - decode, decode))
            return out
        scheduler.schedule = logged

    def summary(self, concurrency: int) -> dict:
        kinds: dict[str, list] = defaultdict(lambda: [0, 0.0, 0, 0])
        for (prompt, decode), sec in zip(self.shapes, self.seconds):
            kind = "decode" if not prompt else "prompt" if not decode else "both"
            k = kinds[kind]
            k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + sec, k[2] + prompt, k[3] + decode
        full = [sec for (prompt, decode), sec in zip(self.shapes, self.seconds)
                if not prompt and decode == concurrency]
        return {"steps": {kind: dict(steps=n, seconds=round(sec, 2), prompt_tokens=p,
                                     decode_rows=d) for kind, (n, sec, p, d) in kinds.items()},
                "decode_step_ms_at_full": round(statistics.median(full) * 1e3, 1)
                if full else None}


def run(llm: LLM, prompts: list[list[int]], tag: str, concurrency: int = 32,
        log: StepLog | None = None) -> dict:
    engine = llm.engine
    if log is not None:
        log.shapes.clear()
        log.seconds.clear()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engine.scheduler.flush_prefix_cache()
    first: dict[str, float] = {}
    arrival: dict[str, float] = {}
    live: set[str] = set()
    pending = list(enumerate(prompts))
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(live) < concurrency:
            i, prompt = pending.pop(0)
            rid = f"{tag}-{i}"
            arrival[rid] = time.perf_counter()
            engine.add_request(rid, prompt, params)
            live.add(rid)
        began = time.perf_counter()
        outs = engine.step()
        if log is not None:
            log.seconds.append(time.perf_counter() - began)
        for out in outs:
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - arrival[out.request_id]
            if out.finished:
                live.discard(out.request_id)
    elapsed = time.perf_counter() - start
    ttft = sorted(first.values())
    return {"output_tokens_per_s": round(len(prompts) * 64 / elapsed, 1),
            "ttft_median_s": round(ttft[len(ttft) // 2], 2),
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 2),
            **(log.summary(concurrency) if log is not None else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", choices=["grouped", "interleaved"], default="grouped")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--breakdown", action="store_true", help="where the steps' time went")
    args = ap.parse_args()
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, max_num_seqs=32)
    log = StepLog(llm.engine.scheduler) if args.breakdown else None
    default = sched.SHARED_PREFIX_BLOCKS
    for r in range(args.rounds):
        for hold in (True, False):
            sched.SHARED_PREFIX_BLOCKS = default if hold else 1 << 30
            result = run(llm, workload(100 + r, args.order), f"{r}-{hold}", log=log)
            print(json.dumps({"hold": hold, "order": args.order, **result}), flush=True)
    sched.SHARED_PREFIX_BLOCKS = default


if __name__ == "__main__":
    main()
