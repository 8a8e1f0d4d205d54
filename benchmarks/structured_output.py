"""Structured output: what constraints cost, and what jump-forward saves.

    python3 benchmarks/structured_output.py [--requests 32] [--repeats 3] [--out FILE]

1. Overhead: ``--requests`` chat requests at once (one per schema of ``tests/structured_cases``,
   cycling), greedy, run constrained, constrained without jump-forward, and unconstrained with
   each request made exactly as long as its constrained output (so the batch shrinks the same
   way and only the grammar's cost differs); alternated ``--repeats`` times, medians reported.
   Output tok/s is generated tokens over wall time. Mask time per step is the worker thread's
   fill time (it runs alongside the forward).
2. Jump-forward on a schema with long fixed keys, one request and eight: forward passes, wall
   time, and whether the outputs are identical token for token (they must be, greedy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine  # noqa: E402
from tests.structured_cases import SCHEMAS, schema_prompt  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.structured import StructuredOutputs  # noqa: E402


def run(llm: LLM, prompts, params, jump_forward: bool = True) -> dict:
    engine = llm.engine
    engine.structured.jump_forward = jump_forward
    before = engine.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    mask_steps = after.num_grammar_mask_steps - before.num_grammar_mask_steps
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "steps": after.num_steps - before.num_steps,
            "mask_ms_per_step": 1e3 * (after.grammar_mask_seconds - before.grammar_mask_seconds)
            / max(1, mask_steps),
            "outputs": [o.outputs[0].token_ids for o in outs]}


def overhead(llm: LLM, n: int, repeats: int, max_tokens: int) -> dict:
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(n)]
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": schema_prompt(name)}])
               for name in names]
    constrained = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                  structured_outputs=StructuredOutputs(json=SCHEMAS[name]))
                   for name in names]
    start = time.perf_counter()
    run(llm, prompts[:1], constrained[:1])  # builds the grammar tokenizer, compiles, warms up
    first = time.perf_counter() - start
    # The same requests unconstrained, each made exactly as long as its constrained output:
    # the batch then shrinks step by step the same way, and only the grammar's cost differs.
    lengths = [len(t) for t in run(llm, prompts, constrained)["outputs"]]
    free = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in lengths]
    rows = {"unconstrained": [], "constrained": [], "constrained, no jump-forward": []}
    for _ in range(repeats):
        rows["unconstrained"].append(run(llm, prompts, free))
        rows["constrained"].append(run(llm, prompts, constrained))
        rows["constrained, no jump-forward"].append(run(llm, prompts, constrained, False))
    table = {}
    for name, runs in rows.items():
        table[name] = {k: statistics.median(r[k] for r in runs)
                       for k in ("tok_s", "tokens", "wall_s", "steps", "mask_ms_per_step")}
    return {"requests": n, "first_constrained_request_s": first, "rows": table}


def jump_forward(llm: LLM, max_tokens: int) -> dict:
    schema = SCHEMAS["long_fixed_keys"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputs(json=schema))
    asks = ["Fill in a customer record.", schema_prompt("long_fixed_keys"),
            "Make up a customer.", "A customer who prefers email.", "Another customer.",
            "A customer record as JSON.", "One more customer.", "A customer who renewed."]
    out = {}
    for batch in (1, 8):
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": a}])
                   for a in asks[:batch]]
        run(llm, prompts, params)
        off, on = run(llm, prompts, params, False), run(llm, prompts, params, True)
        out[f"batch {batch}"] = {
            "identical": off["outputs"] == on["outputs"],
            "steps_off": off["steps"], "steps_on": on["steps"],
            "wall_s_off": off["wall_s"], "wall_s_on": on["wall_s"],
            "speedup": off["wall_s"] / on["wall_s"], "tokens": on["tokens"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    llm = LLM("smollm2-135m-instruct", max_num_seqs=max(64, args.requests), num_blocks=2048)
    result = {"machine": machine(), "dtype": llm.engine.info.dtype,
              "overhead": overhead(llm, args.requests, args.repeats, args.max_tokens),
              "jump_forward": jump_forward(llm, 200)}
    print(json.dumps(result["machine"]))
    o = result["overhead"]
    print(f"\n{o['requests']} requests at once, greedy, dtype {result['dtype']} "
          f"(first constrained request {o['first_constrained_request_s']:.2f} s)")
    print(f"{'':30} {'tok/s':>8} {'tokens':>7} {'steps':>6} {'wall s':>7} {'mask ms/step':>12}")
    for name, r in o["rows"].items():
        print(f"{name:30} {r['tok_s']:8.1f} {r['tokens']:7.0f} {r['steps']:6.0f} "
              f"{r['wall_s']:7.2f} {r['mask_ms_per_step']:12.2f}")
    print("\njump-forward, schema long_fixed_keys, greedy")
    for name, r in result["jump_forward"].items():
        print(f"{name}: steps {r['steps_off']} -> {r['steps_on']}, wall {r['wall_s_off']:.2f} "
              f"-> {r['wall_s_on']:.2f} s (x{r['speedup']:.2f}), identical: {r['identical']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
