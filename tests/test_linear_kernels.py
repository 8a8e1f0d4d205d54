"""Linear kernels as strategies (``model/linear/``): the plan each machine class gets, made
without that machine, and every kernel against the dense reference on random weights (bit for
bit where the kernels promise it)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model import quant as Q
from tokenmill.model.layers import Linear
from tokenmill.model.linear import plan_linears
from tokenmill.model.linear.activation import silu_and_mul
from tokenmill.model.linear.dense import Bf16Rows, Dense, OneDnn
from tokenmill.model.linear.packed import (Bf16Blocks, Bf16BlocksSilu, Bf16Packed,
                                           Bf16PackedSilu, interleaved_columns, F32Packed)
from tokenmill.model.linear.plan import ROLES
from tokenmill.model.linear.quantized import Fp8, QuantBytes
from tokenmill.model.linear.routed import OneDnnRouted
from tokenmill.model.linear.setup import build_kernel
from tokenmill.platform import Machine

ops = cpu_kernels.load()
needs_f32_gemm = pytest.mark.skipif(ops is None or not ops.f32_pack_cols,
                                    reason="no float32 GEMM kernels (AVX2 or AVX512)")
needs_bf16_gemm = pytest.mark.skipif(ops is None or not getattr(ops, "has_bf16_gemm", False),
                                     reason="the packed bf16 GEMM needs AVX512-BF16")
needs_kernels = pytest.mark.skipif(ops is None, reason="CPU kernels not built (no compiler)")


def plan_for(kind: str, dtype: str, quantization: str = "none", **kw):
    return plan_linears(Machine.described(kind), dtype, quantization, **kw)


def kernels(plan) -> dict[str, str]:
    return {role: plan.kernel_for(role) for role in ROLES}


# ----- the plan, per machine class ------------------------------------------------------------

@pytest.mark.parametrize("kind,dtype,quantization,want", [
    ("avx2", "float32", "none", dict.fromkeys(ROLES, "f32-packed")),
    ("avx512-bf16", "bfloat16", "none",
     {**dict.fromkeys(ROLES, "bf16-packed"), "gate_up": "bf16-packed-silu"}),
    ("amx", "bfloat16", "none",
     {**dict.fromkeys(ROLES, "bf16-amx"), "gate_up": "bf16-amx-silu"}),
    ("bare", "float32", "none", dict.fromkeys(ROLES, "onednn")),
    ("bare", "bfloat16", "none", dict.fromkeys(ROLES, "dense")),
    ("cuda", "bfloat16", "none", dict.fromkeys(ROLES, "dense")),
    ("cuda", "bfloat16", "fp8", {**dict.fromkeys(ROLES, "fp8"), "lm_head": "dense"}),
    ("avx2", "float32", "int4", dict.fromkeys(ROLES, "f32-packed-a8")),
    ("avx512-bf16", "bfloat16", "int8",
     {**dict.fromkeys(ROLES, "bf16-blocks"), "gate_up": "bf16-blocks-silu"}),
    ("amx", "bfloat16", "int8", dict.fromkeys(ROLES, "quant-a8")),
    ("avx2", "bfloat16", "int4", dict.fromkeys(ROLES, "quant")),
    ("bare", "float32", "int8", dict.fromkeys(ROLES, "quant-torch")),
])
def test_each_machine_class_gets_its_kernel_families(kind, dtype, quantization, want):
    plan = plan_for(kind, dtype, quantization)
    assert kernels(plan) == want
    assert plan.onednn_trial == (kind == "amx" and dtype == "bfloat16")
    # float gate/up weights take SiLU·mul into the packed bf16 GEMM's epilogue
    assert plan.gate_silu == (kind in ("avx512-bf16", "amx") and dtype == "bfloat16")


def test_what_each_plan_keeps_in_bits_and_quantizes():
    f32 = plan_for("avx2", "float32")
    assert f32.keep_gguf_blocks and f32.kernels_for("qkv", quantized=True) == (
        "f32-packed-bits", "dequantize")  # a GGUF's blocks in their bits, or float32 after all
    assert not plan_for("avx512-bf16", "bfloat16").keep_gguf_blocks
    auto = plan_for("avx512-bf16", "bfloat16", "auto")
    assert auto.keep_gguf_blocks and auto.int8_activations
    # the blocks on the packed bf16 GEMM; a size it does not take, int8 rows of x
    assert auto.kernels_for("down", quantized=True) == ("bf16-blocks", "quant-a8", "quant")
    assert auto.kernels_for("gate_up", quantized=True)[0] == "bf16-blocks-silu"
    int4 = plan_for("avx2", "float32", "int4")
    assert int4.format_of("down") == "int4" and int4.format_of("lm_head") == "int8"
    assert int4.kernels_for("o", True) == ("f32-packed-a8", "f32-packed-bits", "quant")
    # PyTorch's reference attention: the layers keep PyTorch's ops, quantized weights still
    # multiply on the kernels
    ref = plan_for("amx", "float32", "int8", cpu_kernels=False)
    assert kernels(ref) == dict.fromkeys(ROLES, "quant-a8") and not ref.onednn_trial
    assert plan_for("avx2", "float32", cpu_kernels=False).kernel_for("qkv") == "onednn"


def test_gpu_plans_refuse_what_the_gpu_cannot_run():
    plan = plan_for("cuda", "bfloat16", "int8")
    assert plan.quantization == "none" and kernels(plan) == dict.fromkeys(ROLES, "dense")
    assert "CPUs only" in plan.notes[0]
    with pytest.raises(ValueError, match="bfloat16"):
        plan_for("cuda", "float32", "fp8")
    older = dataclasses.replace(Machine.described("cuda"), gpu_capability=(8, 0))
    with pytest.raises(ValueError, match="8.9"):
        plan_linears(older, "bfloat16", "fp8")
    with pytest.raises(ValueError, match="int5"):
        plan_for("avx2", "float32", "int5")
    assert "reference" in plan_for("avx2", "float32", "fp8").notes[0]


@pytest.mark.parametrize("kind", ["bare", "avx2", "avx512-bf16", "amx", "cuda"])
def test_a_plan_is_frozen_and_describes_itself(kind):
    plan = plan_for(kind, "float32" if kind in ("bare", "avx2") else "bfloat16")
    described = plan.describe()
    assert json.loads(json.dumps(described)) == described
    assert set(described["kernels"]) == set(ROLES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.onednn_trial = True  # type: ignore[misc]


# ----- construction follows the plan ----------------------------------------------------------

def linear(n: int, k: int, dtype=torch.float32, bias: bool = False, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=bias)
    layer.weight.data = (torch.randn(n, k, generator=g) / 4).to(dtype)
    if bias:
        layer.bias.data = torch.randn(n, generator=g).to(dtype)
    return layer


@needs_f32_gemm
def test_a_size_the_planned_kernel_cannot_take_gets_the_next_one():
    plan = plan_for("avx2", "float32")
    assert build_kernel(linear(48, 64), "o", plan, ops, ops).family == "f32-packed"
    odd = build_kernel(linear(36, 64), "o", plan, ops, ops)  # not a multiple of 8 columns
    assert odd.family == "onednn"
    dense_only = dataclasses.replace(plan, float_kernels=("dense",))
    assert isinstance(build_kernel(linear(48, 64), "o", dense_only, ops, ops), Dense)


@needs_f32_gemm
def test_unquantized_blocks_the_gemm_cannot_hold_become_float32():
    layer = linear(36, 64)
    layer.set_quantized(Q.quantize_int4(layer.weight.detach()))
    kernel = build_kernel(layer, "o", plan_for("avx2", "float32"), ops, ops)
    assert kernel.family == "onednn" and layer.quant is None
    assert torch.equal(layer.weight, Q.dequantize(Q.quantize_int4(linear(36, 64).weight)))


def test_a_loaded_model_follows_the_plan_it_is_given(tmp_path):
    from tests.tiny_models import make_hf_model, save_hf_model
    from tokenmill.model.loader import load_model
    from tokenmill.runner.cpu_step import unsupported

    path = str(save_hf_model(make_hf_model("llama"), tmp_path / "hf"))
    machine = Machine.detect("cpu")
    plan = plan_linears(machine, "float32", cpu_kernels=ops is not None)
    loaded = load_model(path, "cpu", "float32", plan=plan)
    assert loaded.plan is plan and loaded.onednn_rows is None
    for name, kernel in loaded.kernels.items():  # every layer on its role's first choice
        role = "lm_head" if name == "lm_head" else name.rsplit(".", 1)[1].removesuffix("_proj")
        assert kernel.split(" ")[0] == plan.kernel_for(role), name
    dense = dataclasses.replace(plan, float_kernels=("dense",), onednn_trial=False)
    loaded = load_model(path, "cpu", "float32", plan=dense)
    assert set(loaded.kernels.values()) == {"dense (float32)"}
    assert unsupported(loaded.model).startswith(("not every linear", "needs the CPU kernels"))
    with pytest.raises(ValueError, match="bfloat16"):
        load_model(path, "cpu", "float32", plan=plan_linears(machine, "bfloat16"))


# ----- every kernel against the dense reference -----------------------------------------------

def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def test_dense_is_f_linear():
    layer = linear(40, 24, bias=True)
    x = torch.randn(5, 24)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_onednn_matches_the_float_reference():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch without oneDNN")
    layer = linear(40, 72, bias=True)
    kernel = OneDnn.build(layer.weight, layer.bias)
    x = torch.randn(9, 72)
    torch.testing.assert_close(kernel(x).double(), reference(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)
    assert OneDnn.build(layer.weight.bfloat16(), None) is None


# (every shape and row count of the kernels themselves: tests/test_cpu_kernels.py)

@needs_f32_gemm
@pytest.mark.parametrize("rows,n,k,bias", [(0, 48, 33, True), (3, 48, 33, False),
                                           (70, 64, 576, True)])
def test_f32_packed_matches_float64(rows, n, k, bias):
    """A last column block without a partner; strided and 3-D input."""
    layer = linear(n, k, bias=bias, seed=rows * 5 + n)
    kernel = F32Packed.build(layer.weight, layer.bias, ops)
    cols = ops.f32_pack_cols
    assert kernel.packed.shape == (n // cols, k, cols) and kernel.step_weight().gemm == "f32"
    tol = dict(rtol=1e-5, atol=1e-6 * k + 1e-5)  # float32 rounding of a sum of k products
    x = torch.randn(rows, k)
    torch.testing.assert_close(kernel(x).double(), reference(x, layer.weight, layer.bias), **tol)
    wide = torch.randn(2, rows, 2 * k)[..., :k]
    torch.testing.assert_close(kernel(wide).double(), reference(wide, layer.weight, layer.bias),
                               **tol)


@needs_f32_gemm
@pytest.mark.parametrize("quantize", [Q.quantize_int4, Q.quantize_int8])
def test_f32_packed_in_bits_sums_like_the_float32_weight(quantize):
    n = 3 * ops.f32_pack_cols
    qw = quantize(torch.randn(n, 96) / 8)
    bias = torch.randn(n)
    bits = F32Packed.build_quantized(qw, bias, ops, int8_activations=False)
    floats = F32Packed.build(Q.dequantize(qw), bias, ops)
    assert bits.weight_format == qw.kind and not bits.int8_activations
    assert bits.family == "f32-packed-bits" and floats.family == "f32-packed"
    for rows in (1, 5, 17, 40):
        x = torch.randn(rows, 96)
        assert torch.equal(bits(x), floats(x)), rows


@needs_f32_gemm
def test_f32_packed_int8_activations_is_close_to_the_weights_product():
    if not ops.a8_pack_cols:
        pytest.skip("no int8-activation GEMM (AVX2)")
    qw = Q.quantize_int4(torch.randn(64, 96) / 8)
    kernel = F32Packed.build_quantized(qw, None, ops, int8_activations=True)
    assert kernel.int8_activations and kernel.step_weight().packed.dtype == torch.int8
    assert kernel.family == "f32-packed-a8"
    x = torch.randn(7, 96)
    want = reference(x, Q.dequantize(qw), None)
    assert 0 < (kernel(x).double() - want).abs().max() < 0.02 * want.abs().max()


@needs_bf16_gemm
@pytest.mark.parametrize("rows,n,k,bias", [(1, 48, 33, True), (13, 64, 576, False)])
def test_bf16_packed_matches_the_float_reference(rows, n, k, bias):
    """An odd block of 16 features, an odd K whose last input pairs with a packed zero; strided
    rows and a leading batch dimension."""
    layer = linear(n, k, torch.bfloat16, bias, seed=rows * 7 + n)
    kernel = Bf16Packed.build(layer.weight, layer.bias, ops)
    assert kernel.packed.shape == (n // 16, (k + 1) // 2, 16, 2)
    x = torch.randn(rows, k).bfloat16()
    got = kernel(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    tol = dict(rtol=8e-3, atol=1e-2)  # float32 sums rounded once to bf16
    torch.testing.assert_close(got.double(), reference(x, layer.weight, layer.bias), **tol)
    wide = torch.randn(2, rows, 2 * k).bfloat16()[..., :k]
    torch.testing.assert_close(kernel(wide).double(), reference(wide, layer.weight, layer.bias),
                               **tol)


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [7, 130])
def test_gate_up_with_silu_in_the_epilogue_is_the_two_step_result(rows):
    """silu_and_mul of the plain packed product, bit for bit, across the kernel's row tiles and
    scratch chunks; a bias, or halves that split a column block, keep the two steps."""
    layer = linear(2 * 96, 72, torch.bfloat16, seed=5)
    plain = Bf16Packed.build(layer.weight, None, ops)
    gated = Bf16PackedSilu.build(layer.weight, None, ops)
    assert gated.applies_silu and gated.step_weight().applies_silu
    x = (torch.randn(rows, 72) * 2).bfloat16()
    got = gated(x)
    assert got.shape == (rows, 96) and torch.equal(got, silu_and_mul(plain(x), ops))
    odd = linear(2 * 40, 72, torch.bfloat16)  # the halves meet inside a block of 16
    assert Bf16PackedSilu.build(odd.weight, None, ops) is None
    biased = linear(2 * 96, 72, torch.bfloat16, bias=True)
    assert Bf16PackedSilu.build(biased.weight, biased.bias, ops) is None


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@needs_bf16_gemm
@pytest.mark.parametrize("n,k,bias", [(48, 33, True), (2 * 96, 72, False), (64, 576, False)])
def test_float32_fmas_give_vdpbf16ps_bits_at_every_row_count(n, k, bias):
    """WidenRows (csrc/bf16_gemm.h), what the load routes prompt rows to where it measures
    faster: vdpbf16ps's bits through row tiles of 1-12 rows of the task's column blocks (two,
    or a last odd one), 64-row scratch chunks over rows widened once per call, an odd K's zero
    partner, a bias, the SiLU·mul epilogue, sums that cancel (rows 1000x the rest) and the
    kernel object's route."""
    layer = linear(n, k, torch.bfloat16, bias, seed=n + k)
    kernel = Bf16Packed.build(layer.weight, layer.bias, ops)
    for rows in (1, 8, 9, 12, 13, 16, 17, 25, 33, 64, 65, 130):
        x = torch.randn(rows, k)
        x[::3] *= 1000
        x = x.bfloat16()
        dot, wide = (ops.linear_bf16_packed(x, kernel.packed, layer.bias, widen_from=r)
                     for r in (0, 1))
        assert torch.equal(bits(dot), bits(wide)), rows
        if not bias:
            dot, wide = (ops.linear_bf16_packed_silu(x, kernel.packed, None, widen_from=r)
                         for r in (0, 1))
            assert torch.equal(bits(dot), bits(wide)), rows
        kernel.widen_from = 0
        before = kernel(x)
        kernel.widen_from = 9
        assert torch.equal(bits(kernel(x)), bits(before)), rows
    assert kernel.step_weight().widen_from == 9 and "float32 FMAs from 9 rows" in kernel.describe()


