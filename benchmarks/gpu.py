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
- ``kernels``: the kernels one eager decode step launches (torch.profiler), in all and per
  decoder layer, and each per-layer kernel's name and launches per layer;
- ``serve``: ``tokenmill serve`` on this GPU and ``tokenmill bench serve`` at ``--serve``
  concurrencies (random workload, 2 x concurrency prompts, at least 16);
- ``quality``: greedy agreement on the 16 prompts of tests/test_engine_real.py (24 tokens each,
  identical tokens position by position) of the GPU with graphs, without (``--enforce-eager``),
  with fp8 weights and with an fp8 KV cache, against the CPU's float32 reference and against
  the GPU's own bf16 run; each differing prompt's first divergence and the reference's margin
  between its two best logits there; and the perplexity of each on the shipped text;
- ``cpu-reference``: that reference alone, written to ``--cpu-reference`` (take it on a CPU
  machine, then pass the file to the GPU's ``quality`` run).

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
                kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
                async_scheduling=args.async_scheduling)


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


def offline(args, n: int, profiler=None) -> dict:
    """Output tok/s of ``n`` requests at once; with ``profiler`` (a ``cProfile.Profile``) the
    timed run is profiled."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=n, max_num_batched_tokens=max(8192, args.input_len * 8),
              **engine_options(args))
    vocab = llm.engine.info.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts(min(n, 8), args.input_len, vocab, 1), params, use_tqdm=False)
    batch = prompts(n, args.input_len, vocab, 2)
    before = llm.engine.stats()
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outs = llm.generate(batch, params, use_tqdm=False)
    if profiler is not None:
        profiler.disable()
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


def kernels(args, batch: int) -> dict:
    """Kernels of one eager decode step of ``batch`` sequences: their count, the count per
    decoder layer, and each per-layer kernel's launches per layer."""
    from torch.profiler import ProfilerActivity, profile

    from tokenmill import LLM
    from tokenmill.runner.batch import Chunk

    llm = LLM(args.model, max_num_seqs=max(batch, 8), **dict(engine_options(args),
                                                             enforce_eager=True))
    runner = llm.engine.executor.worker
    layers = len(runner.model.model.layers)
    per_seq = -(-(args.input_len + 8) // runner.block_size)
    chunks = [Chunk([7], args.input_len, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
              for i in range(batch)]
    cuda = runner.device.type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    for _ in range(3):  # compiles, autotunes
        runner.forward(chunks)
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[activity]) as prof:
        runner.forward(chunks)
        if cuda:
            torch.cuda.synchronize()
    names = [e.name for e in prof.events()
             if (e.device_type.name == "CUDA") == cuda and (cuda or e.cpu_parent is None)]
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    # a kernel launched k times a layer appears k * layers times (or more, never fewer)
    per_layer = sum(c // layers for c in counts.values())
    per_name = {n[:100]: c // layers for n, c in counts.items() if c >= layers}
    return {"batch": batch, "kernels_per_step": len(names), "kernels_per_layer": per_layer,
            "layers": layers, "layer_kernels": per_name}


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
    if args.async_scheduling:
        cmd.append("--async-scheduling")
    if args.engine_process:
        cmd.append("--engine-process")
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


def greedy_run(model: str, opts: dict) -> tuple[list[list[int]], list[list[int]]]:
    """The 16 prompts' prompt ids and 24 greedy tokens under ``opts``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, for tests/
    from tests.test_engine_real import PROMPTS
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory=256 << 20, **opts)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def cpu_reference(args) -> dict:
    """The CPU float32 reference: greedy tokens, the margin between the two best logits at
    each of their positions (teacher-forced), and perplexity; written to ``--cpu-reference``."""
    from tokenmill import LLM
    from tokenmill.eval.perplexity import perplexity
    from tokenmill.runner.batch import Chunk

    opts = dict(device="cpu", dtype="float32")
    prompts, outs = greedy_run(args.model, opts)
    runner = LLM(args.model, kv_cache_memory=256 << 20, **opts).engine.executor.worker
    margins = []
    for ids, out in zip(prompts, outs):
        seq = ids + out[:-1]
        table = list(range(1, 2 + len(seq) // runner.block_size))
        logits = runner.forward([Chunk(seq, 0, table, num_logits=len(seq))])[len(ids) - 1:]
        top2 = logits.topk(2, dim=-1).values  # (len(out), 2)
        margins.append([round(float(m), 4) for m in top2[:, 0] - top2[:, 1]])
    ref = {"outputs": outs, "margins": margins,
           "perplexity": round(perplexity(args.model, **opts).perplexity, 4)}
    if args.cpu_reference:
        args.cpu_reference.write_text(json.dumps(ref))
    return ref


def quality(args) -> dict:
    """Greedy tokens and perplexity of each GPU setting against the CPU float32 reference
    (read from ``--cpu-reference`` where given: the GPU machine need not build the CPU
    kernels); per prompt that differs, the first position that does and the reference's
    margin between its two best logits there (a near-tie that bf16 may flip)."""
    from tokenmill.eval.perplexity import perplexity

    if args.cpu_reference and args.cpu_reference.exists():
        ref = json.loads(args.cpu_reference.read_text())
    else:
        ref = cpu_reference(args)
    gpu = dict(device=args.device, dtype=args.dtype)
    settings = {"gpu": gpu, "gpu eager": dict(gpu, enforce_eager=True),
                "gpu fp8 weights": dict(gpu, quantization="fp8"),
                "gpu fp8 KV": dict(gpu, kv_cache_dtype="fp8")}
    outs, ppl = {"cpu float32": ref["outputs"]}, {"cpu float32": ref["perplexity"]}
    for name, opts in settings.items():
        outs[name] = greedy_run(args.model, opts)[1]
        ppl[name] = round(perplexity(args.model, **opts).perplexity, 4)

    def agree(a: str, b: str) -> float:
        pairs = [(x, y) for p, q in zip(outs[a], outs[b]) for x, y in zip(p, q)]
        return round(sum(x == y for x, y in pairs) / len(pairs), 4)

    def divergences(name: str) -> list[dict]:
        found = []
        for i, (p, q) in enumerate(zip(outs[name], ref["outputs"])):
            at = next((j for j, (x, y) in enumerate(zip(p, q)) if x != y), None)
            if at is not None:
                found.append({"prompt": i, "position": at,
                              "reference_margin": ref["margins"][i][at]})
        return found

    return {"perplexity": ppl,
            "agreement_with_cpu_float32": {n: agree(n, "cpu float32") for n in outs},
            "agreement_with_gpu": {n: agree(n, "gpu") for n in outs},
            "identical_prompts": {n: 16 - len(divergences(n)) for n in outs},
            "first_divergences": {n: divergences(n) for n in settings}}


def profile_offline(args, n: int) -> dict:
    """Where the host's time goes in an offline run of ``n`` requests: the functions with the
    most own time (cProfile; the figures run slower than unprofiled ones)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    run = offline(args, n, profiler=prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    return {"requests": n, "profiled_run": run, "tottime_top40": buf.getvalue()}


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
    ap.add_argument("--async-scheduling", action="store_true",
                    help="overlap the host's work with the step in flight (engine/overlap.py)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the serve part runs the engine core in its own process")
    ap.add_argument("--parts", default="single,kernels,steps,offline,serve,quality")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--offline", default="32,256,1024")
    ap.add_argument("--step-batches", default="1,64,256")
    ap.add_argument("--serve", default="1,64,256")
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("--cpu-reference", type=Path,
                    help="the CPU float32 reference of the quality part: read where it "
                         "exists, else computed and written there (--parts cpu-reference)")
    ap.add_argument("--gemm-rows", type=int,
                    help="batches of up to this many tokens take the GEMM-fused kernels "
                         "(kernels/triton_fused.py GEMM_ROWS; 0: none); the parts run in this "
                         "process only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.gemm_rows is not None:
        from tokenmill.kernels import triton_fused

        triton_fused.GEMM_ROWS = args.gemm_rows
    parts = args.parts.split(",")
    result: dict = {"settings": {k: str(v) if isinstance(v, Path) else v
                                 for k, v in vars(args).items() if k != "out"}}
    if "single" in parts:
        result["single"] = single(args)
        print(json.dumps(result["single"]), flush=True)
    if "steps" in parts:
        result["steps"] = [steps(args, b) for b in ints(args.step_batches)]
        print(json.dumps(result["steps"]), flush=True)
    if "kernels" in parts:
        result["kernels"] = [kernels(args, b) for b in (1, 64)]
        print(json.dumps(result["kernels"]), flush=True)
    if "offline" in parts:
        result["offline"] = []
        for n in ints(args.offline):
            result["offline"].append(offline(args, n))
            print(json.dumps(result["offline"][-1]), flush=True)
    if "profile" in parts:  # the largest --offline size, profiled
        result["profile"] = profile_offline(args, max(ints(args.offline)))
        print(result["profile"]["tottime_top40"], flush=True)
    if "serve" in parts:
        result["serve"] = serve(args, ints(args.serve))
    if "cpu-reference" in parts:
        result["cpu_reference"] = cpu_reference(args)
    if "quality" in parts:
        result["quality"] = quality(args)
        print(json.dumps(result["quality"]), flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
