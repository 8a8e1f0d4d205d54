"""The Triton paged-attention backend against the dense float64 reference (the cases of
test_attention.py): decode, prefill, chunks after a cached prefix, shared prefix blocks, GQA
ratios 1/3/8, block sizes 16/32, KV split or not, caches in the compute dtype, int8 and fp8, and
the padded rows of a captured CUDA graph. On a GPU the kernels run compiled; without one they
run under Triton's interpreter (``TRITON_INTERPRET=1``, numpy on the CPU), so the same kernel
code is checked on every machine where triton is installed, and the tests skip where it is not.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
pytest.importorskip("triton")

from tests.seeding import stable_seed  # noqa: E402
from tests.test_attention import CASES, held_by_cache, make_case, reference  # noqa: E402
from tokenmill.attention import triton_paged  # noqa: E402
from tokenmill.attention.triton_paged import TritonPagedBackend, num_splits  # noqa: E402
from tokenmill.runner.batch import Chunk, build_flat_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def run_case(case: str, heads: int, kv_heads: int, dtype, block_size: int,
             kv_cache_dtype: str = "auto", head_dim: int = 32):
    rng = random.Random(stable_seed(case, heads, kv_heads, str(dtype), block_size))
    chunks, kv_cache, q, k, v, dense = make_case(
        rng, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        dtype=dtype, kv_cache_dtype=kv_cache_dtype, **CASES[case])
    kv_cache = tuple(c.to(DEVICE) for c in kv_cache)
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    batch = build_flat_batch(chunks, block_size, DEVICE)
    scale = head_dim ** -0.5
    backend = TritonPagedBackend()
    out = backend.forward(q, k, v, kv_cache, batch.meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    held = held_by_cache(dense, kv_cache_dtype)
    want = reference(chunks, q.cpu(), held, heads, kv_heads, scale)
    tol = TOL[dtype]
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)
    # what this backend stored for the new tokens reads back the same (a decode step of each
    # request at its last position)
    last = [Chunk([0], c.start_pos + len(c.token_ids) - 1, c.block_table) for c in chunks]
    ends = build_flat_batch(chunks, block_size, DEVICE).meta.query_start_loc[1:] - 1
    again = backend.forward(q[ends], k[ends], v[ends], kv_cache,
                            build_flat_batch(last, block_size, DEVICE).meta, scale)
    torch.testing.assert_close(again.cpu().double(), want[ends.cpu()], atol=tol, rtol=tol)


# Under the interpreter (numpy on the CPU) each case takes seconds and the whole matrix minutes,
# more than CI's budget: there every case runs once (GQA 9/3, blocks of 16) and each head layout
# and block size once more on "mixed"; a GPU, or TOKENMILL_TRITON_FULL=1, runs all of it.
FULL = DEVICE == "cuda" or os.environ.get("TOKENMILL_TRITON_FULL", "0") != "0"
HEADS, BLOCKS = [(4, 4), (9, 3), (8, 1)], [8, 16, 32]  # 8: narrower than tl.dot's 16, padded
MATRIX = [(case, *heads, block) for case in sorted(CASES) for heads in HEADS for block in BLOCKS
          if FULL or (heads, block) == ((9, 3), 16)
          or case == "mixed" and (heads == (9, 3) or block == 16)]


@pytest.mark.parametrize("case,heads,kv_heads,block_size", MATRIX)
def test_triton_matches_reference(case, heads, kv_heads, block_size):
    run_case(case, heads, kv_heads, torch.float32, block_size)


@pytest.mark.parametrize("case,kv_cache_dtype,dtype", [
    (case, kv, dtype) for case in ["mixed", "shared_prefix"] for kv in ["auto", "int8", "fp8"]
    for dtype in [torch.bfloat16, torch.float16]
    if FULL or case == "mixed" and (dtype == torch.bfloat16 or kv == "auto")])
def test_triton_low_precision_and_quantized_caches(case, kv_cache_dtype, dtype):
    run_case(case, 9, 3, dtype, 16, kv_cache_dtype, head_dim=64)


@pytest.mark.parametrize("splits", [1, 4, 16])
def test_split_kv_merges_to_the_same_result(monkeypatch, splits):
    """Decode over long contexts, the flash-decoding path, whatever the split count (including
    splits that get no keys at all)."""
    monkeypatch.setattr(triton_paged, "num_splits", lambda tiles: splits)
    rng = random.Random(splits)
    shapes = [(200, 1), (3, 1), (97, 1), (0, 1)]
    chunks, kv_cache, q, k, v, dense = make_case(rng, heads=6, kv_heads=2, head_dim=32,
                                                 block_size=16, shapes=shapes)
    kv_cache = tuple(c.to(DEVICE) for c in kv_cache)
    meta = build_flat_batch(chunks, 16, DEVICE).meta
    out = TritonPagedBackend().forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv_cache,
                                       meta, 32 ** -0.5)
    want = reference(chunks, q, dense, 6, 2, 32 ** -0.5)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=2e-5)


def test_split_count_depends_on_the_batch_shape_only():
    assert num_splits(1) == triton_paged.MAX_SPLITS
    assert num_splits(triton_paged.SPLIT_BELOW_TILES) == 1
    assert all(num_splits(n) >= num_splits(n + 1) for n in range(1, 300))


def test_padded_rows_write_nowhere_and_read_nothing():
    """A captured graph's padding: slot -1 and length 0. The real rows come out as without
    padding, the padded rows as zeros, and the cache is untouched by them."""
    rng = random.Random(3)
    chunks, kv_cache, q, k, v, dense = make_case(rng, heads=4, kv_heads=2, head_dim=32,
                                                 block_size=16, shapes=[(40, 1), (7, 1)])
    kv_cache = tuple(c.to(DEVICE) for c in kv_cache)
    meta = build_flat_batch(chunks, 16, DEVICE).meta
    backend = TritonPagedBackend()
    before = [c.clone() for c in kv_cache]
    want = reference(chunks, q, dense, 4, 2, 32 ** -0.5)
    pad = 3
    meta.query_start_loc = torch.arange(len(chunks) + pad + 1, device=DEVICE)
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int64,
                                                          device=DEVICE)])
    meta.block_tables = torch.cat([meta.block_tables, torch.zeros(
        pad, meta.block_tables.shape[1], dtype=torch.int64, device=DEVICE)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    noise = lambda t: torch.cat([t, torch.randn(pad, *t.shape[1:])]).to(DEVICE)  # noqa: E731
    out = backend.forward(noise(q), noise(k), noise(v), kv_cache, meta, 32 ** -0.5)
    torch.testing.assert_close(out[:2].cpu().double(), want, atol=2e-5, rtol=2e-5)
    assert (out[2:] == 0).all()
    slots = meta.slot_mapping[:2]
    for cache, old in zip(kv_cache, before):  # only the real rows' slots changed
        flat, flat_old = cache.flatten(0, 1), old.flatten(0, 1)
        keep = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        keep[slots] = False
        assert torch.equal(flat[keep], flat_old[keep])
