"""Facts about a built engine (``EngineInfo``), its counters (``EngineStats``) and its latest
step (``StepInfo``): plain data, shared by the engine, its builder and the server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    """Facts about the engine that do not change while it runs."""

    model: str  # the model argument, or the file it resolved to
    vocab_size: int
    max_model_len: int
    kv_cache_tokens: int
    max_num_seqs: int
    block_size: int
    dtype: str = "float32"
    dtype_reason: str = ""
    attention_backend: str = "torch"
    quantization: str = "none"  # the linear weights' format as loaded (none, int8, int4, ...)
    kv_cache_dtype: str = "auto"  # as chosen (platform.choose_kv_cache_dtype): auto = dtype's
    kv_cache_dtype_reason: str = ""
    # decode batch sizes replayed from CUDA graphs, e.g. "1,2,4,8,16,...,64"; "off" when none
    cuda_graphs: str = "off"
    # CPU: "fused" when the decoder layers run in one C++ call (runner/cpu_step.py), else
    # "eager: <why>"
    cpu_step: str = "off"
    hardware: dict = field(default_factory=dict)  # the CPU and its instruction sets
    speculative: dict = field(default_factory=dict)  # method and k; empty when off
    plan: dict = field(default_factory=dict)  # the load-time plan (ExecutionPlan.describe)
    # tensor / pipeline parallel ranks: sizes, the all-reduce, each rank's host, pid, threads,
    # cores, layers and KV blocks (empty in one process)
    parallel: dict = field(default_factory=dict)
    # where the prefix cache's KV events are published (--kv-events-config): endpoint and
    # replay_endpoint as bound, topic, block_size; None when they are not
    kv_events: dict | None = None
    # the KV connector (--kv-role, --kv-offload): role and side channel, or the offload
    # tiers; None when there is none
    kv_transfer: dict | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of counters (totals since start) and gauges (now)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0  # usable KV blocks
    num_free_blocks: int = 0  # of those, free for new KV (never used, or cached and evictable)
    num_cached_blocks: int = 0  # of those, held by the prefix cache (in use or evictable)
    num_preemptions: int = 0
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_structured_requests: int = 0  # requests with an output constraint
    grammar_compile_seconds: float = 0.0  # compiling constraints (cache misses)
    grammar_mask_seconds: float = 0.0  # filling token masks (alongside the forward)
    num_grammar_mask_steps: int = 0  # steps that filled masks
    spec: object | None = None  # speculative.SpecStats when speculative decoding is on
    forward_seconds: float = 0.0  # the executor's execute: model forward + sampling
    scheduler_seconds: float = 0.0  # schedule() + update_from_output()
    step_seconds: float = 0.0  # whole steps, detokenization included
    num_failed_steps: int = 0  # steps that raised (their requests failed, the engine went on)
    # KV connector: tokens admitted as external hits (offload tiers, pulled from a producer),
    # requests waiting for their KV, finished requests whose blocks a consumer has yet to pull
    external_cache_hits: int = 0
    num_loading: int = 0
    num_held: int = 0
    kv_tiers: dict = field(default_factory=dict)  # per tier / transfer: kv_transfer.TierStats
    # LoRA: the adapters of running and of waiting sequences (names, sorted), and how many may
    # run in one step (0: the engine serves no adapters)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0


@dataclass(frozen=True)
class StepInfo:
    """What the latest step did (for per-step metrics and request timings)."""

    num_batched_tokens: int = 0
    num_new_tokens: int = 0
    num_preemptions: int = 0
    scheduled_request_ids: frozenset[str] = frozenset()  # callers' ids that ran any token


def format_plan(described: dict[str, Any]) -> str:
    """``ExecutionPlan.describe()``'s dict as the lines start-up logs (one per decision)."""
    return "\n".join(["execution plan:"] + [f"  {key}: {_flat(value)}"
                                            for key, value in described.items()])


def _flat(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_flat(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "/".join(map(str, value))
    return str(value)
