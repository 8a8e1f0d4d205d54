"""The families' config hooks (``registry.py``'s ``hf_config`` / ``gguf_config``): what a
family reads from ``config.json`` or GGUF metadata beyond the fields every family shares
(``hf_files.py``, ``gguf_file.py``). Kept apart from the model modules and free of torch: a
model's config is read without importing torch (``serve`` reads it to decide on the engine
process, before it spawns it). BERT's hook stays in ``bert.py`` (a pooling model runs in the
server's process anyway).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.model.gguf_file import field
from tokenmill.model.hf_files import rope_scaling as hf_rope_scaling


# ----- Llama (a "llama" GGUF may be Mixtral) ---------------------------------------------------

def gguf_llama(reader, arch: str, cfg: ModelConfig) -> ModelConfig:
    """A "llama" GGUF with ``llama.expert_count`` is Mixtral (llama.cpp's converter says so)."""
    experts = int(field(reader, f"{arch}.expert_count", 0) or 0)
    if not experts:
        return cfg
    return replace(cfg, architecture="mixtral", num_experts=experts,
                   num_experts_per_tok=int(field(reader, f"{arch}.expert_used_count")),
                   moe_intermediate_size=cfg.intermediate_size, extra=dict(norm_topk_prob=True))


# ----- mixture of experts (moe_families.py) ---------------------------------------------------

def hf_qwen_moe(raw: dict, cfg: ModelConfig) -> ModelConfig:
    qwen2 = cfg.architecture == "qwen2_moe"
    extra = dict(norm_topk_prob=raw.get("norm_topk_prob", False),
                 decoder_sparse_step=raw.get("decoder_sparse_step", 1),
                 mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
                 shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0)
                 if qwen2 else 0)
    return replace(cfg, num_experts=raw.get("num_experts") or raw["num_local_experts"],
                   num_experts_per_tok=raw["num_experts_per_tok"],
                   moe_intermediate_size=raw["moe_intermediate_size"], qk_norm=not qwen2,
                   attention_bias=raw.get("qkv_bias", True) if qwen2 else cfg.attention_bias,
                   extra=extra)


def hf_mixtral(raw: dict, cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, num_experts=raw["num_local_experts"],
                   num_experts_per_tok=raw["num_experts_per_tok"],
                   moe_intermediate_size=cfg.intermediate_size,
                   sliding_window=raw.get("sliding_window") or None,
                   extra=dict(norm_topk_prob=True))


def hf_gpt_oss(raw: dict, cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, num_experts=raw["num_local_experts"],
                   num_experts_per_tok=raw.get("num_experts_per_tok",
                                               raw.get("experts_per_token", 4)),
                   moe_intermediate_size=cfg.intermediate_size, attention_bias=True,
                   sliding_window=raw.get("sliding_window") or None,
                   layer_types=tuple(raw.get("layer_types") or ()),
                   extra=dict(softmax_first=False, router_bias=True, attention_sinks=True,
                              swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                              swiglu_limit=float(raw.get("swiglu_limit", 7.0))))


def gguf_qwen_moe(reader, arch: str, cfg: ModelConfig) -> ModelConfig:
    """qwen3moe (top-k renormalised, q/k norm) and qwen2moe (a shared expert) GGUFs."""
    qwen2 = arch == "qwen2moe"
    inter = int(field(reader, f"{arch}.expert_feed_forward_length"))
    norm = bool(field(reader, f"{arch}.expert_weights_norm", not qwen2))
    shared = int(field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0)
    return replace(cfg, num_experts=int(field(reader, f"{arch}.expert_count")),
                   num_experts_per_tok=int(field(reader, f"{arch}.expert_used_count")),
                   moe_intermediate_size=inter,
                   extra=dict(norm_topk_prob=norm, shared_expert_intermediate_size=shared))


# ----- Gemma 3 (gemma3.py) ---------------------------------------------------------------------

