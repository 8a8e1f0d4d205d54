"""Structured output: what a constraint costs per generated token, and what jump-forward saves.

    python3 benchmarks/structured.py [--mode overhead|jump-forward|all] [--requests 32]
        [--temperature 0 1] [--repeats 3] [--max-tokens 128] [--out FILE]

``overhead`` (the default): ``--requests`` chat requests submitted together to one engine, one
per case of ``tests/structured_cases.py`` (22 JSON schemas, then 10 regexes, cycling), each run

- unconstrained: the same requests without a constraint (they end at EOS or ``--max-tokens``);
- unconstrained, same lengths: each request exactly as long as its constrained output
  (``ignore_eos``), so the batch shrinks step by step as the constrained one does;
- constrained (jump-forward on, the default) and constrained with jump-forward off.

Rows alternate for ``--repeats`` rounds; medians are reported. Output tok/s is generated tokens
over wall time; constrained outputs are shorter (they end when the schema is complete), so tok/s
is the figure to compare, and jump-forward raises it (several tokens per step): the row without
it shows the cost of the masks alone. Masks are filled by a worker thread while the forward
runs: ``mask ms/step`` is that thread's time, not added to the step. ``valid`` is the share of
outputs that parse and validate (``jsonschema``, with formats) or ``re.fullmatch``. Compiling
is reported apart (cached per constraint afterwards): the grammar tokenizer built on the first
constrained request, then each constraint once.

``jump-forward``: schemas with long fixed keys (``long_fixed_keys``, ``recipe``), greedy, one
request and ``--batch`` requests, jump-forward off against on: forward passes, tokens, wall time,
tok/s, and whether the outputs are identical token for token (under greedy they must be).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from machine import machine  # noqa: E402  (benchmarks/machine.py)
from structured_cases import REGEXES, SCHEMAS, regex_prompt, schema_prompt  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.structured import StructuredOutputs  # noqa: E402

CASES = [("json", n) for n in SCHEMAS] + [("regex", n) for n in REGEXES]
ROWS = ("unconstrained", "unconstrained, same lengths", "constrained",
        "constrained, no jump-forward")
MEDIANS = ("tok_s", "tokens", "steps", "wall_s", "ms_per_step", "tok_per_step",
           "mask_ms_per_step", "valid")


def constraint(kind: str, name: str) -> StructuredOutputs:
    return StructuredOutputs(json=SCHEMAS[name]) if kind == "json" \
        else StructuredOutputs(regex=REGEXES[name])


def is_valid(kind: str, name: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEXES[name], text) is not None
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name],
                            format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(llm: LLM, prompts: list, params: list, cases: list, jump_forward: bool = True) -> dict:
    """One batch submitted together, with the engine's counters read before and after."""
    engine = llm.engine
    engine.structured.jump_forward = jump_forward
    before = engine.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = engine.stats()
    done = [o.outputs[0] for o in outs]
    tokens = sum(len(o.token_ids) for o in done)
    steps = after.num_steps - before.num_steps
    mask_steps = after.num_grammar_mask_steps - before.num_grammar_mask_steps
    mask_s = after.grammar_mask_seconds - before.grammar_mask_seconds
    return {"tok_s": tokens / wall, "tokens": tokens, "steps": steps, "wall_s": wall,
            "ms_per_step": 1e3 * wall / steps, "tok_per_step": tokens / steps,
            "mask_ms_per_step": 1e3 * mask_s / mask_steps if mask_steps else 0.0,
            "valid": statistics.fmean(is_valid(k, n, o.text) for (k, n), o in zip(cases, done)),
            "drafts": after.num_draft_tokens - before.num_draft_tokens,
            "accepted": after.num_accepted_tokens - before.num_accepted_tokens,
            "outputs": [list(o.token_ids) for o in done]}


def compile_times(llm: LLM, cases: list) -> dict:
    """Start-up (the grammar tokenizer, with a trivial regex) and each case compiled cold."""
    start = time.perf_counter()
    llm.engine.compile_grammar(StructuredOutputs(regex="a"))
    startup = time.perf_counter() - start
    ms = []
    for case in dict.fromkeys(cases):
        start = time.perf_counter()
        llm.engine.compile_grammar(constraint(*case))
        ms.append(1e3 * (time.perf_counter() - start))
    return {"startup_s": startup, "compiled": len(ms), "compile_ms_mean": statistics.fmean(ms),
            "compile_ms_max": max(ms)}


def overhead(llm: LLM, args, temperature: float) -> dict:
    cases = [CASES[i % len(CASES)] for i in range(args.requests)]
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": (
        schema_prompt(n) if k == "json" else regex_prompt(n))}]) for k, n in cases]
    seeds = [i if temperature > 0 else None for i in range(len(cases))]
    free = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=s)
            for s in seeds]
    constrained = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=s,
                                  structured_outputs=constraint(*c)) for s, c in zip(seeds, cases)]
    warm = run(llm, prompts, constrained, cases)  # also the lengths of the same-lengths row
    same = [SamplingParams(temperature=temperature, max_tokens=max(1, len(t)), seed=s,
                           ignore_eos=True) for s, t in zip(seeds, warm["outputs"])]
    runs = {
        "unconstrained": lambda: run(llm, prompts, free, cases),
        "unconstrained, same lengths": lambda: run(llm, prompts, same, cases),
        "constrained": lambda: run(llm, prompts, constrained, cases),
        "constrained, no jump-forward": lambda: run(llm, prompts, constrained, cases, False),
    }
    results = {row: [] for row in ROWS}
    for r in range(args.repeats):
        for row in ROWS if r % 2 == 0 else ROWS[::-1]:
            results[row].append(runs[row]())
    rows = {row: {k: statistics.median(x[k] for x in xs) for k in MEDIANS}
            for row, xs in results.items()}
    return {"temperature": temperature, "requests": len(cases), "rows": rows}


