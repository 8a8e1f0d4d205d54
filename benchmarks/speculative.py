"""Speculative decoding: what each method buys on input-grounded work, and what it costs a loaded
server.

    python3 benchmarks/speculative.py grounded [--methods off ngram draft layerskip] [--k 4]
        [--draft-layers L] [--fixed-k] [--tasks N] [--max-tokens 256] [--rounds 3]
        [--dtype auto] [--out FILE]
    python3 benchmarks/speculative.py serve [--concurrency 64 128] [--temperature 0 1]
        [--max-num-seqs 32] [--prompts-per-concurrency 1] [--grounded-concurrency 1 2 4 8]
        [--grounded-per-concurrency 2] [--max-tokens 256] [--fixed-k] [--rounds 1]
        [--out FILE]

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
it (both as ``benchmarks/compare.py`` starts tokenmill: ``peers.TokenmillPeer``, 2 GiB of KV
cache, 2,048-token context, and ``--max-num-seqs``, default 32), each measured by
``tokenmill bench serve`` at each concurrency, servers alternating within a round:

- queue rows (``--concurrency``, default 64 and 128, at each ``--temperature``, default 0 and
  1): random 128/128, EOS ignored, ``--prompts-per-concurrency`` x C requests. With more
  clients than seats, requests wait in the server's queue (the most seen waiting is recorded,
  polled from ``/metrics``), and drafts, scheduled before waiting prompts, compete with them
  for the step's token budget. The default model's greedy continuation of random text falls
  into loops that n-gram lookup predicts (speculation gains); at temperature 1 it rarely
  predicts anything (speculation must cost nothing). On / off >= 0.97, and a queue formed.
- grounded rows (``--grounded-concurrency``, default 1, 2, 4 and 8): the ``grounded`` mode's
  chat tasks, cycled to ``--grounded-per-concurrency`` x C requests (at least one per task),
  greedy, up to ``--max-tokens`` each. Speculation must pay here: on / off >= 1.5.

Output tok/s (medians over ``--rounds``), their ratio, and the draft tokens the n-gram server
verified during the row with their acceptance (``/metrics``); the verdict
(``tokenmill.bench.verdicts.speculation_verdict``) is printed and sets the exit status (1 on
a failed row). ``--fixed-k`` drafts whenever a match exists, as a non-adaptive engine would.

Timing (2-core Xeon with AMX, bf16, others' tests running): about 8 minutes with the
defaults, two server starts included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from machine import machine  # noqa: E402  (benchmarks/machine.py)
from peers import TokenmillPeer, start_peer  # noqa: E402  (benchmarks/peers/peers.py)

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.verdicts import speculation_verdict  # noqa: E402

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
    ngram = excerpt("tokenmill/speculative/ngram.py", "class NgramProposer")
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

def bench(url: str, out_file: Path, concurrency: int, workload: list[str]) -> dict:
    """One ``tokenmill bench serve`` run; its summary (output_throughput, ...)."""
    subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url,
                    "--model", MODEL, *workload, "--max-concurrency", str(concurrency),
                    "--result-file", str(out_file), "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(out_file.read_text())


def queue_workload(concurrency: int, temperature: float, args) -> list[str]:
    """Random 128/128 (EOS ignored), ``--prompts-per-concurrency`` times C requests."""
    n = max(1, round(args.prompts_per_concurrency * concurrency))
    return ["--workload", "random", "--input-len", "128", "--output-len", "128", "--ignore-eos",
            "--num-prompts", str(n), "--temperature", str(temperature)]


def grounded_workload(concurrency: int, args, folder: Path) -> list[str]:
    """The grounded tasks as chat requests, cycled to ``--grounded-per-concurrency`` times C
    (at least one of each), greedy, ``--max-tokens`` each, ending where the model ends."""
    tasks = grounded_tasks()
    n = max(len(tasks), args.grounded_per_concurrency * concurrency)
    path = folder / f"grounded-{n}.jsonl"
    path.write_text("".join(json.dumps({"messages": tasks[i % len(tasks)],
                                        "output_len": args.max_tokens}) + "\n"
                            for i in range(n)))
    return ["--endpoint", "chat", "--workload", "file", "--dataset", str(path),
            "--temperature", "0"]


def gauges(url: str) -> dict[str, float]:
    """The server's draft and accepted token totals (0 without speculation) and its waiting
    requests, from ``/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    names = {"drafts": "spec_decode_num_draft_tokens_total",
             "accepted": "spec_decode_num_accepted_tokens_total",
             "waiting": "num_requests_waiting"}
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for key, name in names.items():
            if line.startswith(f"tokenmill:{name}"):
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


class QueueWatch:
    """The most requests seen waiting in the server's queue while the block runs (polled)."""

    def __init__(self, url: str, every: float = 0.5) -> None:
        self.url, self.every, self.peak = url, every, 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.wait(self.every):
            try:
                self.peak = max(self.peak, gauges(self.url)["waiting"])
            except OSError:
                pass

    def __enter__(self) -> QueueWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


Case = tuple[str, int, float]  # workload (queue | grounded), concurrency, temperature


