"""Sliding-window attention and attention sinks: every backend against a plain masked float64
softmax (windows none / small / wider than the sequence, prefill, decode, chunks after a cached
prefix, mixed batches, GQA, float32 / bfloat16 / int8 caches), the fused CPU step against eager
for a windowed model, and KV blocks freed behind the window of an all-window model."""

from __future__ import annotations

import random

import pytest
import torch

from tests.fakes import FakeExecutor
from tests.family_checks import check_engine, family_prompts
from tests.seeding import stable_seed
from tests.test_attention import BACKENDS, held_by_cache, make_case
from tests.test_cpu_step import DTYPES, ids
from tests.test_scheduler import Driver, fake_token, make_scheduler
from tests.tiny_models import COMMON, make_hf_model, save_hf_model, write_word_tokenizer
from tokenmill.attention import get_backend, has_triton
from tokenmill.cache import KVBlockManager, slot_of
from tokenmill.model.loader import load_model
from tokenmill.params import SamplingParams
from tokenmill.request import Request
from tokenmill.runner.batch import Chunk, build_flat_batch
from tokenmill.runner.model_runner import ModelRunner

# the Triton kernels run under the interpreter on a CPU (conftest sets TRITON_INTERPRET), some
# seconds a case: they take the small batches below
ALL = BACKENDS + (["triton"] if has_triton() else [])

SHAPES = {
    "prefill": [(0, 23), (0, 1), (0, 40)],
    "decode": [(37, 1), (5, 1), (80, 1), (16, 1)],
    "after_cached_prefix": [(64, 20), (32, 1), (33, 16)],
    "mixed": [(30, 1), (0, 17), (48, 9), (3, 1), (64, 33)],
}


def windowed_reference(chunks, q, dense, heads: int, kv_heads: int, scale: float,
                       window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Float64 attention written out: causal, keys within ``window``, sinks in the denominator."""
    outs, start = [], 0
    group = heads // kv_heads
    for c, (k_all, v_all) in zip(chunks, dense):
        n = len(c.token_ids)
        kk = k_all.double().repeat_interleave(group, dim=1)  # (L, H, D)
        vv = v_all.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n].double(), kk) * scale
        pos_q = torch.arange(c.start_pos, c.start_pos + n)[:, None]
        pos_k = torch.arange(k_all.shape[0])[None, :]
        mask = pos_k <= pos_q
        if window is not None:
            mask &= pos_q - pos_k < window
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # a column of sink logits that takes probability but no value
            sink_col = sinks.double()[:, None, None].expand(heads, n, 1)
            p = torch.cat([scores, sink_col], -1).softmax(-1)[..., :-1]
        else:
            p = scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        start += n
    return torch.cat(outs)


def run_case(backend: str, case: str | list[tuple[int, int]], window: int | None, *, heads=6,
             kv_heads=2, head_dim=32, dtype=torch.float32, kv_cache_dtype="auto",
             with_sinks=False):
    """One batch (a SHAPES name, or (cached, new) tokens per request) through ``backend``,
    checked against windowed_reference; returns the case and the reference's output."""
    rng = random.Random(stable_seed(str(case), str(window), heads, str(dtype), kv_cache_dtype,
                                    with_sinks))
    block_size = 16
    chunks, kv_cache, q, k, v, dense = make_case(
        rng, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        shapes=SHAPES[case] if isinstance(case, str) else case, dtype=dtype,
        backend="torch" if backend == "triton" else backend, kv_cache_dtype=kv_cache_dtype)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(rng.randrange(1 << 20)))
    sinks = sinks * 2 if with_sinks else None
    meta = build_flat_batch(chunks, block_size, "cpu").meta
    scale = head_dim ** -0.5
    out = get_backend(backend).forward(q, k, v, kv_cache, meta, scale, window=window,
                                       sinks=sinks)
    assert out.dtype == dtype and out.shape == q.shape
    want = windowed_reference(chunks, q, held_by_cache(dense, kv_cache_dtype), heads, kv_heads,
                              scale, window, sinks)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    return chunks, kv_cache, q, k, v, want, sinks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("window,with_sinks", [
    (None, False), (None, True), (5, False), (5, True), (19, True), (1000, False)])
