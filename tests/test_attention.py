"""Attention backends against a dense float64 reference on random flat batches over a paged cache:
decode rows, prompts, chunks after a cached prefix, sequences sharing prefix blocks (cascade),
GQA group sizes, ragged lengths, float32 and bfloat16, with a cache in the compute dtype, int8,
or bfloat16 under float32 (quantization itself and the int8 cache's capacity: test_kv_quant.py)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.seeding import stable_seed
from tokenmill.attention import get_backend
from tokenmill.attention.cpu_paged import find_cascade_groups, make_plan
from tokenmill.attention.kv_quant import SCALE_BYTES, pack, unpack
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.runner.batch import Chunk, build_flat_batch

BACKENDS = ["torch"] + (["cpu"] if cpu_kernels.load() is not None else [])


def make_case(rng: random.Random, *, heads: int, kv_heads: int, head_dim: int, block_size: int,
              shapes: list[tuple[int, int]], shared_blocks: int = 0, dtype=torch.float32,
              backend: str = "torch", kv_cache_dtype: str = "auto"):
    """A cache holding every request's context, plus the new tokens' q/k/v. ``shapes``:
    (context tokens already cached, new tokens) per request; with ``shared_blocks`` the first
    requests' tables start with the same blocks (their context there is the same K/V).
    ``kv_cache_dtype="int8"`` or ``"fp8"``: the cache holds K/V quantized; ``"bfloat16"``:
    rounded to bfloat16 (``dense`` stays exact)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    total_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 4
    free = list(range(1, total_blocks + 1))
    rng.shuffle(free)
    quantized = CACHE_DTYPES.get(kv_cache_dtype)
    shape = (total_blocks + 1, block_size, kv_heads,
             head_dim + (SCALE_BYTES if quantized else 0))
    cache_dtype = quantized or (torch.bfloat16 if kv_cache_dtype == "bfloat16" else dtype)
    k_cache = torch.zeros(shape, dtype=cache_dtype)
    v_cache = torch.zeros(shape, dtype=cache_dtype)
    shared = [free.pop() for _ in range(shared_blocks)]
    shared_k = torch.randn(shared_blocks * block_size, kv_heads, head_dim, generator=gen)
    shared_v = torch.randn(shared_blocks * block_size, kv_heads, head_dim, generator=gen)
    chunks, dense, news = [], [], []
    for ctx, new in shapes:
        n_blocks = -(-(ctx + new) // block_size)
        uses_shared = shared_blocks and ctx >= shared_blocks * block_size
        table = list(shared) if uses_shared else []
        while len(table) < n_blocks:
            table.append(free.pop())
        k_all = torch.randn(ctx + new, kv_heads, head_dim, generator=gen)
        v_all = torch.randn(ctx + new, kv_heads, head_dim, generator=gen)
        if uses_shared:
            k_all[:len(shared_k)], v_all[:len(shared_v)] = shared_k, shared_v
        k_all, v_all = k_all.to(dtype), v_all.to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(ctx)], dtype=torch.int64)
        get_backend(backend).store_kv(k_all[:ctx], v_all[:ctx], (k_cache, v_cache), slots)
        q = torch.randn(new, heads, head_dim, generator=gen).to(dtype)
        chunks.append(Chunk([0] * new, ctx, table))
        dense.append((k_all, v_all))
        news.append((q, k_all[ctx:], v_all[ctx:]))
    q, k, v = (torch.cat([n[i] for n in news]) for i in range(3))
    return chunks, (k_cache, v_cache), q, k, v, dense


def reference(chunks, q, dense, heads, kv_heads, scale, int8_sigma: bool = False):
    """Dense float64 attention (q, H, D). ``int8_sigma``: also the standard deviation of each
    output element's error when K and V are quantized to int8 (below)."""
    outs, sigmas, start = [], [], 0
    for c, (k_all, v_all) in zip(chunks, dense):
        n = len(c.token_ids)
        qq = q[start:start + n].double()
        group = heads // kv_heads
        kk = k_all.double().repeat_interleave(group, dim=1)  # (L, H, D)
        vv = v_all.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        pos_q = torch.arange(c.start_pos, c.start_pos + n)[:, None]
        mask = torch.arange(k_all.shape[0])[None, :] <= pos_q
        scores = scores.masked_fill(~mask, float("-inf"))
        p = scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        if int8_sigma:
            sigmas.append(int8_error_sigma(qq, kk, vv, p, outs[-1], scale))
        start += n
    return (torch.cat(outs), torch.cat(sigmas)) if int8_sigma else torch.cat(outs)


def int8_error_sigma(q, k, v, p, o, scale) -> torch.Tensor:
    """Standard deviation of the error that int8 K/V bring to each element of ``o``, to first
    order, taking every rounding error as independent and uniform within half a step
    (variance step^2 / 12; step = absmax / 127 of its (token, head) vector):
        o' - o ~= sum_t p_t dv_t + sum_t p_t (ds_t - mean ds) (v_t - o),  ds_t = scale q . dk_t
    so var ~= sum_t p_t^2 [step_v,t^2 / 12 + (v_t - o)^2 scale^2 |q|^2 step_k,t^2 / 12]
    (dropping the mean, which only lowers it). q (Q, H, D); k, v (L, H, D); p (H, Q, L)."""
    step_k = k.abs().amax(-1) / 127  # (L, H)
    step_v = v.abs().amax(-1) / 127
    p2 = p.square()
    var_v = torch.einsum("hqk,kh->qh", p2, step_v.square())[..., None] / 12
    dev2 = (v[None] - o[:, None]).square()  # (Q, L, H, D)
    var_k = torch.einsum("hqk,kh,qkhd->qhd", p2, step_k.square(), dev2) / 12
    var_k = var_k * scale ** 2 * q.square().sum(-1, keepdim=True)
    return (var_v + var_k).sqrt()


