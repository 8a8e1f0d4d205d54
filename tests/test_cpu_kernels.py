"""The compiled CPU kernels against the PyTorch code they replace -- the layer steps, store_kv and
the bf16 / float32 GEMMs (the rungs of tokenmill/kernels/ladder.py whose tests live here) -- and
the kernels' build and fallback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.config import RopeScaling
from tokenmill.model.layers import Linear, RMSNorm, RotaryEmbedding, apply_rope
from tokenmill.model.linear.activation import silu_and_mul
from tokenmill.model.linear.dense import Bf16Rows
from tokenmill.model.linear.packed import Bf16Packed, Bf16PackedSilu, F32Packed

ops = cpu_kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler: the kernels fall back")
DTYPES = [torch.bfloat16, torch.float16]


def close_in_dtype(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for a last-place difference where the order of a float sum differs."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert (got == want).float().mean() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(33, 576), (33, 9, 64)])  # rows, or per head (Qwen3's q/k)
def test_rms_norm_matches_torch(dtype, with_residual, shape):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(shape[-1], 1e-5)
    norm.weight.data = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    res = torch.randn(*shape, generator=g).to(dtype) if with_residual else None
    want = norm(x, res)
    norm.cpu_ops = ops
    got = norm(x, res)
    if with_residual:
        close_in_dtype(got[0], want[0])
        assert torch.equal(got[1], want[1])  # the residual sum is one rounding either way
    else:
        close_in_dtype(got, want)


def test_the_kernels_take_the_model_dtypes_only():
    """float32, bfloat16 and float16 (TOKENMILL_DISPATCH_MODEL_TYPES in common.h); float64,
    which no model runs in, is refused by name rather than built into every kernel."""
    x, none = torch.randn(3, 64, dtype=torch.float64), torch.empty(0)
    with pytest.raises(RuntimeError, match="rms_norm.*Double"):
        ops.rms_norm(x, none, torch.ones(64, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="silu_and_mul.*Double"):
        ops.silu_and_mul(torch.randn(3, 128, dtype=torch.float64))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out, _ = ops.rms_norm(x.to(dtype), none, torch.ones(64, dtype=dtype), 1e-5)
        assert out.dtype == dtype


def test_bf16_rounding_is_torchs_to_the_bit():
    """The kernels round float32 to bfloat16 in registers: ties to even, overflow to inf,
    signed zero and subnormals come out with PyTorch's bits, NaN as NaN (the residual sum of
    rms_norm is one rounding of x + residual, so it must equal torch's add bit for bit)."""
    tiny = torch.finfo(torch.bfloat16).smallest_normal
    pairs = [(1.0, 2.0 ** -8), (1.0 + 2.0 ** -7, 2.0 ** -8), (-1.0, -(2.0 ** -8)),
             (3.0e38, 3.0e38), (-3.0e38, -3.0e38), (float("nan"), 1.0), (float("inf"), 1.0),
             (float("-inf"), -1.0), (-0.0, -0.0), (tiny / 4, 0.0), (-tiny / 8, tiny / 64),
             (1.0, 1e-30)]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 576, generator=g).to(torch.bfloat16)
    res = torch.randn(3, 576, generator=g).to(torch.bfloat16)
    for i, (a, b) in enumerate(pairs):  # in row 0's first register and row 1's last
        x[0, i], res[0, i] = a, b
        x[1, 576 - 1 - i], res[1, 576 - 1 - i] = a, b
    x.view(torch.int16)[2, :2] = 0x7FFF  # NaN with every mantissa bit set
    _, summed = ops.rms_norm(x, res, torch.ones(576, dtype=torch.bfloat16), 1e-5)
    want = (x.float() + res.float()).to(torch.bfloat16)
    nan = want.isnan()  # NaN stays NaN (its bits differ between PyTorch's own conversions)
    assert nan.sum() == 4 and torch.equal(summed.isnan(), nan)
    assert torch.equal(summed.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_matches_torch_on_strided_rows(dtype):
    g = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(64, 512, 10000.0, RopeScaling())
    positions = torch.randint(0, 512, (17,), generator=g)
    cos_sin = rope(positions)
    qkv = torch.randn(17, (9 + 3 + 3) * 64, generator=g).to(dtype)
    view = qkv[:, :12 * 64].view(17, 12, 64)  # strided rows, as in the fused projection
    want = apply_rope(view, cos_sin)
    v_before = qkv[:, 12 * 64:].clone()
    got = apply_rope(view, cos_sin, ops)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    close_in_dtype(got, want)
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # V untouched


def test_float32_rope_rounds_as_the_eager_ops():
    """The fused float32 step rotates with rope_, whose multiplies, subtraction and addition
    round as the eager path's separate PyTorch ops do: the same bits, on strided rows."""
    g = torch.Generator().manual_seed(7)
    cos_sin = RotaryEmbedding(64, 512, 10000.0, RopeScaling())(
        torch.randint(0, 512, (17,), generator=g))
    qkv = torch.randn(17, (9 + 3 + 3) * 64, generator=g)
    view = qkv[:, :12 * 64].view(17, 12, 64)
    want = apply_rope(view, cos_sin)  # float32: PyTorch's ops (the layers keep them there)
    ops.rope_(view, cos_sin[0].squeeze(1), cos_sin[1].squeeze(1))
    assert torch.equal(view, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_holds_the_references_values(dtype):
    """store_kv writes new K/V at their slots in the kernel's layout (K transposed per block
    and head, V as the reference keeps it), from strided rows (the k and v of a fused
    projection): read back, the reference backend's cache, bit for bit. (An int8 cache and a
    bfloat16 one under float32: test_kv_quant.py.)"""
    from tokenmill.attention import get_backend

    g = torch.Generator().manual_seed(6)
    blocks, block_size, heads, head_dim, tokens = 6, 16, 3, 64, 50
    kv = torch.randn(tokens, 8 + 2 * heads * head_dim, generator=g).to(dtype)[:, 8:]
    k = kv[:, :heads * head_dim].view(tokens, heads, head_dim)
    v = kv[:, heads * head_dim:].view(tokens, heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    caches = {}
    for name in ("torch", "cpu"):
        caches[name] = tuple(torch.zeros(blocks, block_size, heads, head_dim, dtype=dtype)
                             for _ in range(2))
        get_backend(name).store_kv(k, v, caches[name], slots)
    (ref_k, ref_v), (cpu_k, cpu_v) = caches["torch"], caches["cpu"]
    assert torch.equal(cpu_v, ref_v)
    # (blocks, heads, head_dim, block_size) per block -> the reference's token-major rows
    assert torch.equal(cpu_k.view(blocks, heads, head_dim, block_size).permute(0, 3, 1, 2), ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 2 * 1536, generator=g) * 4).to(dtype)
    x[0, :8] = torch.tensor([-200.0, -90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 200.0])
    close_in_dtype(silu_and_mul(x, ops), silu_and_mul(x))


@pytest.mark.parametrize("rows", [1, 7, 64, 130])
def test_gate_up_with_silu_in_the_epilogue_is_the_two_step_result(rows):
    """A gate/up weight packed with its blocks interleaved (Bf16PackedSilu) gives
    silu_and_mul(gate_up(x)) bit for bit, for row counts across the kernel's row tiles and
    scratch chunks; a bias, or halves that split a column block, keep the two steps."""
    if not getattr(ops, "has_bf16_gemm", False):
        pytest.skip("the packed bf16 GEMM needs AVX512-BF16")
    g = torch.Generator().manual_seed(5)
    inter, hidden = 96, 72
    weight = (torch.randn(2 * inter, hidden, generator=g) / 8).to(torch.bfloat16)
    x = (torch.randn(rows, hidden, generator=g) * 2).to(torch.bfloat16)
    want = silu_and_mul(Bf16Packed.build(weight, None, ops)(x), ops)
    fused = Bf16PackedSilu.build(weight, None, ops)
    assert fused is not None and fused.applies_silu
    got = fused(x)
    assert got.shape == (rows, inter) and torch.equal(got, want)

    odd = torch.randn(2 * 40, hidden, generator=g).to(torch.bfloat16)  # halves meet in a block
    assert Bf16Packed.build(odd, None, ops) is not None
    assert Bf16PackedSilu.build(odd, None, ops) is None
    bias = torch.randn(2 * inter, generator=g).to(torch.bfloat16)
    assert Bf16PackedSilu.build(weight, bias, ops) is None


def test_float32_keeps_torch_ops():
    x = torch.randn(4, 2 * 8)
    assert torch.equal(silu_and_mul(x, ops), silu_and_mul(x))


def test_build_is_cached_per_machine(tmp_path, monkeypatch):
    """The build folder's name changes with the CPU's flags, so a build from another machine
    (development machines differ day to day) is never loaded."""
    here = cpu_kernels.build_dir()
    assert cpu_kernels.is_built()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: ["sse2"])
    assert cpu_kernels.build_dir() != here
    assert not cpu_kernels.is_built()
    monkeypatch.undo()
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    assert not cpu_kernels.is_built()


def test_editing_any_file_of_csrc_is_another_build(tmp_path, monkeypatch):
    """The headers are compiled into cpu_ops.cpp, so the build folder's name hashes every file
    of csrc/, its path and its content: an edited, renamed or added file is another build."""
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    monkeypatch.setattr(cpu_kernels, "CSRC", csrc)
    inputs = cpu_kernels.build_inputs()
    key = cpu_kernels.build_key(inputs)
    header = sorted(csrc.glob("*.h"))[0]
    text = header.read_text()
    header.write_text(text + "\n")
    assert cpu_kernels.build_key(inputs) != key
    header.write_text(text)
    assert cpu_kernels.build_key(inputs) == key
    header.rename(header.with_name("renamed.h"))
    assert cpu_kernels.build_key(inputs) != key
    header.with_name("renamed.h").rename(header)
    (csrc / "notes.txt").write_text("")
    assert cpu_kernels.build_key(inputs) != key


def test_each_environment_keeps_its_own_build():
    """torch rebuilds a folder whose recorded build differs from the loading environment (the
    source's path, its torch and Python header paths, its compiler), so each of those is in the
    folder's name: a second virtual environment or checkout on the machine gets a folder of its
    own instead of rebuilding (and locking) the first one's."""
    import sysconfig

    inputs = cpu_kernels.build_inputs()
    key = cpu_kernels.build_key(inputs)
    assert cpu_kernels.build_key(list(inputs)) == key  # stable
    torch_dir = str(Path(torch.__file__).resolve().parent)
    assert torch_dir in inputs and sysconfig.get_paths()["include"] in inputs
    assert str(cpu_kernels.SOURCE.resolve()) in inputs  # another checkout: another build
    for i in range(len(inputs)):  # any one input changed: another folder
        changed = [*inputs[:i], inputs[i] + "/other", *inputs[i + 1:]]
        assert cpu_kernels.build_key(changed) != key
    # the folder this environment loads records this environment's torch
    ninja = (cpu_kernels.build_dir() / "build.ninja").read_text()
    assert os.path.join(torch_dir, "include") in ninja


def test_a_statically_linked_libstdcxx_stays_private(tmp_path):
    """Some compilers (an image's CXX wrapper adding -static-libstdc++) put a copy of libstdc++
    into the module. With the kernels' link flags that copy keeps its symbols to itself;
    exported, they bind to the process's libstdc++.so (torch's) while the copy's internals stay
    its own, and a number formatted into an error message was lost here and crashed the
    process on an AMX host. A small library linked that way formats one, after torch loaded."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    archive = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True,
                             text=True).stdout.strip()
    if not os.path.isabs(archive):
        pytest.skip("no static libstdc++ to link")
    source = tmp_path / "fmt.cpp"
    source.write_text('#include <sstream>\n#include <cstring>\n'
                      'extern "C" void tm_format(long v, char* out) {\n'
                      '  std::ostringstream s; s << "N a multiple of " << v;\n'
                      '  std::strcpy(out, s.str().c_str());\n}\n')
    lib = tmp_path / "fmt.so"
    subprocess.run([cxx, "-O2", "-fPIC", "-shared", "-static-libstdc++", str(source),
                    *cpu_kernels._LDFLAGS, "-o", str(lib)], check=True)
    code = ("import ctypes, torch\n"
            f"lib = ctypes.CDLL({str(lib)!r}); out = ctypes.create_string_buffer(64)\n"
            "lib.tm_format(12, out); print(out.value.decode())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "N a multiple of 12"


def test_without_kernels_the_reference_backend_is_chosen(monkeypatch):
    from tokenmill.attention import default_backend, get_backend

    monkeypatch.setattr(cpu_kernels, "load", lambda build=True: None)
    assert default_backend("cpu") == "torch"
    with pytest.raises(ValueError, match="--attention-backend torch"):
        get_backend("cpu")
    from tokenmill.attention import has_triton

    assert default_backend("cuda") == ("triton" if has_triton() else "torch")
    monkeypatch.setattr("tokenmill.attention.has_triton", lambda: False)
    assert default_backend("cuda") == "torch"


@pytest.mark.skipif(ops is None or not ops.has_bf16_dot, reason="needs AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_for_few_rows_matches_float_reference(rows, bias):
    g = torch.Generator().manual_seed(4)
    layer = Linear(600, 36, bias=bias)  # K not a multiple of 32: the masked tail
    layer.weight.data = torch.randn(36, 600, generator=g).bfloat16()
    if bias:
        layer.bias.data = torch.randn(36, generator=g).bfloat16()
    kernel = Bf16Rows.build(layer.weight, layer.bias, ops)
    assert kernel is not None
    layer.use_kernel(kernel, keep_weight=True)
    x = torch.randn(rows, 600, generator=g).bfloat16()
    got = layer(x)
    want = F.linear(x.float(), layer.weight.float(), None if not bias else layer.bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 36)
    # float32 sums rounded once to bf16: within half a bf16 step of the output's size
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)


@pytest.mark.skipif(ops is None or not getattr(ops, "has_bf16_gemm", False),
                    reason="needs AVX512-BF16")
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 13, 64, 70])
@pytest.mark.parametrize("n,k", [(48, 33), (64, 576), (16, 2)])  # odd K, whole tiles, tiny
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_matches_float_reference(rows, n, k, bias):
    """The vdpbf16ps kernel on a packed weight (any row count, an odd block of 16 features,
    an odd K whose last input pairs with a packed zero), through Linear once packed."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    layer = Linear(k, n, bias=bias)
    layer.weight.data = torch.randn(n, k, generator=g).bfloat16()
    if bias:
        layer.bias.data = torch.randn(n, generator=g).bfloat16()
    w = layer.weight.detach().clone()
    kernel = Bf16Packed.build(layer.weight, layer.bias, ops)
    assert kernel is not None and kernel.packed.shape == (n // 16, (k + 1) // 2, 16, 2)
    layer.use_kernel(kernel)
    assert layer.weight is None
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = layer(x)
    want = F.linear(x.float(), w.float(), None if not bias else layer.bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)
    # strided rows (a view) and a leading batch dimension
    wide = torch.randn(2, rows, 2 * k, generator=g).bfloat16()[..., :k]
    torch.testing.assert_close(layer(wide).float(), F.linear(wide.float(), w.float(),
                               None if not bias else layer.bias.float()), rtol=8e-3, atol=1e-2)


@pytest.mark.skipif(ops is None or not getattr(ops, "f32_pack_cols", 0), reason="needs AVX2")
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 13, 64, 70])
@pytest.mark.parametrize("n,k", [(48, 33), (64, 576), (16, 1)])  # an odd block pair, tiny K
@pytest.mark.parametrize("bias", [False, True])
def test_packed_f32_linear_matches_float64_reference(rows, n, k, bias):
    """The float32 kernel on a packed weight: every row count (whole tiles and the rest), a
    last column block without a partner, through Linear once packed; strided and 3-D input."""
    g = torch.Generator().manual_seed(rows * 5 + n)
    layer = Linear(k, n, bias=bias)
    layer.weight.data = torch.randn(n, k, generator=g)
    if bias:
        layer.bias.data = torch.randn(n, generator=g)
    w = layer.weight.detach().clone()
    b = None if not bias else layer.bias.detach().double()
    cols = ops.f32_pack_cols
    kernel = F32Packed.build(layer.weight, layer.bias, ops)
    assert kernel is not None and kernel.packed.shape == (n // cols, k, cols)
    layer.use_kernel(kernel)
    assert layer.weight is None
    x = torch.randn(rows, k, generator=g)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    tol = dict(rtol=1e-5, atol=1e-6 * k + 1e-5)  # float32 rounding of a sum of k products
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double(), b), **tol)
    wide = torch.randn(2, rows, 2 * k, generator=g)[..., :k]
    torch.testing.assert_close(layer(wide).double(), F.linear(wide.double(), w.double(), b),
                               **tol)


