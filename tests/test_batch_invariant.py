"""The batch-invariant mode (``--batch-invariant``, docs/batch_invariance.md): a request's tokens
and logprobs are the same bits whatever shares its batches, however its prompt was split into
chunks, whether its prefix came from the cache, whether it was preempted and recomputed, and
whether speculation verified drafts for it; and with the mode off those do move (the check has
teeth).

One load of the default model per dtype (bf16 where the CPU multiplies it natively, float32);
the other engines are schedulers over the same loaded runner. Sizes are scaled down from the
issue's 32 prompts of 1-2k tokens to what 2 cores run in seconds: a held prompt of 300 tokens
(19 KV blocks: three of attention's softmax steps) among 6 others of 60-330 tokens, which
split it into chunks at arbitrary offsets, share its first 10 blocks (cascade candidates) and
overflow a small cache (preemption).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig, EngineConfig, SpeculativeConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.plan import detect_machine, make_plan
from tokenmill.sched import Scheduler
from tokenmill.speculative import build_decoder

pytestmark = pytest.mark.slow
BS = 16
rng = random.Random(47)
SEGMENT = [rng.randrange(100, 40000) for _ in range(120)]
HELD = SEGMENT * 2 + SEGMENT[:60]  # a copy task: the n-gram proposer finds drafts in it
HELD_SEEDED = SEGMENT[60:] + SEGMENT * 2  # sampled with a seed
SHARED = HELD[:160]  # 10 blocks the prefix-sharing mates start with
MATES = [[rng.randrange(100, 40000) for _ in range(rng.randrange(60, 330))] for _ in range(4)]
SHARING = [SHARED + [rng.randrange(100, 40000) for _ in range(n)] for n in (20, 70)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True,
                        logprobs=2)
OTHER = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _dtypes() -> list[str]:
    caps = detect_machine("cpu").kernel_caps
    return (["bfloat16"] if caps.bf16_gemm else []) + ["float32"]


@pytest.fixture(scope="module")
def cases():
    """dtype -> (the mode-on LLM, the held requests' results run alone), made when first
    asked for."""
    if not detect_machine("cpu").kernel_caps.attention:
        pytest.skip("the batch-invariant mode runs on the compiled CPU kernels")
    made: dict[str, tuple] = {}

    def get(dtype: str) -> tuple:
        if dtype not in made:
            llm = LLM("smollm2-135m-instruct", dtype=dtype, batch_invariant=True,
                      num_blocks=192, block_size=BS, max_num_batched_tokens=512, seed=0)
            assert llm.engine.info.plan["batch_invariant"].startswith("on")
            alone = [results(run(llm, [HELD], [GREEDY], "alone"))[0],
                     results(run(llm, [HELD_SEEDED], [SEEDED], "alone"))[0]]
            made[dtype] = llm, alone
        return made[dtype]
    return get


@pytest.fixture(params=_dtypes())
def case(cases, request):
    """(the mode-on LLM, the held requests' results run alone) for one dtype."""
    return cases(request.param)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], salt: str):
    return llm.generate(prompts, params, use_tqdm=False, cache_salt=salt)


def results(outs) -> list[tuple]:
    """Per output: its tokens and, per token, (token, logprob, rank, top-2), the exact floats."""
    def key(o):
        c = o.outputs[0]
        lps = [(lp.token_id, lp.logprob, lp.rank, tuple(lp.top)) for lp in c.logprobs or []]
        return tuple(c.token_ids), tuple(lps)
    return [key(o) for o in outs]


def batch(seed: int, mates: list[list[int]]
          ) -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """``mates`` in a shuffled order with the two held requests at random places; returns the
    prompts, their params and where the held ones went."""
    r = random.Random(seed)
    items = [(p, OTHER) for p in mates]
    r.shuffle(items)
    for held in ((HELD, GREEDY), (HELD_SEEDED, SEEDED)):
        items.insert(r.randrange(len(items) + 1), held)
    where = [next(i for i, (p, _) in enumerate(items) if p is held) for held in (HELD, HELD_SEEDED)]
    return [p for p, _ in items], [s for _, s in items], where


