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

``--tiny VOCAB`` runs a one-layer, 64-wide random Llama with a VOCAB-token head and the default
model's tokenizer instead of MODEL (built in a temporary directory): its forward and sampling
cost next to nothing, so what is left is the engine's Python per sequence per step, the host
cost a GPU run pays at large batches (a small VOCAB, e.g. 512, keeps the CPU's argmax out of
it). ``--profile N`` prints cProfile's top N functions (by own time) over the timed steps.

Besides wall-clock medians: ``host_cpu_ms``, the host part in this thread's CPU time (steadier on
a shared machine), and ``gc_ms_mean``, the cyclic garbage collector's time per step on average
(a median hides its full collections; throughput pays them). ``--gc-freeze`` calls
``gc.freeze()`` once the engine is built, so full collections skip the startup's objects.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from machine import machine  # benchmarks/machine.py


class TimedModule:
    """Stands in for the runner's model: forwards every call and adds up the time spent."""

    def __init__(self, model) -> None:
        self.model = model
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # this thread's CPU time: steadier than wall time on a busy host

    def __call__(self, *args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        result = self.model(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - cpu
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


class GCTimer:
    """Adds up the time Python's cyclic garbage collector runs (part of the host time)."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def tiny_model(out: Path, vocab: int) -> Path:
    """A one-layer Llama of width 64 with a ``vocab``-row head and the default tokenizer."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.config import DEFAULT_MODEL
    from tokenmill.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    hidden, inter, g = 64, 128, torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden),
              "self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (32, hidden),
              "self_attn.v_proj.weight": (32, hidden), "self_attn.o_proj.weight": (hidden, hidden),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter)}
    tensors = {k if k.startswith("model.") else "model.layers.0." + k:
               torch.randn(*v, generator=g) * 0.02 for k, v in shapes.items()}
    for k in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
              "model.layers.0.post_attention_layernorm.weight"):
        tensors[k] = torch.ones(hidden)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "torch_dtype": "float32", "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id}))
    (out / "tokenizer.json").write_text(tok.backend.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token}))
    return out


def parse_args() -> argparse.Namespace:
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
    ap.add_argument("--tiny", type=int, default=0, metavar="VOCAB",
                    help="a tiny random model with this vocabulary instead of MODEL")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print cProfile's top N functions over the timed steps")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() once the engine is built: full collections skip startup's "
                         "objects")
    return ap.parse_args()


def start_decoding(engine, args: argparse.Namespace) -> None:
    """Every request prefilled and decoding, a few decode steps run."""
    # engine.info is the new engine surface; model_config the old one (for a before/after run).
    vocab = engine.info.vocab_size if hasattr(engine, "info") else engine.model_config.vocab_size
    for i in range(args.num_seqs):
        prompt = [(97 * i + 13 * k) % (vocab - 200) + 100 for k in range(args.prompt_len)]
        # Large batches take many steps to prefill, so no sequence may end before the timing
        # does: all are aborted after it.
        engine.add_request(f"r{i}", prompt, request_params(i, args.sampling, 2048))
    scheduler = engine.scheduler
    while scheduler.num_waiting or any(r.num_output_tokens < 2 for r in scheduler.running):
        engine.step()  # prefill, first tokens
    for _ in range(3):  # warm-up decode steps
        engine.step()


def time_steps(engine, timed: TimedModule, steps: int, profile: int) -> dict[str, list[float]]:
    """Per timed step, in seconds: the whole step, the forward, the scheduler's part, the host
    part in CPU time and the garbage collector's time."""
    times: dict[str, list[float]] = {k: [] for k in ("total", "forward", "sched", "host_cpu",
                                                     "gc")}
    gc_timer = GCTimer()
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        fwd0, sched0 = timed.seconds, engine.scheduler.stats().overhead_seconds_total
        fwd_cpu0, cpu0, gc0 = timed.cpu_seconds, time.thread_time(), gc_timer.seconds
        start = time.perf_counter()
        engine.step()
        times["total"].append(time.perf_counter() - start)
        times["host_cpu"].append(time.thread_time() - cpu0 - (timed.cpu_seconds - fwd_cpu0))
        times["gc"].append(gc_timer.seconds - gc0)
        times["forward"].append(timed.seconds - fwd0)
        times["sched"].append(engine.scheduler.stats().overhead_seconds_total - sched0)
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
        print(text.getvalue())
    return times


def main() -> None:
    args = parse_args()
    if args.tiny:
        args.model = str(tiny_model(Path(tempfile.mkdtemp()) / "tiny", args.tiny))

    import torch

    from tokenmill import LLM

    # The KV of prefill, warm-up and timed steps fits: no preemption.
    num_blocks = max(1024, args.num_seqs * ((args.prompt_len + args.steps + 200) // 16 + 2))
    llm = LLM(args.model, device=args.device, dtype=args.dtype, num_blocks=num_blocks,
              max_num_seqs=max(64, args.num_seqs), enforce_eager=args.enforce_eager,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    engine = llm.engine
    if args.gc_freeze:
        gc.freeze()
    runner = engine.executor.worker
    timed = TimedModule(runner.model)
    runner.model = timed
    start_decoding(engine, args)
    t = time_steps(engine, timed, args.steps, args.profile)
    last_seqs = engine.scheduler.stats().last_num_scheduled
    for i in range(args.num_seqs):
        engine.abort_request(f"r{i}")

    def ms(values: list[float]) -> float:
        return round(1000 * statistics.median(values), 3)

    host = [a - f for a, f in zip(t["total"], t["forward"])]
    result = {
        **machine(), "threads": torch.get_num_threads(), "model": args.model,
        "dtype": runner.config.dtype, "cpu_step": getattr(engine.info, "cpu_step", None),
        "kv_cache_dtype": getattr(engine.info, "kv_cache_dtype", None),
        "weights": getattr(engine.info, "quantization", None),
        "num_seqs": args.num_seqs, "last_step_seqs": last_seqs,
        "sampling": args.sampling, "steps": args.steps,
        "step_ms": ms(t["total"]), "forward_ms": ms(t["forward"]),
        "host_ms": ms(host), "host_cpu_ms": ms(t["host_cpu"]), "scheduler_ms": ms(t["sched"]),
        "gc_ms_mean": round(1000 * statistics.mean(t["gc"]), 3),
        "rest_of_host_ms": ms([h - s for h, s in zip(host, t["sched"])]),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
