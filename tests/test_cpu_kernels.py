"""The compiled CPU kernels' fused layer steps against the PyTorch code they replace (bfloat16
and float16, where they are used), and the kernels' build and fallback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model.layers import RMSNorm, RotaryEmbedding, apply_rope, silu_and_mul
from tokenmill.config import RopeScaling

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


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 2 * 1536, generator=g) * 4).to(dtype)
    x[0, :8] = torch.tensor([-200.0, -90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 200.0])
    close_in_dtype(silu_and_mul(x, ops), silu_and_mul(x))


@pytest.mark.parametrize("rows", [1, 7, 64, 130])
def test_gate_up_with_silu_in_the_epilogue_is_the_two_step_result(rows):
    """A gate/up layer whose blocks are interleaved (Linear.gate_in_epilogue) gives
    silu_and_mul(gate_up(x)) bit for bit, for row counts across the kernel's row tiles and
    scratch chunks; a bias, or halves that split a column block, keep the two steps."""
    if not getattr(ops, "has_bf16_gemm", False):
        pytest.skip("the packed bf16 GEMM needs AVX512-BF16")
    from tokenmill.model.layers import Linear

    g = torch.Generator().manual_seed(5)
    inter, hidden = 96, 72
    layer = Linear(hidden, 2 * inter)
    layer.weight.data = (torch.randn(2 * inter, hidden, generator=g) / 8).to(torch.bfloat16)
    layer.cpu_ops = ops
    assert layer.pack_for_cpu(keep_dense=False, ops=ops)
    x = (torch.randn(rows, hidden, generator=g) * 2).to(torch.bfloat16)
    want = silu_and_mul(layer(x), ops)
    assert layer.gate_in_epilogue() and layer.gated
    got = layer(x)
    assert got.shape == (rows, inter) and torch.equal(got, want)

    odd = Linear(hidden, 2 * 40)  # 40 gate rows: the halves meet inside a block of 16
    odd.weight.data = torch.randn(80, hidden, generator=g).to(torch.bfloat16)
    odd.cpu_ops = ops
    assert odd.pack_for_cpu(keep_dense=False, ops=ops) and not odd.gate_in_epilogue()
    biased = Linear(hidden, 2 * inter, bias=True)
    biased.weight.data = torch.randn(2 * inter, hidden, generator=g).to(torch.bfloat16)
    biased.bias.data = torch.randn(2 * inter, generator=g).to(torch.bfloat16)
    biased.cpu_ops = ops
    assert biased.pack_for_cpu(keep_dense=False, ops=ops) and not biased.gate_in_epilogue()
    assert not odd.gated and not biased.gated


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
    from tokenmill.model.layers import Linear

    g = torch.Generator().manual_seed(4)
    layer = Linear(600, 36, bias=bias)  # K not a multiple of 32: the masked tail
    layer.weight.data = torch.randn(36, 600, generator=g).bfloat16()
    if bias:
        layer.bias.data = torch.randn(36, generator=g).bfloat16()
    layer.cpu_ops = ops
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
    from tokenmill.model.layers import Linear

    g = torch.Generator().manual_seed(rows * 7 + n)
    layer = Linear(k, n, bias=bias)
    layer.weight.data = torch.randn(n, k, generator=g).bfloat16()
    if bias:
        layer.bias.data = torch.randn(n, generator=g).bfloat16()
    w = layer.weight.detach().clone()
    layer.cpu_ops = ops
    assert layer.pack_for_cpu(keep_dense=False, ops=ops)
    assert layer.weight is None and layer.packed_bf16.shape == (n // 16, (k + 1) // 2, 16, 2)
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
    from tokenmill.model.layers import Linear

    g = torch.Generator().manual_seed(rows * 5 + n)
    layer = Linear(k, n, bias=bias)
    layer.weight.data = torch.randn(n, k, generator=g)
    if bias:
        layer.bias.data = torch.randn(n, generator=g)
    w = layer.weight.detach().clone()
    b = None if not bias else layer.bias.detach().double()
    layer.cpu_ops = ops
    assert layer.pack_for_cpu(keep_dense=False, ops=ops)
    cols = ops.f32_pack_cols
    assert layer.weight is None and layer.packed_f32.shape == (n // cols, k, cols)
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
    from tokenmill.model.layers import Linear

    layer = Linear(64, 36)  # 36 features: the plain weight stays (linear_bf16_rows, oneDNN)
    layer.weight.data = torch.randn(36, 64).bfloat16()
    assert not layer.pack_for_cpu(keep_dense=False, ops=ops)
    assert layer.weight is not None and layer.packed_bf16 is None
