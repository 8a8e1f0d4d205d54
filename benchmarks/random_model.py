"""A Llama-shaped Hugging Face directory with random bf16 weights and the default model's
tokenizer: a model of any size to time (speed does not depend on the values), written here
rather than downloaded.

    python benchmarks/random_model.py OUT_DIR --hidden 1024 --layers 16 --heads 16 \\
        --kv-heads 4 --intermediate 2816

The default shape has heads that split over 2 and 4 ranks (the default model's 9 heads and 3
KV heads split only over 3 or 9), for tensor-parallel benchmarks on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill.config import DEFAULT_MODEL
from tokenmill.tokenizer import load_tokenizer


def write(out: Path, hidden: int, layers: int, heads: int, kv_heads: int,
          intermediate: int, seed: int = 0) -> Path:
    tok = load_tokenizer(DEFAULT_MODEL)
    vocab = tok.vocab_size
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:  # small values: activations stay finite
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate)})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}))
    (out / "tokenizer.json").write_text(tok.backend.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "chat_template": tok.chat_template}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    a = ap.parse_args()
    write(a.out, a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate)
    print(a.out)


if __name__ == "__main__":
    main()
