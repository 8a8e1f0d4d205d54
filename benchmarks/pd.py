"""Prefill/decode disaggregation's benchmark (issue 40): what running decodes see while long
prompts keep arriving, on one server and on a prefill + a decode instance.

    python benchmarks/pd.py [--duration 90] [--decodes 8] [--decode-tokens 256]
        [--long-prompt-tokens 2048] [--long-max-tokens 8] [--arrival-interval 0]
        [--setups aggregated,aggregated-chunk256,pd] [--cores 0,1] [--json FILE]

The load is the same for every setup. ``--decodes`` streams, each a distinct short prompt (32
tokens) generating ``--decode-tokens`` tokens with EOS ignored, each started again as soon as
it ends; beside them, distinct prompts of ``--long-prompt-tokens`` tokens asking for
``--long-max-tokens``: back to back, one at a time (``--arrival-interval 0``, the default), or a
new one every that many seconds whatever the server does (open loop). Prompts are text built
with the model's tokenizer (random ids decoded and re-encoded until the count holds, as
``tokenmill bench serve`` builds them), so a 2k prompt is 2k tokens on the server, and no two
share a prefix. After ``--duration`` seconds whatever is in flight is cancelled: only tokens
that arrived before count.

Setups, on two cores (``--cores``, default: the first two this process may use; the client and
the router are not pinned and share them):

- ``aggregated``: one ``tokenmill serve --num-threads 2`` pinned to both cores, chunked prefill
  as by default (``--max-num-batched-tokens 2048``: a 2k prompt is one chunk beside the
  decodes);
- ``aggregated-chunk256``: the same with ``--max-num-batched-tokens 256``, the usual remedy
  without a second instance (smaller chunks, more steps);
- ``pd``: ``tokenmill serve --kv-role producer --num-threads 1`` pinned to the first core and
  ``--kv-role consumer --num-threads 1`` to the second, behind ``tokenmill router --pd``. Every
  request, decode streams included, is prefilled on the producer and decoded on the consumer.

Reported per setup: ITL (the gaps between a decode stream's chunks, one token each) p50 / p99
/ max; TTFT of the decode streams and of the long prompts; output tok/s over the run (every
token that arrived, decodes and long prompts) and requests finished; from ``/metrics``, the
prompt tokens each server computed, its external (pulled) cache hits, and the router's PD
fallbacks. Prints a markdown table with the CPU, its instruction sets and the servers' dtypes;
``--json`` writes it all. Servers' logs go to the system's temporary directory
(``tokenmill-pd-bench-*.log``). Timing: about 2 minutes per setup with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import machine  # noqa: E402
from router import Proc, wait_healthy  # noqa: E402

from tokenmill.bench.workloads import random_text  # noqa: E402
from tokenmill.router.replicas import free_port  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
SETUPS = ("aggregated", "aggregated-chunk256", "pd")
SHORT_PROMPT_TOKENS = 32
# Enough KV for 8 decodes and a few 2k prompts held for the consumer, and no more: a derived
# size (free memory) would differ between one server and two.
DEFAULT_SERVER_ARGS = "--kv-cache-memory 2048blocks"


# ---------------------------------------------------------------------------- processes


@dataclass
class Server(Proc):
    """A process this script started (a server or the router), stopped as a process group;
    ``cores``: what it was pinned to."""

    cores: list[int] | None = None


def spawn(name: str, cmd: list[str], port: int, cores: Sequence[int] | None = None,
          timeout_s: float = 600.0, log_prefix: str = "tokenmill-pd-bench") -> Server:
    """Start ``cmd`` (pinned to ``cores`` before it runs, so every thread it makes inherits
    them) and wait until ``/health`` answers 200."""
    log = Path(tempfile.gettempdir()) / f"{log_prefix}-{name}.log"
    pin = (lambda: os.sched_setaffinity(0, set(cores))) if cores else None
    with open(log, "w") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=pin)
    server = Server(name, popen, f"http://127.0.0.1:{port}", log, list(cores) if cores else None)
    return wait_healthy(server, timeout_s)


def start_serve(name: str, model: str, threads: int, cores: Sequence[int] | None,
                extra: Sequence[str], log_prefix: str = "tokenmill-pd-bench") -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--port", str(port),
           "--num-threads", str(threads), "--log-level", "warning", *extra]
    return spawn(name, cmd, port, cores, log_prefix=log_prefix)


def start_pd_router(prefill: Server, decode: Server, extra: Sequence[str] = ()) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "router", "--pd", "--prefill", prefill.url,
           "--decode", decode.url, "--policy", "round_robin", "--port", str(port),
           "--log-level", "warning", *extra]
    return spawn("router", cmd, port, timeout_s=120)


def server_facts(url: str) -> dict:
    """The dtypes and CPU path a server chose (``/server_info``)."""
    info = httpx.get(url + "/server_info", timeout=10).json()
    keys = ("model", "dtype", "kv_cache_dtype", "kv_cache_dtype_reason", "attention_backend",
            "cpu_step", "threads", "kv_cache_tokens", "kv_transfer")
    return {k: info.get(k) for k in keys}


def scrape(url: str) -> dict[str, float]:
    """A server's (or the router's) counters and gauges, summed over labels but ``tier``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_created", "_bucket")):
                continue
            key = f"{s.name}{{tier={s.labels['tier']}}}" if "tier" in s.labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What the counters (not the gauges) gained between two scrapes."""
    counters = ("_total", "_sum", "_count")
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if k.split("{")[0].endswith(counters)}


# ---------------------------------------------------------------------------- client


@dataclass
class Call:
    """One streamed completion: when it started and when each token (chunk) arrived."""

    kind: str
    start: float
    times: list[float] = field(default_factory=list)
    usage: dict | None = None
    done: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.start if self.times else None


def completion_body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream(http: aiohttp.ClientSession, url: str, body: dict, call: Call) -> None:
    """Send ``body`` and record each chunk that carries a choice; a cancel leaves ``call`` as
    far as it got (neither done nor failed)."""
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                call.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    call.done = call.error is None
                    return
                _on_event(json.loads(data), call)
            call.error = call.error or "stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        call.error = f"{type(e).__name__}: {e}"


def _on_event(event: dict, call: Call) -> None:
    if "error" in event:
        call.error = str(event["error"].get("message", event["error"]))
        return
    if event.get("usage"):
        call.usage = event["usage"]
    if event.get("choices"):
        call.times.append(time.perf_counter())


def build_prompts(model: str, n: int, num_tokens: int, seed: int) -> list[str]:
    """``n`` distinct texts of ``num_tokens`` tokens of ``model``'s tokenizer."""
    from tokenmill.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    rng = random.Random(seed)
    return [random_text(rng, tok, num_tokens, tok.vocab_size) for _ in range(n)]


