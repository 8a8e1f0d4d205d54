"""Multi-LoRA's benchmark (issue 41): what serving adapters costs against the base model alone,
and how long one adapter takes to load.

    python benchmarks/lora.py [--rank 16] [--adapters 16] [--max-loras 4] [--concurrency 32]
        [--num-prompts 128] [--input-len 128] [--output-len 128] [--setups base,1,4,16,16@16]
        [--num-threads N] [--json FILE]

Adapters are written by this script in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``, the keys PEFT writes) with random A and B for every linear of
every layer (q, k, v, o, gate, up, down), rank ``--rank``, so they cost what real ones do; no
adapter is downloaded. One ``tokenmill serve`` loads ``--adapters`` of them (``--lora-modules``,
``--max-loras``) and runs the same ``tokenmill bench serve`` workload (random prompts, EOS
ignored, ``--concurrency`` streams) once per setup:

- ``base``: every request names the base model;
- ``N`` (1, 4, 16...): requests spread uniformly over the first N adapters
  (``bench serve --lora-modules``); with N above ``--max-loras`` the scheduler rotates
  adapters through the slots;
- ``N@M``: the same on a server started with ``--max-loras M`` instead.

A second server without ``--enable-lora`` runs the ``base`` workload too (``base, LoRA off``):
the cost of having LoRA enabled at all. Reported: output tok/s, TPOT and TTFT p50/p99, and each
setup's throughput over the LoRA-off base. The adapter load time is measured on the running
server through ``POST /v1/load_lora_adapter`` (``--allow-runtime-lora``): a fresh rank-``--rank``
adapter, best and median of 5. Prints a markdown table with the CPU and its instruction sets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from machine import machine  # noqa: E402
from router import spawn  # noqa: E402

from tokenmill.config import DEFAULT_MODEL  # noqa: E402
from tokenmill.model.config_reader import read_model_config  # noqa: E402
from tokenmill.model.lora.peft import PEFT_MODULES, module_key, module_shapes  # noqa: E402
from tokenmill.router.replicas import free_port  # noqa: E402

def model_shapes(model: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, {PEFT module name: (in_features, out_features)}) of ``model``."""
    _, cfg = read_model_config(model)
    return cfg.num_layers, module_shapes(cfg)


def write_adapter(directory: Path, layers: int, shapes: dict[str, tuple[int, int]], rank: int,
                  seed: int) -> Path:
    """A random rank-``rank`` LoRA on every linear of every layer, as PEFT saves one."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, (inp, out) in shapes.items():
            key = f"base_model.model.{module_key(i, name)}"  # as PEFT saves it
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(PEFT_MODULES), "lora_dropout": 0.0, "bias": "none",
              "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
              "modules_to_save": None, "base_model_name_or_path": DEFAULT_MODEL}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


def serve(name: str, extra: list[str], threads: int | None) -> object:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
           *(["--num-threads", str(threads)] if threads else []), *extra]
    return spawn(name, cmd, port)


def load_times(url: str, adapter_dir: Path, repeats: int = 5) -> list[float]:
    """Seconds for ``POST /v1/load_lora_adapter`` of a fresh adapter (then unloaded), each."""
    times = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for i in range(repeats):
            name = f"load-probe-{i}"
            start = time.perf_counter()
            r = http.post("/v1/load_lora_adapter",
                          json={"lora_name": name, "lora_path": str(adapter_dir)})
            times.append(time.perf_counter() - start)
            r.raise_for_status()
            http.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
    return times


def bench(url: str, model: str, args: argparse.Namespace, adapters: list[str]) -> dict:
    """One ``tokenmill bench serve`` run (random prompts, EOS ignored); its JSON summary."""
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url,
           "--model", model, "--num-prompts", str(args.num_prompts), "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
           "--max-concurrency", str(args.concurrency), "--seed", str(args.seed),
           "--no-progress", "--result-file", name,
           *(["--lora-modules", *adapters] if adapters else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = Path(name).read_text()
    if not text:
        raise RuntimeError(f"bench serve failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads(text)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


def run(args: argparse.Namespace) -> dict:
    layers, shapes = model_shapes(DEFAULT_MODEL)
    root = Path(tempfile.mkdtemp(prefix="tokenmill-lora-bench-"))
    names = [f"adapter{i}" for i in range(args.adapters)]
    paths = [write_adapter(root / n, layers, shapes, args.rank, seed=i) for i, n in
             enumerate(names)]
    probe = write_adapter(root / "probe", layers, shapes, args.rank, seed=10_000)
    results: dict[str, dict] = {}
    off = serve("lora-off", [], args.num_threads)
    try:
        results["base, LoRA off"] = bench(off.url, _served_name(off.url), args, [])
    finally:
        off.stop()
    modules = [f"{n}={p}" for n, p in zip(names, paths)]
    setups = args.setups.split(",")
    loads: list[float] = []
    for slots in dict.fromkeys(_slots_of(s, args.max_loras) for s in setups):
        on = serve(f"lora-on-{slots}", ["--lora-modules", *modules, "--max-loras", str(slots),
                                        "--max-lora-rank", str(max(args.rank, 16)),
                                        "--allow-runtime-lora"], args.num_threads)
        try:
            base = _served_name(on.url)
            for setup in (s for s in setups if _slots_of(s, args.max_loras) == slots):
                adapters = [] if setup == "base" else names[:int(setup.split("@")[0])]
                label = "base, LoRA on" if setup == "base" else \
                    f"{len(adapters)} adapter(s) mixed, --max-loras {slots}"
                results[label] = bench(on.url, base, args, adapters)
            loads = loads or load_times(on.url, probe)
        finally:
            on.stop()
    return {"machine": machine(), "model": DEFAULT_MODEL, "rank": args.rank,
            "max_loras": args.max_loras, "adapters": args.adapters,
            "concurrency": args.concurrency, "input_len": args.input_len,
            "output_len": args.output_len, "num_prompts": args.num_prompts,
            "results": results, "load_seconds": loads}


def _slots_of(setup: str, default: int) -> int:
    """The --max-loras a setup runs under: ``N@M`` -> M, else the default."""
    return int(setup.split("@")[1]) if "@" in setup else default


def _served_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def table(result: dict) -> str:
    m = result["machine"]
    ref = result["results"]["base, LoRA off"]["output_throughput"]
    lines = [f"CPU: {m['cpu']} ({', '.join(m['isa'])}); dtype "
             f"{m.get('auto_dtype')}; rank {result['rank']}, "
             f"c={result['concurrency']}, {result['num_prompts']} prompts of "
             f"{result['input_len']} tokens, {result['output_len']} out",
             "",
             "| setup | output tok/s | vs base (LoRA off) | TPOT p50 (ms) | TTFT p50 / p99 (ms) |",
             "|---|---|---|---|---|"]
    for setup, r in result["results"].items():
        lines.append(f"| {setup} | {r['output_throughput']:.1f} | "
                     f"{r['output_throughput'] / ref:.2f}x | {r['tpot']['median_ms']:.1f} | "
                     f"{r['ttft']['median_ms']:.0f} / {r['ttft']['p99_ms']:.0f} |")
    loads = result["load_seconds"]
    lines.append(f"\nadapter load (rank {result['rank']}, every linear of every layer, over "
                 f"HTTP): best {min(loads) * 1e3:.0f} ms, median "
                 f"{statistics.median(loads) * 1e3:.0f} ms")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--setups", default="base,1,4,16,16@16")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
