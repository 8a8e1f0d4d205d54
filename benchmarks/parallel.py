"""Tensor and pipeline parallelism on one machine: each layout served by ``tokenmill serve``,
the same ``tokenmill bench serve`` points against each, one after the other.

    python benchmarks/random_model.py /tmp/rand1024       # 16 heads / 4 KV heads, 220M
    python benchmarks/parallel.py --model /tmp/rand1024   # tp1, tp2, pp2, default dtype
    python benchmarks/parallel.py --model /tmp/rand1024 --dtype float32 --layouts tp1,tp2
    python benchmarks/parallel.py --layouts tp1,pp2       # the default model (9 heads and
                                                          # 3 KV heads split over 3 or 9 only)

Layouts: ``tp1`` one process, all cores as threads; ``tp2`` / ``tp4`` tensor parallel ranks,
the cores split evenly between them (each bound to its own); ``pp2`` two pipeline stages;
``tp2pp2``; ``tp2-gloo``, tp2 with the all-reduce through gloo (layer by layer). Points:
random 128 in / 128 out, ignore_eos, greedy, at concurrency 1 and 32.
Prints a markdown table (with the CPU and its instruction sets) and writes
``--out``/parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine  # noqa: E402

LAYOUTS = {"tp1": [], "tp2": ["--tensor-parallel-size", "2"],
           "tp4": ["--tensor-parallel-size", "4"], "pp2": ["--pipeline-parallel-size", "2"],
           "tp2pp2": ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"],
           "tp2-gloo": ["--tensor-parallel-size", "2", "--disable-custom-all-reduce"]}


def serve(model: str, layout: str, port: int, extra: list[str]) -> subprocess.Popen:
    log = open(Path(tempfile.gettempdir()) / f"tokenmill-parallel-{layout}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", model, "--port",
                             str(port), *LAYOUTS[layout], *extra], stdout=log, stderr=log,
                            start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{layout}: the server exited ({log.name})")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{layout}: no /health within 600 s")


def bench(model: str, port: int, concurrency: int, prompts: int, seed: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url",
                    f"http://127.0.0.1:{port}", "--model", model, "--workload", "random",
                    "--input-len", "128", "--output-len", "128", "--ignore-eos",
                    "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
                    "--seed", str(seed), "--warmup", "2", "--no-progress", "--result-file",
                    str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def server_info(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--layouts", default="tp1,tp2,pp2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--quick", action="store_true", help="fewer prompts")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    points = [(1, 8 if args.quick else 16), (32, 32 if args.quick else 96)]
    rows, results = [], {"machine": machine(), "dtype": args.dtype, "runs": {}}
    for layout in args.layouts.split(","):
        proc = serve(args.model, layout, args.port, ["--dtype", args.dtype])
        try:
            info = server_info(args.port)
            for seed, (c, n) in enumerate(points):
                s = bench(args.model, args.port, c, n, seed)
                results["runs"][f"{layout}-c{c}"] = {"summary": s, "parallel": info["parallel"],
                                                     "cpu_step": info["cpu_step"]}
                rows.append(f"| {layout} | {info['dtype']} | {c} | {s['output_throughput']:.1f} | "
                            f"{s['ttft']['median_ms']:.0f} | {s['tpot']['median_ms']:.1f} | "
                            f"{info['parallel'].get('all_reduce', '-')} | {info['cpu_step']} |")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    m = results["machine"]
    print(f"CPU: {m['cpu']}; instruction sets: {m['isa']}")
    print("| layout | dtype | concurrency | output tok/s | TTFT median ms | TPOT median ms | "
          "all-reduce | CPU step |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parallel.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
