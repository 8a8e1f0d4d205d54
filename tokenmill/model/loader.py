"""Build a model from local files: resolve the source, read its config, load its weights."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention import AttentionBackend, default_backend, get_backend
from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.model.layers import pack_linear_weights
from tokenmill.model.registry import model_class
from tokenmill.model_source import ModelSource, resolve_model

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
    quantization: str = "none"  # the linear weights' format as loaded


def load_model(model: str, device: str = "cpu", dtype: str = "float32",
               attention_backend: str = "auto", quantization: str = "none") -> LoadedModel:
    """Load ``model`` (a path or known name) onto ``device`` with weights in ``dtype``;
    attention by the named backend (``auto``: ``default_backend(device)``)."""
    source = resolve_model(model)
    if source.kind == "gguf":
        from tokenmill.model.gguf_file import gguf_model_config, gguf_weights, open_gguf

        reader = open_gguf(source.path)
        cfg = gguf_model_config(reader, source.path).with_dtype(dtype)
        weights = gguf_weights(reader, cfg, source.path)
    else:
        from tokenmill.model.hf_files import hf_model_config, hf_weights

        cfg = hf_model_config(source.path).with_dtype(dtype)
        weights = hf_weights(source.path)
    if attention_backend == "auto":
        attention_backend = default_backend(device)
    backend = get_backend(attention_backend)
    module = build_model(cfg, device, backend)
    load_weights(module, weights, str(source.path))
    pack_linear_weights(module)
    ops = getattr(backend, "ops", None)  # the compiled CPU kernels also fuse the layers' steps
    for layer in module.modules():
        if hasattr(layer, "cpu_ops"):
            layer.cpu_ops = ops
    return LoadedModel(module, cfg, source)


def build_model(cfg: ModelConfig, device: str, backend: AttentionBackend) -> nn.Module:
    # Parameters are created directly in the compute dtype on the device; RoPE tables ask
    # for float32 explicitly and stay that way.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, cfg.dtype))
    try:
        with torch.device(device):
            module = model_class(cfg.architecture)(cfg, backend)
    finally:
        torch.set_default_dtype(previous)
    return module.eval()


def load_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 origin: str) -> None:
    """Copy checkpoint tensors into parameters through each parameter's weight_loader."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and getattr(module.config, "tie_word_embeddings", False):
            continue  # tied: the embedding is the output projection
        target, shard = _target(name)
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"{origin}: checkpoint tensor {name!r} has no place in the model")
        try:
            with torch.no_grad():
                param.weight_loader(param, tensor.to(param.dtype), *([] if shard is None else [shard]))
        except ValueError as e:
            raise ModelLoadError(f"{origin}: tensor {name!r}: {e}") from e
        loaded.add(f"{target}:{shard}")
    _check_complete(module, loaded, origin)


def _target(name: str) -> tuple[str, object]:
    for part, (fused, shard) in _STACKED.items():
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def _check_complete(module: nn.Module, loaded: set[str], origin: str) -> None:
    missing = []
    for name, param in module.named_parameters():
        offsets = getattr(getattr(param.weight_loader, "__self__", None), "offsets", None)
        shards = list(offsets) if offsets else [None]
        missing += [f"{name}[{s}]" if s is not None else name
                    for s in shards if f"{name}:{s}" not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{origin}: checkpoint lacks {len(missing)} tensors: {shown}")
