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


@pytest.mark.parametrize("device,requested_dtype,dtype,requested,want", [
    # --dtype auto kept float32 on a CPU without native bf16: K/V in bf16
    ("cpu", "auto", "float32", "auto", "bfloat16"),
    ("cpu", None, "float32", "auto", "bfloat16"),
    # float32 asked for, or bf16 compute: the compute dtype's cache
    ("cpu", "float32", "float32", "auto", "auto"),
    ("cpu", "auto", "bfloat16", "auto", "auto"),
    ("cuda", "auto", "float16", "auto", "auto"),
    ("cuda", "float32", "float32", "auto", "auto"),
    # an explicit cache dtype is kept
    ("cpu", "auto", "float32", "int8", "int8"),
    ("cpu", "float32", "float32", "bfloat16", "bfloat16"),
])
def test_auto_kv_cache_dtype(device, requested_dtype, dtype, requested, want):
    chosen, why = platform.choose_kv_cache_dtype(device, requested_dtype, dtype, requested)
    assert chosen == want
    if requested != "auto":
        assert why == "asked for"
    elif want == "bfloat16":
        assert "native bfloat16" in why and "memory traffic" in why
    else:
        assert why == f"the compute dtype ({dtype})"


def test_auto_kv_cache_dtype_follows_the_cpu(monkeypatch):
    for features, kv in [({"avx2", "fma3"}, "bfloat16"), ({"avx512_bf16"}, "auto")]:
        monkeypatch.setattr(platform, "cpu_features", lambda: features)
        dtype, _ = platform.choose_dtype("cpu", "auto")
        assert platform.choose_kv_cache_dtype("cpu", "auto", dtype)[0] == kv


_ROUNDS = """
import resource, torch
from tokenmill import platform
assert platform.configure_allocator()
faults = []
for _ in range(8):  # a float32 2,048-token prompt step's temporaries, four layers of them
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h = torch.empty(2048, 576).fill_(1.0)
    for layer in range(4):
        qkv = torch.empty(2048, 960).fill_(1.0)
        o = torch.empty(2048, 576).fill_(1.0)
        del qkv
        gate_up = torch.empty(2048, 3072).fill_(1.0)  # 25 MB
        act = torch.empty(2048, 1536).fill_(1.0)
        del gate_up
        h = torch.empty(2048, 576).fill_(1.0) + o
        del act, o
    del h
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(platform.platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_large_temporaries_reuse_the_heap():
    """With configure_allocator, a step's large temporaries settle into reused heap pages:
    after a few rounds (almost) no page faults. (glibc's defaults here sometimes settle too and
    sometimes map and fault ~15,700 pages every round, unmapping or trimming them each time.)
    Settled rounds still fault a few hundred to ~1,200 pages now and then on some machines
    (seen on a Xeon with AMX, on every commit alike): the bound is a quarter of one round's
    fresh pages over the last four rounds, where unsettled rounds fault four whole rounds'."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ROUNDS], capture_output=True, text=True,
                         check=True)
    faults = [int(x) for x in out.stdout.split()]
    assert len(faults) == 8 and faults[0] > 4096  # the first round does touch fresh pages
    assert sum(faults[4:]) < faults[0] // 4, faults


def test_this_machine_is_described():
    desc = platform.cpu_description()
    assert desc["cpu"] and set(desc["isa"]) <= set(platform.ISA_FLAGS)
    assert platform.usable_cores() >= 1