@dataclass
class Prompts:
    short: list[str]
    long: list[str]
    warm_long: str


def make_prompts(args: argparse.Namespace) -> Prompts:
    n_long = int(args.duration / max(args.arrival_interval, 0.5)) + 4
    short = build_prompts(args.model, args.decodes * 64, SHORT_PROMPT_TOKENS, args.seed)
    long = build_prompts(args.model, n_long + 1, args.long_prompt_tokens, args.seed + 1)
    return Prompts(short, long[1:], long[0])


class Load:
    """The benchmark's traffic against one URL for ``args.duration`` seconds."""

    def __init__(self, url: str, args: argparse.Namespace, prompts: Prompts) -> None:
        self.url, self.args, self.prompts = url, args, prompts
        self.calls: list[Call] = []
        self.long_sent = 0
        self.long_repeats = 0  # long prompts sent a second time (the list ran out)
        self._children: set[asyncio.Task] = set()

    async def run(self) -> float:
        """Drive the load; returns the start time (``time.perf_counter``)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as http:
            self.http = http
            t0 = time.perf_counter()
            tasks = [asyncio.create_task(self._decoder(i)) for i in range(self.args.decodes)]
            tasks.append(asyncio.create_task(self._long_sender(t0)))
            await asyncio.sleep(self.args.duration)
            for t in tasks + list(self._children):
                t.cancel()
            await asyncio.gather(*tasks, *self._children, return_exceptions=True)
        return t0

    async def _one(self, kind: str, prompt: str, max_tokens: int) -> Call:
        call = Call(kind, time.perf_counter())
        self.calls.append(call)  # before sending: a cancelled call keeps what it saw
        await stream(self.http, self.url, completion_body(prompt, max_tokens), call)
        return call

    async def _decoder(self, i: int) -> None:
        short = self.prompts.short
        for n in range(10 ** 9):
            prompt = short[(i + n * self.args.decodes) % len(short)]
            call = await self._one("decode", prompt, self.args.decode_tokens)
            if call.error:
                await asyncio.sleep(0.5)  # a failing server: do not spin on it

    def _next_long(self) -> str:
        long = self.prompts.long
        self.long_repeats += self.long_sent >= len(long)
        prompt = long[self.long_sent % len(long)]
        self.long_sent += 1
        return prompt

    async def _long_sender(self, t0: float) -> None:
        interval = self.args.arrival_interval
        for i in range(10 ** 9):
            if interval <= 0:  # back to back, one at a time
                call = await self._one("long", self._next_long(), self.args.long_max_tokens)
                if call.error:
                    await asyncio.sleep(0.5)
                continue
            await asyncio.sleep(max(0.0, t0 + i * interval - time.perf_counter()))
            task = asyncio.create_task(self._one("long", self._next_long(),
                                                 self.args.long_max_tokens))
            self._children.add(task)
            task.add_done_callback(self._children.discard)


# ---------------------------------------------------------------------------- one setup


def pct_ms(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else None


def summarize(load: Load, t0: float, duration: float) -> dict:
    """ITL, TTFT and throughput of what arrived before the end of the run."""
    end = t0 + duration
    decodes = [c for c in load.calls if c.kind == "decode"]
    longs = [c for c in load.calls if c.kind == "long"]
    gaps = [b - a for c in decodes for a, b in zip(c.times, c.times[1:]) if b <= end]
    arrived = {kind: sum(1 for c in load.calls if c.kind == kind for t in c.times if t <= end)
               for kind in ("decode", "long")}
    dec_ttft = [c.ttft for c in decodes if c.ttft is not None]
    long_ttft = [c.ttft for c in longs if c.ttft is not None]
    errors: dict[str, int] = {}
    for c in load.calls:
        if c.error:
            errors[c.error[:120]] = errors.get(c.error[:120], 0) + 1
    long_prompt = [c.usage["prompt_tokens"] for c in longs if c.usage]
    return {
        "itl_p50_ms": pct_ms(gaps, 50), "itl_p99_ms": pct_ms(gaps, 99),
        "itl_max_ms": pct_ms(gaps, 100), "itl_samples": len(gaps),
        "decode_ttft_p50_ms": pct_ms(dec_ttft, 50), "decode_ttft_p99_ms": pct_ms(dec_ttft, 99),
        "long_ttft_p50_ms": pct_ms(long_ttft, 50), "long_ttft_p99_ms": pct_ms(long_ttft, 99),
        "output_tok_s": (arrived["decode"] + arrived["long"]) / duration,
        "decode_tok_s": arrived["decode"] / duration,
        "decodes_finished": sum(c.done for c in decodes),
        "long_finished": sum(c.done for c in longs), "long_sent": load.long_sent,
        "long_repeats": load.long_repeats,
        "long_prompt_tokens_mean": float(np.mean(long_prompt)) if long_prompt else None,
        "errors": errors,
    }


def start_setup(name: str, args: argparse.Namespace) -> tuple[list[Server], Server]:
    """The setup's processes (started in order; stop them in reverse) and the URL to load."""
    extra = args.server_args.split()
    if name in ("aggregated", "aggregated-chunk256"):
        if name == "aggregated-chunk256":
            extra = [*extra, "--max-num-batched-tokens", "256"]
        server = start_serve(name, args.model, 2, args.cores, extra)
        return [server], server
    first, second = ([args.cores[0]], [args.cores[1]]) if args.cores else (None, None)
    started: list[Server] = []
    try:
        started.append(start_serve("producer", args.model, 1, first,
                                   [*extra, "--kv-role", "producer"]))
        started.append(start_serve("consumer", args.model, 1, second,
                                   [*extra, "--kv-role", "consumer"]))
        started.append(start_pd_router(started[0], started[1], args.router_args.split()))
    except BaseException:
        for s in reversed(started):
            s.stop()
        raise
    return started, started[-1]


