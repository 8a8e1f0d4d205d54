"""Greedy tokens of the default model on every execution path, as JSON.

Run it before and after a change that must not alter outputs, then compare the two files:

    python scripts/greedy_paths.py --onednn-rows 32 > before.json   # on the old commit
    python scripts/greedy_paths.py --onednn-rows 32 > after.json    # on the new one
    python scripts/greedy_paths.py --compare before.json after.json

Each path is one engine configuration (dtype, weights, fused or eager step, attention backend,
speculative decoding, structured output); the figures depend on the machine's instruction set,
so compare files from the same machine only. bf16 results also depend on the forward's thread
count and on the rows from which the load-time trial sends linears to oneDNN (AMX machines):
threads are pinned here, and each path records its CPU step (with that threshold) so that a
difference can be told from a changed trial. Run both sides on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Write a haiku about the sea.", "1, 2, 3, 5, 8, 13,"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}

PATHS: dict[str, dict] = {
    "fp32-fused": dict(dtype="float32"),
    "fp32-eager": dict(dtype="float32", enforce_eager=True),
    "fp32-torch-attention": dict(dtype="float32", attention_backend="torch"),
    "bf16-fused": dict(dtype="bfloat16"),
    "bf16-eager": dict(dtype="bfloat16", enforce_eager=True),
    "auto-dtype": dict(),
    "int8": dict(quantization="int8"),
    "int4": dict(quantization="int4"),
    "gguf-blocks": dict(quantization="auto"),
    "fp32-int8": dict(dtype="float32", quantization="int8"),
    "ngram": dict(speculative_method="ngram"),
    "layerskip": dict(speculative_method="layerskip"),
    "fp32-layerskip": dict(dtype="float32", speculative_method="layerskip"),
    "structured": dict(structured=True),
    "batch-invariant": dict(batch_invariant=True),
    "fp32-batch-invariant": dict(dtype="float32", batch_invariant=True),
}


def pin_onednn_rows(rows: int) -> None:
    """Fix the oneDNN trial's answer (0: packed throughout) instead of timing it, in this
    version of tokenmill or one from before the linear kernels became strategies."""
    answer = rows or None
    try:
        from tokenmill.model.linear import routed
    except ImportError:  # before model/linear/: the loader timed it
        from tokenmill.model import loader

        loader.dense_rows_from = lambda timings: answer
        return
    routed.dense_rows_from = lambda timings, *args, **kwargs: answer


def run_path(options: dict, max_tokens: int) -> dict:
    from tokenmill import LLM, SamplingParams, StructuredOutputs

    options = dict(options)
    structured = options.pop("structured", False)
    llm = LLM(seed=0, num_blocks=256, num_threads=2, **options)
    so = StructuredOutputs(json=json.dumps(SCHEMA)) if structured else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cpu_step": llm.engine.info.cpu_step}


def _as_record(value: list | dict) -> dict:
    """A path's record; files from before records kept the CPU step hold the tokens alone."""
    return value if isinstance(value, dict) else {"tokens": value, "cpu_step": "?"}


def compare(before: str, after: str) -> int:
    """Paths run in both files must be identical; a path only one file has is reported."""
    old, new = (json.load(open(p)) for p in (before, after))
    bad = 0
    for name in sorted(old.keys() | new.keys()):
        if name not in old or name not in new:
            print(f"{name:24s} only in {'after' if name in new else 'before'}")
            continue
        a, b = (_as_record(d[name]) for d in (old, new))
        same = a["tokens"] == b["tokens"]
        bad += not same
        steps = {a["cpu_step"], b["cpu_step"]}
        print(f"{name:24s} {'identical' if same else 'DIFFERENT'}  ({' | '.join(sorted(steps))})")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--onednn-rows", type=int, default=None,
                    help="pin the rows from which linears go to oneDNN (0: never) instead of "
                         "the load-time trial, whose timing differs from load to load")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.onednn_rows is not None:
        pin_onednn_rows(args.onednn_rows)
    result = {name: run_path(PATHS[name], args.max_tokens) for name in args.paths.split(",")}
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
