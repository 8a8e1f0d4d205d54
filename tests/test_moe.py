"""Mixture-of-experts families (model/moe.py, model/moe_families.py) against transformers on
tiny random configs: float32 logits of a whole prompt within 1e-4, greedy tokens through the
engine (batching, chunked prefill, prefix hits, preemption) and the server; Mixtral and
Qwen2-MoE from GGUFs with llama.cpp's stacked expert and shared-expert tensors; the router's
variants; the grouped experts (C++ kernel and PyTorch loop, float32 / bf16 / int8 / int4)
against each other and a per-token sum; Mixtral's fused CPU step against its eager path."""

from __future__ import annotations

import pytest
import torch

from tests.family_checks import check_engine, check_server, family_prompts, hf_last_logits
from tests.tiny_models import (finish_gguf, gguf_tensor_name, gguf_writer, llama_cpp_permute,
                                random_causal_lm, write_word_tokenizer)
from tokenmill.model.moe import grouped_experts, route
from tokenmill.runner.batch import Chunk
from tokenmill.runner.model_runner import ModelRunner

TOL = 1e-4
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
# family -> (transformers config class, its own settings)
CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, head_dim=32,
                                         norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=8,
                                         num_experts_per_tok=3, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=None)),
    # as released: YaRN RoPE (factor 32 over 4096 positions), sliding window on alternate
    # layers (here 6 keys, so prompts reach past it)
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, num_local_experts=4,
                                     num_experts_per_tok=2, head_dim=16, sliding_window=6,
                                     layer_types=["sliding_attention", "full_attention"],
                                     max_position_embeddings=4096, rope_parameters=dict(
                                         rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=4096))),
}


def make_hf(family: str, seed: int = 0, **overrides):
    import transformers

    cls, extra = CONFIGS[family]
    config = getattr(transformers, cls)(**{**COMMON, **extra, **overrides})

    def init(name: str, p) -> bool:
        if "norm" in name:
            return False
        # routers that separate experts clearly; biases a little wider than weights
        p.normal_(0.0, 0.5 if "gate.weight" in name or "router" in name
                  else 0.08 if p.dim() > 1 else 0.2)
        return True

    return random_causal_lm(config, seed, init)


_SAVED: dict = {}


def saved(family: str, tmp_path_factory):
    """(family, transformers model, its directory with a word tokenizer), made once."""
    if family not in _SAVED:
        hf = make_hf(family)
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path)
        write_word_tokenizer(path, VOCAB)
        _SAVED[family] = (family, hf, path)
    return _SAVED[family]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    return saved(request.param, tmp_path_factory)