def warm(url: str, args: argparse.Namespace, prompts: Prompts) -> None:
    """First-call costs (kernels, pools, the transfer path) out of the figures."""
    for prompt, max_tokens in ((prompts.short[-1], 4), (prompts.warm_long, 2)):
        body = {**completion_body(prompt, max_tokens), "stream": False}
        body.pop("stream_options")
        httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()


def run_setup(name: str, args: argparse.Namespace, prompts: Prompts) -> dict:
    servers, entry = start_setup(name, args)
    try:
        facts = server_facts(servers[0].url)
        warm(entry.url, args, prompts)
        before = {s.name: scrape(s.url) for s in servers}
        load = Load(entry.url, args, prompts)
        t0 = asyncio.run(load.run())
        time.sleep(0.5)  # the servers notice the cancelled streams
        after = {s.name: scrape(s.url) for s in servers}
    finally:
        for s in reversed(servers):
            s.stop()
    counters = {n: delta(after[n], before[n]) for n in after}
    return {"setup": name, "server": facts, **summarize(load, t0, args.duration),
            "placement": {s.name: s.cores for s in servers}, "counters": counters}


# ---------------------------------------------------------------------------- report


def _key_counters(run: dict) -> str:
    """Prompt tokens computed / pulled per server, and the router's fallbacks."""
    mean = run["long_prompt_tokens_mean"]
    parts = [f"long prompts of {mean:.0f} tokens (usage)" if mean else "no long prompt done"]
    if run["long_repeats"]:
        parts.append(f"{run['long_repeats']} long prompts sent twice (prefix-cache hits)")
    for name, c in run["counters"].items():
        if name == "router":
            fallbacks = c.get("tokenmill_router_pd_fallbacks_total", 0)
            parts.append(f"router fallbacks {fallbacks:.0f}")
            continue
        pulled = c.get("tokenmill:external_prefix_cache_hits_total", 0)
        line = f"{name} computed {c.get('tokenmill:prompt_tokens_computed_total', 0):.0f} " \
               f"prompt tokens"
        if pulled:
            line += (f", pulled {pulled:.0f} in "
                     f"{c.get('tokenmill:kv_tier_load_seconds_total{tier=p2p}', 0):.2f} s")
        parts.append(line)
    return "; ".join(parts)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(result: dict) -> str:
    a = result["args"]
    lines = [f"{a['decodes']} streams x {a['decode_tokens']} tokens; {a['long_prompt_tokens']}"
             f"-token prompts ({a['long_max_tokens']} out) "
             + ("back to back" if a["arrival_interval"] <= 0
                else f"every {a['arrival_interval']:g} s") + f"; {a['duration']:g} s per setup",
             "| setup | placement | ITL p50 / p99 / max ms | decode TTFT p50 / p99 ms | "
             "long TTFT p50 / p99 ms | output tok/s | decode tok/s | decodes done | "
             "long done | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        place = ", ".join(f"{n} {','.join(map(str, c)) if c else 'any'}"
                          for n, c in r["placement"].items())
        lines.append(
            f"| {r['setup']} | {place} | {_ms(r['itl_p50_ms'])} / {_ms(r['itl_p99_ms'])} / "
            f"{_ms(r['itl_max_ms'])} | {_ms(r['decode_ttft_p50_ms'])} / "
            f"{_ms(r['decode_ttft_p99_ms'])} | {_ms(r['long_ttft_p50_ms'])} / "
            f"{_ms(r['long_ttft_p99_ms'])} | {r['output_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
            f"{r['decodes_finished']} | {r['long_finished']} | {sum(r['errors'].values())} |")
    lines.append("")
    lines += [f"- {r['setup']}: {_key_counters(r)}" for r in result["runs"]]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of load per setup")
    ap.add_argument("--decodes", type=int, default=8, help="streaming decodes kept running")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens each decode makes")
    ap.add_argument("--long-prompt-tokens", type=int, default=2048)
    ap.add_argument("--long-max-tokens", type=int, default=8, help="tokens a long prompt asks")
    ap.add_argument("--arrival-interval", type=float, default=0.0,
                    help="seconds between long prompts (0: back to back, one at a time)")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--cores", default=None,
                    help="two cores, e.g. 0,1 (default: the first two this process may use)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                    help="flags for every tokenmill serve")
    ap.add_argument("--router-args", default="",
                    help="more flags of the pd setup's router, e.g. '--pd-min-prompt-tokens 256'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.setups = args.setups.split(",")
    if unknown := set(args.setups) - set(SETUPS):
        ap.error(f"unknown setups {sorted(unknown)}; known: {', '.join(SETUPS)}")
    usable = sorted(os.sched_getaffinity(0))
    args.cores = ([int(c) for c in args.cores.split(",")] if args.cores else usable)[:2]
    if len(args.cores) < 2:
        print("note: fewer than two usable cores: nothing is pinned", file=sys.stderr)
        args.cores = None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = make_prompts(args)
    runs = []
    for name in args.setups:
        runs.append(run_setup(name, args, prompts))
        print(f"{name}: ITL p99 {_ms(runs[-1]['itl_p99_ms'])} ms, "
              f"{runs[-1]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    saved = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"benchmark": "pd", "machine": machine(), "args": saved, "runs": runs}
    m, s = result["machine"], runs[0]["server"] if runs else {}
    print(f"CPU: {m.get('cpu')}; instruction sets: {m.get('isa')}; dtype {s.get('dtype')}, "
          f"KV cache {s.get('kv_cache_dtype')} ({s.get('kv_cache_dtype_reason')})")
    print(table(result))
    write_json(args.json, result)
    return 0


def write_json(path: Path | None, result: dict) -> None:
    """``--json``: the whole result, where asked."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
