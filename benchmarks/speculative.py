"""Speculative decoding: what each method buys on input-grounded work, and what it costs a loaded
server.

    python3 benchmarks/speculative.py grounded [--methods off ngram draft layerskip] [--k 4]
        [--draft-layers L] [--fixed-k] [--tasks N] [--max-tokens 256] [--rounds 3]
        [--dtype auto] [--out FILE]
    python3 benchmarks/speculative.py serve [--concurrency 1 8 32] [--temperature 0]
        [--fixed-k] [--rounds 2] [--out FILE]

``grounded``: one request at a time (single stream), greedy, on tasks that copy or lightly edit a
passage the prompt holds (this repository's own README, docs and source, so the prompts are the
project's files): decode tok/s (output tokens after the first, over the time after the first),
its ratio to speculation off, the acceptance rate, the mean accepted length (tokens per
verification) and whether every output equals the output without speculation token for token
(greedy: it must). Methods run in alternating order for ``--rounds`` rounds; medians reported.
``draft`` drafts with the target itself (the only real model here), a bound on acceptance whose
draft costs as much as the target; ``layerskip`` drafts with the target's first
``--draft-layers`` layers.

``serve``: ``tokenmill serve`` with ``--speculative-method ngram`` against the same server without
it (both as ``benchmarks/compare.py`` starts tokenmill: ``peers.TokenmillPeer``, 2 GiB of KV cache,
2,048-token context), each measured by ``tokenmill bench serve`` (random 128/128, EOS ignored) at each concurrency;
output tok/s and its ratio (on / off), rounds alternating on and off. The default model's greedy
output on random prompts falls into loops that n-gram lookup predicts; ``--temperature 1`` gives
text it rarely predicts (the case where speculation must cost nothing), and ``--fixed-k``
drafts whenever a match exists, as a non-adaptive engine would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from machine import machine  # noqa: E402  (benchmarks/machine.py)
from peers import TokenmillPeer, start_peer  # noqa: E402  (benchmarks/peers/peers.py)

from tokenmill import LLM, SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"


def excerpt(path: str, start: str, chars: int = 1200) -> str:
    text = (REPO / path).read_text()
    i = text.find(start)
    return text[max(i, 0):max(i, 0) + chars]


def grounded_tasks() -> list[list[dict]]:
    """Chat conversations: repeat a passage, or edit code lightly (about 300 tokens each)."""
    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    readme = excerpt("README.md", "# ")
    arch = excerpt("docs/architecture.md", "")
    ngram = excerpt("tokenmill/spec/ngram.py", "class NgramProposer")
    block_pool = excerpt("tokenmill/cache/block_pool.py", "class ")
    return [
        user(f"Repeat the following text exactly, word for word.\n\n{readme}"),
        user(f"Repeat the following text exactly, word for word.\n\n{arch}"),
        user("Rewrite this Python code, renaming the variable `index` to `idx`. Output only the "
             f"code.\n\n```python\n{ngram}\n```"),
        user("Add a short comment above every method of this Python code and output the whole "
             f"code.\n\n```python\n{block_pool}\n```"),
    ]


def method_options(method: str, k: int, draft_layers: int | None, adaptive: bool) -> dict:
    if method == "off":
        return {}
    opts = dict(speculative_method=method, num_speculative_tokens=k,
                speculative_adaptive=adaptive)
    if method == "draft":
        opts["speculative_model"] = MODEL
    if method == "layerskip" and draft_layers:
        opts["speculative_draft_layers"] = draft_layers
    return opts


def single_stream(llm: LLM, conversation: list[dict], max_tokens: int) -> tuple[list[int], float]:
    """Greedy output ids and decode tok/s (tokens after the first over the time after it)."""
    engine = llm.engine
    ids = llm.chat_prompt_ids(conversation)
    engine.add_request("bench", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if first is None and tokens:
            first, first_count = time.perf_counter(), len(tokens)
    elapsed = time.perf_counter() - first
    return tokens, (len(tokens) - first_count) / elapsed


def run_grounded(args) -> dict:
    tasks = grounded_tasks()[:args.tasks]
    llms = {m: LLM(MODEL, dtype=args.dtype,
                   **method_options(m, args.k, args.draft_layers, not args.fixed_k))
            for m in args.methods}
    for llm in llms.values():  # warm-up
        llm.chat(tasks[0], SamplingParams(max_tokens=8), use_tqdm=False)
    rates: dict[str, list[float]] = {m: [] for m in args.methods}
    outputs: dict[str, list[list[int]]] = {m: [] for m in args.methods}
    before = {m: llms[m].engine.stats().spec for m in args.methods}
    for r in range(args.rounds):
        order = args.methods if r % 2 == 0 else args.methods[::-1]
        for task in tasks:
            for m in order:
                tokens, rate = single_stream(llms[m], task, args.max_tokens)
                rates[m].append(rate)
                if r == 0:
                    outputs[m].append(tokens)
    rows = []
    base = statistics.median(rates["off"]) if "off" in rates else None
    for m in args.methods:
        spec, start = llms[m].engine.stats().spec, before[m]
        row = {"method": m, "decode_tok_s": round(statistics.median(rates[m]), 1)}
        if base:
            row["vs_off"] = round(row["decode_tok_s"] / base, 2)
        if spec is not None:
            drafts = spec.num_draft_tokens - start.num_draft_tokens
            accepted = spec.num_accepted_tokens - start.num_accepted_tokens
            verifications = spec.num_drafts - start.num_drafts
            row.update(acceptance_rate=round(accepted / max(1, drafts), 3),
                       mean_accepted_length=round(1 + accepted / max(1, verifications), 2),
                       draft_tokens=drafts)
        if "off" in outputs:
            row["identical_to_off"] = outputs[m] == outputs["off"]
        row["output_tokens"] = [len(t) for t in outputs[m]]
        rows.append(row)
        print(json.dumps(row), flush=True)
    info = llms[args.methods[0]].engine.info
    return {"mode": "grounded", "machine": machine(), "dtype": info.dtype, "k": args.k,
            "adaptive": not args.fixed_k, "draft_layers": args.draft_layers,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "tasks": len(tasks),
            "rows": rows}


# ----- serve -----------------------------------------------------------------------------------

def bench(url: str, concurrency: int, num_prompts: int, out_file: str,
          temperature: float) -> dict:
    subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url,
                    "--model", MODEL, "--workload", "random", "--input-len", "128",
                    "--output-len", "128", "--ignore-eos", "--num-prompts", str(num_prompts),
                    "--temperature", str(temperature),
                    "--max-concurrency", str(concurrency), "--result-file", out_file,
                    "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(out_file).read_text())


def run_serve(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-spec-"))
    ngram = ("--speculative-method", "ngram", "--num-speculative-tokens", str(args.k),
             *(("--no-speculative-adaptive",) if args.fixed_k else ()))
    # the servers compare.py runs for tokenmill (same KV budget and context), one with n-gram
    peers = {"off": TokenmillPeer("tokenmill", args.dtype),
             "ngram": TokenmillPeer("tokenmill-ngram", args.dtype, extra=ngram)}
    servers = {}
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for i, (name, peer) in enumerate(peers.items()):
            servers[name] = start_peer(peer, tmp, args.base_port + i, tmp / "logs")
        for r in range(args.rounds):
            for c in args.concurrency:
                for name in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                    res = bench(servers[name].url, c, max(8, 2 * c),
                                str(tmp / f"{name}-{c}-{r}.json"), args.temperature)
                    results.setdefault((name, c), []).append(res["output_throughput"])
                    print(name, c, round(res["output_throughput"], 1), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    rows = []
    for c in args.concurrency:
        off = statistics.median(results[("off", c)])
        on = statistics.median(results[("ngram", c)])
        rows.append({"concurrency": c, "off_tok_s": round(off, 1), "ngram_tok_s": round(on, 1),
                     "ratio": round(on / off, 3), "off_runs": results[("off", c)],
                     "ngram_runs": results[("ngram", c)]})
        print(json.dumps(rows[-1]), flush=True)
    return {"mode": "serve", "machine": machine(), "dtype": args.dtype, "k": args.k,
            "adaptive": not args.fixed_k, "temperature": args.temperature,
            "workload": "random 128/128, ignore_eos", "rounds": args.rounds, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["grounded", "serve"])
    ap.add_argument("--methods", nargs="+", default=["off", "ngram", "draft", "layerskip"])
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--draft-layers", type=int, default=None, help="layerskip: layers that draft")
    ap.add_argument("--fixed-k", action="store_true",
                    help="grounded: always draft k (--no-speculative-adaptive), e.g. to measure "
                         "a method's raw acceptance")
    ap.add_argument("--tasks", type=int, default=None, help="grounded: only the first N tasks")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temperature", type=float, default=0.0, help="serve: of the requests")
    ap.add_argument("--base-port", type=int, default=8100, help="serve: ports from here")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    result = run_grounded(args) if args.mode == "grounded" else run_serve(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
