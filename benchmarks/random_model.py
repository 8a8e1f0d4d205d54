"""A Llama-shaped Hugging Face directory with random bf16 weights and the default model's
tokenizer: a model of any size to time (speed does not depend on the values), written here
rather than downloaded.

    python benchmarks/random_model.py OUT_DIR --hidden 1024 --layers 16 --heads 16 \\
        --kv-heads 4 --intermediate 2816
    python benchmarks/random_model.py OUT_DIR --shape smollm2-135m --word-tokenizer
    python benchmarks/random_model.py OUT_DIR --shape qwen2.5-0.5b --word-tokenizer

``--shape`` takes a published model's shapes (below). ``--word-tokenizer`` writes a tokenizer of
``--vocab`` words instead of the default model's (which needs the default model's package: a
machine without it, such as the lent GPU, builds the model this way).

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


# published shapes: hidden, layers, heads, KV heads, intermediate, vocab, rope theta, q/k/v bias
SHAPES = {
    "smollm2-135m": dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536,
                         vocab=49152, rope_theta=100000.0, qkv_bias=False),
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                         vocab=151936, rope_theta=1000000.0, qkv_bias=True),
}


def write(out: Path, hidden: int, layers: int, heads: int, kv_heads: int,
          intermediate: int, seed: int = 0, vocab: int | None = None,
          rope_theta: float = 10000.0, qkv_bias: bool = False) -> Path:
    """The directory; ``vocab`` given: a word-level tokenizer of that many words, else the
    default model's tokenizer. ``qkv_bias``: Qwen2's biased q/k/v projections."""
    tok = load_tokenizer(DEFAULT_MODEL) if vocab is None else None
    vocab = tok.vocab_size if tok is not None else vocab
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
        if qkv_bias:
            tensors.update({p + f"self_attn.{n}_proj.bias": rand(size) for n, size in
                            (("q", heads * head_dim), ("k", kv_heads * head_dim),
                             ("v", kv_heads * head_dim))})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    arch, model_type = ("Qwen2ForCausalLM", "qwen2") if qkv_bias else ("LlamaForCausalLM", "llama")
    (out / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": model_type, "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": rope_theta,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": tok.bos_token_id if tok else 1,
        "eos_token_id": tok.eos_token_id if tok else 2}))
    if tok is None:
        write_word_tokenizer(out, vocab)
        return out
    (out / "tokenizer.json").write_text(tok.backend.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "chat_template": tok.chat_template}))
    return out


def write_word_tokenizer(out: Path, vocab: int) -> None:
    """Words ``w0``..``w{vocab-1}``, one token each, and a plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (out / "tokenizer.json").write_text(tok.to_str())
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "w1", "eos_token": "w2", "chat_template": template}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--shape", choices=sorted(SHAPES),
                    help="a published model's shapes (overrides the options above)")
    ap.add_argument("--word-tokenizer", action="store_true",
                    help="a word-level tokenizer of --vocab words, not the default model's")
    ap.add_argument("--vocab", type=int, default=49152)
    a = ap.parse_args()
    shape = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                 intermediate=a.intermediate, vocab=a.vocab)
    shape.update(SHAPES.get(a.shape, {}))
    if not a.word_tokenizer:
        shape["vocab"] = None
    write(a.out, **shape)
    print(a.out)


if __name__ == "__main__":
    main()
