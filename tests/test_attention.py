"""Attention backends against a dense float64 reference on random flat batches over a paged cache:
decode rows, prompts, chunks after a cached prefix, sequences sharing prefix blocks (cascade),
GQA group sizes, ragged lengths, float32 and bfloat16."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention import get_backend
from tokenmill.attention.cpu_paged import find_cascade_groups, make_plan
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.runner.batch import Chunk, build_flat_batch

BACKENDS = ["torch"] + (["cpu"] if cpu_kernels.load() is not None else [])


def make_case(rng: random.Random, *, heads: int, kv_heads: int, head_dim: int, block_size: int,
              shapes: list[tuple[int, int]], shared_blocks: int = 0, dtype=torch.float32,
              backend: str = "torch"):
    """A cache holding every request's context, plus the new tokens' q/k/v. ``shapes``:
    (context tokens already cached, new tokens) per request; with ``shared_blocks`` the first
    requests' tables start with the same blocks (their context there is the same K/V)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    total_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 4
    free = list(range(1, total_blocks + 1))
    rng.shuffle(free)
    shape = (total_blocks + 1, block_size, kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype)
    v_cache = torch.zeros(shape, dtype=dtype)
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


def reference(chunks, q, dense, heads, kv_heads, scale) -> torch.Tensor:
    outs, start = [], 0
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
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
        start += n
    return torch.cat(outs)


CASES = {
    "decode": dict(shapes=[(37, 1), (5, 1), (80, 1), (16, 1)]),
    "prefill": dict(shapes=[(0, 23), (0, 1), (0, 40)]),
    "mixed": dict(shapes=[(30, 1), (0, 17), (48, 9), (3, 1), (64, 33)]),
    "after_cached_prefix": dict(shapes=[(64, 20), (32, 1), (33, 16)]),
    "shared_prefix": dict(shapes=[(70, 1), (66, 1), (90, 4), (81, 1), (10, 1), (64, 12)],
                          shared_blocks=4),
    "shared_prefix_one_block_left": dict(shapes=[(65, 1), (64, 1), (70, 2)], shared_blocks=4),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64])  # 64: the transposed-block path for wide tiles
def test_backend_matches_dense_reference(backend, case, heads, kv_heads, dtype, head_dim):
    rng = random.Random(hash((case, heads, kv_heads, str(dtype), head_dim)) & 0xFFFF)
    block_size = 16
    chunks, kv_cache, q, k, v, dense = make_case(rng, heads=heads, kv_heads=kv_heads,
                                                 head_dim=head_dim, block_size=block_size,
                                                 dtype=dtype, backend=backend, **CASES[case])
    batch = build_flat_batch(chunks, block_size, "cpu")
    scale = head_dim ** -0.5
    out = get_backend(backend).forward(q, k, v, kv_cache, batch.meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    want = reference(chunks, q, dense, heads, kv_heads, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
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
