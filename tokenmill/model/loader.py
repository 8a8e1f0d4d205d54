"""Build a model from local files: resolve the source, read its config, load its weights."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.attention import AttentionBackend, default_backend, get_backend
from tokenmill.config import ModelConfig
from tokenmill.distributed.layout import RankPosition
from tokenmill.errors import ModelLoadError
from tokenmill.kernels.cpu import load as load_cpu_kernels
from tokenmill.model.linear import LinearPlan, plan_linears
from tokenmill.model.layers import Linear
from tokenmill.model.linear.setup import apply_formats, build_kernels, choose_onednn_rows
from tokenmill.model.linear.setup import choose_widen_rows, describe_weights, format_linear
from tokenmill.model.linear.setup import layer_role, named_linears, route_to_onednn
from tokenmill.model.linear.setup import route_widened
from tokenmill.model.linear.setup import tie_quantized_head
from tokenmill.model.quant import QUANTIZATIONS, QuantWeight, dequantize
from tokenmill.model.registry import model_class
from tokenmill.model.sharding import rank_slice, stage_name
from tokenmill.model_source import ModelSource, resolve_model
from tokenmill.platform import Machine
from tokenmill.util import release_free_heap, tracked

if TYPE_CHECKING:
    from tokenmill.kernels.triton_fused import FusedOps

log = logging.getLogger("tokenmill.model")

# checkpoint sub-name -> (fused parameter sub-name, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    source: ModelSource
    quantization: str = "none"  # the linear weights' formats as loaded (describe_weights)
    plan: LinearPlan | None = None  # what the linears were built from
    # tensor / pipeline parallel: this rank's place (``config`` is then its part's shape)
    position: RankPosition | None = None
    # per linear layer, the kernel it got (a size the plan's first kernel cannot take shows
    # its fallback) and, where the oneDNN trial ran, the rows it routed from (None: none)
    kernels: dict[str, str] = field(default_factory=dict)
    onednn_rows: int | None = None
    widen_rows: int | None = None  # packed bf16: float32 FMAs from this many rows
    # bf16 attention on the CPU kernel: float32 FMAs from this many rows per work item
    attention_widen_rows: int | None = None


def load_model(model: str, device: str = "cpu", dtype: str = "float32",
               attention_backend: str = "auto", quantization: str = "none", *,
               plan: LinearPlan | None = None, position: RankPosition | None = None,
               comm=None) -> LoadedModel:
    """Load ``model`` (a path or known name) onto ``device`` with weights in ``dtype``;
    attention by the named backend (``auto``: ``default_backend(device)``); linear weights
    quantized as ``quantization`` says (model/quant.py) and multiplied by the kernels ``plan``
    names (None: ``plan_linears`` for this machine; a plan replaces ``quantization``).
    ``position``: only this rank's part of the model (``model/sharding.py``), joined to the
    other ranks' by ``comm`` (``distributed.groups.Comm``)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of "
                         f"{', '.join(QUANTIZATIONS)}")
    backend = get_backend(default_backend(device) if attention_backend == "auto"
                          else attention_backend)
    ops = getattr(backend, "ops", None)  # the compiled CPU kernels also fuse the layers' steps
    plan = plan or plan_linears(_machine(device, ops, quantization), dtype, quantization,
                                cpu_kernels=ops is not None)
    if plan.dtype != dtype:
        raise ValueError(f"a plan for {plan.dtype} weights given to load {dtype} ones")
    for note in plan.notes:
        log.warning(note)
    source = resolve_model(model)
    cfg, weights = read_checkpoint(source, dtype, plan.keep_gguf_blocks)
    local = cfg if position is None else position.local_config(cfg)
    module = build_model(local, device, backend, comm)
    if position is not None:
        weights = _rank_weights(weights, position, cfg)

    def format_now(name: str, layer: Linear) -> None:
        format_linear(layer, layer_role(name), plan)
        if layer is getattr(module, "lm_head", None):
            tie_quantized_head(module)  # the tied embedding's float32 table goes too

    # each linear in the plan's format as soon as its weight is in: a float32 model to
    # quantize is never whole in memory beside its quantized copy
    load_weights(module, weights, str(source.path), on_linear=format_now)
    loaded = LoadedModel(module, local, source, plan=plan, position=position)
    build_linears(loaded, ops)
    if getattr(backend, "name", None) == "cpu" and local.dtype == "bfloat16":
        choose_attention_route(loaded, ops)
    use_gpu_ops(module, fused_gpu_ops(module, device, backend))
    release_free_heap()
    return loaded