def _logits(model_path: str, ids: list[int], **load) -> torch.Tensor:
    from tokenmill.model.loader import load_model

    runner = ModelRunner(load_model(model_path, "cpu", **load), num_blocks=64, block_size=4,
                         device="cpu")
    return runner.forward([Chunk(ids, 0, list(range(-(-len(ids) // 4))))], True)


def test_logits_match_transformers(tiny):
    _, hf, path = tiny
    ids = family_prompts(VOCAB)[3][:40]
    want = hf_last_logits(hf, ids)
    for backend in ("torch", "auto"):
        got = _logits(str(path), ids, attention_backend=backend)
        assert (got - want).abs().max().item() <= TOL, backend


def test_greedy_through_engine(tiny):
    family, hf, path = tiny
    check_engine(path, hf, family_prompts(VOCAB))


def test_greedy_through_server(tmp_path_factory):
    """One family through the server (the engine check covers the others' batching)."""
    _, hf, path = saved("qwen3_moe", tmp_path_factory)
    check_server(tmp_path_factory, path, hf, family_prompts(VOCAB)[:4])


_SHARED_GGUF = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                "mlp.shared_expert.up_proj": "ffn_up_shexp",
                "mlp.shared_expert.down_proj": "ffn_down_shexp",
                "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def _write_moe_gguf(hf, path, arch: str) -> None:
    """``hf`` as llama.cpp writes it: Mixtral as arch "llama" with an expert count (q/k rows
    permuted), Qwen2-MoE as "qwen2moe"; each layer's experts stacked into
    ffn_{gate,up,down}_exps (E, out, in), the router and shared expert by their GGUF names."""
    cfg = hf.config
    inter = getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)
    w = gguf_writer(cfg, path, arch, cfg.rope_parameters["rope_theta"])
    w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(inter)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    state = {k: v.detach().numpy().astype("float32") for k, v in hf.state_dict().items()}
    for name, data in state.items():
        if ".experts." in name:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        base, _, kind = name.rpartition(".")
        sub = base.split(".", 3)[-1]
        if sub in _SHARED_GGUF:
            layer = name.split(".")[2]
            data = data[0] if sub == "mlp.shared_expert_gate" else data  # llama.cpp: (H,)
            w.add_tensor(f"blk.{layer}.{_SHARED_GGUF[sub]}.{kind}", data)
        else:
            w.add_tensor(gguf_tensor_name(name), data)
    for layer in range(cfg.num_hidden_layers):
        gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # (E, 2I, H)
        down = state[f"model.layers.{layer}.mlp.experts.down_proj"]
        for kind, t in (("gate", gate_up[:, :inter]), ("up", gate_up[:, inter:]),
                        ("down", down)):
            w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", t.copy())
    finish_gguf(w)


@pytest.mark.parametrize("family,arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe")])
def test_gguf_with_stacked_experts(tmp_path, family, arch):
    hf = make_hf(family, seed=3)
    path = tmp_path / f"{family}.gguf"
    _write_moe_gguf(hf, path, arch)
    ids = family_prompts(VOCAB)[4]
    got = _logits(str(path), ids)
    assert (got - hf_last_logits(hf, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("softmax_first,renormalize", [(True, True), (True, False),
                                                        (False, True)])
def test_route_variants(softmax_first, renormalize):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = route(logits, 2, softmax_first, renormalize)
    top, want_ids = logits.topk(2, dim=-1)
    assert torch.equal(ids, want_ids)  # softmax keeps the order: the same experts either way
    if not softmax_first or renormalize:
        want = torch.softmax(top, dim=-1)
    else:
        want = torch.softmax(logits, dim=-1).gather(1, want_ids)
    assert torch.allclose(weights, want, atol=1e-6)


def _experts_model(tmp_path, dtype: str, quantization: str = "none"):
    from tokenmill.model.loader import load_model

    hf = make_hf("qwen3_moe", seed=5)
    hf.save_pretrained(tmp_path)
    return load_model(str(tmp_path), "cpu", dtype, quantization=quantization)


@pytest.mark.parametrize("dtype,quantization", [("float32", "none"), ("float32", "int8"),
                                                ("float32", "int4"), ("bfloat16", "none"),
                                                ("bfloat16", "int4")])
def test_grouped_kernel_equals_torch_loop(tmp_path, dtype, quantization):
    """The C++ grouped experts (where the experts' kernels have packed weights) give the
    PyTorch loop's sums bit for bit; both are the per-token sum of weighted expert outputs."""
    loaded = _experts_model(tmp_path, dtype, quantization)
    moe = loaded.model.model.layers[0].mlp
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(2)).to(getattr(torch, dtype))
    for linear in [m for e in moe.experts for m in (e.gate_up_proj, e.down_proj)]:
        if hasattr(linear.kernel, "from_rows"):  # oneDNN from 2 rows: both paths take it
            linear.kernel.from_rows = 2
    weights, ids = route(moe.gate(x), moe.top_k, True, True)
    loop = grouped_experts(moe.experts, x, weights, ids)
    out = moe._run_experts(x, weights, ids)
    packed = all(e.gate_up_proj.kernel.step_weight() is not None for e in moe.experts)
    if moe.cpu_ops is not None and hasattr(moe.cpu_ops, "MoEExperts") and packed:
        assert moe._grouped, "the grouped C++ kernel did not run"
    assert torch.equal(out, loop)
    for t in range(3):  # token by token, expert by expert
        want = sum(weights[t, j] * moe.experts[int(ids[t, j])](x[t:t + 1]).float()[0]
                   for j in range(moe.top_k))
        assert torch.allclose(out[t].float(), want, atol=2e-2 if dtype != "float32" else 1e-5)


FUSED_DTYPES = [("float32", "none"), ("float32", "int8"), ("bfloat16", "none")]


@pytest.mark.parametrize("dtype,quantization", FUSED_DTYPES)
def test_mixtral_fused_step_equals_eager(tmp_path, dtype, quantization):
    """Mixtral's layers in the fused CPU step (router and grouped experts called from
    csrc/decoder_step.h) give the eager path's logits bit for bit: prompts of ragged lengths,
    a chunk after a cached prefix, decode rows."""
    from tokenmill.kernels import cpu as cpu_kernels
    from tokenmill.model.loader import load_model

    ops = cpu_kernels.load()
    if ops is None or not hasattr(ops, "DecoderStack") or (
            dtype == "bfloat16" and not getattr(ops, "has_bf16_gemm", False)):
        pytest.skip(f"the CPU kernels' {dtype} GEMM is not built on this CPU")
    make_hf("mixtral", seed=7, hidden_size=128, intermediate_size=64).save_pretrained(tmp_path)

    def runner() -> ModelRunner:
        return ModelRunner(load_model(str(tmp_path), "cpu", dtype, quantization=quantization),
                           num_blocks=64, block_size=16)

    eager, fused = runner(), runner()
    assert fused.fuse_cpu_step().split(";")[0] == "fused"
    g = torch.Generator().manual_seed(4)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    steps = [[Chunk(ids(40), 0, [1, 2, 3]), Chunk(ids(23), 0, [4, 5]), Chunk(ids(1), 0, [6])],
             [Chunk(ids(9), 40, [1, 2, 3, 7]), Chunk(ids(1), 23, [4, 5])],
             [Chunk(ids(1), 49, [1, 2, 3, 7]), Chunk(ids(1), 24, [4, 5])]]
    for i, chunks in enumerate(steps):
        want, got = eager.forward(chunks, all_logits=True), fused.forward(chunks, True)
        assert torch.isfinite(want).all()
        assert torch.equal(want, got), f"step {i}: max diff {(want - got).abs().max()}"
