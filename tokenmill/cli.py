"""The ``tokenmill`` command: ``generate``, ``chat``, ``serve``, ``plan``, ``bench``, ``router``
and ``eval``.

The only place that reads the environment and turns user input into config objects.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from tokenmill.config import DEFAULT_MODEL, EngineConfig, KVEventsConfig
from tokenmill.errors import TokenmillError
from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.tools.parsers import TOOL_PARSERS

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_kv_cache_memory(text: str) -> tuple[int | None, int | None]:
    """``"4GiB"``, ``"512MB"``, ``"1000000"`` (bytes) or ``"2048blocks"`` -> (bytes, blocks)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m and unit in ("block", "blocks"):
        return None, int(float(m.group(1)))
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid KV cache size {text!r}: use bytes (e.g. 4GiB, 512MB, 1000000) or blocks "
            "(e.g. 2048blocks)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit]), None


def _size(text: str, flag: str) -> int:
    """A byte size (``8GiB``) for flags that take no block counts."""
    size, _ = parse_kv_cache_memory(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"{flag} takes bytes (e.g. 8GiB), not blocks")
    return size


# Engine flags: (flag, option of EngineConfig.from_options, argparse keywords). Every default
# is the config dataclasses' own (shown in --help); a flag left out is not passed on at all.
def _int_tuple(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in value.split(","))


