"""The fused Triton kernels of a decoder layer (kernels/triton_fused.py) against the PyTorch path
they replace, on the same device: residual add + RMSNorm, SiLU·mul, RoPE with the K/V write
(padding rows with slot -1 write nothing; quantized caches are left to the backend), and a whole
tiny model's forward with and without them. Low precision agrees within one ulp (the only
difference is the order a row's squares are summed in, or an exp an ulp apart); float32 within
float32's rounding. On a GPU the kernels run compiled on CUDA (``pytest
tests/test_triton_fused.py`` there); without one under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
pytest.importorskip("triton")

from tokenmill.attention.kv_quant import as_cache_rows  # noqa: E402
from tokenmill.kernels.triton_fused import FusedOps  # noqa: E402
from tokenmill.model.layers import RMSNorm, apply_rope, silu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = FusedOps(device_types=(DEVICE,))
LOW = [torch.bfloat16, torch.float16]


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable 16-bit floats lie between ``a`` and ``b``."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a.cpu()) - ordered(b.cpu())).abs()


def assert_agree(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 to its rounding; bfloat16 / float16 within one ulp, nearly all exactly."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-6)
        return
    apart = ulps_apart(got, want)
    assert apart.max().item() <= 1, apart.max()
    assert (apart == 0).float().mean().item() >= 0.97


def randn(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("size", [576, 64, 96])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_the_torch_path(dtype, size, with_residual):
    norm = RMSNorm(size, 1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * randn(size, seed=1))
    norm.to(dtype)
    x = randn(7, size, dtype=dtype, seed=2) * 3
    residual = randn(7, size, dtype=dtype, seed=3) if with_residual else None
    want = norm(x, residual)
    norm.gpu_ops = OPS
    got = norm(x, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the sum: one rounding, the same in both
        got, want = got[0], want[0]
    assert_agree(got, want)


def test_rms_norm_reads_strided_rows():
    x = randn(5, 2 * 96, seed=4)[:, :96]  # rows 192 apart
    norm = RMSNorm(96, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.fill_(1.5)
    want = norm(x)
    norm.gpu_ops = OPS
    assert_agree(norm(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("size", [96, 64, 1536 + 40])  # the last: two column blocks, ragged
def test_silu_and_mul_matches_the_torch_path(dtype, size):
    h = randn(5, 2 * size, dtype=dtype, seed=size) * 4
    assert_agree(OPS.silu_and_mul(h), silu_and_mul(h))


def rope_table(tokens: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (tokens, 1, half) as RotaryEmbedding gives them."""
    inv = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float32) / half)
    freqs = torch.outer(torch.arange(3, 3 + 5 * tokens, 5, dtype=torch.float32), inv)
    return freqs.cos().unsqueeze(1).to(DEVICE), freqs.sin().unsqueeze(1).to(DEVICE)


def torch_rope_store(qkv, rope, heads, kv_heads, d, kv_cache, slots):
    """What LlamaAttention and the backend do without the fused kernel."""
    n = qkv.shape[0]
    qk = apply_rope(qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d), rope)
    q, k = qk.split([heads, kv_heads], dim=1)
    v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
    keep = slots >= 0
    for cache, x in zip(kv_cache, (k, v)):
        rows = cache.view(-1, kv_heads, d)
        rows[slots[keep]] = as_cache_rows(x[keep], cache)
    return q, k


ROPE_CASES = [  # (dtype, cache dtype, heads, kv_heads, head_dim, rotary dims)
    (torch.float32, torch.float32, 9, 3, 64, 64),
    (torch.float32, torch.bfloat16, 4, 4, 32, 32),  # a bfloat16 cache under float32
    (torch.bfloat16, torch.bfloat16, 9, 3, 64, 64),
    (torch.bfloat16, torch.bfloat16, 4, 2, 32, 16),  # partial rotary: half of each head
    (torch.float16, torch.float16, 14, 2, 64, 64),
]


