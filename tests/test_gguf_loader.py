"""GGUF files written the way llama.cpp writes them load into the same model as the weights."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_hf_model, write_tiny_gguf
from tokenmill.model.loader import load_model
from tokenmill.runner.batch import Chunk
from tokenmill.runner.model_runner import ModelRunner

CASES = [
    ("llama", "llama", "F32", 1e-4),
    ("smollm2", "llama", "F16", 1e-4),
    ("llama", "llama", "Q8_0", 1e-4),
    ("smollm2", "llama", "Q4_1", 1e-4),
    ("qwen2", "qwen2", "Q4_0", 1e-4),
    ("qwen3", "qwen3", "BF16", 1e-4),
]


@pytest.mark.parametrize("hf_arch,gguf_arch,qtype,tol", CASES)
def test_gguf_logits_match_source_weights(tmp_path, hf_arch, gguf_arch, qtype, tol):
    hf = make_hf_model(hf_arch)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(hf, path, gguf_arch, qtype)  # also rounds hf's weights like the file
    loaded = load_model(str(path))
    assert loaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert loaded.config.num_kv_heads == hf.config.num_key_value_heads
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    ids = list(range(5, 40))
    ours = runner.forward([Chunk(ids, 0, list(range(31, 21, -1)))], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= tol
