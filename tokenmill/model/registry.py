"""Architecture families: each one's model class and what reading its files needs beyond the
Llama family's defaults. A new family is a model file and an entry here, nothing else.

``hf_files.py`` reads the fields every family shares from ``config.json``, then the family's
``hf_config`` adds its own; ``gguf_file.py`` likewise from GGUF metadata (``gguf_config``) and
maps the family's extra tensor names (``gguf_names``). ``model_type`` / GGUF architecture names
that select a family are listed in ``HF_MODEL_TYPES`` and ``GGUF_ARCHES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    # "module:Class", imported when a model of the family is built
    model: str
    # (config.json as a dict, the shared fields read) -> the family's config
    hf_config: Callable[[dict, ModelConfig], ModelConfig] | None = None
    # (GGUF reader, the file's architecture name, the shared fields read) -> the family's config
    gguf_config: Callable[[Any, str, ModelConfig], ModelConfig] | None = None
    # GGUF per-layer tensor name (``blk.N.<name>.weight``) -> Hugging Face sub-name, beyond
    # the Llama family's (gguf_file._LAYER_NAMES)
    gguf_names: Mapping[str, str] = field(default_factory=dict)
    # the decoder layers may run as the fused CPU step (runner/cpu_step.py)
    fused_step: bool = False
    # tensor / pipeline parallel ranks, LoRA adapters and layer-skip drafting know its layers
    parallel: bool = False
    lora: bool = False


def _hook(path: str) -> Callable:
    """A family's config reader by "module:function", imported when first called."""
    module, _, name = path.partition(":")

    def call(*args):
        return getattr(importlib.import_module(module), name)(*args)

    return call


_LLAMA = Family("tokenmill.model.llama:LlamaForCausalLM", fused_step=True, parallel=True,
                lora=True)

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
}

# config.json's model_type -> family
HF_MODEL_TYPES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
                                  "qwen3": "qwen3"}
# GGUF general.architecture -> family (Mistral files say "llama")
GGUF_ARCHES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                               "qwen3": "qwen3"}


def family(architecture: str) -> Family:
    if architecture not in FAMILIES:
        raise ModelLoadError(f"architecture {architecture!r} is not supported "
                             f"(supported: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[architecture]


def model_class(architecture: str) -> type[nn.Module]:
    module, _, name = family(architecture).model.partition(":")
    return getattr(importlib.import_module(module), name)


def family_config_hf(raw: dict, cfg: ModelConfig) -> ModelConfig:
    hook = family(cfg.architecture).hf_config
    return cfg if hook is None else hook(raw, cfg)


def family_config_gguf(reader, arch: str, cfg: ModelConfig) -> ModelConfig:
    hook = family(cfg.architecture).gguf_config
    return cfg if hook is None else hook(reader, arch, cfg)


__all__ = ["FAMILIES", "Family", "GGUF_ARCHES", "HF_MODEL_TYPES", "family", "model_class"]
