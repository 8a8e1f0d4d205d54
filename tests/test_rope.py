"""RoPE variants (model/layers.py) against transformers' ROPE_INIT_FUNCTIONS and rotary
embeddings: LongRoPE's short and long frequencies and attention factor, YaRN's ramp (truncated
or not) and attention factor, partial rotary, and LongRoPE's per-sequence choice of table rows."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tokenmill.config import RopeScaling
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model.hf_files import rope_scaling
from tokenmill.model.layers import RotaryEmbedding, apply_rope, rope_attention_factor
from tokenmill.model.layers import rope_inv_freq

HERE = Path(".")


def _phi3_config(partial: float = 1.0, **rope):
    import transformers

    pairs = int(32 * partial) // 2
    return transformers.Phi3Config(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=1024,
        original_max_position_embeddings=256, partial_rotary_factor=partial,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
                      "long_factor": [1.0 + 0.9 * i for i in range(pairs)], **rope})


def _yarn_config(**rope):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=8192,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
                      "rope_theta": 150000.0, **rope})


def _ours(hf_config) -> RopeScaling:
    raw = hf_config.to_dict()
    return rope_scaling(raw["rope_parameters"], raw, HERE)


def _rotary_dim(hf_config) -> int:
    head = hf_config.hidden_size // hf_config.num_attention_heads
    return int(head * hf_config.rope_parameters.get("partial_rotary_factor", 1.0))


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("rope", [{}, {"attention_factor": 1.3}], ids=["default-af", "given-af"])
def test_longrope_frequencies_and_attention_factor(partial, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = _phi3_config(partial, **rope)
    ours, dim = _ours(hf_config), _rotary_dim(hf_config)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = init(hf_config, "cpu")
    long, _ = init(hf_config, "cpu", seq_len=257)
    assert torch.equal(rope_inv_freq(dim, 10000.0, ours), short)
    assert torch.equal(rope_inv_freq(dim, 10000.0, ours, long=True), long)
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12)
    if not rope:
        assert factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))


@pytest.mark.parametrize("rope", [{}, {"truncate": False}, {"mscale": 1.0, "mscale_all_dim": 0.5},
                                  {"beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.1}],
                         ids=["default", "gpt-oss-untruncated", "deepseek-mscale", "given"])
def test_yarn_frequencies_and_attention_factor(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = _yarn_config(**rope)
    ours = _ours(hf_config)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    torch.testing.assert_close(rope_inv_freq(64, 150000.0, ours), want, rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12)


def test_yarn_truncation_changes_the_ramp():
    """gpt-oss's untruncated bounds give other frequencies than the rounded ones (so the flag
    matters), both between the extrapolated and interpolated ones."""
    base = RopeScaling(kind="yarn", factor=32.0, original_max_position_embeddings=4096)
    rounded = rope_inv_freq(64, 150000.0, base)
    plain = rope_inv_freq(64, 150000.0, RopeScaling())
    assert torch.all(rounded <= plain) and torch.all(rounded >= plain / 32 * (1 - 1e-6))
    exact = rope_inv_freq(64, 150000.0, replace(base, truncate=False))
    assert not torch.equal(exact, rounded)
    assert torch.all(exact <= plain) and torch.all(exact >= plain / 32 * (1 - 1e-6))


def _meta(seq_lens: list[int], query_lens: list[int], known: list[int] | None = None):
    """A flat batch's metadata, as much of it as RoPE reads."""
    from tokenmill.attention import AttentionMetadata

    none = torch.zeros(0, dtype=torch.int64)
    return AttentionMetadata(query_start_loc=none, seq_lens=torch.tensor(seq_lens),
                             block_tables=none, slot_mapping=none, query_lens_host=query_lens,
                             seq_lens_host=seq_lens, block_size=16, known_lens_host=known)


