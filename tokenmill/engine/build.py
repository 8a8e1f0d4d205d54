"""Build an engine by following its load-time plan (``engine/plan.py``), deciding nothing.

Order: threads and allocator -> the executor's worker (model with weights as ``plan.linear``
says, KV cache, CUDA graphs or the fused CPU step) -> tokenizer, drafter, scheduler, structured
output. Where the built thing does not match the plan (a layer the fused CPU step cannot take
after all), the log says so and ``EngineInfo`` reports what runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tokenmill.engine.info import EngineInfo
from tokenmill.engine.plan import ExecutionPlan, make_plan
from tokenmill.executor import Executor, UniProcExecutor
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig, LoRAConfig
    from tokenmill.engine.kv_publisher import KVEventPublisher
    from tokenmill.kv_transfer.base import KVConnectorScheduler
    from tokenmill.model.loader import LoadedModel

logger = logging.getLogger("tokenmill.engine")


@dataclass
class EngineParts:
    """What ``LLMEngine`` is made of (its constructor's arguments)."""

    scheduler: Scheduler
    executor: Executor
    tokenizer: Any
    info: EngineInfo
    proposer: Any
    structured: Any
    seed: int | None
    kv_publisher: KVEventPublisher | None = None  # --kv-events-config: the cache's events
    lora: LoRAConfig | None = None  # the adapters' limits (None: LoRA off)
    served_model_name: str | None = None  # the base model's name (no adapter may take it)


def build_engine_parts(config: EngineConfig, plan: ExecutionPlan | None = None) -> EngineParts:
    """The parts of the engine ``config`` describes, on this machine (``make_plan`` unless
    given): ``LLMEngine(**vars(parts))``."""
    plan = plan or make_plan(config)
    logger.info("%s", plan)
    publisher = _open_kv_publisher(config)  # before the model loads: a busy port fails fast
    try:
        parts = _build_parts(config, plan)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    if publisher is not None:
        _attach_kv_publisher(parts, publisher, config)
    return parts


def _open_kv_publisher(config: EngineConfig) -> KVEventPublisher | None:
    if not config.kv_events_config.publishing:
        return None  # the cache then logs nothing and hashes nothing: no cost at all
    from tokenmill.engine.kv_publisher import KVEventPublisher

    return KVEventPublisher(config.kv_events_config, config.cache.block_size)


def _attach_kv_publisher(parts: EngineParts, publisher: KVEventPublisher,
                         config: EngineConfig) -> None:
    """The prefix cache logs its changes from now on (it is still empty); the engine sends
    them, and its info says where."""
    parts.scheduler.block_manager.prefix_cache.enable_events()
    parts.kv_publisher = publisher
    parts.info = replace(parts.info, kv_events=publisher.describe())
    if not config.cache.enable_prefix_caching:
        logger.warning("KV events are on but the prefix cache is off (--no-prefix-cache): "
                       "no event will be published")
    logger.info("KV events: publishing on %s (replay: %s)", publisher.endpoint,
                publisher.replay_endpoint)


def _build_parts(config: EngineConfig, plan: ExecutionPlan) -> EngineParts:
    from tokenmill.speculative import build_decoder, load_draft_model
    from tokenmill.structured.backend import GrammarBackend
    from tokenmill.structured.manager import StructuredOutputManager
    from tokenmill.tokenizer import load_tokenizer

    _set_up_process(config, plan)
    executor, loaded = _start_executor(plan)
    tokenizer = load_tokenizer(config.model)
    draft = load_draft_model(config.speculative, loaded, plan.model_config, tokenizer,
                             config.device, plan.dtype, plan.attention_backend)
    connector = _kv_connector(config, plan, executor)
    scheduler = Scheduler(replace(config.scheduler, max_model_len=plan.max_model_len),
                          config.cache, num_blocks=executor.kv_capacity,
                          eos_token_ids={*tokenizer.eos_token_ids,
                                         *plan.model_config.eos_token_ids},
                          connector=connector, max_loras=_max_loras(config))
    rope = plan.model_config.rope_scaling
    if rope.kind == "longrope":
        scheduler.rope_boundary = rope.original_max_position_embeddings
    if plan.model_config.every_layer_windowed and connector is None \
            and not config.speculative.speculative_method:
        # blocks wholly behind every layer's window are never read again: released as the
        # sequence moves on (not with a KV connector, which may read any block, nor under
        # speculation, whose drafter writes through the same tables)
        scheduler.block_manager.sliding_window = plan.model_config.sliding_window
    if connector is not None and hasattr(connector, "blocks_evicted"):  # offload tiers
        scheduler.block_manager.prefix_cache.set_block_listener(connector)
    proposer = build_decoder(config.speculative, draft, executor.kv_capacity,
                             plan.kv.block_size, config.device,
                             config.scheduler.max_num_batched_tokens,
                             block_manager=scheduler.block_manager)
    grammars = GrammarBackend(tokenizer.backend.to_str(), plan.model_config.vocab_size,
                              sorted(scheduler.eos_token_ids))
    info = engine_info(config, plan, executor)
    if connector is not None:
        info = replace(info, kv_transfer=connector.describe())
        logger.info("KV connector: %s", info.kv_transfer)
    return EngineParts(scheduler, executor, tokenizer, info, proposer,
                       StructuredOutputManager(grammars, config.jump_forward), config.seed,
                       lora=config.lora if config.lora.enable_lora else None,
                       served_model_name=config.model)


def _max_loras(config: EngineConfig) -> int | None:
    """Distinct adapters the scheduler lets run at once (None: no adapters, no limit)."""
    return config.lora.max_loras if config.lora.enable_lora else None


def _kv_connector(config: EngineConfig, plan: ExecutionPlan,
                  executor: Executor) -> KVConnectorScheduler | None:
    """The scheduler's side of the KV connector, built from what the workers' side found."""
    info = executor.kv_connector_info()
    if info is None:
        return None
    from tokenmill.kv_transfer.factory import build_scheduler_connector

    return build_scheduler_connector(config.kv_transfer, plan.kv.block_size, info,
                                     tp_size=plan.parallel.tensor_parallel_size)


def run_headless_node(config: EngineConfig) -> int:
    """``tokenmill serve --node-rank N`` (N > 0): this node's ranks of the engine that node 0
    runs; returns when they end (their worst exit status)."""
    from tokenmill.executor.multiproc import run_headless

    plan = make_plan(config)
    logger.info("%s", plan)
    return run_headless(plan.distributed_spec())


def _start_executor(plan: ExecutionPlan) -> tuple[Executor, LoadedModel | None]:
    """The executor the plan asks for, and the loaded model where it is in this process."""
    if not plan.parallel.distributed:
        executor, worker = UniProcExecutor.from_spec(plan.worker_spec())
        return executor, worker.loaded
    if plan.parallel.distributed_executor_backend == "ray":
        from tokenmill.executor.ray_launcher import RayLauncher

        return MultiprocExecutor(plan.distributed_spec(), RayLauncher()), None
    return MultiprocExecutor(plan.distributed_spec()), None


def _set_up_process(config: EngineConfig, plan: ExecutionPlan) -> None:
    import torch

    from tokenmill.platform import configure_allocator, configure_threads

    if plan.threads:
        configure_threads(plan.threads)
        configure_allocator()
    if config.seed is not None:
        torch.manual_seed(config.seed)


def engine_info(config: EngineConfig, plan: ExecutionPlan, executor: Executor) -> EngineInfo:
    from tokenmill.platform import cpu_description

    details = executor.describe()
    return EngineInfo(
        plan.model, plan.model_config.vocab_size, plan.max_model_len,
        (executor.kv_capacity - 1) * plan.kv.block_size,  # block 0 is padding
        config.scheduler.max_num_seqs, plan.kv.block_size, plan.dtype, plan.dtype_reason,
        plan.attention_backend, details["quantization"], plan.kv_cache_dtype,
        plan.kv_cache_dtype_reason, details["cuda_graphs"], details["cpu_step"],
        {} if plan.on_gpu else cpu_description(), plan.speculative, plan=plan.describe(),
        parallel=details if plan.parallel.distributed else {})
