"""A worker: the model, its KV cache and the step's set-up, built from a ``WorkerSpec``.

The spec is the part of the engine's load-time plan a worker needs, as plain data, so it can go
to a worker in another process as it is; ``build_worker`` follows it and decides nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.config import LoRAConfig
    from tokenmill.distributed.groups import Comm
    from tokenmill.distributed.layout import RankPosition
    from tokenmill.kv_transfer.factory import KVTransferSpec
    from tokenmill.kv_transfer.worker import ConnectorWorker
    from tokenmill.model.linear.plan import LinearPlan
    from tokenmill.model.loader import LoadedModel
    from tokenmill.runner.model_runner import ModelRunner

logger = logging.getLogger("tokenmill.executor")


@dataclass(frozen=True)
class WorkerSpec:
    model: str  # the resolved model file or directory
    device: str
    dtype: str
    attention_backend: str
    linear: LinearPlan
    block_size: int
    num_blocks: int | None  # None: sized from the GPU memory the loaded model leaves
    kv_cache_dtype: str
    draft_bytes_per_block: int  # a drafting model's K/V at the same block ids
    max_model_len: int
    graph_batch: int = 0  # capture decode steps of up to this many sequences (0: none)
    fuse_cpu_step: bool = False  # the decoder layers as one C++ call (runner/cpu_step.py)
    governor_threads: int = 0  # a ThreadGovernor over this many threads (0: none)
    planned_cpu_step: str = "off"  # what the plan said of the CPU step, reported when unfused
    max_batched_tokens: int = 2048  # the scheduler's token budget of a step
    kv_transfer: KVTransferSpec | None = None  # a KV connector's worker side (None: off)
    lora: LoRAConfig | None = None  # LoRA adapters served over the model (None: off)


@dataclass
class Worker:
    runner: ModelRunner
    loaded: LoadedModel
    cpu_step: str  # what runs: "fused ...", "eager: <why>", or "off" on a GPU
    connector: ConnectorWorker | None = None  # moves KV blocks in and out (kv_transfer/)


def build_worker(spec: WorkerSpec, position: RankPosition | None = None,
                 comm: Comm | None = None) -> Worker:
    """Load the model as ``spec.linear`` says, allocate its KV cache, and set up graphs, the
    fused CPU step and the thread governor where the spec has them. ``position``: only this
    rank's part of the model, joined to the others' by ``comm`` (tensor / pipeline parallel)."""
    from tokenmill.model.gguf_file import release_gguf
    from tokenmill.model.loader import load_model
    from tokenmill.runner.model_runner import ModelRunner

    loaded = load_model(spec.model, spec.device, spec.dtype, spec.attention_backend,
                        spec.linear.quantization, plan=spec.linear, position=position,
                        comm=comm)
    release_gguf()  # the weights are in: the file's parsed index is not needed any more
    runner = ModelRunner(loaded, _num_blocks(spec, loaded), spec.block_size, spec.device,
                         spec.kv_cache_dtype)
    connector = None
    if spec.kv_transfer is not None:
        from tokenmill.kv_transfer.factory import build_worker_connector

        rank, world = (0, 1) if position is None else (position.rank,
                                                         position.layout.world_size)
        connector = build_worker_connector(spec.kv_transfer, runner.kv_caches, rank, world)
    cpu_step = _set_up_step(spec, runner, comm)
    if spec.lora is not None:  # after the fused step exists: the adapters' slots hook into it
        _add_lora_manager(spec, runner, loaded)
    return Worker(runner, loaded, cpu_step, connector)


def _add_lora_manager(spec: WorkerSpec, runner: ModelRunner, loaded: LoadedModel) -> None:
    import torch

    from tokenmill.runner.lora import LoRAManager

    # the compiled CPU kernels the layers already use (None: the torch reference)
    ops = getattr(loaded.model.model.layers[0].self_attn.backend, "ops", None)
    runner.lora = LoRAManager(loaded.model, spec.lora, loaded.config,
                              getattr(torch, spec.dtype), ops)


def _num_blocks(spec: WorkerSpec, loaded: LoadedModel) -> int:
    if spec.num_blocks is not None:
        return spec.num_blocks
    import torch

    from tokenmill.runner.kv_cache import num_kv_blocks

    return num_kv_blocks(loaded.config, spec.block_size, getattr(torch, spec.dtype),
                         spec.device, extra_bytes_per_block=spec.draft_bytes_per_block,
                         kv_cache_dtype=spec.kv_cache_dtype)


def _set_up_step(spec: WorkerSpec, runner: ModelRunner, comm: Comm | None = None) -> str:
    if spec.graph_batch:
        runner.capture_graphs(spec.graph_batch, spec.max_model_len)
    if spec.governor_threads:
        from tokenmill.runner.threads import ThreadGovernor

        runner.governor = ThreadGovernor(spec.governor_threads)
    if not spec.fuse_cpu_step:
        return spec.planned_cpu_step
    if comm is not None and comm.tp_group is not None and comm.shm is None:
        return "eager: the TP group all-reduces through gloo (--disable-custom-all-reduce, " \
               "ranks on several hosts, or no CPU kernels), which the C++ step cannot call"
    built = runner.fuse_cpu_step(None if comm is None or comm.shm is None else comm.shm.native)
    if not built.startswith("fused"):
        logger.warning("the plan fused the CPU step, but the loaded model runs %s", built)
    return built
