"""What each weight / KV-cache quantization costs and buys, on one machine, in one run.

    python benchmarks/quantization.py [--dtype auto] [--out benchmarks/results/quantization]

Per setting (weights none / the GGUF's own blocks / int8 / int4, and the int8 KV cache):
- perplexity on the shipped text (``tokenmill eval perplexity``, through the engine's path);
- greedy agreement with the unquantized model on the 16 prompts of tests/test_engine_real.py
  (20 tokens each, identical tokens position by position: one early near-tie that flips
  changes every later position of its prompt);
- teacher-forced top-1 agreement: the most likely next token at each of the first 1,024
  positions of the shipped text, the same text fed to every setting (a flip costs one
  position);
- single-request decode speed, load time and peak RSS (``benchmarks/model_speed.py``, its own
  process per setting so the RSS is that setting's);
- the KV cache's capacity in tokens for the same 2 GiB budget.
Writes quantization.json and quantization.md (a table) under --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine import machine  # noqa: E402  (benchmarks/machine.py)

# name -> (weights, KV cache dtype)
SETTINGS = {
    "none": ("none", "auto"),
    "gguf blocks (auto)": ("auto", "auto"),
    "int8": ("int8", "auto"),
    "int4": ("int4", "auto"),
    "int8 KV": ("none", "int8"),
    "int4 + int8 KV": ("int4", "int8"),
}
KV_BUDGET = 2 << 30


def run_json(cmd: list[str]) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode:  # the child's own words, not only its exit status
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def greedy_tokens(dtype: str, weights: str, kv: str) -> tuple[list[list[int]], int]:
    from tests.test_engine_real import GREEDY, PROMPTS
    from tokenmill import LLM

    llm = LLM("smollm2-135m-instruct", dtype=dtype, quantization=weights, kv_cache_dtype=kv,
              kv_cache_memory=KV_BUDGET)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return outs, llm.engine.info.kv_cache_tokens


def teacher_forced_top1(dtype: str, weights: str, kv: str, positions: int = 1024,
                        chunk: int = 256) -> list[int]:
    """The argmax of the logits at each of the shipped text's first ``positions`` tokens, fed
    as one window in prefill chunks of ``chunk``."""
    from tokenmill.eval.perplexity import build_eval_engine, load_text
    from tokenmill.runner.batch import Chunk
    from tokenmill.util import cdiv

    engine = build_eval_engine("smollm2-135m-instruct", positions, dtype=dtype,
                               quantization=weights, kv_cache_dtype=kv)
    runner = engine.executor.worker
    ids = engine.tokenizer.encode(load_text())[:positions]
    table = list(range(1, 1 + cdiv(len(ids), runner.block_size)))  # block 0: padding
    top = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        logits = runner.forward([Chunk(piece, start, table, num_logits=len(piece))])
        top += logits[:len(piece)].argmax(-1).tolist()
    engine.shutdown()
    return top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quantization")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.settings.split(",")
    rows, reference, top1_reference, measured = {}, None, None, {}
    for name in names:  # in child processes first: a child forked from a parent that holds
        weights, kv = SETTINGS[name]  # models inherits its peak RSS
        flags = ["--dtype", args.dtype, "--quantization", weights, "--kv-cache-dtype", kv]
        measured[name] = (run_json([sys.executable, "-m", "tokenmill.cli", "eval", "perplexity",
                                    "--json", *flags]),
                          run_json([sys.executable, "benchmarks/model_speed.py", *flags]))
    for name in names:
        weights, kv = SETTINGS[name]
        ppl, speed = measured[name]
        tokens, capacity = greedy_tokens(ppl["dtype"], weights, kv)
        top1 = teacher_forced_top1(ppl["dtype"], weights, kv)
        reference, top1_reference = reference or tokens, top1_reference or top1
        same = sum(a == b for x, y in zip(reference, tokens) for a, b in zip(x, y))
        rows[name] = {"weights": speed["weights"], "kv_cache_dtype": kv,
                      "perplexity": ppl["perplexity"], "tokens_scored": ppl["tokens_scored"],
                      "greedy_identical": same, "greedy_total": sum(map(len, reference)),
                      "top1_same": sum(a == b for a, b in zip(top1_reference, top1)),
                      "top1_total": len(top1_reference),
                      "kv_cache_tokens_2gib": capacity, **{k: speed[k] for k in (
                          "dtype", "load_s", "peak_rss_mib", "prefill_ms",
                          "decode_tokens_per_s", "decode_ms_per_token")}}
        print(name, json.dumps(rows[name]), flush=True)
    base = rows[names[0]]
    lines = [f"Machine: {json.dumps(machine())}", "",
             "| setting | weights | perplexity (vs first row) | greedy identical | top-1 same, "
             "teacher-forced | decode tok/s (ms/token) | prefill 128 ms | load s | peak RSS MiB "
             "| KV tokens in 2 GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['weights']} | {r['perplexity']:.3f} "
            f"({100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}%) | "
            f"{r['greedy_identical']}/{r['greedy_total']} | {r['top1_same']}/{r['top1_total']} "
            f"| {r['decode_tokens_per_s']:.1f} "
            f"({r['decode_ms_per_token']}) | {r['prefill_ms']} | {r['load_s']} | "
            f"{r['peak_rss_mib']} | {r['kv_cache_tokens_2gib']} |")
    (args.out / "quantization.json").write_text(json.dumps(
        {"machine": machine(), "rows": rows}, indent=2))
    (args.out / "quantization.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