@needs_bf16_gemm
def test_float32_fmas_read_denormal_inputs_as_zero_as_vdpbf16ps_does():
    """Inputs below bf16's normal range times weights large enough that their products are
    normal: vdpbf16ps reads the inputs as zero (so must the FMAs: MXCSR's DAZ) and an output that
    would be denormal is flushed (FTZ)."""
    w = torch.full((32, 64), 1000.0).bfloat16()
    packed = ops.pack_bf16_weight(w)
    x = torch.full((3, 64), 5e-39).bfloat16()
    assert x[0, 0].item() != 0 and abs(x[0, 0].item()) < torch.finfo(torch.bfloat16).tiny
    tiny = torch.full((3, 64), 1e-30).bfloat16()  # normal; products 1e-27
    for widen_from in (0, 1):
        assert torch.equal(ops.linear_bf16_packed(x, packed, None, widen_from=widen_from),
                           torch.zeros(3, 32, dtype=torch.bfloat16))
        small = ops.linear_bf16_packed(tiny, packed, None, widen_from=widen_from)
        assert (small > 0).all()
    # products of 1e-40 and their sums are denormal float32: flushed, each step, to zero
    packed = ops.pack_bf16_weight(torch.full((32, 64), 1e-20).bfloat16())
    x = torch.full((2, 64), 1e-20).bfloat16()
    for widen_from in (0, 1):
        assert torch.equal(ops.linear_bf16_packed(x, packed, None, widen_from=widen_from),
                           torch.zeros(2, 32, dtype=torch.bfloat16))