def twin(llm: LLM, *, proposer=None, num_blocks: int = 192, **scheduler) -> LLM:
    """Another engine over ``llm``'s loaded runner: its own scheduler (empty prefix cache)."""
    engine = llm.engine
    config = replace(engine.scheduler.config, **scheduler)
    sched = Scheduler(config, CacheConfig(block_size=BS), num_blocks=num_blocks,
                      eos_token_ids=engine.eos_token_ids)
    return LLM(engine=LLMEngine(sched, engine.executor, engine.tokenizer, engine.info,
                                proposer=proposer, seed=0))


def held_results(llm: LLM, seed: int, salt: str, mates: list[list[int]] = MATES + SHARING
                 ) -> tuple[list[tuple], list]:
    prompts, params, where = batch(seed, mates)
    outs = run(llm, prompts, params, salt)
    got = results(outs)
    return [got[i] for i in where], [outs[i] for i in where]


def count_cascades(monkeypatch) -> list[tuple[bool, bool]]:
    """(a shared-prefix pass planned, resumed rather than merged) per attention plan made."""
    from tokenmill.attention import cpu_paged

    plans: list[tuple[bool, bool]] = []
    make = cpu_paged.make_plan

    def counted(*args, **kwargs):
        plan = make(*args, **kwargs)
        plans.append((plan.shared is not None, plan.resume))
        return plan

    monkeypatch.setattr(cpu_paged, "make_plan", counted)
    return plans


def test_a_prompt_gives_the_same_bits_alone_and_among_others(case, monkeypatch):
    """Among others (split into chunks where they fill the step's budget), computed whole and
    then from its cached prefix beside mates that share it: the shared-prefix pass runs, its
    softmax state resumed by each sequence's own pass."""
    llm, alone = case
    missed, outs = held_results(llm, 1, "mates", MATES)
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert missed == alone
    plans = count_cascades(monkeypatch)
    hit, outs = held_results(llm, 2, "mates")  # now beside mates that share its first blocks
    assert all(o.num_cached_tokens >= len(SHARED) for o in outs)
    assert (True, True) in plans and (True, False) not in plans
    assert hit == alone


def test_chunks_of_64_and_preemption_change_no_bit(case):
    llm, alone = case
    tight = twin(llm, max_num_batched_tokens=64, num_blocks=40)
    got, _ = held_results(tight, 3, "tight")
    assert tight.engine.num_preemptions > 0
    assert got == alone


def test_speculative_verification_changes_no_bit(case):
    """n-gram drafts, 8 per step, verified in the forward: greedy and seeded tokens and their
    logprobs as without speculation."""
    llm, alone = case
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=8, speculative_adaptive=False)
    spec = twin(llm, proposer=build_decoder(ngram, None, 192, BS, "cpu", 512))
    got = [results(run(spec, [p], [s], "spec"))[0]
           for p, s in ((HELD, GREEDY), (HELD_SEEDED, SEEDED))]
    assert spec.engine.scheduler.num_accepted_tokens > 0
    assert got == alone


def test_without_the_mode_the_same_batches_differ(cases, monkeypatch):
    """The inverse: with the mode off (float32: the same linears, the shared-prefix pass merged
    after the main one) the held prompt's bits move beside mates that share its prefix: the
    scheduler shares their blocks on every CPU and a float32 merge rounds otherwise than one
    pass, so this holds on any machine class (bf16 on AMX differs in more places: oneDNN)."""
    llm, alone = cases("float32")
    from tokenmill.model.linear.plan import plan_linears

    off = plan_linears(detect_machine("cpu"), "float32")
    assert replace(off.with_batch_invariance(), batch_invariant=False) == off  # linears alike
    plans = count_cascades(monkeypatch)
    backend = llm.engine.executor.worker.model.model.layers[0].self_attn.backend
    monkeypatch.setattr(backend, "cascade", "merge")
    plain = twin(llm)
    base = results(run(plain, [HELD], [GREEDY], "off"))[0]
    assert base == alone[0]  # alone, no pass is shared
    assert not any(shared for shared, _ in plans)
    got, _ = held_results(plain, 2, "off")
    assert (True, False) in plans  # the scheduler's doing, on every CPU
    assert got[0] != base