def _kv_events_config(value: str) -> KVEventsConfig:
    """JSON -> ``KVEventsConfig``; a bad key or value is a usage error naming it."""
    try:
        return KVEventsConfig.from_json(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_ENGINE_FLAGS: list[tuple[str, str, dict]] = [
    ("--device", "device", dict(help="cpu or cuda")),
    ("--dtype", "dtype", dict(choices=["auto", "float32", "bfloat16", "float16"],
                              help="compute dtype; auto: bfloat16 where the CPU (AMX, "
                                   "AVX512-BF16) or GPU multiplies it natively, else float32")),
    ("--attention-backend", "attention_backend", dict(
        choices=["auto", "cpu", "triton", "torch"],
        help="cpu: compiled kernels reading K/V in place; triton: Triton kernels (GPU); torch: "
             "the reference; auto: cpu on a CPU where it builds, triton on a GPU")),
    ("--quantization", "quantization", dict(
        choices=["none", "auto", "int8", "int4", "fp8"],
        help="linear weights: none (the compute dtype's values; a float32 model on the CPU "
             "kernels keeps a GGUF's blocks in their bits and widens them in its GEMM, the same "
             "sums), int8 (per-channel scales), int4 (groups of 32); auto: a quantized GGUF "
             "keeps its own Q8_0/Q4_0/Q4_1 blocks, others none. On the CPU kernels these three "
             "multiply x rounded to int8 (llama.cpp's arithmetic: faster; for a float32 model "
             "in groups of 32, +0.3%% perplexity on the default model). fp8: e4m3 weights and "
             "activations (Hopper GPUs)")),
    ("--kv-cache-dtype", "kv_cache_dtype", dict(
        choices=["auto", "bfloat16", "int8", "fp8"],
        help="KV cache storage: auto (the compute dtype, but bfloat16 under float32 weights "
             "that --dtype auto chose on a CPU); bfloat16 (half a float32 cache's bytes, for "
             "a float32 model); int8 or fp8 (e4m3, GPUs), with a scale per token and head: "
             "about twice the tokens of bf16")),
    ("--task", "task", dict(choices=["generate", "embed", "score", "rerank"], help="what the "
                            "model serves (unset: its files say; rerank is score)")),
    ("--enforce-eager", "enforce_eager", dict(
        action="store_const", const=True,
        help="run every step layer by layer from Python: no CUDA graphs of the decode step "
             "on a GPU, no fused C++ decoder step on a CPU")),
    ("--async-scheduling", "async_scheduling", dict(action=argparse.BooleanOptionalAction, help=(
        "prepare and launch the next step while this step's text and outputs are built "
        "(default: on for one GPU worker, off on a CPU)"))),
    ("--batch-invariant", "batch_invariant", dict(action=argparse.BooleanOptionalAction, help=(
        "a request's tokens and logprobs bit for bit the same whatever else shares its batches "
        "and however its prompt is split: one kernel per linear at every row count (AMX tiles "
        "where the CPU has them), the shared-prefix attention pass resumed rather than merged "
        "(CPU kernels; refused where it cannot hold; default: on where it costs nothing "
        "measurable, off with oneDNN's AMX route and --quantization)"))),
    ("--num-threads", "num_threads", dict(
        type=int, help="CPU threads of the forward (unset: chosen from the usable cores)")),
    ("--kv-cache-memory", "kv_cache_memory", dict(
        type=parse_kv_cache_memory, help="KV cache size in bytes (4GiB, 512MB) or blocks "
                                         "(2048blocks); unset: derived from free memory")),
    ("--block-size", "block_size", dict(type=int, help="tokens per KV block")),
    ("--max-num-seqs", "max_num_seqs", dict(type=int, help="sequences running at once")),
    ("--max-num-batched-tokens", "max_num_batched_tokens", dict(
        type=int, help="token budget of one step")),
    ("--max-model-len", "max_model_len", dict(type=int, help="context length (unset: the "
                                                             "model's)")),
    ("--scheduling-policy", "policy", dict(
        choices=["fcfs", "priority", "lpm"],
        help="lpm: longest cached prefix first (falls back to fcfs past 128 waiting)")),
    ("--no-prefix-cache", "enable_prefix_caching", dict(
        action="store_const", const=False, help="turn off automatic prefix caching")),
    ("--no-jump-forward", "jump_forward", dict(
        action="store_const", const=False,
        help="structured output: decode grammar-forced text one token per step")),
    ("--speculative-method", "speculative_method", dict(
        choices=["ngram", "draft", "layerskip"],
        help="speculative decoding: ngram (prompt lookup), draft (a draft model, "
             "--speculative-model) or layerskip (the target's first layers draft); unset: off")),
    ("--num-speculative-tokens", "num_speculative_tokens", dict(
        type=int, help="speculative decoding: the most draft tokens per sequence and step")),
    ("--prompt-lookup-min", "prompt_lookup_min", dict(
        type=int, help="ngram speculation: shortest suffix to look up")),
    ("--prompt-lookup-max", "prompt_lookup_max", dict(
        type=int, help="ngram speculation: longest suffix to look up")),
    ("--speculative-model", "speculative_model", dict(
        help="draft speculation: the draft model (a .gguf file, a Hugging Face directory or "
             "a known name) sharing the target's vocabulary")),
    ("--speculative-draft-layers", "speculative_draft_layers", dict(
        type=int, help="layerskip speculation: layers that draft (unset: a quarter)")),
    ("--no-speculative-adaptive", "speculative_adaptive", dict(
        action="store_const", const=False,
        help="speculative decoding: always draft the full k (no choice by measured "
             "acceptance and cost)")),
    ("--tensor-parallel-size", "tensor_parallel_size", dict(
        type=int, help="split every layer over this many ranks (processes): heads, "
                       "intermediate features and vocabulary")),
    ("--pipeline-parallel-size", "pipeline_parallel_size", dict(
        type=int, help="split the layers into this many stages, each its own rank(s)")),
    ("--pp-layer-partition", "pp_layer_partition", dict(
        type=_int_tuple, help="decoder layers per pipeline stage, comma-separated, e.g. 16,14 "
                              "(unset: as even as possible)")),
    ("--distributed-executor-backend", "distributed_executor_backend", dict(
        choices=["mp", "ray"], help="mp: rank processes spawned here; ray: Ray actors on the "
                                    "Ray cluster (ray start --head / --address; pip install "
                                    "tokenmill[ray])")),
    ("--nnodes", "nnodes", dict(type=int, help="machines the ranks span; node 0 runs the "
                                               "server, the others --headless")),
    ("--node-rank", "node_rank", dict(type=int, help="this machine's index among --nnodes")),
    ("--master-addr", "master_addr", dict(help="node 0's address, which every node reaches")),
    ("--master-port", "master_port", dict(
        type=int, help="node 0's rendezvous port (a torch TCPStore); the control plane takes "
                       "the three ports after it")),
    ("--cpu-cores-per-rank", "cpu_cores_per_rank", dict(
        type=int, help="intra-op threads of each rank (unset: this node's cores shared "
                       "evenly)")),
    ("--cpu-bind", "cpu_bind", dict(
        type=lambda v: tuple(v.split("|")),
        help="per local rank the cores it runs on, '|'-separated, e.g. '0-7|8-15'")),
    ("--disable-custom-all-reduce", "disable_custom_all_reduce", dict(
        action="store_const", const=True,
        help="all-reduce through gloo even where every rank of a tensor-parallel group shares "
             "one host (the fused CPU step then runs layer by layer)")),
    ("--worker-timeout", "worker_timeout", dict(
        type=float, help="seconds without a rank's heartbeat before it counts as hung")),
    ("--seed", "seed", dict(type=int, help="seed the sampling of requests that give no seed "
                                           "of their own, reproducibly: the same requests in "
                                           "the same order sample the same text (in bf16 on "
                                           "a CPU, with a fixed --num-threads: the thread "
                                           "count changes bf16 sums) (unset: random)")),
    ("--kv-role", "kv_role", dict(
        choices=("producer", "consumer", "both"),
        help="prefill/decode disaggregation (vLLM's kv_transfer_params protocol): a producer "
             "prefills requests marked do_remote_decode and keeps their KV blocks for a "
             "consumer to pull; a consumer pulls the blocks a request's kv_transfer_params "
             "names instead of computing the prompt (tokenmill router --pd routes both)")),
    ("--kv-transport", "kv_transport", dict(
        choices=("auto", "shm", "tcp"),
        help="how KV blocks travel between instances: shm (same host), tcp, or auto (shm "
             "where both run on one host)")),
    ("--kv-transfer-host", "kv_transfer_host", dict(
        help="the address consumers reach this producer's KV side channel at (unset: "
             "127.0.0.1)")),
    ("--kv-transfer-port", "kv_transfer_port", dict(
        type=int, help="the KV side channel's port (rank r: port + r; 0: free ports)")),
    ("--kv-transfer-timeout", "kv_transfer_timeout", dict(
        type=float, help="seconds a producer keeps a finished prefill's blocks for a consumer "
                         "that does not pull them")),
    ("--kv-pull-timeout", "kv_pull_timeout", dict(
        type=float, help="seconds a consumer waits for a pull before computing the prompt "
                         "itself")),
    ("--kv-offload", "kv_offload", dict(
        choices=("none", "host", "disk"),
        help="where blocks the prefix cache evicts go, to be loaded back on a later hit: host "
             "(RAM) or disk (--kv-offload-dir; kept across restarts)")),
    ("--kv-offload-size", "kv_offload_size", dict(
        type=lambda v: _size(v, "--kv-offload-size"),
        help="bytes of the offload tier (host RAM, or disk), e.g. 8GiB")),
    ("--kv-offload-host-size", "kv_offload_host_size", dict(
        type=lambda v: _size(v, "--kv-offload-host-size"),
        help="with --kv-offload disk: a RAM tier of this many bytes in front of the disk")),
    ("--kv-offload-dir", "kv_offload_dir", dict(
        help="with --kv-offload disk: the directory of block files (shared by restarts)")),
    ("--kv-test-fail-after-blocks", "kv_test_fail_after_blocks", dict(
        type=int, help=argparse.SUPPRESS)),
    ("--enable-lora", "enable_lora", dict(
        action="store_const", const=True,
        help="serve LoRA adapters over the model (serve: --lora-modules, or loaded at run time)")),
    ("--max-loras", "max_loras", dict(type=int, help="LoRA adapters running in one step")),
    ("--max-cpu-loras", "max_cpu_loras", dict(
        type=int, help="LoRA adapters kept in memory, the least recently used evicted and read "
                       "again when asked for (unset: max(--max-loras, 16))")),
    ("--max-lora-rank", "max_lora_rank", dict(
        type=int, help="the highest LoRA rank accepted (an adapter above it is refused)")),
    ("--kv-events-config", "kv_events_config", dict(
        type=_kv_events_config, metavar="JSON",
        help="publish the prefix cache's block stored / removed events in vLLM's KV-event "
             "format (ZMQ PUB, msgpack) for a cache-aware router; vLLM's JSON, e.g. "
             "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}' "
             "(port 0: a free port; /server_info says which)")),
]


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.config import engine_option_default

    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"a .gguf file, a Hugging Face directory or a known name "
                        f"(default: {DEFAULT_MODEL})")
    for flag, option, spec in _ENGINE_FLAGS:
        kwargs = dict(spec)
        default = engine_option_default(option)
        if default is not None and kwargs.get("action") != "store_const":
            kwargs["help"] += f" (default: {default})"
        p.add_argument(flag, dest=option, default=None, **kwargs)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine flags the user gave, as ``EngineConfig.from_options`` keywords."""
    options = {option: getattr(args, option) for _, option, _ in _ENGINE_FLAGS
               if getattr(args, option) is not None}
    if getattr(args, "lora_modules", None) or getattr(args, "allow_runtime_lora", False):
        options.setdefault("enable_lora", True)  # serve's adapters need it
    if "kv_cache_memory" in options:  # "4GiB" -> bytes, "2048blocks" -> a block count
        size, blocks = options.pop("kv_cache_memory")
        options.update({"kv_cache_memory": size} if blocks is None else {"num_blocks": blocks})
    # Flags that cannot go together fail here, before torch is imported or a model loads.
    EngineConfig.from_options(args.model, **options)
    return options


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--min-tokens", type=int, default=0,
                   help="end-of-sequence is not sampled before this many tokens (default: 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence, up to --max-tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts (batched)")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message with the model's chat template")
    gen.set_defaults(func=_cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat in the terminal, streamed")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(func=_cmd_chat)
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    _add_serve_args(serve)
    _add_data_parallel_args(serve)
    serve.set_defaults(func=_cmd_serve)
    plan = sub.add_parser("plan", help="print the load-time plan (dtype, kernels, KV blocks, "
                                       "threads) for this machine or a described one")
    _add_engine_args(plan)
    plan.add_argument("--machine", default=None,
                      choices=["bare", "avx2", "avx512-bf16", "amx", "cuda"],
                      help="plan for a machine of this class instead of this one")
    plan.add_argument("--json", action="store_true", help="print the plan as a JSON object")
    plan.set_defaults(func=_cmd_plan)
    from tokenmill.bench.main import add_bench_parser

    add_bench_parser(sub)
    from tokenmill.router.cli import add_router_parser

    add_router_parser(sub)
    _add_eval_parser(sub)
    return parser


def _add_eval_parser(sub) -> None:
    evals = sub.add_parser("eval", help="quality checks of a model as the engine runs it")
    ppl = evals.add_subparsers(dest="eval_command", required=True).add_parser(
        "perplexity", help="perplexity on a fixed text (weights and KV cache as configured)")
    _add_engine_args(ppl)
    ppl.add_argument("--text", default=None,
                     help="a UTF-8 text file (default: the shipped tokenmill/eval/data/eval.txt)")
    ppl.add_argument("--context", type=int, default=None,
                     help="tokens per window (default: 1024, at most the model's length)")
    ppl.add_argument("--stride", type=int, default=None,
                     help="tokens between window starts; each window after the first scores "
                          "its last STRIDE tokens (default: half the context)")
    ppl.add_argument("--chunk", type=int, default=256,
                     help="prefill each window through the paged KV cache in chunks of at most "
                          "this many tokens (default: 256)")
    ppl.add_argument("--max-tokens", type=int, default=None,
                     help="score at most this many tokens (default: the whole text)")
    ppl.add_argument("--json", action="store_true", help="print the result as a JSON object")
    ppl.set_defaults(func=_cmd_eval_perplexity)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the MODEL argument)")
    p.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY on every route but /health, /version "
                        "and the API docs (default: env TOKENMILL_API_KEY, else none)")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key (for a scraper that has none)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="503 + Retry-After past this many waiting requests (default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM (default: 30)")
    p.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls when tools are offered (hermes: "
                        "<tool_call>{json}</tool_call>, as SmolLM2 and Qwen; default: hermes)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), help="the model's "
                   "thinking tags: chat gets message.reasoning, responses reasoning items")
    p.add_argument("--step-timeout", type=float, default=60.0,
                   help="a step running longer turns /health into 503 until it ends (default: 60)")
    p.add_argument("--test-faults", default=None, help=argparse.SUPPRESS)  # engine/faults.py
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine in a process of its own, apart from HTTP (default: on for "
                        "one worker generating text, GPU or CPU)")
    from tokenmill.engine.lora_modules import add_lora_args
    from tokenmill.server.dashboard_args import add_dashboard_args
    from tokenmill.server.limits import add_limit_args
    from tokenmill.server.observe_args import add_observe_args

    add_lora_args(p)
    add_limit_args(p)
    add_observe_args(p)
    add_dashboard_args(p)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def _add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.router.config import POLICIES

    g = p.add_argument_group("data parallelism (replicas behind the router, one port)")
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="run this many engine replicas, each on its own share of the usable "
                        "cores (with --device cuda, each on its own GPU of "
                        "CUDA_VISIBLE_DEVICES), behind a router on --host/--port; one that dies "
                        "is restarted (default: 1, no router)")
    g.add_argument("--router-policy", default="cache_aware", choices=POLICIES,
                   help="how the router picks a replica (default: cache_aware)")


def _serve_data_parallel(args: argparse.Namespace, options: dict) -> int:
    """``serve --data-parallel-size N``: the replicas and the router; this process runs no
    engine."""
    import os

    from tokenmill.router.app import serve_router
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.replicas import DataParallelConfig, run_data_parallel

    if any(options.get(k, 1) > 1 for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                             "nnodes")):
        raise ValueError("--data-parallel-size runs single-process replicas: it does not go "
                         "with --tensor-parallel-size, --pipeline-parallel-size or --nnodes")
    if args.kv_events_config is not None:
        raise ValueError("--data-parallel-size gives each replica its own --kv-events-config; "
                         "leave it out")
    key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or None
    gpus = None
    if options.get("device", "cpu").startswith("cuda"):  # one GPU each, chosen by the env
        if options["device"] != "cuda":
            raise ValueError("--data-parallel-size gives each replica its own GPU: pass "
                             "--device cuda and choose the GPUs with CUDA_VISIBLE_DEVICES")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = tuple(visible.split(",") if visible else map(str, range(args.data_parallel_size)))
    router = RouterConfig(policy=args.router_policy, host=args.host, port=args.port,
                          api_keys=(key,) if key else (), worker_api_key=key,
                          log_level=args.log_level)
    argv = args.argv[args.argv.index("serve") + 1:]
    return run_data_parallel(DataParallelConfig(
        size=args.data_parallel_size, serve_argv=tuple(argv), router=router,
        may_share_cores="num_threads" in options, gpus=gpus), serve_router)


def _make_llm(args: argparse.Namespace):
    from tokenmill.engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_options(args))
    info = llm.engine.info
    print(f"tokenmill: loaded {info.model} in {time.perf_counter() - t0:.1f}s; "
          f"KV cache {info.kv_cache_tokens} tokens", file=sys.stderr)
    return llm


def _sampling_params(args: argparse.Namespace):
    from tokenmill.params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                          ignore_eos=args.ignore_eos, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.sampling_seed)


def _cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    prompts = ([llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in args.prompt]
               if args.chat else args.prompt)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    for out in outs:
        print(out.outputs[0].text)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"tokenmill: {tokens} tokens in {elapsed:.1f}s ({tokens / elapsed:.1f} tokens/s), "
          f"{llm.engine.num_preemptions} preemptions", file=sys.stderr)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """What ``serve`` would build, decided and printed without loading any weights."""
    import json

    from tokenmill.engine.plan import detect_machine, make_plan
    from tokenmill.platform import Machine

    options = engine_options(args)
    if args.machine is not None:
        machine = Machine.described(args.machine)
        options["device"] = machine.device
    else:
        machine = detect_machine(options.get("device", "cpu"))
    plan = make_plan(EngineConfig.from_options(args.model, **options), machine)
    print(json.dumps(plan.describe(), indent=1) if args.json else plan)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.engine.chat_repl import ChatSession

    params = _sampling_params(args)
    return ChatSession(_make_llm(args), params, args.system).run()


def _run_headless(args: argparse.Namespace, options: dict) -> int:
    import logging

    from tokenmill.engine.build import run_headless_node

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_headless_node(EngineConfig.from_options(args.model, **options))


def _cmd_serve(args: argparse.Namespace) -> int:
    import gc
    import os

    # Before torch (and its OpenMP runtime, libgomp) loads: OpenMP threads that spin without end
    # after each parallel region take the cores the event loop needs to stream, and threads that
    # sleep at once must be woken for each of a step's ~300 parallel regions. Spinning for a
    # while (200k rounds, tens of microseconds: the gap between one op and the next) and then
    # sleeping measured best on 2 cores with the default model's Q4_1 weights: TPOT at one
    # stream 28 ms (sleeping or spinning) -> 19 ms, output tok/s at 32 streams 178 (sleeping) /
    # 125 (spinning) -> 192 (docs/performance.md). A user's own setting of either wins.
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ.update(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT="200000")
    # oneDNN keeps two caches per GEMM shape (ideep's and its primitive cache, 1,024 entries of
    # ~0.3 MiB each by default), and every token count of a step through oneDNN is a shape: a
    # server's private memory grew +590 MiB over 4 minutes of load and still rose. 256 entries
    # fill in a few minutes, then stay flat (benchmarks/soak.py). A user's own setting wins.
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):  # read as torch loads
        os.environ.setdefault(name, "256")
    options = engine_options(args)  # bad engine flags fail here, before the server is imported
    if (args.data_parallel_size or 1) > 1:
        return _serve_data_parallel(args, options)
    if options.get("node_rank", 0) > 0:  # another node's ranks: no engine, no server here
        return _run_headless(args, options)
    from tokenmill.engine.core_client import engine_process_choice, launch_core
    from tokenmill.server.dashboard_args import dashboard_settings
    from tokenmill.server.limits import limits_from_args

    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ValueError("--max-queued-requests must be >= 1")
    if args.step_timeout <= 0:
        raise ValueError("--step-timeout must be > 0")
    limits, dashboard = limits_from_args(args), dashboard_settings(args)
    model_name = args.served_model_name or args.model
    separate, why = engine_process_choice(args, options)
    print(f"tokenmill: the engine core runs "
          f"{'in its own process' if separate else 'in this process'}: {why}", file=sys.stderr)
    # The core (scheduler, model, sampling, detokenization: engine/core_proc.py) starts before
    # this process imports the server, and loads while it does; nothing before this line
    # imports torch, FastAPI or the server, and behind a core this process never imports torch
    # (tests/test_engine_core_process.py). docs/performance.md has the start-up figures.
    launch = launch_core(args, options, model_name) if separate else None
    try:
        from tokenmill.server.app import ServerSettings, run_server

        settings = ServerSettings.from_args(args, model_name, limits, dashboard)
    except BaseException:
        if launch is not None:
            launch.abandon()
        raise
    if launch is not None:
        return run_server(launch.client(), settings, args.log_level)
    # Loading makes ~190k long-lived objects: collecting as they piled up took ~1 s of start-up
    gc.disable()
    try:
        engine = _make_llm(args).engine
    finally:
        gc.enable()
    from tokenmill.engine.faults import FaultPlan
    from tokenmill.engine.lora_modules import load_lora_modules

    engine.fault_hook = FaultPlan.parse(args.test_faults) if args.test_faults else None  # tests
    load_lora_modules(engine, settings.model_name, args.lora_modules)
    return run_server(engine, settings, args.log_level)


def _cmd_eval_perplexity(args: argparse.Namespace) -> int:
    import json

    from tokenmill.eval.perplexity import load_text, perplexity

    text = load_text(args.text)  # before the model loads: a bad path fails at once
    result = perplexity(args.model, text, context=args.context, stride=args.stride,
                        chunk=args.chunk, max_tokens=args.max_tokens, **engine_options(args))
    print(json.dumps(result.to_dict()) if args.json else result.summary())
    return 0


def _show_progress() -> None:
    """Long operations (loading weights, building kernels, capturing CUDA graphs, scoring)
    draw a bar on stderr when it is a terminal, or with TOKENMILL_PROGRESS=1 (0: never);
    stdout, where JSON goes, never gets one."""
    import os

    from tokenmill.util import set_progress_display, terminal_progress

    wanted = os.environ.get("TOKENMILL_PROGRESS")
    if wanted == "1" or (wanted is None and sys.stderr.isatty()):
        set_progress_display(terminal_progress)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: replicas reuse it
    _show_progress()
    try:
        return args.func(args)
    except (TokenmillError, ValueError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
