"""The load-time plan: every per-machine decision, made once before anything is built.

``make_plan(config, machine)`` turns an ``EngineConfig`` and a ``platform.Machine`` into a
frozen ``ExecutionPlan``: the compute dtype and why, the KV cache's dtype, the attention
backend, the linear kernels (``model.linear``'s ``LinearPlan``), the fused CPU step or CUDA
graphs, the thread layout, the KV blocks and the speculative set-up. Construction
(``engine/build.py``) then follows it without deciding anything again; start-up logs print it and
``/server_info`` shows it. It reads only the model's config (never its weights), so a test can
plan for a machine it does not have (``Machine.described("avx2")``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from tokenmill.config import (EngineConfig, KVTransferConfig, LoRAConfig, ModelConfig,
                              ParallelConfig)
from tokenmill.distributed.layout import ParallelLayout
from tokenmill.engine.info import format_plan
from tokenmill.executor.multiproc import DistributedSpec
from tokenmill.executor.worker import WorkerSpec
from tokenmill.model.config_reader import read_model_config, stored_block_formats
from tokenmill.model.linear.plan import LinearPlan, plan_linears
from tokenmill.model.registry import family
from tokenmill.platform import Machine, choose_dtype, choose_kv_cache_dtype
from tokenmill.runner.kv_cache import (bytes_per_block, check_kv_cache_dtype,
                                       default_kv_cache_bytes, num_kv_blocks)
from tokenmill.speculative import layerskip_layers, spec_description

if TYPE_CHECKING:
    from tokenmill.kv_transfer.factory import KVTransferSpec


# the model's shape as the ranks' settings compare it
_SHAPE = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
          "num_heads", "num_kv_heads", "head_dim")


@dataclass(frozen=True)
class KVPlan:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens (None: sized from
    the GPU memory left once the model is loaded, ``budget_rule`` says how)."""

    block_size: int
    num_blocks: int | None
    bytes_per_block: int  # the target's K/V, every layer
    draft_bytes_per_block: int  # a drafting model's K/V at the same block ids
    budget_rule: str

    @property
    def tokens(self) -> int | None:
        """Tokens the cache holds (block 0 is the tables' padding)."""
        return None if self.num_blocks is None else (self.num_blocks - 1) * self.block_size


