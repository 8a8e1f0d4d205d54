"""The router's benchmarks (issue 39): what it costs per request, and what its policies buy.

    python benchmarks/router.py overhead [--rate 500] [--duration 20] [--workers 2]
        [--policies round_robin,cache_aware] [--out overhead.json]
    python benchmarks/router.py policies [--policies round_robin,least_load,cache_aware,
        cache_aware_exact] [--workloads shared-prefix,multi-turn] [--tiny] [--out policies.json]

``overhead``: fake OpenAI workers (benchmarks/peers/fake_openai.py, answering at once) and one
``tokenmill router`` in front. An open-loop client sends short non-streamed completions at a
fixed rate, first straight to the fakes (spread over them as the router would), then through
the router; the difference of the latency percentiles is what the router adds. Run once per
policy, a direct run before each so drift on a shared machine shows up in both columns.

``policies``: two (``--workers``) real ``tokenmill serve --num-threads 1`` workers (KV events
on when this tokenmill supports ``--kv-events-config``) behind a router started afresh for
every policy and workload,
the workers' prefix caches flushed in between; ``tokenmill bench serve`` drives the
shared-prefix (8 groups) and multi-turn workloads through it. Reported per run: prefix-cache hit
tokens (the workers' ``tokenmill:prefix_cache_hits`` counters, before and after), TTFT p50/p99
and throughput. ``cache_aware`` is the approximate tree (the router told not to read events);
``cache_aware_exact`` mirrors the workers' KV events.

Both print a markdown table with the CPU and its instruction sets and write ``--out`` (JSON).
Logs of the processes started go to the system's temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar
from pathlib import Path

import aiohttp
import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import machine  # noqa: E402

from tokenmill.router.replicas import free_port  # noqa: E402

FAKE = HERE / "peers" / "fake_openai.py"
DEFAULT_MODEL = "smollm2-135m-instruct"  # tokenmill's default; not imported, to stay torch-free
# label -> (router --policy, extra router flags, needs workers that publish KV events)
POLICY_RUNS: dict[str, tuple[str, list[str], bool]] = {
    "round_robin": ("round_robin", [], False),
    "least_load": ("least_load", [], False),
    "prefix_hash": ("prefix_hash", [], False),
    "cache_aware": ("cache_aware", ["--no-kv-events"], False),
    "cache_aware_exact": ("cache_aware", [], True),
}
KV_EVENTS_CONFIG = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                               "replay_endpoint": "tcp://127.0.0.1:0"})


# ---------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A server this script started: stopped as a process group, so its children go too."""

    name: str
    popen: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


P = TypeVar("P", bound=Proc)


def spawn(name: str, cmd: list[str], port: int, timeout_s: float = 600.0,
          health: str = "/health") -> Proc:
    """Start ``cmd`` and wait until ``health`` answers 200; its output goes to a log file."""
    log = Path(tempfile.gettempdir()) / f"tokenmill-router-bench-{name}.log"
    with open(log, "w") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    return wait_healthy(Proc(name, popen, f"http://127.0.0.1:{port}", log), timeout_s, health)


