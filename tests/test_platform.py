"""--dtype auto: the compute dtype follows the CPU's instruction sets, never a fixed machine."""

from __future__ import annotations

import pytest

from tokenmill import platform


@pytest.mark.parametrize("features,dtype", [
    ({"avx2", "fma3"}, "float32"),  # an AVX2-only EPYC: bf16 would be emulated, slow
    ({"avx2", "avx512_f", "avx512_bf16"}, "bfloat16"),  # Zen 4 / Cooper Lake
    ({"avx2", "avx512_f", "amx_bf16", "amx_tile"}, "bfloat16"),  # Sapphire Rapids
    (set(), "float32"),
])
def test_auto_dtype_follows_the_cpu(monkeypatch, features, dtype):
    monkeypatch.setattr(platform, "cpu_features", lambda: features)
    chosen, why = platform.choose_dtype("cpu", "auto")
    assert chosen == dtype
    assert ("natively" in why) == (dtype == "bfloat16")
    assert platform.choose_dtype("cpu", None)[0] == dtype


def test_explicit_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(platform, "cpu_features", lambda: {"avx2"})
    assert platform.choose_dtype("cpu", "bfloat16") == ("bfloat16", "asked for")


def test_this_machine_is_described():
    desc = platform.cpu_description()
    assert desc["cpu"] and set(desc["isa"]) <= set(platform.ISA_FLAGS)
    assert platform.usable_cores() >= 1
