"""Bad model inputs give one clear ModelLoadError naming the problem."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from tests.tiny_models import make_hf_model, write_tiny_gguf
from tokenmill.errors import ModelLoadError
from tokenmill.model.loader import load_model


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/no/such/model.gguf")


def test_hub_name_is_refused_with_hint():
    with pytest.raises(ModelLoadError, match="never downloads"):
        load_model("meta-llama/Llama-3.2-1B")


def test_non_model_file_and_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(bad))


def test_truncated_gguf(tmp_path):
    good = tmp_path / "good.gguf"
    write_tiny_gguf(make_hf_model("llama"), good, "llama", "F16")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(str(cut))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model(str(path))


def test_unsupported_tensor_type(tmp_path):
    good = tmp_path / "good.gguf"
    write_tiny_gguf(make_hf_model("llama"), good, "llama", "F32")
    reader = gguf.GGUFReader(str(good))
    path = tmp_path / "int.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, f in reader.fields.items():
        if key.startswith("llama."):
            w.add_key_value(key, f.contents(), f.types[0])
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name == "blk.0.ffn_up.weight":
            data = data.astype(np.int32)  # an integer weight: no dequantization exists
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="blk.0.ffn_up.weight.*I32"):
        load_model(str(path))


def test_unsupported_hf_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(ModelLoadError, match="gpt_neox"):
        load_model(str(tmp_path))


def test_import_is_cheap():
    code = ("import sys, tokenmill; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'fastapi', 'uvicorn', 'numpy', 'gguf')]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