@dataclass(frozen=True)
class ExecutionPlan:
    machine: Machine
    model: str  # the file or directory the model argument resolved to
    model_config: ModelConfig  # in the planned compute dtype
    device: str
    dtype: str
    dtype_reason: str
    kv_cache_dtype: str
    kv_cache_dtype_reason: str
    attention_backend: str
    attention_reason: str
    linear: LinearPlan
    kv: KVPlan
    max_model_len: int
    threads: int  # the forward's intra-op threads (0 on a GPU)
    thread_governor: bool  # one thread while other processes take the cores (runner/threads.py)
    cpu_step: str  # "fused", or "eager: <why>" (runner/cpu_step.py)
    cuda_graphs: str  # "decode batches up to N", or "off: <why>"
    async_scheduling: str  # "on: <why>" or "off: <why>" (engine/overlap.py)
    max_num_seqs: int
    speculative: dict[str, Any] = field(default_factory=dict)  # empty when off
    max_batched_tokens: int = 2048
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)  # off by default
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # off by default
    # "on: <why>" or "off: <why>": a request's results the same whatever its batch (its
    # linear half is ``linear.batch_invariant``; docs/batch_invariance.md)
    batch_invariant: str = "off: not planned"

    @property
    def on_gpu(self) -> bool:
        return self.machine.on_gpu

    def worker_spec(self) -> WorkerSpec:
        """What each worker builds (``executor/worker.py``)."""
        fused = self.cpu_step == "fused"
        return WorkerSpec(
            model=self.model, device=self.device, dtype=self.dtype,
            attention_backend=self.attention_backend, linear=self.linear,
            block_size=self.kv.block_size, num_blocks=self.kv.num_blocks,
            kv_cache_dtype=self.kv_cache_dtype,
            draft_bytes_per_block=self.kv.draft_bytes_per_block,
            max_model_len=self.max_model_len, graph_batch=self.graph_batch,
            fuse_cpu_step=fused, governor_threads=self.threads if self.thread_governor else 0,
            planned_cpu_step="off" if self.on_gpu else self.cpu_step,
            max_batched_tokens=self.max_batched_tokens, kv_transfer=self._kv_transfer_spec(),
            lora=self.lora if self.lora.enable_lora else None)

    def _kv_transfer_spec(self) -> KVTransferSpec | None:
        if not self.kv_transfer.enabled:
            return None
        from tokenmill.kv_transfer.factory import KVTransferSpec

        return KVTransferSpec(self.kv_transfer, self.model, self.kv.block_size,
                              self.attention_backend, self.kv_cache_dtype,
                              self.linear.quantization)

    def distributed_spec(self) -> DistributedSpec:
        """What the multi-process executor starts (``executor/multiproc.py``)."""
        from tokenmill.platform import usable_cpus

        threads, cpu_sets = rank_threads(self.parallel, self.machine, usable_cpus())
        cfg = self.model_config
        # what every node must agree on (cores, memory and kernels may differ between nodes)
        settings = {"model": os.path.basename(self.model), "dtype": self.dtype,
                    "shape": {k: getattr(cfg, k) for k in _SHAPE}, "layout": self.layout,
                    "quantization": self.linear.quantization,
                    "kv_cache_dtype": self.kv_cache_dtype, "block_size": self.kv.block_size,
                    "max_model_len": self.max_model_len,
                    "custom_all_reduce_off": self.parallel.disable_custom_all_reduce}
        return DistributedSpec(self.worker_spec(), self.layout, self.parallel, self.model_config,
                               threads, cpu_sets, settings)

    @property
    def graph_batch(self) -> int:
        """The largest decode batch captured in a CUDA graph (0: none)."""
        return self.max_num_seqs if self.cuda_graphs.startswith("decode") else 0

    def describe(self) -> dict[str, Any]:
        """The plan as plain data (start-up log, ``/server_info``)."""
        return {
            "machine": self.machine.describe(), "model": self.model, "device": self.device,
            "dtype": {"value": self.dtype, "why": self.dtype_reason},
            "kv_cache_dtype": {"value": self.kv_cache_dtype, "why": self.kv_cache_dtype_reason},
            "attention_backend": {"value": self.attention_backend,
                                  "why": self.attention_reason},
            "linear": self.linear.describe(),
            "kv_cache": {"block_size": self.kv.block_size, "num_blocks": self.kv.num_blocks,
                         "tokens": self.kv.tokens, "bytes_per_block": self.kv.bytes_per_block,
                         "draft_bytes_per_block": self.kv.draft_bytes_per_block,
                         "budget": self.kv.budget_rule},
            "max_model_len": self.max_model_len,
            "threads": {"count": self.threads, "governor": self.thread_governor},
            "cpu_step": self.cpu_step, "cuda_graphs": self.cuda_graphs,
            "async_scheduling": self.async_scheduling,
            "batch_invariant": self.batch_invariant,
            "speculative": self.speculative or "off",
            "parallel": self._describe_parallel(),
            "kv_transfer": self._describe_kv_transfer(),
            "lora": self._describe_lora(),
        }

    def _describe_lora(self) -> dict[str, Any] | str:
        lora = self.lora
        if not lora.enable_lora:
            return "off"
        return {"max_loras": lora.max_loras, "max_cpu_loras": lora.cpu_loras,
                "max_lora_rank": lora.max_lora_rank}

    def _describe_kv_transfer(self) -> dict[str, Any] | str:
        """The KV connector asked for: its settings that are not their defaults."""
        kv = self.kv_transfer
        if not kv.enabled:
            return "off"
        return {f.name: getattr(kv, f.name) for f in fields(kv)
                if getattr(kv, f.name) != f.default}

    def _describe_parallel(self) -> dict[str, Any] | str:
        p = self.parallel
        if not p.distributed:
            return "one process"
        threads, cpus = rank_threads(p, self.machine, list(range(self.machine.cores)))
        return {"tensor": p.tensor_parallel_size, "pipeline": p.pipeline_parallel_size,
                "stage_layers": list(self.layout.stage_layers),
                "backend": p.distributed_executor_backend, "nnodes": p.nnodes,
                "threads_per_rank": threads,
                "bound": "no" if cpus[0] is None else "a core range each"}

    def __str__(self) -> str:
        return format_plan(self.describe())


