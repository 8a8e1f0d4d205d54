"""Read a model from a local Hugging Face directory (config.json + safetensors): the fields every
family shares here, the family's own by its hook (``model/registry.py``)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.config import ModelConfig, RopeScaling
from tokenmill.errors import ModelLoadError
from tokenmill.model.registry import HF_MODEL_TYPES, family_config_hf

if TYPE_CHECKING:  # a checkpoint's config is read without torch (serve, before the core)
    import torch


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def hf_model_config(model_dir: Path) -> ModelConfig:
    raw = read_json(model_dir / "config.json")
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(f"{model_dir}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(sorted(HF_MODEL_TYPES))})")
    try:
        # a multimodal config (Gemma 3's) nests the language model's fields in text_config
        fields = {**raw, **raw["text_config"]} if "text_config" in raw else raw
        cfg = _config_from_dict(fields, HF_MODEL_TYPES[model_type], model_dir)
        return family_config_hf(raw, cfg)
    except KeyError as e:
        raise ModelLoadError(f"{model_dir}/config.json lacks required key {e}") from e


def _config_from_dict(raw: dict, arch: str, model_dir: Path) -> ModelConfig:
    heads = raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}  # transformers >= 5 nests RoPE settings here
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    max_pos = raw.get("max_position_embeddings", 2048)
    eos = raw.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=rope_scaling(raw.get("rope_scaling") or rope, raw, model_dir),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or raw.get("attention_bias", False),
        qk_norm=arch == "qwen3",
        mlp_bias=raw.get("mlp_bias", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        **_sliding_window(raw, arch),
    )


def _sliding_window(raw: dict, arch: str) -> dict:
    """``sliding_window`` and ``layer_types`` as transformers reads them: Qwens slide only
    with ``use_sliding_window``, and then the layers from ``max_window_layers`` on (unless the
    config lists its ``layer_types``); the others whenever a window is set."""
    window = raw.get("sliding_window")
    qwen = arch.startswith("qwen")
    if not window or not raw.get("use_sliding_window", not qwen):
        return {}
    types = tuple(raw.get("layer_types") or ())
    if not types and "max_window_layers" in raw and qwen:
        first = raw["max_window_layers"]
        types = tuple("sliding_attention" if i >= first else "full_attention"
                      for i in range(raw["num_hidden_layers"]))
    return {"sliding_window": int(window), "layer_types": types}


def rope_scaling(rs: dict, raw: dict, model_dir: Path) -> RopeScaling:
    """A config.json's RoPE scaling (``rs``: rope_scaling, or transformers 5's rope_parameters;
    ``raw``: the whole config, for fields some kinds keep beside it); ModelLoadError names a
    kind tokenmill does not implement."""
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3", factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
    if kind in ("longrope", "su", "yarn"):
        return _extended_rope(kind, rs, raw)
    raise ModelLoadError(f"{model_dir}: RoPE scaling type {kind!r} is not supported "
                         "(supported: default, linear, llama3, longrope, yarn)")


def _extended_rope(kind: str, rs: dict, raw: dict) -> RopeScaling:
    """LongRoPE (Phi-3/4; "su" in early Phi-3 files) or YaRN, their defaults resolved as
    transformers does: ``factor`` from the context's growth, the attention factor from
    DeepSeek's ``mscale`` / ``mscale_all_dim`` where given (else the kind's own formula)."""
    max_pos = raw.get("max_position_embeddings", 2048)
    # Phi-3 keeps the original context beside the scaling, and that one wins
    original = int(raw.get("original_max_position_embeddings")
                   or rs.get("original_max_position_embeddings") or max_pos)
    factor = float(rs.get("factor") or max_pos / original)
    attention = rs.get("attention_factor")
    if attention is None and rs.get("mscale") and rs.get("mscale_all_dim"):
        attention = _yarn_mscale(factor, rs["mscale"]) / _yarn_mscale(factor, rs["mscale_all_dim"])
    common = dict(factor=factor, original_max_position_embeddings=original,
                  attention_factor=None if attention is None else float(attention))
    if kind != "yarn":
        return RopeScaling(kind="longrope", short_factor=tuple(map(float, rs["short_factor"])),
                           long_factor=tuple(map(float, rs["long_factor"])), **common)
    return RopeScaling(kind="yarn", beta_fast=float(rs.get("beta_fast") or 32),
                       beta_slow=float(rs.get("beta_slow") or 1),
                       truncate=bool(rs.get("truncate", True)), **common)  # gpt-oss: False


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hf_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files (pytorch .bin checkpoints are "
                             "not loaded, convert them to safetensors)")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{file} is not a valid safetensors file: {e}") from e