@pytest.mark.skipif(ops is None or not getattr(ops, "f32_pack_cols", 0), reason="needs AVX2")
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 13, 64, 70])
@pytest.mark.parametrize("n,k", [(48, 33), (64, 576)])
def test_packed_f32_linear_adds_the_residual_as_pytorch_does(rows, n, k):
    """The fused step adds a layer's residual to its o_proj and down outputs as their tiles are
    stored: the same float32 sums as the linear and then a PyTorch add, bit for bit, with and
    without a bias and from a residual that is a strided view; a residual of another shape is
    refused."""
    g = torch.Generator().manual_seed(rows + n)
    packed = ops.pack_f32_weight(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g)
    residual = torch.randn(rows, n + 16, generator=g)[:, 16:]
    for bias in (None, torch.randn(n, generator=g)):
        want = ops.linear_f32_packed(x, packed, bias) + residual
        assert torch.equal(ops.linear_f32_packed_add(x, packed, bias, residual), want)
    with pytest.raises(RuntimeError, match="residual"):
        ops.linear_f32_packed_add(x, packed, None, torch.zeros(rows, n - 8))


@pytest.mark.skipif(ops is None or not getattr(ops, "f32_pack_cols", 0), reason="needs AVX2")
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 57, 2048])
@pytest.mark.parametrize("n", [33, 96, 576, 4096])
def test_float32_rms_norm_rounds_as_pytorch_does(rows, n):
    """The fused float32 step's RMSNorm (the squares and the scaling in the kernel, PyTorch's
    own mean) equals PyTorch's rms_norm bit for bit: rows whole registers and not, widths with
    a scalar tail, two eps, values over several magnitudes, and a strided view."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    w = torch.randn(n, generator=g)
    for eps in (1e-5, 1e-6):
        x = torch.randn(rows, n, generator=g) * torch.rand(rows, 1, generator=g) * 10
        assert torch.equal(ops.rms_norm_f32(x, w, eps), F.rms_norm(x, (n,), w, eps))
    wide = torch.randn(rows, n + 40, generator=g)[:, 40:]
    assert torch.equal(ops.rms_norm_f32(wide, w, 1e-5), F.rms_norm(wide, (n,), w, 1e-5))


@pytest.mark.skipif(ops is None or not getattr(ops, "has_bf16_gemm", False),
                    reason="needs AVX512-BF16")
def test_packing_needs_whole_blocks_of_16_features():
    weight = torch.randn(36, 64).bfloat16()  # 36 features: the plain weight's kernels take it
    assert Bf16Packed.build(weight, None, ops) is None
    assert Bf16Rows.build(weight, None, ops) is not None