def measure(server, case: Case, args, tmp: Path, tag: str) -> dict:
    """Output tok/s of one case on one server, with the drafts it verified meanwhile and the
    longest queue seen."""
    workload, c, temperature = case
    argv = queue_workload(c, temperature, args) if workload == "queue" \
        else grounded_workload(c, args, tmp)
    before = gauges(server.url)
    with QueueWatch(server.url) as watch:
        res = bench(server.url, tmp / f"{tag}.json", c, argv)
    after = gauges(server.url)
    return {"tok_s": res["output_throughput"], "completed": res["completed"],
            "drafts": after["drafts"] - before["drafts"],
            "accepted": after["accepted"] - before["accepted"], "peak_waiting": watch.peak}


def serve_row(case: Case, runs: dict[str, list[dict]]) -> dict:
    off = statistics.median(r["tok_s"] for r in runs["off"])
    on = statistics.median(r["tok_s"] for r in runs["ngram"])
    drafts = sum(r["drafts"] for r in runs["ngram"])
    accepted = sum(r["accepted"] for r in runs["ngram"])
    return {"workload": case[0], "concurrency": case[1], "temperature": case[2],
            "off_tok_s": round(off, 1), "ngram_tok_s": round(on, 1), "ratio": round(on / off, 3),
            "off_runs": [round(r["tok_s"], 1) for r in runs["off"]],
            "ngram_runs": [round(r["tok_s"], 1) for r in runs["ngram"]],
            "ngram_draft_tokens": int(drafts),
            "ngram_acceptance": round(accepted / drafts, 3) if drafts else None,
            "peak_waiting": max(r["peak_waiting"] for rs in runs.values() for r in rs)}


def run_serve(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-spec-"))
    seats = ("--max-num-seqs", str(args.max_num_seqs))
    ngram = ("--speculative-method", "ngram", "--num-speculative-tokens", str(args.k),
             *(("--no-speculative-adaptive",) if args.fixed_k else ()))
    # the servers compare.py runs for tokenmill (same KV budget and context), one with n-gram
    peers = {"off": TokenmillPeer("tokenmill", args.dtype, extra=seats),
             "ngram": TokenmillPeer("tokenmill-ngram", args.dtype, extra=(*seats, *ngram))}
    cases: list[Case] = [("queue", c, t) for t in args.temperature for c in args.concurrency]
    cases += [("grounded", c, 0.0) for c in args.grounded_concurrency]
    runs: dict[Case, dict[str, list[dict]]] = {c: {"off": [], "ngram": []} for c in cases}
    servers = {}
    try:
        for i, (name, peer) in enumerate(peers.items()):
            servers[name] = start_peer(peer, tmp, args.base_port + i, tmp / "logs")
        for r in range(args.rounds):
            for case in cases:
                for name in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                    tag = f"{name}-{'-'.join(map(str, case))}-{r}"
                    got = measure(servers[name], case, args, tmp, tag)
                    runs[case][name].append(got)
                    print(name, *case, round(got["tok_s"], 1), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    rows = [serve_row(case, runs[case]) for case in cases]
    for row in rows:
        print(json.dumps(row), flush=True)
    verdict = speculation_verdict(rows)
    print("verdict:", "PASS" if verdict["passed"] else "FAIL: " + "; ".join(verdict["problems"]))
    return {"mode": "serve", "machine": machine(), "dtype": args.dtype, "k": args.k,
            "adaptive": not args.fixed_k, "max_num_seqs": args.max_num_seqs,
            "queue_workload": f"random 128/128, ignore_eos, "
                              f"{args.prompts_per_concurrency:g} x C requests",
            "grounded_workload": f"{len(grounded_tasks())} chat tasks cycled, greedy, "
                                 f"max_tokens {args.max_tokens}, "
                                 f"{args.grounded_per_concurrency} x C requests",
            "rounds": args.rounds, "rows": rows, "verdict": verdict}


def main() -> int:
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
    ap.add_argument("--rounds", type=int, default=None,
                    help="methods alternate for this many rounds (grounded 3, serve 1)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[64, 128],
                    help="serve: concurrencies of the queue rows")
    ap.add_argument("--max-num-seqs", type=int, default=32,
                    help="serve: the servers' seats, below the queue rows' concurrency so "
                         "requests wait")
    ap.add_argument("--prompts-per-concurrency", type=float, default=1.0,
                    help="serve: queue rows send this many times C requests")
    ap.add_argument("--grounded-concurrency", type=int, nargs="*", default=[1, 2, 4, 8],
                    help="serve: concurrencies of the grounded rows")
    ap.add_argument("--grounded-per-concurrency", type=int, default=2,
                    help="serve: grounded rows send this many times C requests (at least "
                         "one per task)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0],
                    help="serve: of the queue rows' requests (a row per temperature)")
    ap.add_argument("--base-port", type=int, default=8100, help="serve: ports from here")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 3 if args.mode == "grounded" else 1
    result = run_grounded(args) if args.mode == "grounded" else run_serve(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if result.get("verdict", {}).get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
