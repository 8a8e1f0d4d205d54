"""The GPU figures: single stream, offline throughput, host time per step, and the server.

    python3 benchmarks/gpu.py                                   # every part, bf16
    python3 benchmarks/gpu.py --parts single,offline --quantization fp8 --kv-cache-dtype fp8
    python3 benchmarks/gpu.py --enforce-eager --parts single,steps   # without CUDA graphs

SmolLM2-135M (the default model), 128 prompt tokens of random ids and 128 output tokens with EOS
ignored, greedy. Parts:

- ``single``: one request alone, TTFT and TPOT (median of 5 runs) and tok/s;
- ``offline``: ``--offline`` requests at once through ``LLM.generate`` (max_num_seqs = the
  count): output tok/s;
- ``steps``: decode steps of ``--step-batches`` sequences run by the ModelRunner directly: the
  host's time to build the inputs and launch the step, against the step's time on the GPU;
- ``serve``: ``tokenmill serve`` on this GPU and ``tokenmill bench serve`` at ``--serve``
  concurrencies (random workload, 2 x concurrency prompts, at least 16);
- ``quality``: greedy agreement on the 16 prompts of tests/test_engine_real.py (24 tokens each,
  identical tokens position by position) of the GPU with graphs, without (``--enforce-eager``),
  with fp8 weights and with an fp8 KV cache, against the CPU's float32 reference and against
  the GPU's own bf16 run; and the perplexity of each on the shipped text.

Prints one JSON object (and writes it to ``--out`` if given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

MODEL = "smollm2-135m-instruct"


def engine_options(args) -> dict:
    return dict(device=args.device, dtype=args.dtype, quantization=args.quantization,
                kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def single(args) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=8, **engine_options(args))
    vocab = llm.engine.info.vocab_size
    ttft, total = [], []
    for i in range(6):  # the first is a warm-up
        p = prompts(1, args.input_len, vocab, 100 + i)
        t0 = time.perf_counter()
        llm.generate(p, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                     use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(p, SamplingParams(temperature=0, max_tokens=args.output_len,
                                       ignore_eos=True), use_tqdm=False)
        t2 = time.perf_counter()
        if i:
            ttft.append(t1 - t0)
            total.append(t2 - t1)
    tpot = statistics.median((t - f) / (args.output_len - 1) for t, f in zip(total, ttft))
    return {"ttft_ms": round(statistics.median(ttft) * 1e3, 2), "tpot_ms": round(tpot * 1e3, 3),
            "tokens_per_s": round(1 / tpot, 1), "engine": engine_facts(llm)}


def offline(args, n: int) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=n, max_num_batched_tokens=max(8192, args.input_len * 8),
              **engine_options(args))
    vocab = llm.engine.info.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts(min(n, 8), args.input_len, vocab, 1), params, use_tqdm=False)
    batch = prompts(n, args.input_len, vocab, 2)
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after.num_steps - before.num_steps
    return {"requests": n, "elapsed_s": round(elapsed, 2), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / elapsed, 1), "steps": steps,
            "ms_per_step": round(elapsed / steps * 1e3, 3),
            "preemptions": llm.engine.num_preemptions}


def steps(args, batch: int) -> dict:
    """Host time (inputs + launch, until the call returns) and GPU time per decode step."""
    from tokenmill import LLM
    from tokenmill.runner.batch import Chunk

    llm = LLM(args.model, max_num_seqs=max(batch, 8), **engine_options(args))
    runner = llm.engine.executor.worker
    ctx = args.input_len
    per_seq = -(-(ctx + 64) // runner.block_size)
    chunks = [Chunk([7], ctx, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
              for i in range(batch)]
    if 1 + batch * per_seq > runner.num_blocks:
        raise SystemExit(f"{batch} sequences of {ctx} tokens need more KV blocks")
    host, gpu = [], []
    for i in range(30):
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
            enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start_ev.record()
        logits = runner.forward(chunks)
        end_ev.record()
        t1 = time.perf_counter()
        logits.argmax(-1).tolist()  # the readback a step does
        if i >= 5:
            host.append(t1 - t0)
            gpu.append(start_ev.elapsed_time(end_ev) / 1e3)
        for c in chunks:
            c.start_pos += 1
    return {"batch": batch, "host_ms": round(statistics.median(host) * 1e3, 3),
            "gpu_ms": round(statistics.median(gpu) * 1e3, 3),
            "graphs": runner.graphs is not None}


def serve(args, concurrencies: list[int]) -> list[dict]:
    from compare import bench_args  # benchmarks/compare.py

    from tokenmill.bench import main as bench

    port = args.port
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", args.model, "--port", str(port),
           "--device", args.device, "--dtype", args.dtype, "--quantization", args.quantization,
           "--kv-cache-dtype", args.kv_cache_dtype,
           "--max-num-seqs", str(max(concurrencies))]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    proc = subprocess.Popen(cmd, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"tokenmill serve did not start (exit {proc.poll()})")
                time.sleep(1)
        results = []
        for c in concurrencies:
            settings = dict(workload="random", input_len=args.input_len,
                            output_len=args.output_len, num_prompts=max(16, 2 * c))
            a = bench_args(settings, url, seed=c)
            a.model = a.tokenizer = args.model
            tok = bench._tokenizer(a)
            reqs = bench.build_workload(a, tok)
            s = asyncio.run(bench.run_once(a, reqs, tok, c, float("inf")))
            results.append({"concurrency": c, "output_tokens_per_s": s["output_throughput"],
                            "ttft_p99_ms": s["ttft"]["p99_ms"],
                            "tpot_median_ms": s["tpot"]["median_ms"],
                            "completed": s["completed"], "failed": s["failed"]})
            print(json.dumps(results[-1]), flush=True)
        return results
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def quality(args) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, for tests/
    from tests.test_engine_real import PROMPTS
    from tokenmill import LLM, SamplingParams
    from tokenmill.eval.perplexity import perplexity

    params = SamplingParams(temperature=0, max_tokens=24)
    gpu = dict(device=args.device, dtype=args.dtype)
    settings = {"cpu float32": dict(device="cpu", dtype="float32"),
                "gpu": gpu, "gpu eager": dict(gpu, enforce_eager=True),
                "gpu fp8 weights": dict(gpu, quantization="fp8"),
                "gpu fp8 KV": dict(gpu, kv_cache_dtype="fp8")}
    outs, ppl = {}, {}
    for name, opts in settings.items():
        llm = LLM(args.model, kv_cache_memory=256 << 20, **opts)
        outs[name] = [o.outputs[0].token_ids for o in
                      llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
        ppl[name] = round(perplexity(args.model, **opts).perplexity, 4)

    def agree(a: str, b: str) -> float:
        pairs = [(x, y) for p, q in zip(outs[a], outs[b]) for x, y in zip(p, q)]
        return round(sum(x == y for x, y in pairs) / len(pairs), 4)

    return {"perplexity": ppl,
            "agreement_with_cpu_float32": {n: agree(n, "cpu float32") for n in settings},
            "agreement_with_gpu": {n: agree(n, "gpu") for n in settings}}


def engine_facts(llm) -> dict:
    info = llm.engine.info
    return {"dtype": info.dtype, "attention_backend": info.attention_backend,
            "weights": info.quantization, "kv_cache_dtype": info.kv_cache_dtype,
            "cuda_graphs": info.cuda_graphs, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL,
                    help="a known name, a .gguf file or a Hugging Face directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--parts", default="single,steps,offline,serve,quality")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--offline", default="32,256,1024")
    ap.add_argument("--step-batches", default="1,64,256")
    ap.add_argument("--serve", default="1,64,256")
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    parts = args.parts.split(",")
    result: dict = {"settings": {k: v for k, v in vars(args).items() if k != "out"}}
    if "single" in parts:
        result["single"] = single(args)
        print(json.dumps(result["single"]), flush=True)
    if "steps" in parts:
        result["steps"] = [steps(args, b) for b in ints(args.step_batches)]
        print(json.dumps(result["steps"]), flush=True)
    if "offline" in parts:
        result["offline"] = []
        for n in ints(args.offline):
            result["offline"].append(offline(args, n))
            print(json.dumps(result["offline"][-1]), flush=True)
    if "serve" in parts:
        result["serve"] = serve(args, ints(args.serve))
    if "quality" in parts:
        result["quality"] = quality(args)
        print(json.dumps(result["quality"]), flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
