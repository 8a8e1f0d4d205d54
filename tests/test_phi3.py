"""Phi-3 / Phi-4 (model/phi3.py) against transformers on tiny random models: fused qkv and
gate/up checkpoints, LongRoPE (short and long factors, the attention factor) and Phi-4-mini's
partial rotary. The original context is 32 positions: prompts on both sides of it, and a
sequence crossing it while decoding. The engine and server checks keep every sequence on one
side of it (crossing needs the scheduler's recompute:
``test_greedy_crossing_the_original_context``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.family_checks import STEPS, check_engine, check_server, family_prompts
from tests.family_checks import hf_last_logits
from tests.tiny_models import finish_gguf, gguf_writer, random_causal_lm, write_word_tokenizer

VOCAB = 96
ORIGINAL = 32  # family_prompts' prompts are 9-70 tokens, 32 more are generated
WIDE_ORIGINAL = 112  # beyond every sequence of family_prompts (at most 102 tokens)


def make_phi3(partial: float, original: int = ORIGINAL, window: int | None = None,
              seed: int = 0):
    """A random transformers Phi-3 with LongRoPE (distinct short and long factors, an original
    context of ``original`` in 128 positions), ``partial`` of each 16-dim head rotated and a
    sliding ``window`` (None: none)."""
    import transformers

    pairs = int(16 * partial) // 2
    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=original, partial_rotary_factor=partial,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
                      "long_factor": [1.5 + 0.7 * i for i in range(pairs)]},
        sliding_window=window, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    return random_causal_lm(cfg, seed)


def _save(hf, directory):
    hf.save_pretrained(directory)
    write_word_tokenizer(directory, VOCAB)
    return hf, directory


@pytest.fixture(scope="module", params=[(1.0, 24), (0.75, None)],
                ids=["phi3-window", "phi4-partial"])
def phi3(request, tmp_path_factory):
    """Phi-3-mini's shape (whole heads, a sliding window) and Phi-4-mini's (partial rotary)."""
    partial, window = request.param
    return _save(make_phi3(partial, window=window), tmp_path_factory.mktemp("phi3"))


@pytest.fixture(scope="module")
def phi4(tmp_path_factory):
    return _save(make_phi3(0.75), tmp_path_factory.mktemp("phi4"))


@pytest.fixture(scope="module")
def phi4_wide(tmp_path_factory):
    """Every sequence of family_prompts within the original context."""
    return _save(make_phi3(0.75, WIDE_ORIGINAL), tmp_path_factory.mktemp("phi4-wide"))


def _load(directory):
    from tokenmill.model.loader import load_model

    return load_model(str(directory), attention_backend="torch").model


def _forward(model, kv, tokens: list[int], start: int, known: int | None = None):
    """Logits of every token of one chunk at positions ``start..``; ``known``: the sequence's
    known length, as the scheduler would tell it (None: the batch does not say)."""
    from tokenmill.runner.batch import Chunk, build_flat_batch

    batch = build_flat_batch([Chunk(tokens, start, list(range(8)), len(tokens))], 16, "cpu",
                             all_logits=True)
    if known is not None:
        batch.meta.known_lens_host = [known]
    with torch.no_grad():
        return model(batch.input_ids, batch.positions, kv, batch.meta, batch.logits_indices)


def _kv():
    return [(torch.zeros(8, 16, 2, 16), torch.zeros(8, 16, 2, 16)) for _ in range(2)]


def test_config_reads_the_phi3_settings(phi3):
    from tokenmill.model.hf_files import hf_model_config

    hf, directory = phi3
    cfg = hf_model_config(directory)
    assert cfg.architecture == "phi3"
    assert cfg.partial_rotary_factor == hf.config.partial_rotary_factor
    assert cfg.sliding_window == hf.config.sliding_window
    rs = cfg.rope_scaling
    assert rs.kind == "longrope" and rs.original_max_position_embeddings == ORIGINAL
    assert rs.factor == 128 / ORIGINAL and rs.attention_factor is None


@pytest.mark.parametrize("length", [9, ORIGINAL, ORIGINAL + 1, 100])
def test_float32_logits_match_transformers(phi3, length):
    """Every position's logits, for prompts within and beyond the original context."""
    hf, directory = phi3
    prompt = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(length))
    want = hf_last_logits(hf, prompt.tolist())
    got = _forward(_load(directory), _kv(), prompt.tolist(), 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_crossing_the_original_context_as_transformers_does(phi3):
    """transformers' generate takes the short factors while a sequence is within the original
    context, then recomputes the whole sequence with the long ones: the model does the same
    given the sequence's known length, prefilled in chunks and recomputed at the crossing."""
    hf, directory = phi3
    prompt = family_prompts(VOCAB)[4]  # 9 tokens: crosses 32 at the 24th generated token
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                      min_new_tokens=STEPS, do_sample=False, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0].tolist()
    model, kv, start = _load(directory), _kv(), 0
    for step, want in enumerate(out.logits):
        end = len(prompt) + step
        if end == ORIGINAL + 1:
            start = 0  # the recompute at the crossing
        for a in range(start, end, 13):  # 13-token chunks
            logits = _forward(model, kv, tokens[a:min(a + 13, end)], a, known=end)
        torch.testing.assert_close(logits[-1], want[0], rtol=0, atol=1e-4)
        start = end


