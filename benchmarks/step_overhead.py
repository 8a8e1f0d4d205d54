"""Host time of one engine step around the model: scheduler, batch building, sampling, outputs.

    python benchmarks/step_overhead.py [MODEL] --num-seqs 32 --steps 60 --sampling mixed

Runs ``--num-seqs`` requests to steady decode (every step then holds one token of each), times
``--steps`` steps, and splits each into the model's forward (the ``nn.Module`` call, timed by a
wrapper) and everything else the engine does on the host: ``schedule()`` and
``update_from_output()`` (the scheduler's own clock), and the rest (flat batch, logits
processing and sampling, detokenization, stop strings, outputs). Prints one JSON object with
medians in milliseconds, the CPU model and its instruction set.

``--sampling greedy`` gives every request temperature 0; ``mixed`` makes half of them sample
with temperature 0.8 / top-p 0.95 / top-k 50, a quarter of those with a repetition penalty
and a seed, which is what a server sees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from machine import machine  # benchmarks/machine.py


class TimedModule:
    """Stands in for the runner's model: forwards every call and adds up the time spent."""

    def __init__(self, model) -> None:
        self.model = model
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        result = self.model(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return result

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def request_params(i: int, sampling: str, max_tokens: int):
    from tokenmill import SamplingParams

    if sampling == "greedy" or i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    extra = {"repetition_penalty": 1.1, "seed": i} if i % 4 == 1 else {}
    return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=max_tokens,
                          ignore_eos=True, **extra)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sampling", choices=["greedy", "mixed"], default="mixed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="the layer-by-layer path instead of the fused CPU step")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    args = ap.parse_args()

    import torch

    from tokenmill import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, num_blocks=1024,
              max_num_seqs=max(64, args.num_seqs), enforce_eager=args.enforce_eager,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    engine = llm.engine
    runner = engine.executor.worker
    timed = TimedModule(runner.model)
    runner.model = timed
    # engine.info is the new engine surface; model_config the old one (for a before/after run).
    vocab = engine.info.vocab_size if hasattr(engine, "info") else engine.model_config.vocab_size
    max_tokens = args.steps + 8
    for i in range(args.num_seqs):
        prompt = [(97 * i + 13 * k) % (vocab - 200) + 100 for k in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, request_params(i, args.sampling, max_tokens))
    while any(len(o.outputs[0].token_ids) < 2 for o in engine.step()):  # prefill, first tokens
        pass
    for _ in range(3):  # warm-up decode steps
        engine.step()

    totals, forwards, scheds = [], [], []
    for _ in range(args.steps):
        fwd0, sched0 = timed.seconds, engine.scheduler.stats().overhead_seconds_total
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
        forwards.append(timed.seconds - fwd0)
        scheds.append(engine.scheduler.stats().overhead_seconds_total - sched0)
    for i in range(args.num_seqs):
        engine.abort_request(f"r{i}")

    def ms(values: list[float]) -> float:
        return round(1000 * statistics.median(values), 3)

    host = [t - f for t, f in zip(totals, forwards)]
    result = {
        **machine(), "threads": torch.get_num_threads(), "model": args.model,
        "dtype": runner.config.dtype, "cpu_step": getattr(engine.info, "cpu_step", None),
        "kv_cache_dtype": getattr(engine.info, "kv_cache_dtype", None),
        "weights": getattr(engine.info, "quantization", None),
        "num_seqs": args.num_seqs,
        "sampling": args.sampling, "steps": args.steps,
        "step_ms": ms(totals), "forward_ms": ms(forwards),
        "host_ms": ms(host), "scheduler_ms": ms(scheds),
        "rest_of_host_ms": ms([h - s for h, s in zip(host, scheds)]),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