def test_window_and_sinks_match_masked_softmax(backend, case, window, with_sinks):
    run_case(backend, case, window, with_sinks=with_sinks)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (torch.bfloat16, "auto"), (torch.float32, "int8"), (torch.float32, "bfloat16")])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 1, 64), (4, 4, 80)])
def test_window_dtypes_and_groups(backend, dtype, kv_cache_dtype, heads, kv_heads, head_dim):
    run_case(backend, "mixed", 7, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
             dtype=dtype, kv_cache_dtype=kv_cache_dtype, with_sinks=True)


# decode (split KV at this batch size), a prompt, a chunk after a cached prefix
SMALL = [(40, 1), (0, 9), (35, 6)]


@pytest.mark.skipif(not has_triton(), reason="needs the triton package")
@pytest.mark.parametrize("window,with_sinks,kv_cache_dtype", [
    (None, True, "auto"), (3, False, "auto"), (3, True, "int8")])
def test_triton_window_and_sinks(window, with_sinks, kv_cache_dtype):
    run_case("triton", SMALL, window, heads=4, kv_heads=2, with_sinks=with_sinks,
             kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 40])
def test_tiles_straddling_a_softmax_step(backend, window):
    """A chunk after an unaligned prefix: some query tiles span two of the CPU kernel's
    softmax steps (8 blocks), so a row may see no key of a step (bf16: its probabilities must
    be zeros, not the previous step's)."""
    run_case(backend, [(10, 150), (3, 140)], window, heads=4, kv_heads=2, head_dim=64,
             dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ALL)
def test_blocks_behind_the_window_are_never_read(backend):
    """Table entries wholly behind every query's window replaced by the padding block 0 filled
    with garbage (what the scheduler leaves after freeing them): the same output. The kernels
    never load it (NaN values); the reference may, masked (finite values)."""
    window = 20
    chunks, kv_cache, q, k, v, want, _ = run_case(backend, SMALL, window)
    k_cache, v_cache = kv_cache
    k_cache[0], v_cache[0] = 1e4, float("nan") if backend != "torch" else -1e4
    freed = []
    for c in chunks:
        first = max(0, c.start_pos - window + 1) // 16  # the first block any query sees
        freed.append(Chunk(c.token_ids, c.start_pos, [0] * first + c.block_table[first:]))
    meta = build_flat_batch(freed, 16, "cpu").meta
    meta.slot_mapping = build_flat_batch(chunks, 16, "cpu").meta.slot_mapping
    out = get_backend(backend).forward(q, k, v, kv_cache, meta, 32 ** -0.5, window=window)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


# ----- KV blocks behind the window ------------------------------------------------------------

class WindowedFake(FakeExecutor):
    """The fake runner of test_scheduler.py, reading only what a window of ``window`` sees."""

    def __init__(self, block_size: int, window: int):
        super().__init__(block_size, fake_token)
        self.window = window
        self.most_live = 0  # the most blocks a chunk's table held

    def check_reads(self, chunks) -> None:
        for c in chunks:
            history = c.request.all_token_ids
            if len(c.token_ids) == 1:  # a decode: the window and its own block
                self.most_live = max(self.most_live, sum(b != 0 for b in c.block_table))
            for pos in range(max(0, c.start_pos - self.window + 1), c.start_pos):
                slot = slot_of(c.block_table, pos, self.block_size)
                assert slot >= self.block_size, (c.request_id, pos, "released too early")
                assert self.kv.get(slot) == (pos, history[pos]), (c.request_id, pos)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_blocks_behind_the_window_go_back_to_the_pool(prefix_cache, monkeypatch):
    """Random arrivals (n > 1, shared prompt heads, preemption) with a window of 10 and blocks
    of 4: every read inside the window finds its own KV, cached blocks hold what the tree files
    them under, nothing leaks, and a long sequence holds about window / block_size blocks."""
    window, block_size = 10, 4
    scheduler = make_scheduler(num_blocks=16, block_size=block_size, budget=24, max_seqs=6,
                               prefix_cache=prefix_cache)
    scheduler.block_manager.sliding_window = window
    released = []
    real = KVBlockManager.release_behind
    monkeypatch.setattr(KVBlockManager, "release_behind",
                        lambda self, r, first: released.append(real(self, r, first)) or 0)
    driver = Driver(scheduler)
    driver.runner = WindowedFake(block_size, window)
    rng = random.Random(0)
    head = [7 + i % 40 for i in range(20)]  # at most 60 tokens a sequence: 15 blocks
    arrivals = {step: [Request(f"r{step}-{k}", head[:rng.randrange(21)] + [
        100 + rng.randrange(50) for _ in range(rng.randrange(1, 20))],
        SamplingParams(max_tokens=rng.randrange(1, 21), n=rng.choice([1, 1, 2])))
        for k in range(rng.randrange(4))] for step in range(0, 40, 2)}
    driver.run(arrivals)
    assert sum(released) > 50 and scheduler.stats().num_preemptions > 0
    assert driver.runner.most_live <= window // block_size + 2