def wait_healthy(proc: P, timeout_s: float, health: str = "/health") -> P:
    """``proc`` once ``health`` answers 200; stopped, and an error with its log's tail, when it
    exits or stays silent for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            tail = proc.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} "
                               f"({proc.log}):\n{tail}")
        try:
            if httpx.get(proc.url + health, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"{proc.name}: no answer on {health} within {timeout_s:.0f} s "
                       f"({proc.log})")


def start_fake(index: int, model: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, str(FAKE), "--port", str(port), "--model", model]
    return spawn(f"fake{index}", cmd, port, timeout_s=60)


def start_router(workers: Sequence[str], policy: str, extra: Sequence[str] = ()) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "router", "--port", str(port),
           "--policy", policy, "--log-level", "warning",
           *[a for url in workers for a in ("--worker", url)], *extra]
    return spawn(f"router-{policy}", cmd, port, timeout_s=120)


def start_worker(index: int, model: str, kv_events: bool, extra: Sequence[str]) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--port", str(port),
           "--num-threads", "1", *extra]
    if kv_events:
        cmd += ["--kv-events-config", KV_EVENTS_CONFIG]
    return spawn(f"worker{index}", cmd, port)


def serve_supports_kv_events() -> bool:
    """Whether this tokenmill's ``serve`` has ``--kv-events-config`` (the publisher may not
    have landed yet; the exact mode is then skipped with a message, the rest still runs)."""
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=300)
    return "--kv-events-config" in out.stdout


# ---------------------------------------------------------------------------- overhead


@dataclass
class LoadResult:
    """What an open-loop run at a fixed rate saw."""

    target: str
    sent: int = 0
    latencies_s: list[float] = field(default_factory=list, repr=False)
    errors: dict[str, int] = field(default_factory=dict)
    late_s: list[float] = field(default_factory=list, repr=False)  # how far behind the schedule
    elapsed_s: float = 0.0

    def summary(self) -> dict:
        lat = np.asarray(self.latencies_s) * 1000 if self.latencies_s else np.zeros(1)
        return {"target": self.target, "sent": self.sent, "ok": len(self.latencies_s),
                "errors": self.errors, "achieved_rps": len(self.latencies_s) / self.elapsed_s,
                "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                "mean_ms": float(lat.mean()),
                "client_late_p99_ms": float(np.percentile(self.late_s or [0.0], 99) * 1000)}


async def _one_request(http: aiohttp.ClientSession, url: str, body: dict,
                       res: LoadResult) -> None:
    start = time.perf_counter()
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            await resp.read()
            error = None if resp.status == 200 else f"HTTP {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        error = type(e).__name__
    if error:
        res.errors[error] = res.errors.get(error, 0) + 1
    else:
        res.latencies_s.append(time.perf_counter() - start)


async def open_loop(urls: Sequence[str], model: str, rate: float, duration_s: float,
                    label: str) -> LoadResult:
    """Requests at ``rate`` per second for ``duration_s``, whatever the answers take (open
    loop: a slow target builds a queue instead of slowing the client). ``urls`` are used in
    turn, so a direct run spreads load over the fakes as the router does. The client is
    aiohttp's: httpx's costs 1.6 ms of CPU a request here, which at 500 req/s would take most
    of a core from the processes measured."""
    res = LoadResult(label)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024),
                                     timeout=timeout) as http:
        for i in range(32):  # open connections before the clock starts
            await _one_request(http, urls[i % len(urls)], _body(model, -1), LoadResult("warm"))
        tasks, t0 = [], time.perf_counter()
        for i in range(int(rate * duration_s)):
            due = t0 + i / rate
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            res.late_s.append(max(0.0, time.perf_counter() - due))
            tasks.append(asyncio.create_task(
                _one_request(http, urls[i % len(urls)], _body(model, i), res)))
        res.sent = len(tasks)
        await asyncio.gather(*tasks)
        res.elapsed_s = time.perf_counter() - t0
    return res


def _body(model: str, i: int) -> dict:
    return {"model": model, "prompt": f"Request number {i}: say something short.",
            "max_tokens": 4, "temperature": 0}


def run_overhead(args: argparse.Namespace) -> dict:
    fakes = [start_fake(i, args.model) for i in range(args.workers)]
    runs = []
    try:
        urls = [f.url for f in fakes]
        for label in args.policies:
            policy, extra, _ = POLICY_RUNS[label]
            direct = asyncio.run(open_loop(urls, args.model, args.rate, args.duration, "direct"))
            router = start_router(urls, policy, extra)
            try:
                routed = asyncio.run(open_loop([router.url], args.model, args.rate,
                                               args.duration, f"router {label}"))
            finally:
                router.stop()
            runs.append(_overhead_row(label, direct.summary(), routed.summary()))
    finally:
        for f in fakes:
            f.stop()
    return {"mode": "overhead", "machine": machine(), "rate": args.rate,
            "duration_s": args.duration, "workers": args.workers, "runs": runs}


def _overhead_row(label: str, direct: dict, routed: dict) -> dict:
    return {"policy": label, "direct": direct, "router": routed,
            "added_p50_ms": routed["p50_ms"] - direct["p50_ms"],
            "added_p99_ms": routed["p99_ms"] - direct["p99_ms"]}


def overhead_table(result: dict) -> str:
    lines = [f"fake workers: {result['workers']}, target {result['rate']:g} req/s for "
             f"{result['duration_s']:g} s each",
             "| policy | path | p50 ms | p99 ms | achieved req/s | errors | client late p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for path in ("direct", "router"):
            s = run[path]
            lines.append(f"| {run['policy']} | {path} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
                         f"{s['achieved_rps']:.0f} | {sum(s['errors'].values())} | "
                         f"{s['client_late_p99_ms']:.1f} |")
        lines.append(f"| {run['policy']} | **added** | **{run['added_p50_ms']:.2f}** | "
                     f"**{run['added_p99_ms']:.2f}** | | | |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class Sizes:
    """Workload sizes: ``FULL`` for the note's figures, ``TINY`` to prove the script runs."""

    prompts_per_group: int = 8  # shared-prefix: 8 groups of this many
    system_len: int = 512
    question_len: int = 32
    conversations: int = 16  # multi-turn
    turns: int = 4
    turn_len: int = 64
    conversation_system_len: int = 256
    output_len: int = 32
    concurrency: int = 8


