"""Tiny random-weight Hugging Face models of each supported architecture, saved to disk."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5)

# name -> (transformers config class name, extra config)
ARCHS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope-tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "smollm2": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1,
                                    rope_theta=100000.0)),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    # a window of 8 on the first layer, global RoPE scaled, softcapped logits
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}})),
}


def make_hf_model(arch: str, seed: int = 0, **config_overrides):
    """A transformers model with every weight random (norms and biases too), in eval mode;
    ``config_overrides`` replace config values (``vocab_size=257``)."""
    import transformers

    cls_name, extra = ARCHS[arch]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **config_overrides})
    return random_causal_lm(config, seed)


def random_causal_lm(config, seed: int = 0, init=None):
    """transformers' causal LM of ``config`` in eval mode, every weight random: norms near 1,
    the rest N(0, 0.08); ``init(name, param)`` may draw a parameter its own way (True: done)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if init is not None and init(name, p):
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model


def save_hf_model(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                "lm_head": "output"}


def gguf_tensor_name(hf_name: str) -> str:
    base, kind = hf_name.rsplit(".", 1)
    if base in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}.{kind}"


def llama_cpp_permute(w, n_head: int):
    """What llama.cpp's converter does to q/k rows for the llama architecture."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(model, path: Path, arch: str, qtype_name: str = "F32") -> None:
    """Write ``model`` as a GGUF file the way llama.cpp would; 2-D weights in ``qtype_name``.

    The model's own weights are replaced by their quantize->dequantize round trip, so the file
    and the model hold the same numbers and logits can be compared exactly.
    """
    import gguf
    from gguf import quants

    cfg = model.config
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = gguf_writer(cfg, path, arch, cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    with torch.no_grad():
        for name, p in model.named_parameters():
            data = p.detach().numpy().astype("float32")
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                data = llama_cpp_permute(data, heads)
            raw = None
            if data.ndim == 2 and qtype_name != "F32":
                # Quantization is row-wise, so it commutes with the q/k row permutation.
                data, raw = quants.quantize(data, qtype), qtype
                rounded = quants.quantize(p.detach().numpy().astype("float32"), qtype)
                p.copy_(torch.from_numpy(quants.dequantize(rounded, qtype)))
            w.add_tensor(gguf_tensor_name(name), data, raw_dtype=raw)
    finish_gguf(w)


def gguf_writer(cfg, path: Path, arch: str, rope_theta: float):
    """A ``gguf.GGUFWriter`` for ``arch`` holding the shape keys llama.cpp's converter writes
    for the transformers config ``cfg``; the caller adds its own keys and the tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    return w


def finish_gguf(w) -> None:
    """Write ``gguf_writer``'s file: header, keys, tensors."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_word_tokenizer(directory, vocab_size: int) -> None:
    """A tokenizer.json of words ``w0``..``w{vocab_size-1}``, one token each (so a tiny model
    directory loads as an engine does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (directory / "tokenizer.json").write_text(tok.to_str())
