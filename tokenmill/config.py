"""Frozen configuration dataclasses.

Every component takes only the config it needs. Environment variables are read at the CLI
boundary and turned into these; nothing below the CLI reads the environment.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from functools import cached_property
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is one of ``default``, ``linear``, ``llama3``,
    ``freq_factors`` (per-frequency divisors, as llama.cpp stores Llama 3.1 scaling in GGUF)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()
    # longrope (Phi-3/4): per-frequency divisors below / beyond the original context
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # longrope / yarn: cos and sin multiplied by this (None: the kind's own formula)
    attention_factor: float | None = None
    # yarn (gpt-oss): the ramp between interpolated and extrapolated frequencies
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the ramp's bounds to whole dims (gpt-oss: False)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a model, independent of the file it was read from. The fields up to ``extra``
    are what every family has or what code outside the model file reads (the KV cache, the
    plan, attention); ``extra`` holds one family's own settings (``model/registry.py``)."""

    architecture: str  # a family in model/registry.py: "llama", "qwen3", "gemma3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # sliding-window attention: a query at position q sees keys at p with q - p < window;
    # ``layer_types`` ("sliding_attention" / "full_attention" per layer) says which layers
    # (empty: every layer, when ``sliding_window`` is set)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # mixture of experts: routed experts, how many each token takes, their MLP width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    partial_rotary_factor: float = 1.0  # RoPE rotates this fraction of each head (Phi-4)
    causal: bool = True  # False: a bidirectional encoder (BERT), which keeps no KV cache
    task: str = "generate"  # what the model serves by default: "generate", "embed", "rerank"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: it attends to every key)."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def every_layer_windowed(self) -> bool:
        """Every layer slides: KV blocks wholly behind the window are never read again."""
        return self.sliding_window is not None and all(
            self.window(i) is not None for i in range(self.num_layers))

    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_dtype(self, dtype: str) -> ModelConfig:
        return replace(self, dtype=dtype)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens per layer."""

    block_size: int = 16
    num_blocks: int | None = None  # derived from kv_cache_memory when None
    kv_cache_memory: int | None = None  # bytes; derived from free memory when both are None
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests
    enable_prefix_caching: bool = True  # radix-tree prefix cache (False: a null cache)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    policy: str = "fcfs"  # "fcfs" | "priority" | "lpm" (longest cached prefix first)
    # overlap: schedule and launch step N+1 before step N's detokenization and outputs
    # (engine/overlap.py); the same outputs token for token
    async_scheduling: bool | None = None  # None: on for one GPU worker (engine/plan.py)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters over the base model (``model/lora/``, ``runner/lora.py``): up to
    ``max_loras`` adapters take part in one step, ``max_cpu_loras`` stay loaded (least recently
    used evicted, reloaded from their files when asked for again)."""

    enable_lora: bool = False
    max_loras: int = 4  # adapters active in one step (vLLM's max_loras)
    max_cpu_loras: int | None = None  # adapters kept loaded; None: max(max_loras, 16)
    max_lora_rank: int = 64  # an adapter of a higher rank is refused at load

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None \
            else max(self.max_loras, 16)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``tokenmill/speculative/``): a proposer drafts up to
    ``num_speculative_tokens`` tokens per sequence and step, verified in the target's forward."""

    speculative_method: str | None = None  # None (off) | "ngram" | "draft" | "layerskip"
    num_speculative_tokens: int = 4  # the most drafts per sequence and step (k)
    prompt_lookup_min: int = 2  # ngram: shortest suffix that may match
    prompt_lookup_max: int = 5  # ngram: longest suffix tried first
    speculative_model: str | None = None  # draft: a model sharing the target's vocabulary
    # layerskip: the target's first L layers (+ its final norm and lm_head) draft;
    # None: a quarter of the layers
    speculative_draft_layers: int | None = None
    # k per sequence and step from the measured acceptance and step costs (off: always k)
    speculative_adaptive: bool = True

    def __post_init__(self) -> None:
        if self.speculative_method not in (None, "ngram", "draft", "layerskip"):
            raise ValueError(f"unknown speculative method {self.speculative_method!r}; "
                             "use ngram, draft or layerskip")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative method 'draft' needs a draft model "
                             "(--speculative-model)")
        if self.speculative_draft_layers is not None and self.speculative_draft_layers < 1:
            raise ValueError("speculative_draft_layers must be at least 1")