def choose_attention_route(loaded: LoadedModel, ops) -> None:
    """bf16 attention's products by vdpbf16ps or by float32 FMAs with its bits, per kind of
    work item, as the load's trial measures them (``attention/cpu_trial.py``); process-wide in
    the kernel, as the two differ in pace only."""
    from tokenmill.attention import cpu_trial

    cfg = loaded.config
    if ops is None or not cpu_trial.WIDEN_TRIAL:
        return
    loaded.attention_widen_rows = cpu_trial.choose_widen_rows(
        ops, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    ops.set_attention_widen_from(loaded.attention_widen_rows or 0)


def fused_gpu_ops(module: nn.Module, device: str, backend: AttentionBackend
                  ) -> FusedOps | None:
    """The fused Triton kernels of a decoder layer (``kernels/triton_fused.py``) for the Llama
    family on a GPU under the Triton attention backend (which is told when the fused RoPE
    kernel stored the K/V already); None elsewhere."""
    from tokenmill.model.llama import LlamaForCausalLM

    if (not str(device).startswith("cuda") or getattr(backend, "name", None) != "triton"
            or type(module) is not LlamaForCausalLM):
        return None
    from tokenmill.kernels.triton_fused import FusedOps

    return FusedOps()


def use_gpu_ops(module: nn.Module, ops: FusedOps | None) -> None:
    """Hand ``ops`` (a ``FusedOps``, or None: PyTorch's) to every module that takes them."""
    for layer in module.modules():
        if hasattr(layer, "gpu_ops"):
            layer.gpu_ops = ops


def _machine(device: str, ops, quantization: str) -> Machine:
    """This machine; its CPU kernels are loaded to find out only where something uses them
    (the layers', or quantized weights' even under PyTorch's reference attention)."""
    built = True if ops is not None else (None if quantization != "none" else False)
    return Machine.detect(device, kernels_built=built)


def read_checkpoint(source: ModelSource, dtype: str, keep_gguf_blocks: bool
                    ) -> tuple[ModelConfig, Iterable[tuple[str, torch.Tensor]]]:
    """The model's config and its (name, tensor) pairs; a GGUF's quantized blocks come as
    ``QuantWeight``s where ``keep_gguf_blocks``."""
    if source.kind == "gguf":
        from tokenmill.model.gguf_file import gguf_model_config, gguf_weights, open_gguf

        reader = open_gguf(source.path)
        cfg = gguf_model_config(reader, source.path).with_dtype(dtype)
        return cfg, gguf_weights(reader, cfg, source.path, keep_quantized=keep_gguf_blocks)
    from tokenmill.model.hf_files import hf_model_config, hf_weights

    return hf_model_config(source.path).with_dtype(dtype), hf_weights(source.path)


def build_linears(loaded: LoadedModel, ops) -> None:
    """The linears in the plan's formats and kernels (``model/linear/setup.py``), the layers'
    other CPU kernels (``ops``) set, and the oneDNN and float32-FMA trials run where the plan
    says."""
    module, plan = loaded.model, loaded.plan
    apply_formats(module, plan)
    quant_ops = ops if ops is not None else load_cpu_kernels() if plan.needs_quant_ops else None
    kernels = build_kernels(module, plan, ops, quant_ops)
    loaded.quantization = describe_weights(kernels, plan.quantization)
    for layer in module.modules():
        if hasattr(layer, "cpu_ops"):
            layer.cpu_ops = ops
    if plan.onednn_trial:
        loaded.onednn_rows = choose_onednn_rows(module, ops)
        route_to_onednn(module, loaded.onednn_rows, ops)
    if plan.widen_trial:
        loaded.widen_rows = choose_widen_rows(module)
        route_widened(module, loaded.widen_rows)
    loaded.kernels = {name: m.kernel.describe() for name, m in module.named_modules()
                      if hasattr(m, "kernel")}


def _rank_weights(weights: Iterable[tuple[str, torch.Tensor]], position: RankPosition,
                  cfg: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint as this rank sees it: its stage's layers renumbered, each tensor cut to
    the rank's slice before anything else holds it."""
    for name, tensor in weights:
        local = stage_name(name, position)
        if local is not None:
            target, shard = _target(local)
            yield local, rank_slice(target, shard, tensor, position, cfg)


def build_model(cfg: ModelConfig, device: str, backend: AttentionBackend,
                comm=None) -> nn.Module:
    # Parameters are created directly in the compute dtype on the device; RoPE tables ask
    # for float32 explicitly and stay that way.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, cfg.dtype))
    try:
        with torch.device(device):
            cls = model_class(cfg.architecture)
            module = cls(cfg, backend) if comm is None else cls(cfg, backend, comm=comm)
    finally:
        torch.set_default_dtype(previous)
    return module.eval()


def load_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 origin: str, on_linear: Callable[[str, Linear], None] | None = None) -> None:
    """Copy checkpoint tensors into parameters through each parameter's weight_loader. A model
    whose checkpoints name or shape tensors differently from its parameters (experts stored
    one by one, a fused projection to split) maps them by its ``checkpoint_weights``.
    ``on_linear(name, layer)`` is called for each linear layer once its weight's last shard
    is in (a tied output layer's: once the embedding's is)."""
    adapt = getattr(module, "checkpoint_weights", None)
    if adapt is not None:
        weights = adapt(weights)
    params: dict[str, nn.Parameter | object] = dict(module.named_parameters())
    finished = object()  # in ``params`` for a weight that ``on_linear`` replaced
    linears: dict[int, list[tuple[str, Linear]]] = {}  # parameter -> the linears it weighs
    for name, _, layer in named_linears(module) if on_linear is not None else ():
        if layer.weight is not None:
            linears.setdefault(id(layer.weight), []).append((name, layer))
    loaded: set[str] = set()
    for name, tensor in tracked(weights, f"loading {origin.rsplit('/', 1)[-1]}",
                                unit="tensors"):
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and getattr(module.config, "tie_word_embeddings", False):
            continue  # tied: the embedding is the output projection
        target, shard = _target(name)
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"{origin}: checkpoint tensor {name!r} has no place in the model")
        if param is finished:
            raise ModelLoadError(f"{origin}: checkpoint tensor {name!r} comes again after its "
                                 "layer was complete")
        if isinstance(tensor, QuantWeight):  # kept quantized where the layer takes it
            owner = module.get_submodule(target.rpartition(".")[0])
            if target.endswith(".weight") and hasattr(owner, "load_quantized"):
                try:
                    owner.load_quantized(tensor, shard)
                except ValueError as e:
                    raise ModelLoadError(f"{origin}: tensor {name!r}: {e}") from e
            else:
                tensor = dequantize(tensor)
        if not isinstance(tensor, QuantWeight):
            try:
                with torch.no_grad():
                    param.weight_loader(param, tensor.to(param.dtype),
                                        *([] if shard is None else [shard]))
            except ValueError as e:
                raise ModelLoadError(f"{origin}: tensor {name!r}: {e}") from e
        loaded.add(f"{target}:{shard}")
        users = linears.get(id(param), ())
        if users and all(f"{target}:{s}" in loaded for s in _shards(param)):
            for owner_name, owner in users:
                on_linear(owner_name, owner)
            if all(owner.weight is not param for _, owner in users):
                params[target] = finished  # quantized: the loader's was its last reference
    _check_complete(module, loaded, origin)


def _target(name: str) -> tuple[str, object]:
    for part, (fused, shard) in _STACKED.items():
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def _shards(param: nn.Parameter) -> list:
    """The shard ids a parameter is loaded in (a fused projection's), or [None]."""
    offsets = getattr(getattr(param.weight_loader, "__self__", None), "offsets", None)
    return list(offsets) if offsets else [None]


def _check_complete(module: nn.Module, loaded: set[str], origin: str) -> None:
    missing = []
    for name, param in module.named_parameters():
        missing += [f"{name}[{s}]" if s is not None else name
                    for s in _shards(param) if f"{name}:{s}" not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{origin}: checkpoint lacks {len(missing)} tensors: {shown}")
