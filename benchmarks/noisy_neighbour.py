"""A noisy neighbour: ``tokenmill serve`` on a CPU whose every core another process keeps busy.

    python3 benchmarks/noisy_neighbour.py [--concurrency 1 8] [--prompts-per-concurrency 8 4]
        [--busy N] [--idle-start] [--dtype auto] [--port 8170] [--out FILE]
        [any other flag: passed to ``tokenmill serve``, e.g. --num-threads 1]

``tokenmill serve`` sets ``OMP_WAIT_POLICY=ACTIVE`` and a long spin count (``cli.py``): its
OpenMP threads spin between parallel regions instead of sleeping, which pays on an idle machine
and could collapse on a shared one, where a spinning thread burns the time slice a descheduled
sibling needs. This measures what a neighbour costs:

1. ``--busy`` processes (default: one per core this process may run on) that loop in pure
   Python start; the server starts beside them (as ``benchmarks/compare.py`` starts tokenmill:
   2 GiB of KV cache, 2,048-token context), and the time from its process start to the first
   ``/health`` 200 is the loaded start-up.
2. For each concurrency C: ``tokenmill bench serve`` (random 128/128, EOS ignored,
   ``--prompts-per-concurrency`` x C requests) with the busy processes stopped, then again with
   fresh ones running: output tok/s idle and loaded, TTFT and TPOT medians.
3. With ``--idle-start``, the server is stopped and started once more with nothing beside it,
   for the idle start-up.

The verdict (``tokenmill.bench.verdicts.neighbour_verdict``): every concurrency keeps at least
half its idle throughput under load, and the loaded start-up takes under 30 s. It is printed,
written with the figures to ``--out`` (default ``benchmarks/results/noisy_neighbour.json``)
and sets the exit status (1 on a failure).

Timing (2-core Xeon with AMX, bf16): about 3 minutes with the defaults and ``--idle-start``.
Not part of the test suite (its verdict is: ``tests/test_verdicts.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

from machine import machine  # noqa: E402  (benchmarks/machine.py)
from peers import SERVED_NAME, Running, TokenmillPeer, stop_on_sigterm  # noqa: E402

from tokenmill.bench.verdicts import neighbour_verdict  # noqa: E402

BUSY_LOOP = "while True: pass"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Busy:
    """``n`` processes that keep a core each busy until ``stop()``."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP],
                                       start_new_session=True) for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []


def start_server(peer: TokenmillPeer, port: int, log: Path,
                 timeout: float = 600) -> tuple[Running, float]:
    """Start the server; (running server, seconds from its process start to /health 200)."""
    spec = peer.launch(HERE, port)
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        t0 = time.monotonic()
        proc = subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=spec.cwd or HERE.parent)
    running = Running(peer.name, proc, url, log)
    try:
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        return running, time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.1)
    except BaseException:
        running.stop()
        raise
    running.stop()
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"tokenmill did not answer /health (exit {proc.poll()}); log tail:\n{tail}")


def bench(url: str, concurrency: int, num_prompts: int, out_file: Path) -> dict:
    subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url,
                    "--model", SERVED_NAME, "--workload", "random", "--input-len", "128",
                    "--output-len", "128", "--ignore-eos", "--num-prompts", str(num_prompts),
                    "--max-concurrency", str(concurrency), "--result-file", str(out_file),
                    "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    res = json.loads(out_file.read_text())
    return {"tok_s": round(res["output_throughput"], 1), "completed": res["completed"],
            "ttft_median_ms": round(res["ttft"]["median_ms"], 1),
            "tpot_median_ms": round(res["tpot"]["median_ms"], 1)}


def measure(url: str, args, tmp: Path) -> dict[int, dict[str, dict]]:
    """Per concurrency: the idle run, then the loaded one beside fresh busy processes."""
    out: dict[int, dict[str, dict]] = {}
    for c, per in zip(args.concurrency, args.prompts_per_concurrency):
        n = max(1, per * c)
        idle = bench(url, c, n, tmp / f"idle-{c}.json")
        busy = Busy(args.busy)
        try:
            loaded = bench(url, c, n, tmp / f"loaded-{c}.json")
        finally:
            busy.stop()
        out[c] = {"idle": idle, "loaded": loaded}
        print(f"concurrency {c}: idle {idle['tok_s']} tok/s, loaded {loaded['tok_s']} tok/s "
              f"({loaded['tok_s'] / idle['tok_s']:.2f}x)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Unknown flags are passed to `tokenmill serve`.")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts-per-concurrency", type=int, nargs="+", default=[8, 4],
                    help="requests per run: this times C (one value per --concurrency)")
    ap.add_argument("--busy", type=int, default=usable_cores(),
                    help="busy processes (default: one per usable core)")
    ap.add_argument("--idle-start", action="store_true",
                    help="also time a start-up with nothing beside the server")
    ap.add_argument("--dtype", default=None, help="tokenmill serve --dtype (default: auto)")
    ap.add_argument("--port", type=int, default=8170)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "noisy_neighbour.json")
    args, serve_flags = ap.parse_known_args()
    if len(args.prompts_per_concurrency) != len(args.concurrency):
        ap.error("give one --prompts-per-concurrency value per --concurrency")
    stop_on_sigterm()
    peer = TokenmillPeer("tokenmill", args.dtype, extra=tuple(serve_flags))
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-neighbour-"))
    busy = Busy(args.busy)
    server = None
    try:
        server, start_s = start_server(peer, args.port, tmp / "logs" / "loaded-start.log")
        busy.stop()
        print(f"start-up beside {args.busy} busy processes: {start_s:.1f} s", flush=True)
        runs = measure(server.url, args, tmp)
        idle_start_s = None
        if args.idle_start:
            server.stop()
            server, idle_start_s = start_server(peer, args.port, tmp / "logs" / "idle-start.log")
            print(f"start-up alone: {idle_start_s:.1f} s", flush=True)
    finally:
        busy.stop()
        if server is not None:
            server.stop()
    verdict = neighbour_verdict({c: r["idle"]["tok_s"] for c, r in runs.items()},
                                {c: r["loaded"]["tok_s"] for c, r in runs.items()}, start_s)
    print("verdict:", "PASS" if verdict["passed"] else "FAIL: " + "; ".join(verdict["problems"]))
    result = {"machine": machine(), "busy_processes": args.busy, "serve_flags": serve_flags,
              "workload": "random 128/128, ignore_eos", "start_s_loaded": round(start_s, 1),
              "start_s_idle": None if idle_start_s is None else round(idle_start_s, 1),
              "runs": {str(c): r for c, r in runs.items()}, "verdict": verdict,
              "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
