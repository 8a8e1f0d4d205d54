"""bf16 attention's two routes on a CPU with AVX512-BF16 (csrc/attention_wide.h): float32 FMAs
give vdpbf16ps's bits for every kind of batch — prompts, decode rows, chunks after a cached
prefix, a shared prefix merged or resumed (the batch-invariant mode's cascade), sliding windows,
sinks, head sizes 32-256, denormal queries and K/V, and one call whose items take both routes —
and the load's trial (attention/cpu_trial.py) picks a route without leaving its own behind."""

from __future__ import annotations

import random

import pytest
import torch

from tests.seeding import stable_seed
from tests.test_attention import CASES, make_case
from tokenmill.attention import cpu_trial, get_backend
from tokenmill.attention.cpu_paged import CASCADES, TILE, WRITE
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.runner.batch import build_flat_batch

OPS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(OPS is None or not OPS.has_bf16_dot,
                                reason="the two routes need the kernels built for AVX512-BF16")
BLOCK = 16
DENORMAL = 3e-39  # below bfloat16's smallest normal (1.18e-38)


@pytest.fixture
def ops():
    before = OPS.attention_widen_from()
    yield OPS
    OPS.set_attention_widen_from(before)


def denormals(t: torch.Tensor, gen: torch.Generator) -> None:
    """A fifth of t's elements made bfloat16 denormals of either sign, in place."""
    pick = torch.rand(t.shape, generator=gen) < 0.2
    sign = torch.where(torch.rand(t.shape, generator=gen) < 0.5, -1.0, 1.0)
    t[pick] = (sign * DENORMAL).to(t.dtype)[pick]


def routes(ops, case: str, heads: int, kv_heads: int, head_dim: int, *, cascade="merge",
           window=None, sinks=False, tiny=False) -> list[torch.Tensor]:
    """The batch's attention by vdpbf16ps only, by FMAs only, and by FMAs from the rows of one
    decode token's heads + 1 (both routes in one call)."""
    rng = random.Random(stable_seed(case, heads, kv_heads, head_dim, cascade, str(window),
                                    sinks, tiny))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    chunks, kv_cache, q, k, v, _ = make_case(rng, heads=heads, kv_heads=kv_heads,
                                             head_dim=head_dim, block_size=BLOCK,
                                             dtype=torch.bfloat16, backend="cpu", **CASES[case])
    if tiny:
        for t in (q, k, v, *kv_cache):
            denormals(t, gen)
    backend = get_backend("cpu")
    backend.cascade = cascade
    sink = torch.randn(heads, generator=gen) * 2 if sinks else None
    outs = []
    for rows in (0, 1, heads // kv_heads + 1):
        ops.set_attention_widen_from(rows)
        cache = tuple(t.clone() for t in kv_cache)  # forward stores the new K/V
        meta = build_flat_batch(chunks, BLOCK, "cpu").meta
        outs.append(backend.forward(q, k, v, cache, meta, head_dim ** -0.5, window=window,
                                    sinks=sink))
    return outs


def assert_same_bits(outs: list[torch.Tensor]) -> None:
    dot = outs[0].view(torch.int16)
    assert torch.isfinite(outs[0]).all()
    for other in outs[1:]:
        diff = (other.view(torch.int16) != dot).sum().item()
        assert diff == 0, f"{diff} of {dot.numel()} outputs differ from vdpbf16ps's"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cascade", CASCADES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 96), (4, 2, 160), (4, 1, 256)])
def test_fma_route_gives_vdpbf16ps_bits(ops, case, cascade, heads, kv_heads, head_dim):
    assert_same_bits(routes(ops, case, heads, kv_heads, head_dim, cascade=cascade))


@pytest.mark.parametrize("case", ["prefill", "mixed", "after_cached_prefix"])
@pytest.mark.parametrize("window,sinks", [(7, False), (40, True), (None, True)])
def test_windows_and_sinks_keep_the_bits(ops, case, window, sinks):
    assert_same_bits(routes(ops, case, 6, 2, 64, window=window, sinks=sinks))


@pytest.mark.parametrize("case", ["prefill", "decode", "shared_prefix"])
@pytest.mark.parametrize("cascade", CASCADES)
def test_denormal_queries_and_cache_read_as_zero_on_both_routes(ops, case, cascade):
    assert_same_bits(routes(ops, case, 9, 3, 64, cascade=cascade, tiny=True))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (4, 1, 256)])
def test_float32_outputs_and_log_sum_exps_keep_their_bits(ops, case, heads, kv_heads, head_dim):
    """The kernel's float32 output (a cascade's first pass, before any rounding to bf16) and
    each row's log-sum-exp: bits a bf16 output would round away."""
    rng = random.Random(stable_seed(case, heads, kv_heads, head_dim, "float32 out"))
    chunks, kv_cache, q, k, v, _ = make_case(rng, heads=heads, kv_heads=kv_heads,
                                             head_dim=head_dim, block_size=BLOCK,
                                             dtype=torch.bfloat16, backend="cpu", **CASES[case])
    backend = get_backend("cpu")
    meta = build_flat_batch(chunks, BLOCK, "cpu").meta
    backend.store_kv(k, v, kv_cache, meta.slot_mapping)
    plan = backend.plan(meta)
    results = []
    for rows in (0, 1, heads // kv_heads + 1):
        ops.set_attention_widen_from(rows)
        out, lse = torch.empty(q.shape), torch.empty(q.shape[:2])
        ops.paged_attention(q, *kv_cache, meta.block_tables, meta.query_start_loc,
                            plan.key_start_block, plan.key_limit, plan.key_low, plan.empty,
                            plan.empty, out, lse, torch.empty(0), head_dim ** -0.5, WRITE, TILE)
        results.append(torch.cat([out.flatten(), lse.flatten()]))
    assert torch.isfinite(results[0]).all()
    for other in results[1:]:
        diff = (other.view(torch.int32) != results[0].view(torch.int32)).sum().item()
        assert diff == 0, f"{diff} of {other.numel()} floats differ from vdpbf16ps's"


def test_the_trial_checks_the_bits_and_leaves_the_setting_alone(ops):
    ops.set_attention_widen_from(7)
    assert cpu_trial.widened_exact(ops, 9, 3, 64)
    rows = cpu_trial.choose_widen_rows(ops, 9, 3, 64, repeats=1)
    assert rows in (None, 1, 4)
    assert ops.attention_widen_from() == 7
    # a head size the kernel has no bf16 pairs for, and the float32 build's shapes: no trial
    assert cpu_trial.choose_widen_rows(ops, 9, 3, 80) is None
    with pytest.raises(RuntimeError, match="rows >= 0"):
        ops.set_attention_widen_from(-1)