# ----- kernels: the pieces the mode relies on --------------------------------------------------

def kernel_ops():
    from tokenmill.kernels import cpu

    ops = cpu.load()
    if ops is None:
        pytest.skip("no CPU kernels")
    return ops


def kv(dtype: torch.dtype, g: torch.Generator, blocks: int = 48, kv_heads: int = 2, d: int = 64):
    k_cache = torch.randn(blocks, BS, kv_heads, d, generator=g).to(dtype)
    return k_cache, torch.randn(blocks, BS, kv_heads, d, generator=g).to(dtype)


def attention_dtypes(ops) -> tuple[torch.dtype, ...]:
    return ((torch.bfloat16,) if ops.has_bf16_gemm else ()) + (torch.float32,)


def test_attention_rows_keep_their_bits_in_any_tile():
    """A query row's output and log-sum-exp are the same bits whether its tile holds it alone
    or with other rows reaching further (more keys, other window starts)."""
    ops, g, i64 = kernel_ops(), torch.Generator().manual_seed(0), torch.int64
    heads, d = 4, 64
    for dtype in attention_dtypes(ops):
        k_cache, v_cache = kv(dtype, g)
        q = torch.randn(40, heads, d, generator=g).to(dtype)
        table = torch.randperm(47, generator=g)[None, :] + 1
        limits = torch.arange(700, 740)  # 40 query tokens at positions 699 .. 738
        for low in (torch.empty(0, dtype=i64), limits - 300):
            def attend(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
                n = rows.stop - rows.start
                out, lse = torch.empty(n, heads, d, dtype=dtype), torch.empty(n, heads)
                lo = low[rows].contiguous() if low.numel() else low
                ops.paged_attention(q[rows], k_cache, v_cache, table, torch.tensor([0, n]),
                                    torch.tensor([0]), limits[rows].contiguous(), lo,
                                    torch.empty(0, dtype=i64), torch.empty(0), out, lse,
                                    torch.empty(0), d ** -0.5, 0, 16)
                return out, lse
            tile_out, tile_lse = attend(slice(0, 40))
            for t in (0, 13, 39):
                out, lse = attend(slice(t, t + 1))
                assert torch.equal(out[0], tile_out[t]) and torch.equal(lse[0], tile_lse[t])


def test_a_resumed_shared_pass_gives_one_pass_bits():
    """Three sequences sharing their first 8 blocks (one softmax step): the shared pass saving
    its state and each sequence's pass resuming it give what one pass per sequence gives."""
    from tokenmill.attention.cpu_paged import MERGE, RESUME, SAVE_STATE, WRITE

    ops, g, i64 = kernel_ops(), torch.Generator().manual_seed(2), torch.int64
    heads, d, shared = 4, 64, 8
    assert ops.attention_step_blocks == shared
    for dtype in attention_dtypes(ops):
        k_cache, v_cache = kv(dtype, g)
        own = torch.randperm(39, generator=g)[:36].view(3, 12) + 9  # 12 own blocks each
        tables = torch.cat([torch.arange(1, 9).expand(3, -1), own], 1)  # (3, 20)
        lens, new = [300, 261, 170], [5, 1, 30]  # tokens, of which new this step
        starts = torch.tensor([0, 5, 6, 36])
        limits = torch.tensor([p + 1 for s, q in zip(lens, new) for p in range(s - q, s)])
        q = torch.randn(36, heads, d, generator=g).to(dtype)
        empty, none = torch.empty(0), torch.empty(0, dtype=i64)
        one = torch.empty(36, heads, d, dtype=dtype)
        lse = torch.empty(36, heads)
        ops.paged_attention(q, k_cache, v_cache, tables, starts, torch.zeros(3, dtype=i64),
                            limits, none, none, empty, one, lse, empty, d ** -0.5, WRITE, 16)
        for mode in (MERGE, RESUME):
            out = torch.zeros(36, heads, d)
            state = torch.empty(36, heads, 2)
            state[..., 0], state[..., 1] = float("-inf"), 0.0
            passes = [(tables[:1, :shared], torch.tensor([0, 36]), torch.zeros(1, dtype=i64),
                       torch.full((36,), shared * BS), torch.arange(36), SAVE_STATE),
                      (tables, starts, torch.full((3,), shared), limits, none, mode)]
            if mode == MERGE:  # the merge's order: the main pass first, then the shared one
                passes = [passes[1][:5] + (WRITE,), passes[0][:5] + (MERGE,)]
            for table, qs, first, lim, rows, combine in passes:
                ops.paged_attention(q, k_cache, v_cache, table, qs, first, lim, none, rows,
                                    empty, out, lse, state, d ** -0.5, combine, 16)
            same = torch.equal(out.to(dtype), one)
            assert same if mode == RESUME else not same


def gemms(ops) -> dict[str, tuple]:
    """Each linear kernel the mode runs: (its call on x, x's dtype), over one random weight."""
    from tokenmill.model.quant import quantize_int4, quantize_int8

    w = torch.randn(96, 576, generator=torch.Generator().manual_seed(3)) / 20
    out: dict[str, tuple] = {}
    if ops.has_bf16_gemm:
        packed = ops.pack_bf16_weight(w.bfloat16())
        out["bf16-packed"] = (lambda x: ops.linear_bf16_packed(x, packed, None), torch.bfloat16)
        # float32 FMAs from 16 rows (the load's trial picks the rows): vdpbf16ps's bits
        out["bf16-packed-widened"] = (
            lambda x: ops.linear_bf16_packed(x, packed, None, widen_from=16), torch.bfloat16)
        out["bf16-rows"] = (lambda x: ops.linear_bf16_rows(x, w.bfloat16(), None), torch.bfloat16)
    if ops.has_bf16_amx:
        out["bf16-amx"] = (lambda x: ops.linear_bf16_packed(x, packed, None, True), torch.bfloat16)
    if ops.f32_pack_cols:
        f32 = ops.pack_f32_weight(w)
        out["f32-packed"] = (lambda x: ops.linear_f32_packed(x, f32, None), torch.float32)
        for q in (quantize_int4(w), quantize_int8(w)):
            bits = ops.pack_f32_quant_weight(q.qweight, q.scales, q.zeros, q.bits, 32)
            out[f"f32-packed-bits-{q.bits}"] = (
                lambda x, b=bits: ops.linear_f32_packed(x, b, None), torch.float32)
    if ops.a8_pack_cols:
        q = quantize_int4(w)
        a8 = ops.pack_a8_weight(q.qweight, q.scales, q.zeros, 4, 32)
        out["f32-packed-a8"] = (lambda x: ops.linear_f32_packed(x, a8, None), torch.float32)
    return out


def test_each_linear_kernel_sums_a_row_alike_at_every_row_count():
    """The mode's GEMMs: a row's outputs are the same bits alone, in a few rows, in a row tile's
    tail or among hundreds (threads split the output columns, each output sums along K in one
    order)."""
    ops = kernel_ops()
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(4))
    for name, (gemm, dtype) in gemms(ops).items():
        xs = x.to(dtype)
        full = gemm(xs)
        for lo, hi in ((0, 1), (7, 8), (3, 12), (20, 37), (100, 300)):
            assert torch.equal(gemm(xs[lo:hi]), full[lo:hi]), (name, lo, hi)