def detect_machine(device: str = "cpu") -> Machine:
    """This machine, with whether the C++ CPU kernels load (built on first use)."""
    from tokenmill.kernels.cpu import load

    return Machine.detect(device, kernels_built=device.startswith("cpu") and load() is not None)


def make_plan(config: EngineConfig, machine: Machine | None = None) -> ExecutionPlan:
    """The plan for ``config`` on ``machine`` (None: this machine, ``detect_machine``)."""
    machine = machine or detect_machine(config.device)
    check_kv_cache_dtype(config.kv_cache_dtype)
    source, model_cfg = read_model_config(config.model)
    dtype, dtype_reason = choose_dtype(config.device, config.dtype, machine)
    kv_dtype, kv_reason = choose_kv_cache_dtype(config.device, config.dtype, dtype,
                                                config.kv_cache_dtype)
    model_cfg = model_cfg.with_dtype(dtype)
    backend, backend_reason = _attention(config, machine)
    linear = plan_linears(machine, dtype, config.quantization, cpu_kernels=backend == "cpu")
    invariant, linear = _batch_invariant(config, machine, model_cfg, backend, linear)
    max_len = min(config.scheduler.max_model_len or model_cfg.max_position_embeddings,
                  model_cfg.max_position_embeddings)
    speculative, draft_cfg = _speculative(config, model_cfg, dtype)
    _check_family(config, model_cfg)
    layout = ParallelLayout.plan(config.parallel, model_cfg)
    _check_parallel(config, layout)
    # distributed, the engine's process only samples: the cores are the ranks'
    threads = 0 if machine.on_gpu else 1 if config.parallel.distributed else \
        (config.num_threads or machine.cores)
    return ExecutionPlan(
        machine=machine, model=str(source.path), model_config=model_cfg, device=config.device,
        dtype=dtype, dtype_reason=dtype_reason, kv_cache_dtype=kv_dtype,
        kv_cache_dtype_reason=kv_reason, attention_backend=backend,
        attention_reason=backend_reason, linear=linear,
        kv=_kv(config, machine, model_cfg, draft_cfg, kv_dtype, layout), max_model_len=max_len,
        threads=threads, thread_governor=config.num_threads is None and threads > 1,
        cpu_step=_cpu_step(config, machine, model_cfg, backend, linear,
                           bool(stored_block_formats(source))),
        cuda_graphs=_cuda_graphs(config, machine, backend),
        async_scheduling=_async_scheduling(config, machine),
        max_num_seqs=config.scheduler.max_num_seqs, speculative=speculative,
        max_batched_tokens=config.scheduler.max_num_batched_tokens, parallel=config.parallel,
        layout=layout, kv_transfer=config.kv_transfer, lora=config.lora,
        batch_invariant=invariant)


def _invariance_default_off(config: EngineConfig, linear: LinearPlan) -> str | None:
    """Why the batch-invariant mode stays off here unless asked for; None: on by default.
    On by default where it was measured to cost nothing (docs/batch_invariance.md: within
    1.5% without AMX, bf16 and float32; 4/8-bit weights on the bf16 GEMM run its kernels, bit
    for bit); off where it costs more than 10% or was not measured."""
    if linear.onednn_trial:
        return ("the default here: with oneDNN's AMX route planned, the mode's AMX tiles "
                "take prompt chunks 20-30% slower (--batch-invariant turns it on)")
    if config.quantization != "none" and linear.quant_kernels[:1] != ("bf16-blocks",):
        return ("the default for --quantization (4/8-bit weights) off the bf16 GEMM: its cost "
                "there is not measured (--batch-invariant turns it on)")
    return None