@pytest.mark.parametrize("dtype,cache_dtype,heads,kv_heads,d,rotary", ROPE_CASES)
def test_rope_and_kv_write_match_the_torch_path(dtype, cache_dtype, heads, kv_heads, d, rotary):
    n, blocks, block_size = 6, 4, 4
    qkv = randn(n, (heads + 2 * kv_heads) * d, dtype=dtype, seed=d + heads)
    rope = rope_table(n, rotary // 2)
    slots = torch.tensor([5, -1, 0, 13, -1, 7], device=DEVICE)  # -1: a graph's padding row
    fill = torch.full((blocks, block_size, kv_heads, d), 7.0, dtype=cache_dtype, device=DEVICE)
    want_cache = (fill.clone(), fill.clone())
    want_q, _ = torch_rope_store(qkv, rope, heads, kv_heads, d, want_cache, slots)
    cache = (fill.clone(), fill.clone())
    q, k, v, stored = OPS.rope_qkv(qkv, rope, heads, kv_heads, cache, slots)
    assert stored and k is None and v is None
    assert q.is_contiguous()
    assert_agree(q, want_q.contiguous())
    for got, want in zip(cache, want_cache):
        assert_agree(got, want)  # the padding rows' slots keep their 7s in both
    assert (cache[0].view(-1, kv_heads, d)[[1, 2, 3, 4, 6]] == 7).all()


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.uint8])
def test_a_quantized_cache_is_left_to_the_backend(cache_dtype):
    n, heads, kv_heads, d = 3, 4, 2, 32
    qkv = randn(n, (heads + 2 * kv_heads) * d, dtype=torch.bfloat16, seed=9)
    rope = rope_table(n, d // 2)
    cache = tuple(torch.zeros(2, 4, kv_heads, d + 2, dtype=cache_dtype, device=DEVICE)
                  for _ in range(2))
    q, k, v, stored = OPS.rope_qkv(qkv, rope, heads, kv_heads, cache,
                                   torch.arange(n, device=DEVICE))
    assert not stored and not cache[0].any() and not cache[1].any()
    qk = apply_rope(qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d), rope)
    assert_agree(q, qk[:, :heads].contiguous())
    assert_agree(k, qk[:, heads:].contiguous())
    assert torch.equal(v, qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d))


def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """The GEMM-fused kernels against cuBLAS (or a float32 product) and the unfused kernels:
    the GEMM's sums are added in another order, so an output can land one rounding step away
    (two after RoPE mixes two of them); nearly all are equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    apart = ulps_apart(got, want)
    assert apart.max().item() <= 2, apart.max()
    assert (apart == 0).float().mean().item() >= 0.95


def unfused_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` as the layer runs it (cuBLAS); the CPU sums in float32, as a GPU does."""
    if DEVICE == "cuda":
        return torch.nn.functional.linear(x, w, b)
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None
                                      else b.float()).to(x.dtype)


GEMM_CASES = [  # (dtype, tokens, heads, kv_heads, head_dim, bias, residual)
    (torch.bfloat16, 1, 9, 3, 64, False, True),   # SmolLM2's attention, one decode row
    (torch.bfloat16, 6, 4, 2, 32, True, False),   # Qwen2's biases; layer 0: no residual yet
    (torch.float16, 40, 4, 2, 32, False, True),   # three row tiles, the last ragged
]