def _hf_cos_sin(rotary, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor([positions]))
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]  # (len, rotary_dim / 2): both halves are equal


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_tables_match_transformers(partial):
    """cos/sin (attention factor included) of a sequence within the original context and of
    one beyond it, looked up through ``rows``."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf_config = _phi3_config(partial)
    ours = RotaryEmbedding(32, 1024, 10000.0, _ours(hf_config), _rotary_dim(hf_config))
    for length in (200, 256, 257, 1000):
        positions = list(range(length))
        cos, sin = ours(ours.rows(torch.tensor(positions), _meta([length], [length])))
        want_cos, want_sin = _hf_cos_sin(Phi3RotaryEmbedding(hf_config), positions)
        torch.testing.assert_close(cos.squeeze(1), want_cos, rtol=0, atol=2e-6)
        torch.testing.assert_close(sin.squeeze(1), want_sin, rtol=0, atol=2e-6)


def test_yarn_tables_match_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = _yarn_config()
    ours = RotaryEmbedding(64, 8192, 150000.0, _ours(hf_config))
    positions = [0, 1, 7, 1023, 1024, 5000, 8191]
    cos, sin = ours(torch.tensor(positions))
    want_cos, want_sin = _hf_cos_sin(LlamaRotaryEmbedding(hf_config), positions)
    torch.testing.assert_close(cos.squeeze(1), want_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin.squeeze(1), want_sin, rtol=0, atol=2e-6)


def test_longrope_rows_choose_per_sequence():
    """One batch: a sequence within the original context (short rows), one beyond it (long
    rows even at positions within it), one whose prompt chunk ends within it but whose known
    length is beyond (long, where the batch says so); a decode batch decides on the device."""
    scaling = RopeScaling(kind="longrope", factor=4.0, original_max_position_embeddings=8,
                          short_factor=(1.0, 1.0), long_factor=(2.0, 2.0))
    rope = RotaryEmbedding(4, 32, 10000.0, scaling)
    positions = torch.tensor([5, 6, 7, 9, 10, 0, 1, 2])
    meta = _meta([8, 11, 3], [3, 2, 3])
    assert rope.rows(positions, meta).tolist() == [37, 38, 39, 9, 10, 32, 33, 34]
    meta.known_lens_host = [8, 11, 20]
    assert rope.rows(positions, meta).tolist() == [37, 38, 39, 9, 10, 0, 1, 2]
    decode = _meta([8, 9, 3], [1, 1, 1])
    decode.seq_lens_host = [1, 1, 1]  # placeholders, as in a captured CUDA graph's batch
    assert rope.rows(torch.tensor([7, 8, 2]), decode).tolist() == [39, 8, 34]
    plain = RotaryEmbedding(4, 32, 10000.0, RopeScaling())
    assert plain.rows(positions, meta) is positions


def _hf_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # (T, rotary)
    # transformers' layout: (batch, heads, T, head_dim)
    q = x.transpose(0, 1).unsqueeze(0)
    out, _ = apply_rotary_pos_emb(q, q, full_cos.unsqueeze(0), full_sin.unsqueeze(0))
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("rotary_dim", [64, 48])
def test_partial_rotary_matches_transformers(rotary_dim):
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(64, 512, 10000.0, RopeScaling(), rotary_dim)
    cos_sin = rope(torch.randint(0, 512, (17,), generator=g))
    x = torch.randn(17, 6, 64, generator=g)
    want = _hf_apply(x, cos_sin[0].squeeze(1), cos_sin[1].squeeze(1))
    got = apply_rope(x, cos_sin)
    assert torch.equal(got, want)
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler: the kernels fall back")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_partial_rotary_kernel_in_place_on_strided_heads(dtype):
    """The CPU kernel rotates the leading dims of stacked q/k heads inside the fused qkv rows
    in place, as the PyTorch path does, and leaves the rest of each head and V alone."""
    g = torch.Generator().manual_seed(4)
    rope = RotaryEmbedding(64, 512, 10000.0, RopeScaling(), 48)
    cos_sin = rope(torch.randint(0, 512, (17,), generator=g))
    qkv = torch.randn(17, (6 + 2 + 2) * 64, generator=g).to(dtype)
    view = qkv[:, :8 * 64].view(17, 8, 64)  # (tokens, q and k heads, head_dim), strided rows
    want = apply_rope(view.clone(), cos_sin)
    before = qkv.clone()
    got = apply_rope(view, cos_sin, cpu_kernels.load())
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert (got == want).float().mean() > 0.97
    assert torch.equal(got[..., 48:], before[:, :8 * 64].view(17, 8, 64)[..., 48:])
    assert torch.equal(qkv[:, 8 * 64:], before[:, 8 * 64:])
