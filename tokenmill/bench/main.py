"""``tokenmill bench serve`` and ``tokenmill bench sweep``: load-test any OpenAI-compatible
server."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tokenmill.bench import workloads as wl
from tokenmill.bench.client import BenchClient, RunConfig
from tokenmill.bench.replay import add_replay_parser
from tokenmill.bench.report import format_table, parse_slo, summarize


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bsub.add_parser("serve", help="one run of a workload against a server")
    _add_common(serve)
    serve.add_argument("--request-rate", type=float, default=float("inf"))
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--result-file", default=None)
    serve.set_defaults(func=cmd_bench_serve)
    sweep = bsub.add_parser("sweep", help="a workload at several concurrencies, plotted")
    _add_common(sweep)
    sweep.add_argument("--concurrencies", default="1,4,16", help="comma-separated")
    sweep.add_argument("--label", default=None, help="name of this server in the plot")
    sweep.add_argument("--result-file", default="sweep.json",
                       help="JSON of all points; appended to when it exists (one line per server)")
    sweep.add_argument("--plot", default="sweep.png", help="PNG: throughput vs TTFT p99 / TPOT")
    sweep.set_defaults(func=cmd_bench_sweep)
    add_replay_parser(bsub)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server expects")
    p.add_argument("--tokenizer", default=None,
                   help="model (path or known name) whose tokenizer counts tokens (default: "
                        "--model if tokenmill can load it, else the default model)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn", "file"],
                   default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups")
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: user turns")
    p.add_argument("--system-prompt-len", type=int, default=0,
                   help="multi-turn: tokens of a system prompt shared by every conversation")
    p.add_argument("--dataset", default=None, help="file: a JSONL of prompts or conversations")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    p.add_argument("--slo", default=None, help="e.g. ttft_ms=1000,tpot_ms=100")
    p.add_argument("--api-key", default=None)
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves: each request names one, drawn at "
                        "random (seeded by --seed)")
    p.add_argument("--no-progress", action="store_true")


def _tokenizer(args: argparse.Namespace):
    from tokenmill.config import DEFAULT_MODEL
    from tokenmill.errors import TokenmillError
    from tokenmill.tokenizer import load_tokenizer

    try:
        return load_tokenizer(args.tokenizer or args.model)
    except TokenmillError:
        if args.tokenizer:
            raise
        return load_tokenizer(DEFAULT_MODEL)


def build_workload(args: argparse.Namespace, tok) -> list[wl.BenchRequest]:
    reqs = _workload(args, tok)
    if args.lora_modules:
        wl.assign_models(reqs, args.lora_modules, args.seed)
    return reqs


def _workload(args: argparse.Namespace, tok) -> list[wl.BenchRequest]:
    vocab = tok.vocab_size
    if args.workload == "random":
        return wl.random_workload(tok, args.num_prompts, args.input_len, args.output_len,
                                  args.range_ratio, args.seed, vocab)
    if args.workload == "shared-prefix":
        return wl.shared_prefix_workload(tok, args.num_groups, args.prompts_per_group,
                                         args.system_len, args.question_len, args.output_len,
                                         args.seed, vocab)
    if args.workload == "multi-turn":
        return wl.multi_turn_workload(tok, args.num_prompts, args.num_turns, args.input_len,
                                      args.output_len, args.seed, vocab, args.system_prompt_len)
    if not args.dataset:
        raise ValueError("--workload file needs --dataset FILE.jsonl")
    return wl.file_workload(args.dataset, tok, args.output_len)


async def run_once(args: argparse.Namespace, reqs: list[wl.BenchRequest], tok,
                   max_concurrency: int | None, request_rate: float) -> dict:
    from tqdm.auto import tqdm

    cfg = RunConfig(args.base_url, args.model, args.endpoint, request_rate, max_concurrency,
                    args.ignore_eos, args.seed, args.api_key, temperature=args.temperature)
    client = BenchClient(cfg, lambda text: len(tok.encode(text, add_special_tokens=False)))
    try:
        if args.warmup:  # prompts of their own, so no server's prefix cache is primed by them
            await client.run(wl.random_workload(tok, args.warmup, 32, 8, seed=args.seed + 7919,
                                                vocab=tok.vocab_size))
        # None: a bar only when stderr is a terminal (never in a log or piped output)
        with tqdm(total=len(reqs), desc="requests", disable=True if args.no_progress else None
                  ) as bar:
            results, duration = await client.run(reqs, lambda: bar.update(1))
    finally:
        await client.close()
    summary = summarize(results, duration, parse_slo(args.slo))
    summary.update(workload=args.workload, endpoint=args.endpoint, base_url=args.base_url,
                   model=args.model, max_concurrency=max_concurrency,
                   request_rate=None if request_rate == float("inf") else request_rate,
                   num_requests=len(reqs), seed=args.seed)
    return summary


def cmd_bench_serve(args: argparse.Namespace) -> int:
    tok = _tokenizer(args)
    reqs = build_workload(args, tok)
    print(f"workload {args.workload}: {wl.describe(reqs)}", file=sys.stderr)
    summary = asyncio.run(run_once(args, reqs, tok, args.max_concurrency, args.request_rate))
    print(format_table(summary))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(summary, indent=2))
    return 0 if summary["completed"] else 1


def cmd_bench_sweep(args: argparse.Namespace) -> int:
    tok = _tokenizer(args)
    reqs = build_workload(args, tok)
    label = args.label or args.base_url
    points = []
    for c in [int(x) for x in args.concurrencies.split(",")]:
        s = asyncio.run(run_once(args, reqs, tok, c, float("inf")))
        print(f"{label} concurrency {c}: {s['output_throughput']:.1f} tok/s, "
              f"TTFT p99 {s['ttft']['p99_ms']:.0f} ms, TPOT median {s['tpot']['median_ms']:.0f} ms")
        points.append(s)
    path = Path(args.result_file)
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[label] = points
    path.write_text(json.dumps(runs, indent=2))
    plot_sweep(runs, args.plot)
    return 0


def plot_sweep(runs: dict[str, list[dict]], out: str) -> None:
    """Output throughput against TTFT p99 and TPOT median, one line per server."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("plotting needs matplotlib: pip install 'tokenmill[bench]'") from e
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in runs.items():
        tput = [p["output_throughput"] for p in points]
        for ax, key, name in ((axes[0], ("ttft", "p99_ms"), "TTFT p99 (ms)"),
                              (axes[1], ("tpot", "median_ms"), "TPOT median (ms)")):
            ax.plot([p[key[0]][key[1]] for p in points], tput, marker="o", label=label)
            for p, x, y in zip(points, [p[key[0]][key[1]] for p in points], tput):
                ax.annotate(str(p["max_concurrency"]), (x, y), fontsize=7)
            ax.set_xlabel(name)
            ax.set_ylabel("output tokens/s")
    axes[0].set_title("throughput vs time to first token")
    axes[1].set_title("throughput vs time per output token")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)  # compare.py redraws after every run