# ----- a windowed Mistral: fused step, engine ---------------------------------------------------

def windowed_mistral(tmp_path_factory, window: int, **sizes) -> tuple[object, str]:
    """A tiny random transformers Mistral whose every layer slides, saved as an engine loads it."""
    hf = make_hf_model("mistral", seed=5, sliding_window=window, **sizes)
    directory = save_hf_model(hf, tmp_path_factory.mktemp(f"mistral-w{window}"))
    write_word_tokenizer(directory, COMMON["vocab_size"])
    return hf, directory


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_step_equals_eager_for_a_windowed_model(tmp_path_factory, dtype):
    """Bit for bit, as test_cpu_step.py holds the unwindowed step: prompts, a chunk after a
    cached prefix, decode rows, and sequences sharing blocks (no cascade pass under a window
    that hides some of them, the shared one where it hides none)."""
    _, path = windowed_mistral(tmp_path_factory, 20, hidden_size=128, intermediate_size=96)
    eager, fused = (ModelRunner(load_model(str(path), "cpu", dtype=dtype), num_blocks=64,
                                block_size=16) for _ in range(2))
    assert eager.model.config.every_layer_windowed
    assert fused.fuse_cpu_step().split(";")[0] == "fused"
    a, b = ids(40, 1), ids(23, 2)
    steps = [
        [Chunk(a, 0, [1, 2, 3]), Chunk(b, 0, [4, 5]), Chunk([7], 0, [6])],
        [Chunk(ids(9, 3), 40, [1, 2, 3, 7]), Chunk([11], 23, [4, 5]), Chunk(ids(5, 4), 1, [6])],
        [Chunk(ids(3, 10 + i), 32, [1, 2, 8 + i]) for i in range(3)],
        [Chunk([5 + i], 35 + 3 * i, [1, 2, 8 + i]) for i in range(3)] + [Chunk([9], 24, [4, 5])],
        [Chunk([3], 13, [1]), Chunk([4], 12, [4])],  # the window hides nothing: cascade-free plan
    ]
    for i, chunks in enumerate(steps):
        want = eager.forward(chunks, all_logits=True)
        got = fused.forward(chunks, all_logits=True)
        assert torch.isfinite(want).all()
        assert torch.equal(want, got), f"step {i}: max diff {(want - got).abs().max()}"


def test_engine_with_blocks_released_matches_transformers(tmp_path_factory, monkeypatch):
    """Greedy tokens of an all-window model (window 24 < every prompt but one) equal
    transformers' under batching, chunked prefill, prefix hits and preemption, with the blocks
    behind the window released."""
    hf, path = windowed_mistral(tmp_path_factory, 24, hidden_size=128, intermediate_size=96)
    released = []
    real = KVBlockManager.release_behind
    monkeypatch.setattr(KVBlockManager, "sliding_window", 24)  # what the engine sets
    monkeypatch.setattr(KVBlockManager, "release_behind",
                        lambda self, r, first: released.append(real(self, r, first)) or 0)
    # hf_greedy's min_new_tokens would suppress EOS (id 2), which ignore_eos samples
    hf.generation_config.eos_token_id = None
    # fewer blocks than family_checks gives: released blocks would otherwise spare preemption
    prompts = family_prompts(COMMON["vocab_size"])  # four of them: transformers is the slow part
    check_engine(path, hf, [prompts[i] for i in (0, 1, 3, 5)], num_blocks=10)
    assert sum(released) > 0
