"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' own GGUF
loading of the same file: greedy continuations must be token-for-token identical."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.loader import load_model
from tokenmill.runner.batch import Chunk
from tokenmill.runner.model_runner import ModelRunner

pytestmark = pytest.mark.slow  # the real model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Les plus beaux paysages d'Europe sont",
    "1, 1, 2, 3, 5, 8, 13,",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_gguf(hf_default_float32):
    return hf_default_float32


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(load_model("smollm2-135m-instruct"), num_blocks=256, block_size=16)


def test_config_read_from_gguf_metadata(runner):
    cfg = runner.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers_gguf(hf_gguf, runner, prompt):
    model, tok = hf_gguf
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    ours = runner.greedy_generate(ids, NEW_TOKENS)
    assert len(ref) == NEW_TOKENS
    assert ours == ref, f"{tok.decode(ours)!r} != {tok.decode(ref)!r}"


def test_batched_prompts_equal_alone(hf_gguf, runner):
    """Several real prompts in one flat batch give the logits each gives alone."""
    _, tok = hf_gguf
    seqs = [tok(p)["input_ids"] for p in PROMPTS]
    tables, alone = [], []
    for i, s in enumerate(seqs):
        table = list(range(200 - 8 * i, 200 - 8 * i - (-(-len(s) // 16)), -1))
        tables.append(table)
        alone.append(runner.forward([Chunk(s, 0, table)])[0])
    batched = runner.forward([Chunk(s, 0, t) for s, t in zip(seqs, tables)])
    for row, ref in enumerate(alone):
        assert (batched[row] - ref).abs().max().item() <= 1e-4