BLOCK_SHAPES = [(48, 96, True), (2 * 96, 64, False), (64, 576, False)]


def _blocks_and_rows(n, k, bias, quantize):
    """Bf16Blocks (and, without a bias, Bf16BlocksSilu) of a random layer's weight quantized
    by ``quantize``, the weight dequantized, the bf16 bias, and a function giving ``rows``
    random rows of x, every third one 1000x the rest."""
    layer = linear(n, k, torch.float32, bias, seed=n + k)
    qw = quantize(layer.weight.detach())
    bias_bf16 = layer.bias.detach().bfloat16() if bias else None
    blocks = Bf16Blocks.build_quantized(qw, bias_bf16, ops)
    assert blocks.packed.dtype == torch.uint8 and blocks.weight_format == qw.kind
    assert blocks.in_features == k and blocks.step_weight().gemm == "bf16"
    gated = None if bias else Bf16BlocksSilu.build_quantized(qw, None, ops)
    assert gated is None or (gated.applies_silu and gated.family == "bf16-blocks-silu")

    def rows_of_x(rows):
        x = torch.randn(rows, k)
        x[::3] *= 1000
        return x.bfloat16()
    return blocks, gated, Q.dequantize(qw), bias_bf16, rows_of_x


@needs_bf16_gemm
@pytest.mark.parametrize("quantize", [Q.quantize_int4, Q.quantize_int8], ids=["4-bit", "8-bit"])
@pytest.mark.parametrize("n,k,bias", BLOCK_SHAPES)
def test_blocks_sum_each_row_alike_at_every_row_count(n, k, bias, quantize):
    """Bf16Blocks over 4-bit groups (csrc/bf16_nibbles.h: vdpbf16ps over the nibbles as bf16
    16 + q, scaled per group in float32) and 8-bit ones (csrc/bf16_q8.h: float32 FMAs over
    scale * q). Each row's outputs are the same bits whatever the rows beside it (tiles of
    1-16 rows, one or two column blocks, an odd trailing block; for 8 bits 1-12 rows of both
    blocks, widened in registers up to 32 rows, over a panel from 33) and, for 4 bits, by
    vdpbf16ps or float32 FMAs; they are the float64 product of x and the blocks' weights
    rounded once to bf16 but for an output next to a rounding boundary -- closer to it than
    the bf16 weights' products (each weight rounded to bf16) -- and SiLU·mul's epilogue gives
    the products' activation bit for bit."""
    blocks, gated, weight, bias_bf16, rows_of_x = _blocks_and_rows(n, k, bias, quantize)
    dense = Bf16Packed.build(weight.bfloat16(), bias_bf16, ops)
    x = rows_of_x(130)
    full = blocks(x)
    for rows in (1, 2, 8, 9, 12, 13, 16, 17, 25, 32, 33, 64, 65, 130):
        for start in (0, 130 - rows):
            for widen_from in (0, 1):
                blocks.widen_from = widen_from
                got = blocks(x[start:start + rows])
                assert torch.equal(bits(got), bits(full[start:start + rows])), \
                    (rows, start, widen_from)
    blocks.widen_from = 0
    ref = x.double() @ weight.double().T
    if bias_bf16 is not None:
        ref += bias_bf16.double()
    # within a bf16 step of the exact product, but for float32's error summing across K
    scale = x.double().abs() @ weight.double().abs().T
    assert ((full.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + scale * 2.0 ** -12).all()
    rounded = ref.bfloat16()
    exact = (full == rounded).float().mean()
    assert exact > 0.98 and (dense(x) == rounded).float().mean() < exact
    if gated is not None:
        for widen_from in (0, 1):
            gated.widen_from = widen_from
            y = gated.product(x)
            assert torch.equal(bits(gated(x)), bits(gated.activate(y))), widen_from
            assert torch.equal(bits(y[:, interleaved_columns(n)]), bits(full))


@needs_bf16_gemm
def test_many_rows_of_a_long_k_go_in_slices_with_each_rows_bits():
    """Calls whose widened rows pass 1.5 MiB run every task over one slice of rows before the
    next (common.h's for_row_slices; K 4,096: slices of at most 64, 96 or 96 rows for bf16,
    4-bit and 8-bit weights): each row's outputs are still the bits of that row alone or in a
    call of a few rows, by vdpbf16ps and by float32 FMAs."""
    n, k = 64, 4096
    layer = linear(n, k, torch.float32, seed=3)
    x = torch.randn(150, k)
    x[::3] *= 1000
    x = x.bfloat16()
    bf16 = Bf16Packed.build(layer.weight.detach().bfloat16(), None, ops)
    kernels = [bf16] + [Bf16Blocks.build_quantized(quantize(layer.weight.detach()), None, ops)
                        for quantize in (Q.quantize_int4, Q.quantize_int8)]
    for kernel in kernels:
        for widen_from in (0, 1):
            kernel.widen_from = widen_from
            full = kernel(x)
            for lo, hi in ((0, 1), (49, 50), (63, 66), (140, 150), (0, 40), (149, 150)):
                assert torch.equal(bits(kernel(x[lo:hi])), bits(full[lo:hi])), \
                    (kernel.describe(), widen_from, lo, hi)
    ref = x.double() @ layer.weight.detach().bfloat16().double().T
    torch.testing.assert_close(bf16(x).double(), ref, rtol=1e-2, atol=ref.abs().max() * 1e-3)


@needs_bf16_gemm
def test_blocks_the_bf16_gemm_cannot_take_go_to_the_next_kernel():
    per_feature = Q.quantize_int8(torch.randn(32, 48), group_size=None)  # one scale per row
    assert Bf16Blocks.build_quantized(per_feature, None, ops) is None
    ragged = Q.quantize_int4(torch.randn(40, 64))  # 40 features: not in blocks of 16
    assert Bf16Blocks.build_quantized(ragged, None, ops) is None
    layer = linear(40, 64)
    layer.set_quantized(ragged)
    assert build_kernel(layer, "o", plan_for("avx512-bf16", "bfloat16", "int4"), ops,
                        ops).family == "quant-a8"


@needs_bf16_gemm
@pytest.mark.parametrize("rows,bias", [(2, True), (9, False)])
def test_bf16_rows_for_a_weight_the_gemm_cannot_pack(rows, bias):
    layer = linear(36, 600, torch.bfloat16, bias)  # 36 features; K with a masked tail
    assert Bf16Packed.build(layer.weight, layer.bias, ops) is None
    kernel = Bf16Rows.build(layer.weight, layer.bias, ops)
    x = torch.randn(rows, 600).bfloat16()
    got = kernel(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 36)
    torch.testing.assert_close(got.double(), reference(x, layer.weight, layer.bias),
                               rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("with_ops", [True, False])
@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_quantized_bytes_match_the_dequantized_weight(with_ops, rows):
    """From the bytes (few rows), dequantized + GEMM (many), or PyTorch without kernels."""
    if with_ops and ops is None:
        pytest.skip("CPU kernels not built (no compiler)")
    qw = Q.quantize_int4(torch.randn(64, 96) / 8)
    bias = torch.randn(64)
    kernel = QuantBytes(qw, bias, ops if with_ops else None)
    assert not kernel.int8_activations
    assert kernel.family == ("quant" if with_ops else "quant-torch")
    x = torch.randn(rows, 96)
    torch.testing.assert_close(kernel(x).double(), reference(x, Q.dequantize(qw), bias),
                               rtol=1e-5, atol=1e-5)


def test_fp8_is_close_to_the_float_product():
    w, x = torch.randn(48, 64), torch.randn(5, 64)
    got = Fp8(Q.quantize_fp8(w), None)(x)
    want = reference(x, w, None)
    assert 0 < (got.double() - want).abs().max() < 0.15 * want.abs().max()


@needs_f32_gemm
def test_routed_batches_go_to_onednn_from_their_rows():
    layer = linear(48, 64, bias=True)
    packed = F32Packed.build(layer.weight, layer.bias, ops)
    routed = OneDnnRouted(packed, layer.weight, layer.bias, 16, ops)
    step = routed.step_weight()
    assert step.dense is not None and step.dense_from_rows == 16
    small, large = torch.randn(15, 64), torch.randn(16, 64)
    assert torch.equal(routed(small), packed(small))
    assert torch.equal(routed(large), F.linear(large, layer.weight, layer.bias))
