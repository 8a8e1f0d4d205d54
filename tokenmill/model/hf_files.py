"""Read a model from a local Hugging Face directory (config.json + safetensors): the fields every
family shares here, the family's own by its hook (``model/registry.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenmill.config import ModelConfig, RopeScaling
from tokenmill.errors import ModelLoadError
from tokenmill.model.registry import HF_MODEL_TYPES, family_config_hf


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
        cfg = _config_from_dict(raw, HF_MODEL_TYPES[model_type], model_dir)
        return family_config_hf(raw, cfg)
    except KeyError as e:
        raise ModelLoadError(f"{model_dir}/config.json lacks required key {e}") from e


def _config_from_dict(raw: dict, arch: str, model_dir: Path) -> ModelConfig:
    heads = raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}  # transformers >= 5 nests RoPE settings here
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    max_pos = raw.get("max_position_embeddings", 2048)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "mistral") else None
    if window:
        # Sliding-window attention is not implemented: stay within the window, where it is exact.
        max_pos = min(max_pos, window)
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
        rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope, model_dir),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or raw.get("attention_bias", False),
        qk_norm=arch == "qwen3",
        mlp_bias=raw.get("mlp_bias", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )


def _rope_scaling(rs: dict, model_dir: Path) -> RopeScaling:
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
    raise ModelLoadError(f"{model_dir}: RoPE scaling type {kind!r} is not supported "
                         "(supported: default, linear, llama3)")


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