FULL = Sizes()
TINY = Sizes(prompts_per_group=2, system_len=64, question_len=8, conversations=4, turns=2,
             turn_len=16, conversation_system_len=32, output_len=4, concurrency=4)


def workload_flags(workload: str, sizes: Sizes) -> list[str]:
    if workload == "shared-prefix":
        return ["--workload", "shared-prefix", "--num-groups", "8",
                "--prompts-per-group", str(sizes.prompts_per_group),
                "--system-len", str(sizes.system_len), "--question-len", str(sizes.question_len)]
    if workload == "multi-turn":
        return ["--workload", "multi-turn", "--endpoint", "chat",
                "--num-prompts", str(sizes.conversations), "--num-turns", str(sizes.turns),
                "--input-len", str(sizes.turn_len),
                "--system-prompt-len", str(sizes.conversation_system_len)]
    raise ValueError(f"unknown workload {workload!r}")


def bench_through(url: str, model: str, workload: str, sizes: Sizes, seed: int) -> dict:
    """One ``tokenmill bench serve`` run; its JSON summary."""
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url,
           "--model", model, *workload_flags(workload, sizes), "--output-len",
           str(sizes.output_len), "--ignore-eos", "--max-concurrency", str(sizes.concurrency),
           "--warmup", "0", "--seed", str(seed), "--no-progress", "--result-file", name]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not Path(name).read_text():
        raise RuntimeError(f"bench serve failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(Path(name).read_text())


def prefix_counters(url: str) -> dict[str, float]:
    """A worker's prefix-cache counters (summed over models): tokens looked up and hit."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for key, name in (("hits", "tokenmill:prefix_cache_hits_total"),
                          ("queries", "tokenmill:prefix_cache_queries_total")):
            if line.startswith(name):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def warm(workers: Sequence[Proc], model: str) -> None:
    """One short request straight to each worker, so first-call costs (kernels picked, pools
    grown) land in no policy's figures — else the first policy run would pay them."""
    for w in workers:
        httpx.post(w.url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": "warm up", "max_tokens": 4}).raise_for_status()


def flush(workers: Sequence[Proc]) -> None:
    """Empty every worker's prefix cache, so each policy starts cold."""
    for w in workers:
        resp = httpx.post(w.url + "/flush_cache", timeout=60)
        if resp.status_code != 200:
            raise RuntimeError(f"{w.name}: /flush_cache answered {resp.status_code}: {resp.text}")


def router_hit_metrics(url: str) -> dict[str, float]:
    """The router's own cache-hit estimate lines (names as the router exports them)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("tokenmill_router_") and "hit" in line}


def policy_run(workers: Sequence[Proc], label: str, workload: str,
               args: argparse.Namespace) -> dict:
    """One policy on one workload: a fresh router, cold worker caches, one bench run."""
    policy, extra, _ = POLICY_RUNS[label]
    flush(workers)
    before = [prefix_counters(w.url) for w in workers]
    router = start_router([w.url for w in workers], policy, extra)
    try:
        s = bench_through(router.url, args.model, workload, args.sizes, args.seed)
        router_metrics = router_hit_metrics(router.url)
    finally:
        router.stop()
    after = [prefix_counters(w.url) for w in workers]
    hits = [a["hits"] - b["hits"] for a, b in zip(after, before)]
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before))
    return {"policy": label, "workload": workload, "hit_tokens": sum(hits),
            "hit_tokens_per_worker": hits, "queried_tokens": queries,
            "hit_rate": sum(hits) / queries if queries else 0.0,
            "ttft_p50_ms": s["ttft"]["median_ms"], "ttft_p99_ms": s["ttft"]["p99_ms"],
            "ttft_later_turns_p50_ms": s.get("ttft_by_turn", {}).get("later", {}).get(
                "median_ms"),
            "request_throughput": s["request_throughput"],
            "output_throughput": s["output_throughput"], "completed": s["completed"],
            "failed": s["failed"], "router_metrics": router_metrics, "summary": s}


def run_policies(args: argparse.Namespace) -> dict:
    events = serve_supports_kv_events()
    if not events:
        print("note: this tokenmill's serve has no --kv-events-config yet: the workers publish "
              "no KV events and cache_aware_exact is skipped", file=sys.stderr)
    extra = args.worker_args.split() if args.worker_args else []
    workers = [start_worker(i, args.model, events, extra) for i in range(args.workers)]
    rows, skipped = [], []
    try:
        warm(workers, args.model)
        for label in args.policies:
            if POLICY_RUNS[label][2] and not events:
                skipped.append(label)
                continue
            for workload in args.workloads:
                rows.append(policy_run(workers, label, workload, args))
                print(f"{label} / {workload}: {rows[-1]['hit_tokens']:.0f} hit tokens",
                      file=sys.stderr)
    finally:
        for w in workers:
            w.stop()
    _compare_to_round_robin(rows)
    return {"mode": "policies", "machine": machine(), "model": args.model, "kv_events": events,
            "sizes": asdict(args.sizes), "skipped": skipped, "runs": rows}


def _compare_to_round_robin(rows: list[dict]) -> None:
    base = {r["workload"]: r for r in rows if r["policy"] == "round_robin"}
    for r in rows:
        b = base.get(r["workload"])
        r["hits_vs_round_robin"] = r["hit_tokens"] / b["hit_tokens"] if b and b["hit_tokens"] \
            else None


def policies_table(result: dict) -> str:
    lines = ["| policy | workload | hit tokens | vs round_robin | hit rate | TTFT p50 ms | "
             "TTFT p99 ms | TTFT turns 2+ p50 ms | req/s | output tok/s | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        ratio = f"{r['hits_vs_round_robin']:.2f}x" if r["hits_vs_round_robin"] else "-"
        later = r["ttft_later_turns_p50_ms"]
        lines.append(f"| {r['policy']} | {r['workload']} | {r['hit_tokens']:.0f} | {ratio} | "
                     f"{r['hit_rate']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     f"{'-' if later is None else f'{later:.0f}'} | "
                     f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                     f"{r['failed']} |")
    if result["skipped"]:
        lines.append(f"\nskipped (workers publish no KV events): {', '.join(result['skipped'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    over = sub.add_parser("overhead", help="latency the router adds, against fake workers")
    over.add_argument("--rate", type=float, default=500.0, help="requests per second")
    over.add_argument("--duration", type=float, default=20.0, help="seconds per run")
    over.add_argument("--workers", type=int, default=2, help="fake workers")
    over.add_argument("--policies", default="round_robin,cache_aware")
    over.add_argument("--model", default="fake-model")
    pol = sub.add_parser("policies", help="hit tokens, TTFT, throughput per policy")
    pol.add_argument("--policies", default="round_robin,least_load,cache_aware,cache_aware_exact")
    pol.add_argument("--workloads", default="shared-prefix,multi-turn")
    pol.add_argument("--model", default=DEFAULT_MODEL)
    pol.add_argument("--tiny", action="store_true", help="a few seconds a run: does it work?")
    pol.add_argument("--seed", type=int, default=0)
    pol.add_argument("--worker-args", default="", help="more flags for each tokenmill serve")
    pol.add_argument("--workers", type=int, default=2,
                     help="tokenmill workers, one thread each (more than the cores: they share)")
    pol.add_argument("--max-concurrency", type=int, default=None,
                     help="requests (multi-turn: conversations) in flight (default: 8)")
    for p in (over, pol):
        p.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = ap.parse_args(argv)
    args.policies = args.policies.split(",")
    unknown = set(args.policies) - set(POLICY_RUNS)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICY_RUNS)}")
    if args.mode == "policies":
        args.workloads = args.workloads.split(",")
        args.sizes = TINY if args.tiny else FULL
        if args.max_concurrency:
            args.sizes = replace(args.sizes, concurrency=args.max_concurrency)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_overhead(args) if args.mode == "overhead" else run_policies(args)
    m = result["machine"]
    print(f"CPU: {m.get('cpu')}; instruction sets: {m.get('isa')}")
    print(overhead_table(result) if args.mode == "overhead" else policies_table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