CASES = {
    "decode": dict(shapes=[(37, 1), (5, 1), (80, 1), (16, 1)]),
    "prefill": dict(shapes=[(0, 23), (0, 1), (0, 40)]),
    "mixed": dict(shapes=[(30, 1), (0, 17), (48, 9), (3, 1), (64, 33)]),
    "after_cached_prefix": dict(shapes=[(64, 20), (32, 1), (33, 16)]),
    "shared_prefix": dict(shapes=[(70, 1), (66, 1), (90, 4), (81, 1), (10, 1), (64, 12)],
                          shared_blocks=4),
    "shared_prefix_one_block_left": dict(shapes=[(65, 1), (64, 1), (70, 2)], shared_blocks=4),
}


# An int8 cache's output against the exact float64 attention of the unquantized K/V: within
# INT8_SIGMAS standard deviations of the error quantization brings (int8_error_sigma); the
# largest seen over 25 x 192 random cases per backend was 5.1.
INT8_SIGMAS = 7.0


CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.uint8}  # --kv-cache-dtype -> tensor dtype


def held_by_cache(dense, kv_cache_dtype: str):
    """The K/V a cache of ``kv_cache_dtype`` gives back for each request's exact K/V."""
    if kv_cache_dtype == "bfloat16":
        return [(k.to(torch.bfloat16).double(), v.to(torch.bfloat16).double()) for k, v in dense]
    cache_dtype = CACHE_DTYPES.get(kv_cache_dtype)
    if cache_dtype is None:
        return dense
    return [(unpack(pack(k, cache_dtype), torch.float64),
             unpack(pack(v, cache_dtype), torch.float64)) for k, v in dense]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
# 64: the transposed-block path for wide tiles; 80 (10 registers on AVX2, 5 on AVX512): value
# tiles of 4 head registers and a remainder
@pytest.mark.parametrize("head_dim", [32, 64, 80])
@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8"),
    (torch.bfloat16, "int8"), (torch.float32, "bfloat16")])  # bf16 under bf16 is "auto"
def test_backend_matches_dense_reference(backend, case, heads, kv_heads, dtype, head_dim,
                                         kv_cache_dtype):
    rng = random.Random(stable_seed(case, heads, kv_heads, str(dtype), head_dim))
    block_size = 16
    chunks, kv_cache, q, k, v, dense = make_case(rng, heads=heads, kv_heads=kv_heads,
                                                 head_dim=head_dim, block_size=block_size,
                                                 dtype=dtype, backend=backend,
                                                 kv_cache_dtype=kv_cache_dtype, **CASES[case])
    batch = build_flat_batch(chunks, block_size, "cpu")
    scale = head_dim ** -0.5
    out = get_backend(backend).forward(q, k, v, kv_cache, batch.meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    int8 = kv_cache_dtype == "int8"
    # exact (to the compute dtype) against what the cache holds: int8 values times scales,
    # or K/V rounded to bfloat16
    want = reference(chunks, q, held_by_cache(dense, kv_cache_dtype), heads, kv_heads, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    if int8:  # and within what quantization explains of the exact K/V's attention
        exact, sigma = reference(chunks, q, dense, heads, kv_heads, scale, int8_sigma=True)
        excess = (out.double() - exact).abs() - tol * (1 + exact.abs())
        assert (excess <= INT8_SIGMAS * sigma).all(), (excess / sigma).max()
    # the new tokens' K/V were stored at their slots: attending to them again, as a decode
    # step of each request at its last position, gives the same result
    last = [Chunk([0], c.start_pos + len(c.token_ids) - 1, c.block_table) for c in chunks]
    ends = build_flat_batch(chunks, block_size, "cpu").meta.query_start_loc[1:] - 1
    meta = build_flat_batch(last, block_size, "cpu").meta
    q_last = q[ends]
    again = get_backend(backend).forward(q_last, k[ends], v[ends], kv_cache, meta, scale)
    torch.testing.assert_close(again.double(), want[ends], atol=tol, rtol=tol)


def test_cascade_groups_are_found_for_shared_tables_only():
    rng = random.Random(0)
    chunks, *_ = make_case(rng, heads=4, kv_heads=2, head_dim=8, block_size=16,
                           **CASES["shared_prefix"])
    groups = find_cascade_groups([c.block_table for c in chunks],
                                 [len(c.token_ids) for c in chunks],
                                 [c.start_pos + len(c.token_ids) for c in chunks], 16)
    # requests 0, 1, 2, 3 and 5 start with the 4 shared blocks; request 4 has its own
    assert len(groups) == 1
    assert groups[0].rows == [0, 1, 2, 3, 5]
    assert groups[0].blocks == chunks[0].block_table[:4]
    plan = make_plan(build_flat_batch(chunks, 16, "cpu").meta)
    assert plan.key_start_block.tolist() == [4, 4, 4, 4, 0, 4]
    # a block that is still being filled by the new tokens is never shared
    groups = find_cascade_groups([[1, 2, 3], [1, 2, 3]], [1, 1], [40, 40], 16)
    assert groups[0].blocks == [1, 2]