def jump_forward(llm: LLM, args) -> dict:
    out = {}
    for name in args.jf_schemas:
        for batch in sorted({1, args.batch}):
            cases = [("json", name)] * batch
            prompts = [llm.chat_prompt_ids([{"role": "user", "content":
                                             f"{schema_prompt(name)} Example {i + 1}."}])
                       for i in range(batch)]
            params = [SamplingParams(temperature=0.0, max_tokens=args.jf_max_tokens,
                                     structured_outputs=constraint("json", name))] * batch
            run(llm, prompts, params, cases)  # warm-up
            off, on = [], []
            for _ in range(args.repeats):
                off.append(run(llm, prompts, params, cases, jump_forward=False))
                on.append(run(llm, prompts, params, cases, jump_forward=True))
            wall_off = statistics.median(r["wall_s"] for r in off)
            wall_on = statistics.median(r["wall_s"] for r in on)
            out[f"{name}, batch {batch}"] = {
                "identical": all(r["outputs"] == off[0]["outputs"] for r in off + on),
                "steps_off": off[0]["steps"], "steps_on": on[0]["steps"],
                "tokens_off": off[0]["tokens"], "tokens_on": on[0]["tokens"],
                "wall_s_off": wall_off, "wall_s_on": wall_on, "speedup": wall_off / wall_on,
                "tok_s_off": off[0]["tokens"] / wall_off, "tok_s_on": on[0]["tokens"] / wall_on,
                "drafts_on": on[0]["drafts"], "accepted_on": on[0]["accepted"],
                "valid": on[0]["valid"]}
    return out


def print_overhead(compiled: dict, tables: list[dict]) -> None:
    print(f"\ngrammar start-up (tokenizer) {compiled['startup_s']:.2f} s; compile "
          f"{compiled['compile_ms_mean']:.1f} ms mean, {compiled['compile_ms_max']:.1f} ms max "
          f"over {compiled['compiled']} constraints (cached afterwards)")
    for t in tables:
        rows = t["rows"]
        print(f"\n{t['requests']} requests at once, temperature {t['temperature']}")
        print(f"{'':29} {'tok/s':>7} {'tokens':>6} {'steps':>5} {'wall s':>6} {'ms/step':>7} "
              f"{'tok/step':>8} {'mask ms/step':>12} {'valid':>6}")
        for name, r in rows.items():
            print(f"{name:29} {r['tok_s']:7.1f} {r['tokens']:6.0f} {r['steps']:5.0f} "
                  f"{r['wall_s']:6.2f} {r['ms_per_step']:7.1f} {r['tok_per_step']:8.2f} "
                  f"{r['mask_ms_per_step']:12.2f} {r['valid']:6.0%}")
        for ref in ROWS[:2]:
            on, off = (rows[c]["tok_s"] / rows[ref]["tok_s"] for c in ROWS[2:])
            print(f"constrained tok/s / {ref}: {on:.3f} with jump-forward, {off:.3f} without")


def print_jump_forward(rows: dict) -> None:
    print("\njump-forward off -> on, greedy")
    for name, r in rows.items():
        print(f"{name:24} steps {r['steps_off']:4d} -> {r['steps_on']:4d}  tokens "
              f"{r['tokens_off']:4d} -> {r['tokens_on']:4d}  wall {r['wall_s_off']:6.2f} -> "
              f"{r['wall_s_on']:6.2f} s (x{r['speedup']:.2f})  tok/s {r['tok_s_off']:6.1f} -> "
              f"{r['tok_s_on']:6.1f}  drafts {r['accepted_on']}/{r['drafts_on']} accepted  "
              f"identical: {'yes' if r['identical'] else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--mode", choices=["overhead", "jump-forward", "all"], default="overhead")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jf-schemas", nargs="+", default=["long_fixed_keys", "recipe"])
    ap.add_argument("--batch", type=int, default=8, help="jump-forward's batched run")
    ap.add_argument("--jf-max-tokens", type=int, default=200)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, num_blocks=args.num_blocks,
              max_num_seqs=max(64, args.requests, args.batch))
    result = {"machine": machine(), "model": args.model, "dtype": llm.engine.info.dtype,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    print(json.dumps(result["machine"]), f"dtype {result['dtype']}")
    result["compile"] = compile_times(llm, CASES)
    if args.mode in ("overhead", "all"):
        result["overhead"] = [overhead(llm, args, t) for t in args.temperature]
        print_overhead(result["compile"], result["overhead"])
    if args.mode in ("jump-forward", "all"):
        result["jump_forward"] = jump_forward(llm, args)
        print_jump_forward(result["jump_forward"])
        if not all(r["identical"] for r in result["jump_forward"].values()):
            print("WARNING: jump-forward changed a greedy output")
    result["preemptions"] = llm.engine.num_preemptions
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
