"""Quantized weights (model/quant.py, kernels/csrc/quant_ops.h): each format against its float
reference, GGUF blocks kept as the file has them, and whole models loaded quantized."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import make_hf_model, write_tiny_gguf
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model import quant as Q
from tokenmill.model.layers import Linear
from tokenmill.model.linear import plan as linear_plan
from tokenmill.model.linear.quantized import DENSE_ROWS, Fp8, QuantBytes
from tokenmill.model.loader import load_model
from tokenmill.runner.batch import Chunk
from tokenmill.runner.model_runner import ModelRunner

OPS = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(OPS is None, reason="CPU kernels not built (no compiler)")

SHAPES = [(96, 64), (50, 96), (256, 576)]


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row: scales must not divide by zero
    w[1, :32] = 0.3  # a constant group
    return w


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group", [32, None])  # Q8_0's groups; one scale per feature
def test_int8_round_trip_within_half_a_step(n, k, group):
    w = weights(n, k)
    qw = Q.quantize_int8(w, group)
    assert qw.qweight.dtype == torch.int8 and qw.group_size == (group or k)
    assert qw.scales.dtype == (torch.float16 if group else torch.float32)
    step = qw.scales.float().repeat_interleave(qw.group_size, dim=1)
    err = (Q.dequantize(qw) - w).abs()
    assert torch.all(err <= step * (0.5 + 1e-5))  # + float32 rounding of w / scale
    assert torch.isfinite(Q.dequantize(qw)).all()


@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_round_trip_within_half_a_step(n, k):
    w = weights(n, k)
    qw = Q.quantize_int4(w)
    assert qw.bits == 4 and qw.qweight.shape == (n, k // 2) and qw.scales.shape == (n, k // 32)
    step = qw.scales.float().repeat_interleave(32, dim=1)
    err = (Q.dequantize(qw) - w).abs()
    # half a step, plus float16's rounding of the offset (relative 2^-11 of the group's minimum)
    slack = w.abs().view(n, k // 32, 32).amax(-1).repeat_interleave(32, dim=1) * 2.0 ** -10
    assert torch.all(err <= step / 2 + slack + 1e-7)
    # the maximum and minimum of each group are represented (up to float16 rounding)
    assert torch.all(err[1, :32] <= 0.3 * 2.0 ** -10)


def test_int4_keeps_float32_scales_where_float16_cannot_hold_them():
    w = weights(8, 64) * 1e-5  # steps below float16's normal range
    qw = Q.quantize_int4(w)
    assert qw.scales.dtype == torch.float32
    assert (Q.dequantize(qw) - w).abs().max() <= qw.scales.max() / 2 * 1.001
    assert Q.quantize_int4(weights(8, 64)).scales.dtype == torch.float16


def test_int4_needs_groups_of_32():
    with pytest.raises(ValueError, match="groups"):
        Q.quantize_int4(torch.randn(4, 48))


def _formats(n: int, k: int) -> list[Q.QuantWeight]:
    w = weights(n, k, seed=n + k)
    return [Q.quantize_int8(w), Q.quantize_int8(w, None), Q.quantize_int4(w),
            Q.quantize_int4(w * 1e-5)]


@needs_kernels
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_products_equal_the_dequantized_weights(n, k, rows, dtype):
    """The kernel multiplies straight from the bytes; its products are those of the weights
    the reference dequantizes (float32 up to the order of the sums)."""
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    for qw in _formats(n, k):
        y = OPS.quant_linear(x, qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size, bias)
        ref = x.double() @ Q.dequantize(qw).double().T + bias.double()
        assert y.dtype == dtype and y.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
        assert ((y.double() - ref).abs() / ref.abs().max()).max() < tol, qw.kind


@needs_kernels
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_dequantization_is_bit_exact(n, k, dtype):
    for qw in _formats(n, k):
        got = OPS.quant_dequantize(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size, dtype)
        assert torch.equal(got, Q.dequantize(qw, dtype)), qw.kind


@needs_kernels
@pytest.mark.parametrize("rows", [1, DENSE_ROWS, DENSE_ROWS + 1, 100])
def test_quant_linear_paths_agree(rows):
    """Kernel from the bytes (few rows), dequantize + GEMM (many rows) and the PyTorch
    fallback without kernels: one result."""
    qw = Q.quantize_int4(weights(64, 96))
    x = torch.randn(rows, 96)
    ref = x @ Q.dequantize(qw).T
    for ops in (OPS, None):
        assert torch.allclose(QuantBytes(qw, None, ops)(x), ref, atol=1e-5, rtol=1e-5)


needs_int8_dot = pytest.mark.skipif(OPS is None or not OPS.has_int8_dot,
                                    reason="no AVX512-VNNI")
A8_SHAPES = [(96, 64), (50, 96), (256, 576), (7, 32)]  # K % 64: 0 and 32


def int8_activation_product(qw: Q.QuantWeight, rows: int):
    """(kernel result, the reference: x quantized per row to int8 times the dequantized
    weights, the scale per row, x, bias) for random x with a zero run, and a bias."""
    n, k = qw.shape
    Q.use_int8_activations(qw)
    x = torch.randn(rows, k)
    x[0, :7] = 0.0
    bias = torch.randn(n)
    y = QuantBytes(qw, bias, OPS)(x)
    sx = (x.abs().amax(1, keepdim=True) / 127).clamp_min(1e-30)
    xq = torch.round(x / sx).clamp(-127, 127) * sx
    ref = xq.double() @ Q.dequantize(qw).double().T + bias.double()
    assert ((y.double() - ref).abs() / ref.abs().max()).max() < 1e-5
    return y, sx, x, bias


@needs_int8_dot
@pytest.mark.parametrize("n,k", A8_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_w8a8_equals_quantized_activations_times_int8_weights(n, k, rows):
    w = weights(n, k)
    qw = Q.quantize_int8(w)
    y, sx, x, bias = int8_activation_product(qw, rows)
    # and against the float product: within the two roundings' bound
    wd = Q.dequantize(qw).double()
    step = qw.scales.double().repeat_interleave(32, dim=1)
    bound = (sx.double() / 2) @ wd.abs().sum(1, keepdim=True).T + x.abs().double() @ (step / 2).T
    exact = x.double() @ w.double().T + bias.double()
    assert torch.all((y.double() - exact).abs() <= bound + 1e-5)


@needs_int8_dot
@pytest.mark.parametrize("n,k", A8_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("qtype", ["int4", "Q4_0", "Q4_1"])
def test_w4a8_equals_quantized_activations_times_int4_weights(n, k, rows, qtype):
    w = weights(n, k)
    if qtype == "int4":
        qw = Q.quantize_int4(w)
    else:
        from gguf import GGMLQuantizationType, quants

        raw = quants.quantize(w.numpy(), GGMLQuantizationType[qtype])
        qw = Q.from_gguf_blocks(raw, qtype, (n, k))
    int8_activation_product(qw, rows)


needs_a8_gemm = pytest.mark.skipif(OPS is None or not OPS.a8_pack_cols,
                                   reason="no int8-activation GEMM (AVX2)")


def int8_groups_product(x: torch.Tensor, qw: Q.QuantWeight) -> torch.Tensor:
    """What a8_gemm.h computes, in float64: each group of 32 of x's rows rounded to int8 with
    its own scale (absmax / 127, half to even), times the dequantized weights (scale * q, plus
    a 4-bit weight's offset)."""
    rows, k = x.shape
    g = x.reshape(rows, k // 32, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    q = torch.round(g * torch.where(d > 0, 1 / d, torch.zeros_like(d))).clamp(-127, 127)
    return (q.double() * d.double()).reshape(rows, k) @ Q.dequantize(qw, torch.float64).T


@needs_a8_gemm
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(8, 32), (64, 96), (960, 576), (576, 1536)])
def test_a8_packed_linear_multiplies_int8_groups_of_x(bits, n, k):
    """linear_f32_packed over a weight packed by pack_a8_weight: x's groups of 32 rounded to
    int8, the integer products, the scales and offsets; every row-tile remainder and more rows
    than a panel, a bias and a residual, a strided x, groups of zeros, and the extremes (4-bit
    15s and 8-bit -128s times +-127: no int16 sum may saturate)."""
    w = weights(n, k)
    qw = Q.quantize_int4(w) if bits == 4 else Q.quantize_int8(w)
    if bits == 8:
        qw.qweight[2, :32] = -128
    else:
        qw.qweight[2, :16] = 0xFF
    packed = OPS.pack_a8_weight(qw.qweight, qw.scales, qw.zeros, bits, 32)
    assert packed.dtype == torch.int8 and packed.shape[:2] == (n // 8, k // 32)
    gen = torch.Generator().manual_seed(1)
    for rows in (0, 1, 2, 3, 4, 5, 7, 64, 65, 130):
        x = torch.randn(rows, k + 5, generator=gen)[:, 3:k + 3]  # rows k + 5 apart
        if rows:  # a group of zeros; groups of +-127 only, against the weights' extremes
            x[0, :32] = 0.0
            x[-1, :32] = 3.0
            x[rows // 2, :32] = -3.0
        want = int8_groups_product(x, qw)
        got = OPS.linear_f32_packed(x, packed, None)
        assert got.shape == (rows, n)
        if rows:
            assert ((got.double() - want).abs().max() / want.abs().max()) < 2e-6, rows
        bias, residual = torch.randn(n, generator=gen), torch.randn(rows, n + 2, generator=gen)
        added = OPS.linear_f32_packed_add(x, packed, bias, residual[:, :n])
        assert torch.equal(added, got + bias + residual[:, :n])


@needs_a8_gemm
def test_a8_packing_refuses_what_it_cannot_take():
    qw = Q.quantize_int4(weights(16, 64))
    with pytest.raises(RuntimeError, match="offsets"):
        OPS.pack_a8_weight(qw.qweight, qw.scales, None, 4, 32)
    odd = Q.quantize_int8(weights(12, 64))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        OPS.pack_a8_weight(odd.qweight, odd.scales, None, 8, 32)
    with pytest.raises(RuntimeError, match="float16 scales"):
        OPS.pack_a8_weight(qw.qweight, qw.scales.float(), qw.zeros, 4, 32)
    packed = OPS.pack_a8_weight(qw.qweight, qw.scales, qw.zeros, 4, 32)
    with pytest.raises(RuntimeError, match="K = 96"):
        OPS.linear_f32_packed(torch.randn(2, 96), packed, None)


@needs_kernels
def test_int8_activations_without_their_kernels_run_weights_only():
    """A weight marked for int8 activations that no int8 kernel takes (no VNNI, not packed:
    e.g. a bf16 model on AVX2) is multiplied by the weights-only kernels, not refused."""
    qw = Q.quantize_int4(weights(64, 96))
    Q.use_int8_activations(qw)
    x = torch.randn(3, 96)
    got = QuantBytes(qw, None, OPS)(x)
    if OPS.has_int8_dot:  # the VNNI kernel: x rounded to int8
        assert not torch.allclose(got, x @ Q.dequantize(qw).T, atol=1e-6, rtol=1e-6)
    else:
        assert torch.allclose(got, x @ Q.dequantize(qw).T, atol=1e-5, rtol=1e-5)


def test_int8_activations_need_groups_of_32_in_float16():
    with pytest.raises(ValueError):
        Q.use_int8_activations(Q.quantize_int4(weights(8, 64) * 1e-5))  # float32 scales
    with pytest.raises(ValueError):
        Q.use_int8_activations(Q.quantize_int8(weights(8, 64), None))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_kept_exactly(qtype):
    """GGUF blocks repacked without a float round trip: the same weights as the gguf
    package's dequantization, bit for bit, and (with the kernels) the same products."""
    from gguf import GGMLQuantizationType, quants

    w = weights(40, 96, seed=3).numpy()
    raw = quants.quantize(w, GGMLQuantizationType[qtype])
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]))
    qw = Q.from_gguf_blocks(raw, qtype, (40, 96))
    assert qw.kind == qtype.lower() and qw.scales.dtype == torch.float16
    assert torch.equal(Q.dequantize(qw), reference)
    if OPS is not None:
        x = torch.randn(3, 96)
        y = OPS.quant_linear(x, qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size, None)
        assert torch.allclose(y, F.linear(x, reference), atol=1e-5, rtol=1e-5)