def _batch_invariant(config: EngineConfig, machine: Machine, model_cfg: ModelConfig,
                     backend: str, linear: LinearPlan) -> tuple[str, LinearPlan]:
    """Whether a request's tokens and logprobs stay the same whatever shares its batches
    ("on: <why>" / "off: <why>") and the linear plan that follows; asked for where it cannot
    hold, refused."""
    asked = config.batch_invariant
    if asked is False:
        return "off: asked for", linear
    blocker = _invariance_blocker(config, machine, model_cfg, backend, linear)
    default_off = None if asked else _invariance_default_off(config, linear)
    if blocker is None and default_off is None:
        why = "asked for" if asked else "the default where it costs nothing measurable"
        return (f"on: {why} (one kernel per linear at every row count, the shared-prefix "
                "pass resumed rather than merged)",
                linear.with_batch_invariance())
    if asked:
        raise ValueError(f"--batch-invariant cannot hold here: {blocker}")
    return f"off: {blocker or default_off}", linear


def _invariance_blocker(config: EngineConfig, machine: Machine, model_cfg: ModelConfig,
                        backend: str, linear: LinearPlan) -> str | None:
    """Why this engine's results could follow the batch whatever the mode; None: they need
    not (every kernel it would run keeps one reduction order per row)."""
    if machine.on_gpu:
        return "the GPU kernels' splits follow the batch (the mode runs on the CPU kernels)"
    if backend != "cpu":
        return f"the {backend} attention backend (the mode needs the compiled CPU kernels)"
    if not family(model_cfg.architecture).fused_step or model_cfg.num_experts:
        return f"{model_cfg.architecture}'s layers are not covered (Llama-family dense ones are)"
    if config.parallel.distributed or config.lora.enable_lora:
        return "parallel ranks and LoRA adapters are not covered"
    return linear.order_blocker()


def _check_family(config: EngineConfig, model_cfg: ModelConfig) -> None:
    """What the model's family cannot run yet (``model/registry.py``), refused before anything
    starts."""
    fam = family(model_cfg.architecture)
    if config.parallel.distributed and not fam.parallel:
        raise ValueError(f"tensor / pipeline parallel ranks run Llama-family layers; "
                         f"{model_cfg.architecture} runs in one process")
    if config.lora.enable_lora and not fam.lora:
        raise ValueError(f"LoRA adapters apply to Llama-family layers, not "
                         f"{model_cfg.architecture}'s")
    if config.speculative.speculative_method == "layerskip" and not fam.parallel:
        raise ValueError(f"speculative_method layerskip drafts with Llama-family layers, not "
                         f"{model_cfg.architecture}'s; use ngram or draft")


def _check_parallel(config: EngineConfig, layout: ParallelLayout) -> None:
    """What the ranks cannot run yet, refused before anything starts."""
    if not config.parallel.distributed:
        return
    kv = config.kv_transfer
    if kv.kv_role in ("producer", "both") and not kv.kv_transfer_port:
        raise ValueError("a producer's ranks listen at --kv-transfer-port + rank, where "
                         "consumers find them: give a port (--kv-transfer-port)")
    if config.speculative.speculative_method == "layerskip":
        raise ValueError("speculative_method layerskip drafts with the target's own layers in "
                         "the engine's process; with tensor / pipeline parallel ranks use "
                         "ngram or draft")