def _beyond_the_original(prompts: list[list[int]]) -> list[list[int]]:
    """``prompts`` with those within the original context lengthened beyond it (after another
    prompt's first tokens): every sequence then stays on the long side."""
    return [p if len(p) > ORIGINAL else prompts[3][:ORIGINAL] + p for p in prompts]


def test_greedy_through_the_engine_beyond_the_original_context(phi4):
    """Batching, chunked prefill (long factors from a prompt's first chunk on), prefix hits,
    preemption."""
    hf, directory = phi4
    check_engine(directory, hf, _beyond_the_original(family_prompts(VOCAB)))


def test_greedy_through_the_server_within_the_original_context(phi4_wide, tmp_path_factory):
    """Sequences within the original context: the short factors with the attention factor."""
    hf, directory = phi4_wide
    check_server(tmp_path_factory, directory, hf, family_prompts(VOCAB))


def test_greedy_crossing_the_original_context(tmp_path_factory):
    """Prompts within the original context whose sequences cross it while decoding: the
    scheduler recomputes each at the crossing, on the long factors, as transformers does (on
    this model the first diverges from transformers without the recompute)."""
    from tests.family_checks import engine_greedy, hf_greedy

    hf, directory = _save(make_phi3(1.0), tmp_path_factory.mktemp("phi3-crossing"))
    prompts = family_prompts(VOCAB)[4:]
    got, _ = engine_greedy(directory, prompts)
    assert got == [hf_greedy(hf, p) for p in prompts]


def write_phi3_gguf(hf, path, qtype_name: str) -> None:
    """``hf`` as llama.cpp's converter writes a Phi-3: fused ``attn_qkv`` and ``ffn_up`` (gate
    rows, then up), LongRoPE's factors as tensors; 2-D weights in ``qtype_name``, and ``hf``'s
    own weights rounded the same way."""
    import gguf
    from gguf import quants

    cfg, arch = hf.config, "phi3"
    rope = cfg.rope_parameters
    w = gguf_writer(cfg, path, arch, rope["rope_theta"])  # a context of 128 (make_phi3)
    w.add_uint32(f"{arch}.rope.dimension_count", int(16 * rope["partial_rotary_factor"]))
    w.add_uint32(f"{arch}.rope.scaling.original_context_length", ORIGINAL)
    for kind in ("long", "short"):
        w.add_tensor(f"rope_factors_{kind}.weight",
                     np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            base = name.rsplit(".", 1)[0]
            layer = base.split(".")[2] if base.startswith("model.layers.") else None
            sub = base.split(".", 3)[3] if layer is not None else base
            data, raw = p.detach().numpy().astype(np.float32), None
            if data.ndim == 2 and qtype_name != "F32":
                qtype = gguf.GGMLQuantizationType[qtype_name]
                data, raw = quants.quantize(data, qtype), qtype
                p.copy_(torch.from_numpy(quants.dequantize(data, qtype)))
            prefix = f"blk.{layer}." if layer is not None else ""
            w.add_tensor(f"{prefix}{names[sub]}.weight", data, raw_dtype=raw)
    finish_gguf(w)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_matches_transformers(tmp_path, qtype):
    """A llama.cpp-style Phi-4-mini GGUF (kept in its Q8_0 blocks, the fused tensors cut by
    rows) loads into the model transformers runs, LongRoPE and partial rotary included."""
    from tokenmill.model.loader import load_model

    hf = make_phi3(0.75)
    path = tmp_path / f"phi4-{qtype}.gguf"
    write_phi3_gguf(hf, path, qtype)
    loaded = load_model(str(path), attention_backend="torch", quantization="auto")
    assert loaded.config.partial_rotary_factor == 0.75
    ours, want = loaded.config.rope_scaling, _config_of(tmp_path, hf).rope_scaling
    assert ours.short_factor == pytest.approx(want.short_factor)  # float32 in the file
    assert replace(ours, short_factor=(), long_factor=()) == \
        replace(want, short_factor=(), long_factor=())
    for length in (20, 40):
        prompt = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(9))
        got = _forward(loaded.model, _kv(), prompt.tolist(), 0)
        torch.testing.assert_close(got, hf_last_logits(hf, prompt.tolist()), rtol=0, atol=1e-4)


def _config_of(directory, hf):
    from tokenmill.model.hf_files import hf_model_config

    hf.config.save_pretrained(directory)
    return hf_model_config(directory)
