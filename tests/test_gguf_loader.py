"""GGUF files written the way llama.cpp writes them load into the same model as the weights, and
tokenmill's index of a file is the gguf package's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import make_hf_model, write_tiny_gguf
from tokenmill.errors import ModelLoadError
from tokenmill.gguf_meta import GgufTensor, read_gguf_index, read_gguf_metadata
from tokenmill.model import gguf_file
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


# ----- the file's index: tokenmill's reader against the gguf package's ---------------------


def same_index(path) -> int:
    """tokenmill's index of ``path`` equals ``gguf.GGUFReader``'s: every metadata value, and per
    tensor its name, type, shape and every byte of its data in the same numpy shape and dtype.
    Returns the number of tensors."""
    import gguf

    ours, theirs = read_gguf_index(path), gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == fields
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape) == (b.tensor_type, tuple(b.shape.tolist())), a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data, b.data), a.name
    return len(ours.tensors)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_index_matches_the_gguf_package(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(make_hf_model("qwen3"), path, "qwen3", qtype)
    assert same_index(path) > 10


@pytest.mark.slow  # the real model: 272 tensors, a 49,152-token vocabulary
def test_index_of_the_default_model_matches_the_gguf_package(default_gguf_path):
    assert same_index(default_gguf_path) == 272


def test_index_refuses_a_duplicate_name_and_a_tensor_past_the_end(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(make_hf_model("llama"), path, "llama", "Q8_0")
    raw = path.read_bytes()
    twice = tmp_path / "twice.gguf"  # names of one length, so every offset stays where it was
    twice.write_bytes(raw.replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight"))
    with pytest.raises(ModelLoadError, match="twice.gguf.*'blk.0.attn_q.weight' appears twice"):
        read_gguf_index(twice)
    short = tmp_path / "short.gguf"
    short.write_bytes(raw[:-100])
    with pytest.raises(ModelLoadError, match="short.gguf.*runs past the end of the file"):
        read_gguf_index(short)
    assert read_gguf_index(path).tensors  # the intact file reads


def test_index_of_a_big_endian_file_matches_the_gguf_package(tmp_path):
    import gguf

    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("llama.block_count", 1)
    w.add_array("t.floats", [1.5, -2.0])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("c.weight", np.arange(64, dtype=np.int32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert same_index(path) == 3
    assert read_gguf_index(path).tensors[2].data[1, 0] == 32  # the values, not their bytes


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_string_arrays_read_as_the_gguf_package_reads_them(tmp_path, endian):
    """A vocabulary's strings (read in one loop of their own): empty and multi-byte ones as the
    package decodes them, invalid UTF-8 replaced by U+FFFD as a lone string always was (the
    package raises there); an array cut short is the file's error, not a crash."""
    import gguf

    words = ["", "a", "Ġthe", "日本", "\u00e9" * 40, "<|im_end|>"]
    path = tmp_path / "words.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian[endian])
    w.add_array("tokenizer.ggml.tokens", words)
    w.add_array("t.bytes", [b"ok", b"\xff\xfe"])  # not UTF-8
    w.add_uint32("t.after", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    fields = read_gguf_metadata(path)
    reader = gguf.GGUFReader(str(path))
    assert fields["tokenizer.ggml.tokens"] == words == [
        reader.fields["tokenizer.ggml.tokens"].contents(i) for i in range(len(words))]
    assert fields["t.bytes"] == ["ok", "\ufffd\ufffd"] and fields["t.after"] == 7
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:raw.index("<|im_end|>".encode()) + 4])
    with pytest.raises(ModelLoadError, match="cut.gguf.*runs past the end of the file"):
        read_gguf_metadata(cut)


@pytest.mark.parametrize("qtype", ["BF16", "Q4_0", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantized_in_row_groups_as_the_gguf_package_does_it_whole(monkeypatch, qtype):
    """Blocks dequantize many rows per call (not gguf.quants' 16), here in groups of 3 rows and a
    remainder: the values are the package's, bit for bit."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    raw = quants.quantize(np.random.default_rng(1).standard_normal((11, 64), np.float32), kind)
    monkeypatch.setattr(gguf_file, "_DEQUANTIZE_BYTES", 3 * raw.shape[1])
    ours = gguf_file._dequantize(GgufTensor("w", kind, (64, 11), raw), Path("w.gguf"))
    theirs = quants.dequantize(raw, kind)
    assert ours.shape == (11, 64)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