@dataclass(frozen=True)
class ParallelConfig:
    """The model split over ``tensor_parallel_size * pipeline_parallel_size`` worker processes
    (``executor/multiproc.py``), on one machine or over ``nnodes`` of them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # decoder layers per pipeline stage, e.g. (16, 14); None: as even as the count allows
    pp_layer_partition: tuple[int, ...] | None = None
    # "mp" (worker processes spawned here, joined by a torch TCPStore) or "ray" (Ray actors)
    distributed_executor_backend: str = "mp"
    nnodes: int = 1
    node_rank: int = 0  # 0 runs the engine and the server; the others only workers (headless)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    # intra-op threads of each rank (None: this node's cores shared evenly between its ranks)
    cpu_cores_per_rank: int | None = None
    # per local rank, the cores it runs on, e.g. ("0-7", "8-15") (None: even ranges when the
    # cores go round, else unbound)
    cpu_bind: tuple[str, ...] | None = None
    # a worker is declared hung after this long without a heartbeat
    worker_timeout: float = 10.0
    # the TP all-reduce through the ranks' backend (gloo on a CPU) even where the shared-memory
    # one could run (every rank of the group on one host); the fused CPU step then runs eagerly
    disable_custom_all_reduce: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be mp or ray, got "
                             f"{self.distributed_executor_backend!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks (tensor x pipeline parallel) do not "
                             f"split evenly over {self.nnodes} nodes")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--nnodes > 1 needs --master-port (and --master-addr)")
        if self.pp_layer_partition is not None and \
                len(self.pp_layer_partition) != self.pipeline_parallel_size:
            raise ValueError(f"pp_layer_partition has {len(self.pp_layer_partition)} stages; "
                             f"pipeline_parallel_size is {self.pipeline_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def distributed(self) -> bool:
        """Whether the model runs in worker processes rather than the engine's own."""
        return self.world_size > 1 or self.nnodes > 1 or self.distributed_executor_backend == "ray"


KV_ROLES = ("producer", "consumer", "both")
KV_OFFLOAD_TIERS = ("none", "host", "disk")


@dataclass(frozen=True)
class KVTransferConfig:
    """KV blocks that leave the KV cache (``tokenmill/kv_transfer/``): to a decode instance
    (``kv_role``: prefill/decode disaggregation, vLLM's ``kv_transfer_params`` protocol) or to
    slower tiers the radix cache spills to and loads back from (``kv_offload``)."""

    kv_role: str | None = None  # None | "producer" (prefill) | "consumer" (decode) | "both"
    kv_transport: str = "auto"  # "shm" (same host), "tcp", or "auto" (shm where it can)
    kv_transfer_host: str | None = None  # advertised to consumers (None: 127.0.0.1)
    kv_transfer_port: int = 0  # the side channel of rank r binds port + r (0: free ports)
    kv_transfer_timeout: float = 120.0  # producer: unpulled blocks are freed after this (s)
    kv_pull_timeout: float = 10.0  # consumer: a pull that takes longer is recomputed (s)
    # "host" (evicted blocks kept in RAM), "disk" (blocks written to --kv-offload-dir, kept
    # across restarts, with an optional RAM tier of kv_offload_host_size in front)
    kv_offload: str = "none"
    kv_offload_size: int | None = None  # bytes of the host tier, or of the disk tier
    kv_offload_host_size: int = 0  # disk: bytes of a RAM tier in front of it (0: none)
    kv_offload_dir: str | None = None  # disk: where block files live
    # tests only: a producer sends this many blocks of each pull, then goes silent
    kv_test_fail_after_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got "
                             f"{self.kv_role!r} (--kv-role)")
        if self.kv_transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"kv_transport must be auto, shm or tcp, got {self.kv_transport!r}")
        if self.kv_offload not in KV_OFFLOAD_TIERS:
            raise ValueError(f"kv_offload must be one of {', '.join(KV_OFFLOAD_TIERS)}, got "
                             f"{self.kv_offload!r} (--kv-offload)")
        if self.kv_offload == "disk" and not self.kv_offload_dir:
            raise ValueError("--kv-offload disk needs a directory (--kv-offload-dir)")
        if self.kv_offload != "none" and not self.kv_offload_size:
            raise ValueError(f"--kv-offload {self.kv_offload} needs a size (--kv-offload-size)")
        if self.kv_offload == "none" and (self.kv_offload_dir or self.kv_offload_host_size):
            raise ValueError("--kv-offload-dir and --kv-offload-host-size apply only with "
                             "--kv-offload disk")
        if self.kv_offload == "host" and self.kv_offload_host_size:
            raise ValueError("--kv-offload-host-size applies only with --kv-offload disk "
                             "(the host tier's size is --kv-offload-size)")
        if not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"kv_transfer_port must be a port number, got {self.kv_transfer_port}")
        if self.kv_transfer_timeout <= 0 or self.kv_pull_timeout <= 0:
            raise ValueError("kv transfer timeouts must be positive")

    @property
    def enabled(self) -> bool:
        return self.kv_role is not None or self.kv_offload != "none"