@pytest.mark.parametrize("dtype,n,heads,kv_heads,d,bias,with_residual", GEMM_CASES)
def test_norm_qkv_rope_is_the_unfused_kernels_in_one(dtype, n, heads, kv_heads, d, bias,
                                                       with_residual):
    hidden = 96 if d == 32 else 576  # 576: nine K steps of 64; 96: a ragged last one
    x = randn(n, hidden, dtype=dtype, seed=n)
    residual = randn(n, hidden, dtype=dtype, seed=n + 1) if with_residual else None
    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    norm.weight.data = (randn(hidden, seed=3).abs() + 0.5).to(dtype)
    rows = (heads + 2 * kv_heads) * d
    w = randn(rows, hidden, dtype=dtype, seed=4) * 0.1
    b = randn(rows, dtype=dtype, seed=5) * 0.1 if bias else None
    rope = rope_table(n, d // 2)
    slots = torch.arange(n, device=DEVICE) * 3
    slots[n // 2] = -1  # a graph's padding row writes nothing
    fill = torch.full((n, 4, kv_heads, d), 7.0, dtype=dtype, device=DEVICE)
    normed = norm(x) if residual is None else norm(x, residual)
    normed, want_res = (normed, x) if residual is None else normed
    want_cache = (fill.clone(), fill.clone())
    want_q, _ = torch_rope_store(unfused_linear(normed, w, b), rope, heads, kv_heads, d,
                                 want_cache, slots)
    cache = (fill.clone(), fill.clone())
    q, res = OPS.norm_qkv_rope(x, residual, norm.weight, 1e-5, w, b, rope, heads, kv_heads,
                               cache, slots)
    assert torch.equal(res, want_res)  # the residual sum, as the unfused norm rounds it
    assert_near(q, want_q.contiguous())
    for got, want in zip(cache, want_cache):
        assert_near(got, want)
    written = (cache[0].view(-1, kv_heads * d) != 7).any(-1)
    assert written.sum().item() == n - 1  # every row's slot but the padding row's


@pytest.mark.parametrize("dtype,n,bias", [(torch.bfloat16, 1, False), (torch.bfloat16, 33, True),
                                          (torch.float16, 20, False)])
def test_norm_gate_up_silu_is_the_unfused_kernels_in_one(dtype, n, bias):
    hidden, inter = 96, 80  # 80: a ragged last column tile
    x = randn(n, hidden, dtype=dtype, seed=n)
    residual = randn(n, hidden, dtype=dtype, seed=n + 7)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    norm.weight.data = (randn(hidden, seed=3).abs() + 0.5).to(dtype)
    w = randn(2 * inter, hidden, dtype=dtype, seed=6) * 0.1
    b = randn(2 * inter, dtype=dtype, seed=8) * 0.1 if bias else None
    normed, want_res = norm(x, residual)
    want = silu_and_mul(unfused_linear(normed, w, b))
    out, res = OPS.norm_gate_up_silu(x, residual, norm.weight, 1e-5, w, b)
    assert torch.equal(res, want_res)
    assert_near(out, want)


def test_split_kv_reads_only_what_its_programs_wrote(monkeypatch):
    """The split-KV buffers come uninitialised (no fill kernel per layer): filled with NaN here,
    decode rows (with a graph's padding rows: slot -1, no keys) still match the reference, so
    every entry the merge reads was written."""
    from tests.test_attention import make_case, reference
    from tokenmill.attention import triton_paged
    from tokenmill.runner.batch import build_flat_batch

    real = triton_paged.split_buffers
    monkeypatch.setattr(triton_paged, "split_buffers",
                        lambda *a: tuple(t.fill_(float("nan")) for t in real(*a)))
    monkeypatch.setattr(triton_paged, "num_splits", lambda tiles: 4)  # some get no keys
    rng = random.Random(4)
    chunks, kv_cache, q, k, v, dense = make_case(rng, heads=6, kv_heads=2, head_dim=32,
                                                 block_size=16, shapes=[(40, 1), (3, 1), (0, 1)])
    want = reference(chunks, q, dense, 6, 2, 32 ** -0.5)
    meta = build_flat_batch(chunks, 16, DEVICE).meta
    pad = 2
    meta.query_start_loc = torch.arange(len(chunks) + pad + 1, device=DEVICE)
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int64, device=DEVICE)])
    meta.block_tables = torch.cat([meta.block_tables, torch.zeros(
        pad, meta.block_tables.shape[1], dtype=torch.int64, device=DEVICE)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    padded = [torch.cat([t, torch.randn(pad, *t.shape[1:])]).to(DEVICE) for t in (q, k, v)]
    out = triton_paged.TritonPagedBackend().forward(
        *padded, tuple(c.to(DEVICE) for c in kv_cache), meta, 32 ** -0.5)
    torch.testing.assert_close(out[:len(chunks)].cpu().double(), want, atol=2e-5, rtol=2e-5)
    assert (out[len(chunks):] == 0).all()


# ----- a whole model: the fused path against PyTorch's on the same device ----------------------

@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.tiny_models import make_hf_model, save_hf_model

    # heads of 32 dims: RoPE's halves are 16 wide, the least the GEMM-fused kernels take
    return {arch: save_hf_model(make_hf_model(arch, hidden_size=128),
                                tmp_path_factory.mktemp(arch))
            for arch in sorted({arch for arch, _ in MODELS})}


def run_steps(model, kv_caches, block_size: int) -> list[torch.Tensor]:
    """Logits of a prompt step of two sequences, then of a decode step of both."""
    from tokenmill.runner.batch import Chunk, build_flat_batch

    steps = [[Chunk(list(range(1, 12)), 0, [0, 1, 2]), Chunk([5, 9, 2], 0, [3])],
             [Chunk([7], 11, [0, 1, 2]), Chunk([4], 3, [3])]]
    out = []
    for chunks in steps:
        batch = build_flat_batch(chunks, block_size, DEVICE, all_logits=True)
        with torch.no_grad():
            out.append(model(batch.input_ids, batch.positions, kv_caches, batch.meta,
                             batch.logits_indices))
    return out


# Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms: its attention keeps PyTorch's RoPE); under the
# interpreter (seconds a model) three of the six
MODELS = [(arch, dtype) for arch in ("llama", "qwen2", "qwen3") for dtype in ("float32", "bfloat16")
          if DEVICE == "cuda" or (arch, dtype) in {("llama", "float32"), ("llama", "bfloat16"),
                                                    ("qwen3", "bfloat16")}]


@pytest.mark.parametrize("arch,dtype", MODELS)
def test_a_model_forward_is_the_same_fused(tiny_dirs, arch, dtype, monkeypatch):
    from tokenmill.attention import triton_paged
    from tokenmill.model.llama import LlamaDecoderLayer
    from tokenmill.model.linear import plan_linears
    from tokenmill.model.loader import load_model, use_gpu_ops
    from tokenmill.platform import Machine

    if DEVICE == "cpu":  # the interpreter runs each program in Python: fewer of them
        monkeypatch.setattr(triton_paged, "num_splits", lambda tiles: 1)

    # F.linear on the weights as loaded, as on a GPU (a CPU would pack them for its kernels)
    plan = plan_linears(Machine.detect(DEVICE), dtype, cpu_kernels=False)
    model = load_model(str(tiny_dirs[arch]), DEVICE, dtype=dtype, attention_backend="triton",
                       plan=plan).model
    cfg = model.config
    shape = (8, 4, cfg.num_kv_heads, cfg.head_dim)
    dt = getattr(torch, dtype)
    calls = []
    fused_layer = LlamaDecoderLayer._gemm_fused
    monkeypatch.setattr(LlamaDecoderLayer, "_gemm_fused",
                        lambda *a: calls.append(1) or fused_layer(*a))
    results, gemm_calls = [], []
    # PyTorch's ops; the fused norms, RoPE and SiLU around cuBLAS; the GEMM-fused kernels
    for ops in (None, FusedOps((DEVICE,), gemm_rows=0), OPS):
        use_gpu_ops(model, ops)
        calls.clear()
        caches = [(torch.zeros(shape, dtype=dt, device=DEVICE),
                   torch.zeros(shape, dtype=dt, device=DEVICE)) for _ in range(cfg.num_layers)]
        results.append((run_steps(model, caches, 4), caches))
        gemm_calls.append(len(calls))
    # 16-bit Llama and Qwen2 layers take the GEMM-fused kernels; float32 and Qwen3's q/k
    # norms do not
    takes = dtype != "float32" and arch != "qwen3"
    assert gemm_calls == [0, 0, 2 * cfg.num_layers if takes else 0]
    (plain, plain_caches), *fused_runs = results
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=0.05, atol=0.05)
    for fused, fused_caches in fused_runs:
        for a, b in zip(fused, plain):
            torch.testing.assert_close(a.cpu(), b.cpu(), **tol)
        for (fk, fv), (pk, pv) in zip(fused_caches, plain_caches):
            torch.testing.assert_close(fk.cpu().float(), pk.cpu().float(), **tol)
            torch.testing.assert_close(fv.cpu().float(), pv.cpu().float(), **tol)


def test_the_loader_hands_the_kernels_only_to_a_gpu_llama():
    from tokenmill.attention import get_backend
    from tokenmill.config import ModelConfig
    from tokenmill.kernels.triton_fused import FusedOps
    from tokenmill.model.llama import LlamaForCausalLM
    from tokenmill.model.loader import fused_gpu_ops

    cfg = ModelConfig("llama", vocab_size=32, hidden_size=64, intermediate_size=96,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    triton_backend = get_backend("triton")
    model = LlamaForCausalLM(cfg, triton_backend)
    assert isinstance(fused_gpu_ops(model, "cuda", triton_backend), FusedOps)
    assert fused_gpu_ops(model, "cuda:0", get_backend("torch")) is None
    assert fused_gpu_ops(model, "cpu", triton_backend) is None
    assert fused_gpu_ops(torch.nn.Linear(2, 2), "cuda", triton_backend) is None