def rank_threads(parallel: ParallelConfig, machine: Machine, cpus: list[int]
                 ) -> tuple[int, tuple[tuple[int, ...] | None, ...]]:
    """Each local rank's threads and cores: ``cpu_bind`` as given, else even shares of this
    node's cores, each bound to its own range when they go round (else unbound)."""
    local = parallel.ranks_per_node
    if parallel.cpu_bind is not None:
        if len(parallel.cpu_bind) != local:
            raise ValueError(f"cpu_bind names {len(parallel.cpu_bind)} core sets for {local} "
                             "ranks on this node")
        sets = tuple(tuple(_parse_cpus(b)) for b in parallel.cpu_bind)
        return parallel.cpu_cores_per_rank or min(map(len, sets)), sets
    per = parallel.cpu_cores_per_rank or max(1, len(cpus) // local)
    if machine.on_gpu or parallel.distributed_executor_backend == "ray":  # Ray places them
        return (1 if machine.on_gpu else per), (None,) * local
    if per * local > len(cpus):
        return per, (None,) * local
    return per, tuple(tuple(cpus[i * per:(i + 1) * per]) for i in range(local))


def _parse_cpus(spec: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _attention(config: EngineConfig, machine: Machine) -> tuple[str, str]:
    if config.attention_backend != "auto":
        return config.attention_backend, "asked for"
    if machine.on_gpu:
        # whether triton is importable is a fact of the environment, not of the machine
        from tokenmill.attention import has_triton

        if has_triton():
            return "triton", "the GPU default (graph-safe paged kernel)"
        return "torch", "triton is not installed"
    if machine.kernel_caps.attention:
        return "cpu", "the compiled CPU kernels read K/V in place"
    return "torch", "no compiled CPU kernels (no C++ compiler, or an unsupported CPU)"


def _speculative(config: EngineConfig, model_cfg: ModelConfig,
                 dtype: str) -> tuple[dict[str, Any], ModelConfig | None]:
    """What speculation runs and the drafting model's shape (None: no drafting model)."""
    spec = config.speculative
    if spec.speculative_method is None:
        return {}, None
    if spec.speculative_method == "draft":
        draft_cfg = read_model_config(spec.speculative_model)[1].with_dtype(dtype)
        return spec_description(spec), draft_cfg
    if spec.speculative_method == "layerskip":
        layers = layerskip_layers(spec, model_cfg.num_layers)
        return spec_description(spec, layers), replace(model_cfg, num_layers=layers)
    return spec_description(spec), None


def _kv(config: EngineConfig, machine: Machine, model_cfg: ModelConfig,
        draft_cfg: ModelConfig | None, kv_dtype: str, layout: ParallelLayout) -> KVPlan:
    import torch

    cache = config.cache
    dtype = getattr(torch, model_cfg.dtype)
    # parallel ranks: this node's ranks' K/V per block (as if one model held all their
    # layers), from one budget
    node_cfg = _node_kv_shape(model_cfg, layout, config.parallel.ranks_per_node)
    per_block = bytes_per_block(node_cfg, cache.block_size, dtype, kv_dtype)
    # A drafting model's cache holds as many tokens as the target's, within one budget.
    draft = bytes_per_block(draft_cfg, cache.block_size, dtype) if draft_cfg else 0
    if cache.num_blocks is not None:
        return KVPlan(cache.block_size, cache.num_blocks, per_block, draft, "asked for")
    if cache.kv_cache_memory is not None:
        budget, rule = cache.kv_cache_memory, f"{cache.kv_cache_memory} bytes asked for"
    elif machine.on_gpu:
        return KVPlan(cache.block_size, None, per_block, draft,
                      "90% of the GPU memory free once the model is loaded")
    else:
        budget = default_kv_cache_bytes(machine.device, machine.memory_bytes)
        rule = "a fifth of the host's available memory, at most 4 GiB"
    blocks = num_kv_blocks(node_cfg, cache.block_size, dtype, machine.device, budget,
                           extra_bytes_per_block=draft, kv_cache_dtype=kv_dtype)
    return KVPlan(cache.block_size, blocks, per_block, draft, rule)


def _node_kv_shape(model_cfg: ModelConfig, layout: ParallelLayout, ranks: int) -> ModelConfig:
    """A shape whose KV block costs what one block costs ``ranks`` ranks of the largest stage
    together (the model itself at one rank)."""
    if layout.world_size == 1:
        return model_cfg
    sizes = layout.stage_layers
    rank_cfg = layout.position(sizes.index(max(sizes)) * layout.tp_size).local_config(model_cfg)
    return replace(rank_cfg, num_layers=rank_cfg.num_layers * ranks)


def _cpu_step(config: EngineConfig, machine: Machine, model_cfg: ModelConfig, backend: str,
              linear: LinearPlan, stored_blocks: bool) -> str:
    """Whether the decoder layers run as one C++ call per forward (``runner/cpu_step.py``)."""
    if machine.on_gpu:
        return "eager: not a CPU"
    if config.enforce_eager:
        return "eager: --enforce-eager"
    caps = machine.kernel_caps
    if backend != "cpu":
        return "eager: needs the CPU kernels' attention and GEMM (AVX2 or AVX512)"
    if not family(model_cfg.architecture).fused_step:
        return f"eager: the fused step runs Llama-family layers, not {model_cfg.architecture}"
    if model_cfg.qk_norm:
        return "eager: per-head q/k norms (Qwen3) run eagerly"
    if model_cfg.dtype == "bfloat16" and not caps.bf16_gemm:
        return "eager: bf16 needs the CPU kernels' bf16 GEMM (AVX512-BF16)"
    if model_cfg.dtype not in ("bfloat16", "float32"):
        return f"eager: {model_cfg.dtype} runs eagerly"
    why = _fused_blocker(linear, model_cfg, stored_blocks and linear.keep_gguf_blocks)
    return f"eager: {why}" if why else "fused"


# the linear kernels the fused step multiplies on, per compute dtype
_FUSABLE = {"bfloat16": ("bf16-packed", "bf16-packed-silu", "bf16-amx", "bf16-amx-silu",
                         "bf16-blocks", "bf16-blocks-silu"),
            "float32": ("f32-packed", "f32-packed-bits", "f32-packed-a8")}


def _fused_blocker(linear: LinearPlan, model_cfg: ModelConfig, kept_blocks: bool) -> str | None:
    """Why the decoder layers' linears keep the fused step out; None when they do not.
    ``kept_blocks``: the weights stay in a GGUF's 4/8-bit blocks."""
    roles = ("qkv", "o", "gate_up", "down")
    kernels = {role: linear.kernels_for(role, True)[0] if kept_blocks else linear.kernel_for(role)
               for role in roles}
    if any(k not in _FUSABLE[model_cfg.dtype] for k in kernels.values()):
        name = "bf16" if model_cfg.dtype == "bfloat16" else "float32"
        return (f"not every linear layer is a packed {name} weight (quantized, or a size the "
                f"kernels do not pack): {', '.join(f'{r} {k}' for r, k in kernels.items())}")
    if model_cfg.dtype == "bfloat16" and model_cfg.mlp_bias:
        return "gate/up takes no SiLU·mul in its epilogue (an MLP bias)"
    return None


def _cuda_graphs(config: EngineConfig, machine: Machine, backend: str) -> str:
    if not machine.on_gpu:
        return "off: not a GPU"
    if config.enforce_eager:
        return "off: --enforce-eager"
    if config.parallel.distributed:
        return "off: parallel ranks (their collectives are not captured)"
    if backend != "triton":
        return f"off: the {backend} attention backend is not graph-safe"
    return f"decode batches up to {config.scheduler.max_num_seqs}"


def _async_scheduling(config: EngineConfig, machine: Machine) -> str:
    """Overlapped scheduling: on by default where the device computes while the engine's
    thread builds outputs (one GPU worker: 1.05-1.4x offline on an H100, docs/benchmarks.md);
    off on a CPU, whose forward takes the cores the overlap would need."""
    asked = config.scheduler.async_scheduling
    if asked is not None:
        return f"{'on' if asked else 'off'}: asked for"
    if not machine.on_gpu:
        return "off: a CPU's forward takes the cores (--async-scheduling turns it on)"
    if config.parallel.distributed:
        return "off: parallel ranks (--async-scheduling turns it on)"
    return "on: one GPU worker queues each step while the last one's outputs are built"