def test_concat_rows_joins_one_format_only():
    a, b = Q.quantize_int4(weights(8, 64)), Q.quantize_int4(weights(16, 64, seed=1))
    joined = Q.concat_rows([a, b])
    assert joined.shape == (24, 64)
    assert torch.equal(Q.dequantize(joined), torch.cat([Q.dequantize(a), Q.dequantize(b)]))
    assert Q.concat_rows([a, Q.quantize_int8(weights(8, 64))]) is None


# ---- whole models ------------------------------------------------------------------------

def _f32_packed(m: Linear) -> torch.dtype | None:
    """The dtype of the layer's weight packed for float32's GEMM, or None (another kernel)."""
    step = m.kernel.step_weight()
    return step.packed.dtype if step is not None and step.gemm == "f32" else None


def _packed_in_bits(m: Linear) -> bool:
    return _f32_packed(m) == torch.uint8


def _packed_a8(m: Linear) -> bool:
    """Packed for float32's GEMM with int8 activations (pack_a8_weight)."""
    return _f32_packed(m) == torch.int8


def _kind(m: Linear) -> str:
    """The layer's weight format: kept as it is, packed in its bits, or a float dtype."""
    return m.kernel.weight_format


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    table = list(range(1, -(-len(ids) // 4) + 1))
    return runner.forward([Chunk(ids, 0, table)], all_logits=True)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("arch", ["llama", "smollm2"])  # q/k rows permuted; tied embedding
def test_quantized_gguf_model_runs_from_its_blocks(tmp_path, qtype, arch, monkeypatch):
    monkeypatch.setattr(linear_plan, "INT8_ACTIVATIONS", False)  # weights only: exact products
    hf = make_hf_model(arch)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, path, arch if arch == "llama" else "llama", qtype)
    ids = [3, 17, 42, 5, 88, 1, 60, 29, 11]
    dense = load_model(str(path), "cpu", "float32", "torch", "none")
    kept = load_model(str(path), "cpu", "float32", "auto", "auto")
    linears = [m for m in kept.model.modules() if isinstance(m, Linear)]
    # every layer in its blocks: as they are, or packed in their bits for the float32 GEMM
    assert all(m.weight is None and isinstance(m.kernel, QuantBytes) != _packed_in_bits(m)
               for m in linears)
    assert any(_packed_in_bits(m) for m in linears) == (OPS is not None and OPS.f32_pack_cols > 0)
    assert kept.quantization.startswith(qtype.lower())
    if arch == "smollm2":  # tied: the embedding is looked up from the output layer's blocks
        head = kept.model.lm_head
        assert kept.model.model.embed_tokens.quant is not None
        assert not isinstance(head.kernel, QuantBytes) \
            or kept.model.model.embed_tokens.quant is head.kernel.qw
    # same weights, so the same logits (float32, up to the order of the sums)
    assert torch.allclose(_logits(kept, ids), _logits(dense, ids), atol=2e-4, rtol=1e-4)
    if OPS is not None and (OPS.has_int8_dot or OPS.a8_pack_cols):
        monkeypatch.setattr(linear_plan, "INT8_ACTIVATIONS", True)  # close, not exact
        a8 = load_model(str(path), "cpu", "float32", "auto", "auto")
        head = a8.model.lm_head  # packed for float32's int8-activation GEMM, or the VNNI kernel's
        assert head.kernel.int8_activations and (_packed_a8(head) or not OPS.a8_pack_cols)
        ref = _logits(dense, ids)
        assert 0 < (_logits(a8, ids) - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("quantization,tol", [("int8", 0.05), ("int4", 0.25)])
def test_float_model_quantized_at_load(tmp_path, quantization, tol):
    from tests.tiny_models import save_hf_model

    path = save_hf_model(make_hf_model("smollm2"), tmp_path / "hf")
    ids = [3, 17, 42, 5, 88, 1, 60, 29, 11]
    dense = _logits(load_model(str(path), "cpu", "float32", "auto", "none"), ids)
    loaded = load_model(str(path), "cpu", "float32", "auto", quantization)
    assert _kind(loaded.model.lm_head) == "int8"  # the output layer keeps 8 bits
    kinds = {_kind(m) for m in loaded.model.modules()
             if isinstance(m, Linear) and m is not loaded.model.lm_head}
    assert kinds == {quantization}
    got = _logits(loaded, ids)
    rel = (got - dense).abs().max() / dense.abs().max()
    assert 0 < rel < tol  # changed (it is quantized), but not by much


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantizing_load_lets_each_float_weight_go_at_once(tmp_path, monkeypatch, quantization):
    """Each linear is quantized as soon as its weight is complete, and its float32 weight is
    gone before the next layer's is read (a tied output layer's with the embedding's table):
    the model is never whole in float32 beside its quantized copy (the peak memory of
    ``--quantization int8``). The result is the one that quantizing after the load gives, bit
    for bit."""
    import weakref

    from tests.tiny_models import save_hf_model
    from tokenmill.model import loader

    path = save_hf_model(make_hf_model("smollm2"), tmp_path / "hf")
    ids = [3, 17, 42, 5, 88, 1, 60, 29, 11]
    done = []
    format_linear = loader.format_linear

    def watched(layer, role, plan):
        assert all(ref() is None for ref in done), "an earlier layer's float weight is held"
        done.append(weakref.ref(layer.weight))
        format_linear(layer, role, plan)

    monkeypatch.setattr(loader, "format_linear", watched)
    loaded = load_model(str(path), "cpu", "float32", "auto", quantization)
    # 2 layers of 4 linears, and the tied output layer (the embedding's table, gone with it);
    # the last one's float weight gone too while the model lives
    assert len(done) == 4 * 2 + 1 and all(ref() is None for ref in done)
    streamed = _logits(loaded, ids)
    monkeypatch.setattr(loader, "format_linear", lambda *_: None)  # all by apply_formats
    after = _logits(load_model(str(path), "cpu", "float32", "auto", quantization), ids)
    assert torch.equal(streamed, after)


@pytest.mark.parametrize("n,k,rows", [(64, 96, 1), (48, 160, 7), (256, 64, 33)])
def test_fp8_linear_within_the_format_bound(n, k, rows):
    """fp8 weights (per-channel scales) times fp8 activations (per-row scales): each product
    term carries at most the two roundings of e4m3 (2^-4 relative each, plus subnormals)."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    qw = Q.quantize_fp8(w)
    assert qw.qweight.dtype == torch.float8_e4m3fn and qw.scales.shape == (n, 1)
    back = Q.dequantize(qw)
    tiny = qw.scales * 2 ** -10
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, tiny) * (1 + 1e-6)).all()
    bias = torch.randn(n, generator=gen)
    got = Fp8(qw, bias)(x)
    want = x.double() @ w.double().T + bias.double()
    # |error| <= sum_j |x_j| |w_j| ((1 + 2^-4)^2 - 1) + the subnormal floors
    bound = (x.abs().double() @ w.abs().double().T) * ((1 + 2 ** -4) ** 2 - 1) + 1e-3
    assert ((got.double() - want).abs() <= bound).all()
    assert (got.double() - want).abs().max() > 0  # it did quantize


def test_fp8_per_tensor_fallback_gives_the_rowwise_product():
    """Where a CPU's torch._scaled_mm takes per-tensor scales only (PyTorch 2.11), the fp8
    product is summed unscaled in float32 and scaled per row and column after: the row-wise
    call's result up to the output's rounding."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 96, generator=gen), torch.randn(9, 96, generator=gen)
    qw = Q.quantize_fp8(w)
    x_scale = (x.abs().amax(dim=-1, keepdim=True) / Q.FP8_MAX).clamp_min(1e-12)
    xq = (x / x_scale).to(torch.float8_e4m3fn)
    for dtype in (torch.float32, torch.bfloat16):
        fallback = Q._scaled_mm_rows(xq, qw.qweight.t(), x_scale, qw.scales.t(), dtype,
                                     rowwise=False)
        exact = (xq.double() * x_scale.double()) @ (qw.qweight.double() * qw.scales.double()).T
        assert fallback.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        assert ((fallback.double() - exact).abs() <= tol * exact.abs().max()).all()
        if not Q._cpu_scaled_mm_takes_rows():  # per-tensor scales only in this torch
            continue
        rowwise = Q._scaled_mm_rows(xq, qw.qweight.t(), x_scale, qw.scales.t(), dtype,
                                    rowwise=True)
        assert ((rowwise.double() - fallback.double()).abs()
                <= tol * exact.abs().max()).all()


def test_fp8_model_quantizes_every_layer_but_the_output(tmp_path):
    from tests.tiny_models import save_hf_model

    path = save_hf_model(make_hf_model("llama"), tmp_path / "hf")
    ids = [3, 17, 42, 5, 88, 1, 60, 29, 11]
    dense = _logits(load_model(str(path), "cpu", "float32", "auto", "none"), ids)
    loaded = load_model(str(path), "cpu", "float32", "auto", "fp8")
    assert not isinstance(loaded.model.lm_head.kernel, Fp8)
    layers = [m for m in loaded.model.modules() if isinstance(m, Linear)
              and m is not loaded.model.lm_head]
    assert layers and all(isinstance(m.kernel, Fp8) for m in layers)
    assert loaded.quantization == f"fp8 x{len(layers)}"
    rel = (_logits(loaded, ids) - dense).abs().max() / dense.abs().max()
    assert 0 < rel < 0.2


def test_auto_leaves_float_checkpoints_alone(tmp_path):
    from tests.tiny_models import save_hf_model

    path = save_hf_model(make_hf_model("llama"), tmp_path / "hf")
    loaded = load_model(str(path), "cpu", "float32", "auto", "auto")
    assert loaded.quantization == "none"
    assert all(_kind(m) == "float32" for m in loaded.model.modules() if isinstance(m, Linear))


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="int5"):
        load_model("smollm2-135m-instruct", quantization="int5")


@pytest.mark.slow  # the real model
def test_default_model_keeps_its_gguf_blocks(default_gguf_path):
    """The default model's Q4_1 layers and Q8_0 table, repacked: the weights equal the float
    model's (the same blocks dequantized at load, which test_gguf_blocks_kept_exactly holds to
    the gguf package's values), q/k rows included."""
    dense = load_model(str(default_gguf_path), "cpu", "float32", "torch", "none")
    kept = load_model(str(default_gguf_path), "cpu", "float32", "torch", "auto")
    # + " (int8 activations: ...)" where the VNNI kernels take them
    assert kept.quantization.startswith("q4_1 x120, q8_0 x1")
    for (name, m), m_dense in zip(kept.model.named_modules(), dense.model.modules()):
        if isinstance(m, Linear):
            qw = m.kernel.qw  # PyTorch's attention: the kernels multiplying from the bytes
            w = Q.dequantize(qw)
            ref = m_dense.weight if m_dense.weight is not None else \
                m_dense.kernel.packed.to_dense()  # oneDNN's prepacked weight
            assert torch.equal(w, ref), name
            # the file's own size per weight: Q4_1 20 bytes per 32, Q8_0 34
            per_block = 20 if qw.kind == "q4_1" else 34
            assert qw.nbytes() == w.numel() // 32 * per_block


needs_f32_gemm = pytest.mark.skipif(OPS is None or not OPS.f32_pack_cols,
                                    reason="no float32 GEMM kernels (AVX2 or AVX512)")


@needs_f32_gemm
@pytest.mark.parametrize("quantize", [Q.quantize_int4, Q.quantize_int8])
@pytest.mark.parametrize("blocks,k", [(1, 32), (3, 64), (5, 96), (12, 576)])
def test_weight_packed_in_its_bits_sums_like_the_float32_weight(quantize, blocks, k):
    """A 4/8-bit weight packed for the float32 GEMM (widened in registers up to a tile's rows,
    through a shared panel beyond) gives the float32 weight's sums exactly: same values, same
    order. Column blocks 1, 3, 5 and 12 leave every remainder of the 4-block tasks; the rows
    cover the register tiles of 1-2 rows (4 blocks at once), up to 8 / 16, and the panel."""
    n = blocks * OPS.f32_pack_cols
    qw = quantize(weights(n, k, seed=blocks))
    dense = OPS.pack_f32_weight(Q.dequantize(qw))
    packed = OPS.pack_f32_quant_weight(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size)
    assert packed.dtype == torch.uint8
    assert packed.numel() == n * k * (0.75 if qw.bits == 4 else 1.125)
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 5, 8, 9, 16, 17, 40):
        x = torch.randn(rows, k, generator=gen)
        residual = torch.randn(rows, n, generator=gen)
        for b in (None, bias):
            want = OPS.linear_f32_packed(x, dense, b)
            assert torch.equal(OPS.linear_f32_packed(x, packed, b), want), (rows, b is None)
            # the residual added as the tiles are stored, as the fused step asks for it
            assert torch.equal(OPS.linear_f32_packed_add(x, packed, b, residual),
                               want + residual), (rows, b is None)
        # a row view with a stride (a slice of a wider tensor), as the layers pass them
        wide = torch.randn(rows, k + 32, generator=gen)[:, 32:]
        assert torch.equal(OPS.linear_f32_packed(wide, packed, None),
                           OPS.linear_f32_packed(wide, dense, None))


@needs_f32_gemm
def test_packing_in_bits_refuses_what_it_cannot_hold():
    qw = Q.quantize_int4(weights(OPS.f32_pack_cols, 64))
    with pytest.raises(RuntimeError, match="offsets"):
        OPS.pack_f32_quant_weight(qw.qweight, qw.scales, None, 4, 32)
    with pytest.raises(RuntimeError, match="groups of 32"):
        OPS.pack_f32_quant_weight(qw.qweight, qw.scales, qw.zeros, 4, 64)
    odd = Q.quantize_int8(weights(OPS.f32_pack_cols + 1, 64))
    with pytest.raises(RuntimeError, match="multiple"):
        OPS.pack_f32_quant_weight(odd.qweight, odd.scales, None, 8, 32)


@pytest.mark.slow  # the real model
@needs_f32_gemm
def test_default_model_in_its_blocks_gives_the_float32_logits(default_gguf_path, monkeypatch):
    """A float32 model keeps the file's Q4_1 / Q8_0 blocks in their bits for the float32 GEMM,
    unquantized ("none", the default) and with --quantization auto (its int8 activations off)
    alike, and gives the float32 weights' logits bit for bit, eager and fused, on prompts of 1
    to 40 tokens and a batch of decode rows."""
    kept = load_model(str(default_gguf_path), "cpu", "float32", "auto", "none")
    monkeypatch.setattr(linear_plan, "INT8_ACTIVATIONS", False)  # auto, weights only
    auto = load_model(str(default_gguf_path), "cpu", "float32", "auto", "auto")
    monkeypatch.setattr(linear_plan, "FLOAT32_IN_BITS", False)
    dense = load_model(str(default_gguf_path), "cpu", "float32", "auto", "none")
    assert dense.quantization == "none"
    assert kept.quantization == "none (float32 from q4_1 x120, q8_0 x1 kept in their bits)"
    assert auto.quantization == "q4_1 x120, q8_0 x1"
    for m in (kept, auto):
        linears = [x for x in m.model.modules() if isinstance(x, Linear)]
        assert linears and all(_packed_in_bits(x) for x in linears)
    assert all(_f32_packed(x) == torch.float32 for x in dense.model.modules()
               if isinstance(x, Linear))
    runners = [ModelRunner(m, num_blocks=64, block_size=16) for m in (dense, kept, auto)]
    gen = torch.Generator().manual_seed(0)
    for fused in (False, True):
        if fused:
            assert [r.fuse_cpu_step() for r in runners] == ["fused"] * 3
        for length in (1, 3, 9, 40):
            ids = torch.randint(100, 40000, (length,), generator=gen).tolist()
            chunk = Chunk(ids, 0, list(range(-(-length // 16))))
            want, *got = (r.forward([chunk], all_logits=True) for r in runners)
            assert all(torch.equal(g, want) for g in got), (fused, length)
        # eight one-token rows at different positions of their own blocks (decode)
        chunks = [Chunk([int(t)], p, [4 + i]) for i, (t, p) in
                  enumerate(zip(torch.randint(100, 40000, (8,), generator=gen), range(8)))]
        want, *got = (r.forward(chunks) for r in runners)
        assert all(torch.equal(g, want) for g in got), fused


needs_bf16_gemm = pytest.mark.skipif(not getattr(OPS, "has_bf16_gemm", False),
                                     reason="no bf16 GEMM kernels (AVX512-BF16)")


def _bf16_blocks_planned() -> bool:
    """Whether this machine's plan puts a bf16 model's 4/8-bit weights on the packed bf16 GEMM
    (off AMX: with AMX the plan keeps the int8-activation kernels, model/linear/plan.py)."""
    from tokenmill.engine.plan import detect_machine

    plan = linear_plan.plan_linears(detect_machine("cpu"), "bfloat16", "auto")
    return plan.quant_kernels[0] == "bf16-blocks"


@pytest.mark.slow  # the real model
@needs_bf16_gemm
def test_default_model_in_its_blocks_runs_in_bf16_as_eager(default_gguf_path):
    """--quantization auto on a bf16 model (the default dtype here): the file's Q4_1 / Q8_0
    blocks kept and multiplied on the packed bf16 GEMM (Q4_1 as bf16 16 + q scaled per group,
    Q8_0 dequantized to bf16 per task). The fused step gives the eager path's logits bit for
    bit, by vdpbf16ps and by float32 FMAs, on prompts of 1 to 40 tokens and a batch of decode
    rows; and those logits are close to the bf16 model's (the weights' products summed
    without rounding each weight to bf16): the same top token at nearly every position."""
    if not _bf16_blocks_planned():
        pytest.skip("this machine's plan keeps 4/8-bit weights off the bf16 GEMM (AMX)")
    auto = load_model(str(default_gguf_path), "cpu", "bfloat16", "auto", "auto")
    dense = load_model(str(default_gguf_path), "cpu", "bfloat16", "auto", "none")
    assert auto.quantization == "q4_1 x120, q8_0 x1"  # x stays bf16: no int8 activations
    linears = [x for x in auto.model.modules() if isinstance(x, Linear)]
    assert {x.kernel.family for x in linears} == {"bf16-blocks", "bf16-blocks-silu"}
    assert all(x.kernel.step_weight().packed.dtype == torch.uint8 for x in linears)
    eager, fused, ref = (ModelRunner(m, num_blocks=64, block_size=16) for m in (auto, auto, dense))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (1, 3, 9, 40)]
    decode = [Chunk([int(t)], p, [4 + i]) for i, (t, p) in
              enumerate(zip(torch.randint(100, 40000, (8,), generator=gen), range(8)))]

    def logits(runner):
        out = [runner.forward([Chunk(ids, 0, list(range(-(-len(ids) // 16))))],
                              all_logits=True) for ids in prompts]
        return out + [runner.forward(decode)]
    want = logits(eager)
    assert fused.fuse_cpu_step() == "fused"
    for widen_from in (0, 1):
        for x in linears:
            x.kernel.widen_from = widen_from
        assert all(torch.equal(g, w) for g, w in zip(logits(fused), want)), widen_from
    close = torch.cat([(g.argmax(-1) == w.argmax(-1)).float()
                       for g, w in zip(want, logits(ref))])
    assert close.mean() >= 0.9, close


@pytest.mark.slow  # the real model
@needs_a8_gemm
def test_default_model_with_int8_activations_runs_fused_as_eager(default_gguf_path):
    """--quantization auto on a float32 model: every linear packed for the int8-activation
    GEMM, the fused step on it giving the eager path's logits bit for bit (same kernels, same
    order), and those close to the float32 weights' logits: the same top token at most
    positions of a real text."""
    auto = load_model(str(default_gguf_path), "cpu", "float32", "auto", "auto")
    dense = load_model(str(default_gguf_path), "cpu", "float32", "auto", "none")
    assert auto.quantization == "q4_1 x120, q8_0 x1 (int8 activations: 121 layers)"
    linears = [x for x in auto.model.modules() if isinstance(x, Linear)]
    assert linears and all(_packed_a8(x) for x in linears)
    eager, fused, ref = (ModelRunner(m, num_blocks=64, block_size=16) for m in (auto, auto, dense))
    assert fused.fuse_cpu_step() == "fused"
    gen = torch.Generator().manual_seed(0)
    for length in (1, 9, 40):
        ids = torch.randint(100, 40000, (length,), generator=gen).tolist()
        chunk = Chunk(ids, 0, list(range(-(-length // 16))))
        a, b = (r.forward([chunk], all_logits=True) for r in (eager, fused))
        assert torch.equal(a, b), length
    from tokenmill.eval.perplexity import load_text
    from tokenmill.tokenizer import load_tokenizer

    ids = load_tokenizer("smollm2-135m-instruct").encode(load_text())[:200]
    chunk = Chunk(ids, 0, list(range(-(-len(ids) // 16))))
    got, want = (r.forward([chunk], all_logits=True) for r in (fused, ref))
    assert not torch.equal(got, want)  # the activations were rounded
    same = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert same >= 0.85, same  # 0.94 on this text; a broken product agrees on almost none
    chunks = [Chunk([int(t)], p, [40 + i]) for i, (t, p) in
              enumerate(zip(torch.randint(100, 40000, (8,), generator=gen), range(8)))]
    assert torch.equal(eager.forward(chunks), fused.forward(chunks))
