"""Architecture families: each one's model class and what reading its files needs beyond the
Llama family's defaults. A new family is a model file, an entry here and, where its files
hold more than the shared fields, a config hook in ``family_config.py`` (torch-free: configs
are read before torch is imported).

``hf_files.py`` reads the fields every family shares from ``config.json``, then the family's
``hf_config`` adds its own; ``gguf_file.py`` likewise from GGUF metadata (``gguf_config``) and
maps the family's extra tensor names (``gguf_names``). ``model_type`` / GGUF architecture names
that select a family are listed in ``HF_MODEL_TYPES`` and ``GGUF_ARCHES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError

if TYPE_CHECKING:
    from torch import nn


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
                lora=True,  # a "llama" GGUF with experts is Mixtral: its hook says so
                gguf_config=_hook("tokenmill.model.family_config:gguf_llama"))

# mixture of experts (model/moe_families.py): llama.cpp's expert tensors, stacked (E, out, in)
_MOE_GGUF = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
             "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
             "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj",
             "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_MOE = "tokenmill.model.moe_families:MoEForCausalLM"
_QWEN_MOE = Family(_MOE, hf_config=_hook("tokenmill.model.family_config:hf_qwen_moe"),
                   gguf_config=_hook("tokenmill.model.family_config:gguf_qwen_moe"),
                   gguf_names=_MOE_GGUF)

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "qwen2_moe": _QWEN_MOE, "qwen3_moe": _QWEN_MOE,
    "mixtral": Family(_MOE, hf_config=_hook("tokenmill.model.family_config:hf_mixtral"),
                      gguf_names=_MOE_GGUF, fused_step=True),
    "gpt_oss": Family(_MOE, hf_config=_hook("tokenmill.model.family_config:hf_gpt_oss")),
    "gemma3": Family("tokenmill.model.gemma3:Gemma3ForCausalLM",
                     hf_config=_hook("tokenmill.model.family_config:hf_gemma3"),
                     gguf_config=_hook("tokenmill.model.family_config:gguf_gemma3"),
                     gguf_names={"post_attention_norm": "post_attention_layernorm",
                                 "ffn_norm": "pre_feedforward_layernorm",
                                 "post_ffw_norm": "post_feedforward_layernorm"}),
    "phi3": Family("tokenmill.model.phi3:Phi3ForCausalLM",
                   hf_config=_hook("tokenmill.model.family_config:hf_phi3"),
                   gguf_config=_hook("tokenmill.model.family_config:gguf_phi3"),
                   gguf_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                   fused_step=True),
    # encoders (model/bert.py): the hook makes a sequence classifier "bert_classifier"
    "bert": Family("tokenmill.model.bert:BertModel",
                   hf_config=_hook("tokenmill.model.bert:hf_config")),
    "bert_classifier": Family("tokenmill.model.bert:BertForSequenceClassification",
                              hf_config=_hook("tokenmill.model.bert:hf_config")),
}

# config.json's model_type -> family
HF_MODEL_TYPES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
                                  "qwen3": "qwen3",
                                  "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe",
                                  "mixtral": "mixtral", "gpt_oss": "gpt_oss",
                                  "gemma3_text": "gemma3", "gemma3": "gemma3",
                                  "phi3": "phi3", "bert": "bert"}
# GGUF general.architecture -> family (Mistral files say "llama")
GGUF_ARCHES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                               "qwen3": "qwen3",
                               "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                               "gemma3": "gemma3", "phi3": "phi3"}


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