@dataclass(frozen=True)
class KVEventsConfig:
    """Publishing the prefix cache's changes as KV events (``tokenmill/kv_events.py``), so a
    router can mirror each worker's cache exactly. The field names are vLLM's, so the JSON a
    vLLM deployment passes to ``--kv-events-config`` works here unchanged. An endpoint's port 0
    binds a free port; ``/server_info`` reports the bound ones."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null" (nothing published); None: zmq when enabled
    endpoint: str = "tcp://*:5557"  # ZMQ PUB: frames [topic, seq, msgpack batch]
    replay_endpoint: str | None = "tcp://*:5558"  # ZMQ ROUTER serving missed batches; None: off
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark: past it a slow subscriber loses batches
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = "kv-events"
    # stamped on every batch; a data-parallel replica's ports are offset by it (as vLLM's are)
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if self.publisher is None:  # frozen: the resolved value is set once, here
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be zmq or null, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be at least 1")
        if self.data_parallel_rank is not None and self.data_parallel_rank < 0:
            raise ValueError("kv events data_parallel_rank must be >= 0")

    @property
    def publishing(self) -> bool:
        """Whether events are collected and sent at all (else the cache records nothing)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        """Refuses keys this class lacks, by name: a misspelt key would silently do nothing."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown kv events option(s) {', '.join(unknown)}; known: "
                             f"{', '.join(f.name for f in fields(cls))}")
        for f in fields(cls):
            if f.name in values:
                _check_json_type(f"kv events option {f.name}", values[f.name], str(f.type))
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """``--kv-events-config '{"enable_kv_cache_events": true, ...}'``."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the kv events config is not JSON: {e}") from None
        if not isinstance(values, dict):
            raise ValueError("the kv events config must be a JSON object")
        return cls.from_dict(values)

    def __str__(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    # "auto": bfloat16 where the hardware multiplies it natively, else float32 on a CPU
    # (tokenmill.platform.choose_dtype); or float32 / bfloat16 / float16
    dtype: str = "auto"
    # "auto": "cpu" (K/V read in place by the compiled kernels) on a CPU where they build,
    # "triton" on a GPU where triton is installed, else "torch" (the reference)
    attention_backend: str = "auto"
    # Linear weights: "none" (the compute dtype's values; float32 on the CPU kernels keeps a
    # GGUF's quantized blocks in their bits, widened in the GEMM to the same float32 sums),
    # "int8" (per-channel scales), "int4" (groups of 32 with scales and offsets), "auto" (a
    # quantized GGUF stays as the file has it: Q8_0 as int8, Q4_0 / Q4_1 as int4, each with the
    # file's own block scales; else none), "fp8" (e4m3 with per-channel scales, times per-token
    # fp8 activations; for Hopper GPUs)
    quantization: str = "none"
    # KV cache storage: "auto" (the compute dtype), "bfloat16" (values rounded to bf16: half a
    # float32 cache), "int8" or "fp8" (e4m3; for GPUs), each with a scale per token and head
    kv_cache_dtype: str = "auto"
    # GPU: run every step eagerly (no CUDA graphs of the decode step)
    enforce_eager: bool = False
    # intra-op threads of the forward on a CPU (None: tokenmill.platform.default_threads)
    num_threads: int | None = None
    # Sampling seed of requests that bring none (derived per request from it and the arrival
    # order); None: such requests sample nondeterministically.
    seed: int | None = None
    # Structured output: offer the text a grammar forces next as drafts, verified in the same
    # forward (jump-forward); off, every token costs a step.
    jump_forward: bool = True
    # Batch-invariant output: a request's tokens and logprobs bit for bit the same whatever
    # else shares its batches and however its prompt was split (one reduction order per weight
    # and attention row; docs/batch_invariance.md). None: the plan's default (engine/plan.py);
    # True where the plan cannot promise it is refused.
    batch_invariant: bool | None = None
    # What the model serves: "generate", "embed" (embeddings; rerank and score by their
    # cosine), "score" (a cross-encoder's pair scores; "rerank" says the same); None: what its
    # files say (a sentence-transformers directory or a BERT: embed; a sequence classifier:
    # score; other decoders: generate)
    task: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # prefix-cache changes published as vLLM-format KV events (off by default)
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    # KV blocks moved to a decode instance or to host / disk tiers (off by default)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    # LoRA adapters served over the base model (off by default)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if isinstance(self.kv_events_config, dict):  # LLM(kv_events_config={...}), as vLLM's
            object.__setattr__(self, "kv_events_config",
                               KVEventsConfig.from_dict(self.kv_events_config))
        if self.kv_transfer.kv_offload != "none" and not self.cache.enable_prefix_caching:
            raise ValueError("--kv-offload spills the prefix cache: it needs prefix caching "
                             "(drop --no-prefix-cache)")
        # The CPU formats would be dequantized at load on a GPU: refused, not quietly dropped.
        if self.device.split(":")[0] == "cuda" and self.quantization in ("int8", "int4", "auto"):
            raise ValueError(f"quantization {self.quantization!r} (--quantization) runs on CPUs "
                             f"only for now; on {self.device} use none or fp8")
        _check_lora_parallel(self.lora, self.parallel)
        if self.task not in (None, "generate", "embed", "score", "rerank"):
            raise ValueError(f"unknown task {self.task!r}; use generate, embed or score "
                             "(rerank: score)")

    @classmethod
    def from_options(cls, model: str = DEFAULT_MODEL, **options: Any) -> EngineConfig:
        """Flat options (``max_num_seqs=8, block_size=32, device="cpu"``, any field of this
        class, ``CacheConfig`` or ``SchedulerConfig``) -> the nested config. Options left out
        keep the dataclasses' defaults, the only place defaults are written."""
        _check_speculative_options(options)
        sections: dict[str | None, dict[str, Any]] = {}
        for name, value in options.items():
            sections.setdefault(_section_of(name), {})[name] = value
        top = sections.pop(None, {})
        nested = {sec: _SECTIONS[sec](**values) for sec, values in sections.items()}
        return cls(model=model, **top, **nested)


def _check_lora_parallel(lora: LoRAConfig, parallel: ParallelConfig) -> None:
    """Adapters live in the engine's own process (``runner/lora.py``): ranks in other processes
    have none, so LoRA with them is refused before anything loads."""
    if not lora.enable_lora or not parallel.distributed:
        return
    raise ValueError(
        "--enable-lora serves adapters in one process for now: it does not go with "
        f"--tensor-parallel-size {parallel.tensor_parallel_size}, --pipeline-parallel-size "
        f"{parallel.pipeline_parallel_size}, --nnodes {parallel.nnodes} "
        f"(--distributed-executor-backend {parallel.distributed_executor_backend})")


_JSON_TYPES: dict[str, type] = {"bool": bool, "int": int, "str": str}


def _check_json_type(what: str, value: Any, annotation: str) -> None:
    """A JSON value against a field's annotation ("int", "str | None", ...): a wrong type named
    here, not as whatever comparison it would break later. JSON's true is not an int here."""
    kinds = annotation.split(" | ")
    if value is None and "None" in kinds:
        return
    allowed = tuple(_JSON_TYPES[k] for k in kinds if k in _JSON_TYPES)
    if isinstance(value, bool) != (bool in allowed) or not isinstance(value, allowed):
        raise ValueError(f"{what} must be {annotation}, got {value!r}")


_SECTIONS: dict[str, type] = {"cache": CacheConfig, "scheduler": SchedulerConfig,
                              "speculative": SpeculativeConfig, "parallel": ParallelConfig,
                              "kv_transfer": KVTransferConfig, "lora": LoRAConfig}
_SPECULATIVE_METHODS = ("ngram", "draft", "layerskip")
# speculative options that belong to one method; the others belong to every method
_SPECULATIVE_OPTION_METHODS = {"prompt_lookup_min": ("ngram",), "prompt_lookup_max": ("ngram",),
                               "speculative_model": ("draft",),
                               "speculative_draft_layers": ("layerskip",)}


def _check_speculative_options(options: dict[str, Any]) -> None:
    """A speculative option given without the method it belongs to would be ignored: refused
    before anything loads."""
    method = options.get("speculative_method")
    given = sorted(options.keys() & {f.name for f in fields(SpeculativeConfig)})
    for name in given:
        if name == "speculative_method":
            continue
        methods = _SPECULATIVE_OPTION_METHODS.get(name, _SPECULATIVE_METHODS)
        if method not in methods:
            allowed = " or ".join(filter(None, [", ".join(methods[:-1]), methods[-1]]))
            raise ValueError(f"speculative option {name} applies only with speculative_method "
                             f"{allowed} (--speculative-method); got {method or 'none'}")


def _section_of(option: str) -> str | None:
    """Which config holds ``option``: None for EngineConfig itself, else a section name."""
    if option in {f.name for f in fields(EngineConfig)} - {"model", *_SECTIONS}:
        return None
    for section, cls in _SECTIONS.items():
        if option in {f.name for f in fields(cls)}:
            return section
    raise TypeError(f"unknown engine option {option!r}; known: {sorted(engine_option_names())}")


def engine_option_names() -> list[str]:
    """Every flat option ``EngineConfig.from_options`` takes (besides ``model``)."""
    top = [f.name for f in fields(EngineConfig) if f.name not in {"model", *_SECTIONS}]
    return top + [f.name for cls in _SECTIONS.values() for f in fields(cls)]


def engine_option_default(option: str) -> Any:
    """The default of one flat option, read from its dataclass (for --help texts)."""
    section = _section_of(option)
    cls = EngineConfig if section is None else _SECTIONS[section]
    f = next(f for f in fields(cls) if f.name == option)
    return f.default_factory() if f.default is MISSING else f.default