# the family's own settings, kept in ModelConfig.extra
_GEMMA3_DEFAULTS = {
    "query_pre_attn_scalar": 256.0,
    "rope_local_base_freq": 10000.0,
    "final_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh",
    # added to every norm weight at load: 1.0 for Hugging Face checkpoints (they hold w of
    # x * (1 + w)), 0.0 for GGUF files (llama.cpp's converter stored 1 + w)
    "norm_offset": 1.0,
}
# five sliding layers, then a global one (when the config does not list them)
_GEMMA3_PATTERN = 6
_GEMMA3_27B_LAYERS = 62  # the one Gemma 3 whose query_pre_attn_scalar is not its head_dim


def hf_gemma3(raw: dict, cfg: ModelConfig) -> ModelConfig:
    """Gemma 3's own fields from config.json (a Gemma3ForConditionalGeneration's text_config
    for model_type "gemma3"); RoPE as transformers 5 nests it per layer type, or the older
    rope_theta / rope_local_base_freq / rope_scaling."""
    text = raw.get("text_config") or raw
    if text.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("Gemma attention-logit softcapping (Gemma 2) is not supported")
    if text.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional Gemma 3 (EmbeddingGemma) is not supported")
    rope = text.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    theta = full.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    local_theta = local.get("rope_theta", text.get("rope_local_base_freq", 10_000.0))
    scaling = full if full else (text.get("rope_scaling") or {})
    extra = {**_GEMMA3_DEFAULTS,
             "query_pre_attn_scalar": float(text.get("query_pre_attn_scalar", 256)),
             "rope_local_base_freq": float(local_theta),
             "final_logit_softcapping": text.get("final_logit_softcapping"),
             "hidden_activation": text.get("hidden_activation") or "gelu_pytorch_tanh"}
    layers = text["num_hidden_layers"]
    types = text.get("layer_types") or _pattern_types(
        layers, text.get("sliding_window_pattern", _GEMMA3_PATTERN))
    return replace(cfg, rope_theta=float(theta),
                   rope_scaling=hf_rope_scaling(scaling, text, Path("config.json")),
                   tie_word_embeddings=text.get("tie_word_embeddings",
                                                raw.get("tie_word_embeddings", True)),
                   sliding_window=text.get("sliding_window"), layer_types=tuple(types),
                   qk_norm=True, extra=extra)


def gguf_gemma3(reader, arch: str, cfg: ModelConfig) -> ModelConfig:
    """Gemma 3 from llama.cpp's metadata, which leaves out what llama.cpp hard-codes: five of
    six layers sliding, a local RoPE base of 10000, attention scaled by head_dim ** -0.5 (the
    query_pre_attn_scalar of every Gemma 3 but the 27B, whose 168 llama.cpp derives as
    hidden / heads)."""
    window = field(reader, f"{arch}.attention.sliding_window")
    scalar = cfg.hidden_size / cfg.num_heads if cfg.num_layers == _GEMMA3_27B_LAYERS \
        else cfg.head_dim
    extra = {**_GEMMA3_DEFAULTS, "query_pre_attn_scalar": float(scalar),
             "rope_local_base_freq": float(field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
             "final_logit_softcapping": field(reader, f"{arch}.final_logit_softcapping"),
             "norm_offset": 0.0}
    return replace(cfg, sliding_window=None if window is None else int(window),
                   layer_types=tuple(_pattern_types(cfg.num_layers, _GEMMA3_PATTERN)), qk_norm=True,
                   extra=extra)


def _pattern_types(num_layers: int, pattern: int) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)]


# ----- Phi-3 (phi3.py) -------------------------------------------------------------------------

def hf_phi3(raw: dict, cfg: ModelConfig) -> ModelConfig:
    """config.json's Phi-3 setting beyond the shared ones (the sliding window is one):
    partial rotary, at the top level or in transformers 5's ``rope_parameters``."""
    rope = raw.get("rope_parameters") or {}
    partial = raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    return replace(cfg, partial_rotary_factor=float(partial))


def gguf_phi3(reader, arch: str, cfg: ModelConfig) -> ModelConfig:
    """llama.cpp's Phi-3 setting beyond the shared ones: the rotated dims of each head
    (``rope.dimension_count``; Phi-4-mini: 96 of 128)."""
    rotated = field(reader, f"{arch}.rope.dimension_count")
    if rotated is None:
        return cfg
    return replace(cfg, partial_rotary_factor=int(rotated) / cfg.head_dim)