def test_amx_tiles_multiply_as_the_float_product_and_fuse_silu_alike():
    """The AMX route of the packed bf16 GEMM: the float product within bf16's rounding, and its
    SiLU·mul epilogue the two-step result bit for bit (as vdpbf16ps's is)."""
    from tokenmill.model.linear.packed import BF16_PACK_COLS

    ops = kernel_ops()
    if not ops.has_bf16_amx:
        pytest.skip("no AMX tiles here")
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(192, 576, generator=g) / 20, torch.randn(37, 576, generator=g)
    w, x = w.bfloat16(), x.bfloat16()
    got = ops.linear_bf16_packed(x, ops.pack_bf16_weight(w), None, True).float()
    want = x.double() @ w.double().T
    assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=1e-3)
    p = ops.pack_bf16_weight(w)  # gate/up blocks interleaved, as Bf16PackedSilu packs them
    inter = p.view(2, p.shape[0] // 2, *p.shape[1:]).transpose(0, 1).reshape(p.shape).contiguous()
    fused = ops.linear_bf16_packed_silu(x, inter, None, True)
    two_step = ops.silu_and_mul_interleaved(ops.linear_bf16_packed(x, inter, None, True),
                                            BF16_PACK_COLS)
    assert torch.equal(fused, two_step)


def test_float32_silu_mul_is_per_row_at_any_thread_count():
    """PyTorch splits elementwise ops over threads by elements, and a split inside a row takes
    its last elements through the scalar exp; ``silu_and_mul_rows`` keeps rows whole, with
    PyTorch's own bits for each row."""
    from tokenmill.kernels import cpu

    ops = cpu.load()
    if ops is None:
        pytest.skip("no CPU kernels")
    x = torch.randn(300, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(7)
        out = ops.silu_and_mul_rows(x)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 150, 299):
        gate, up = x[r:r + 1].chunk(2, dim=-1)
        assert torch.equal(out[r], (F.silu(gate) * up)[0])


# ----- the plan ---------------------------------------------------------------------------------

def test_the_plan_says_where_the_mode_holds():
    from tokenmill.platform import Machine

    # on by default where it was measured to cost nothing; off by default with oneDNN's AMX
    # route (prompt chunks 20% slower on the tiles) and for --quantization off the bf16 GEMM
    # (not measured); 4/8-bit weights on it run the bf16 kernels, bit for bit: on
    bf16 = EngineConfig.from_options(dtype="bfloat16")
    assert make_plan(bf16, Machine.described("avx512-bf16")).batch_invariant.startswith("on")
    amx = make_plan(bf16, Machine.described("amx"))
    assert amx.batch_invariant.startswith("off") and "AMX" in amx.batch_invariant
    assert amx.linear.onednn_trial and not amx.linear.batch_invariant
    asked = make_plan(EngineConfig.from_options(dtype="bfloat16", batch_invariant=True),
                      Machine.described("amx"))
    assert asked.batch_invariant.startswith("on") and not asked.linear.onednn_trial
    int8 = make_plan(EngineConfig.from_options(dtype="bfloat16", quantization="int8"),
                     Machine.described("avx512-bf16"))
    assert int8.batch_invariant.startswith("on") and int8.linear.batch_invariant
    a8 = make_plan(EngineConfig.from_options(dtype="float32", quantization="int8"),
                   Machine.described("avx2"))
    assert a8.batch_invariant.startswith("off") and "--quantization" in a8.batch_invariant
    f32 = make_plan(EngineConfig.from_options(dtype="float32"), Machine.described("avx2"))
    assert f32.batch_invariant.startswith("on") and f32.linear.batch_invariant
    no = make_plan(EngineConfig.from_options(dtype="float32", batch_invariant=False),
                   Machine.described("avx2"))
    assert no.batch_invariant == "off: asked for" and not no.linear.batch_invariant
    assert "batch_invariant" in no.describe()
    with pytest.raises(ValueError, match="torch attention backend"):
        make_plan(EngineConfig.from_options(attention_backend="torch", batch_invariant=True))
    off = make_plan(EngineConfig.from_options(attention_backend="torch"))
    assert "torch attention backend" in off.batch_invariant


def test_the_linear_plan_drops_the_onednn_trial_and_kernels_that_follow_the_rows():
    from tokenmill.model.linear.plan import plan_linears
    from tokenmill.platform import Machine

    amx = plan_linears(Machine.described("amx"), "bfloat16")
    assert amx.onednn_trial and amx.order_blocker() is None
    fixed = amx.with_batch_invariance()
    assert fixed.batch_invariant and not fixed.onednn_trial
    assert fixed.kernel_for("qkv") == "bf16-amx" and fixed.kernel_for("gate_up") == "bf16-amx-silu"
    zen4 = plan_linears(Machine.described("avx512-bf16"), "bfloat16").with_batch_invariance()
    assert zen4.kernel_for("qkv") == "bf16-packed"
    bare = plan_linears(Machine.described("bare"), "float32")
    assert bare.order_blocker() is not None
