"""Batched LoRA (``model/lora/slots.py``, ``kernels/csrc/lora.h``): the kernels' ``LoRABank``
against the PyTorch reference, and a tiny Llama with adapters in its slots against a model whose
weights have them merged (W + B·scale·A), on the fused CPU step and the eager path.

Each adapter has its own ranks (4, 8, 16, and different ranks for the slices of one fused
linear); base rows of a mixed batch keep their bits; float32 rows of a mixed batch equal each
request run alone; the fused step equals the eager path bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import COMMON, make_hf_model, save_hf_model
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model.linear import plan as linear_plan
from tokenmill.model.linear import routed
from tokenmill.model.linear.packed import interleaved_columns
from tokenmill.model.loader import load_model
from tokenmill.model.lora.slots import (LoRASlots, lora_reference, moved_segments,
                                        plain_segments)
from tokenmill.model.lora.weights import LoRASlice, ModuleLoRA
from tokenmill.runner.batch import Chunk
from tokenmill.runner.model_runner import ModelRunner

ops = cpu_kernels.load()
HAS_BANK = ops is not None and hasattr(ops, "LoRABank")
FUSED = {"bfloat16": HAS_BANK and getattr(ops, "has_bf16_gemm", False),
         "float32": HAS_BANK and getattr(ops, "f32_pack_cols", 0) > 0}
needs_bank = pytest.mark.skipif(not HAS_BANK, reason="the CPU kernels did not build")
DTYPES = [pytest.param(d, marks=pytest.mark.skipif(
    not FUSED[d], reason=f"the CPU kernels' {d} GEMM is not built on this CPU (needs AVX512-BF16)"))
    for d in FUSED]
BLOCK = 16
SIZES = dict(hidden_size=128, intermediate_size=96)  # 4 heads of 32, 2 KV heads
HF_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# tokenmill's fused linears: role -> its PEFT modules in output order
ROLES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
# three adapters: rank, targets, and ranks that differ from it per module (rank_pattern)
ADAPTERS = [(4, ("q_proj", "v_proj"), {}),
            (8, tuple(HF_MODULES), {}),
            (16, ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
             {"k_proj": 4, "gate_proj": 8})]


# ----- the kernel against the reference ----------------------------------------------------

def random_module(ranks: list[int], outs: list[int], k: int, dtype: torch.dtype,
                  gen: torch.Generator) -> ModuleLoRA:
    """A ModuleLoRA of slices with ``ranks`` onto consecutive output blocks of sizes ``outs``."""
    slices, rank_start, out_start = [], 0, 0
    b = torch.zeros(sum(ranks), sum(outs))
    for r, n in zip(ranks, outs):
        slices.append(LoRASlice(rank_start, r, out_start, n))
        b[rank_start:rank_start + r, out_start:out_start + n] = torch.randn(r, n, generator=gen)
        rank_start, out_start = rank_start + r, out_start + n
    a = torch.randn(sum(ranks), k, generator=gen) / k ** 0.5
    return ModuleLoRA(a.to(dtype), (b * 0.1).to(dtype), tuple(slices))


def bank_with(modules: list[ModuleLoRA], interleaved: bool = False):
    bank = ops.LoRABank(len(modules), 1)
    for slot, m in enumerate(modules):
        segs = moved_segments(m, interleaved_columns(m.b.shape[1])) if interleaved \
            else plain_segments(m)
        bank.set(slot, 0, 2, m.a, m.b, torch.tensor(segs).view(-1, 5), None)
    return bank


def set_groups(bank, groups: list[tuple[int, list[int]]]) -> None:
    rows = torch.tensor([r for _, rs in groups for r in rs], dtype=torch.int64)
    bounds = torch.tensor([0, *torch.tensor([len(rs) for _, rs in groups]).cumsum(0).tolist()])
    bank.set_step(rows, bounds, [slot for slot, _ in groups])


@needs_bank
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bank_adds_what_the_reference_adds(dtype):
    """Ranks 4/8/16 in one call, fused-linear slices of their own ranks (one of rank 0), an
    empty group, a group of 9 rows (tiles of 4 and the rest), inputs and outputs not a multiple
    of a vector; base rows untouched, every row as it is alone."""
    gen = torch.Generator().manual_seed(0)
    k, outs = 72, [40, 24, 24]
    modules = [random_module([4, 4, 0], outs, k, dtype, gen),
               random_module([8, 2, 8], outs, k, dtype, gen),
               random_module([16], [88], k, dtype, gen)]
    x = torch.randn(16, k, generator=gen).to(dtype)
    y0 = torch.randn(16, 88, generator=gen).to(dtype)
    groups = [(2, [1, 3, 4, 5, 6, 8, 9, 11, 15]), (1, []), (0, [0, 2, 7]), (1, [12, 13])]
    bank = bank_with(modules)
    set_groups(bank, groups)
    assert [bank.touches(0, r) for r in range(4)] == [False, False, True, False]
    got = y0.clone()
    bank.add_(0, 2, x, got, False)
    want = y0.clone()
    for slot, rows in groups:
        m = modules[slot]
        lora_reference(x, want, torch.tensor(rows, dtype=torch.int64), m.a, m.b,
                       plain_segments(m))
    base = [10, 14]
    assert torch.equal(got[base], y0[base])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the delta: the float64 product of the module's A and B
    m = modules[0]
    exact = y0[[0, 2, 7]].double() + (x[[0, 2, 7]].double() @ m.a.double().T) @ m.b.double()
    torch.testing.assert_close(got[[0, 2, 7]].double(), exact, atol=tol, rtol=tol)
    for slot, rows in groups:  # each row alone: the same bits
        for r in rows:
            set_groups(bank, [(slot, [0])])
            alone = y0[r:r + 1].clone()
            bank.add_(0, 2, x[r:r + 1], alone, False)
            assert torch.equal(alone, got[r:r + 1]), (slot, r)
    bank.clear_step()
    assert not bank.touches(0, 2)


@needs_bank
def test_interleaved_segments_add_where_the_packed_product_holds_each_feature():
    """A gate/up product with column blocks of 16 interleaved: the slices cut at the blocks
    add to each feature at its interleaved column."""
    gen = torch.Generator().manual_seed(1)
    m = random_module([8, 4], [96, 96], 64, torch.float32, gen)
    x, y0 = torch.randn(5, 64, generator=gen), torch.randn(5, 192, generator=gen)
    cols = interleaved_columns(192)
    segs = moved_segments(m, cols)
    assert len(segs) == 12 and all(s[4] == 16 for s in segs)
    plain, moved = y0.clone(), y0[:, torch.argsort(cols)].clone()
    rows = torch.tensor([0, 3, 4])
    lora_reference(x, plain, rows, m.a, m.b, plain_segments(m))
    bank = ops.LoRABank(1, 1)
    bank.set(0, 0, 2, m.a, m.b, torch.tensor(plain_segments(m)), torch.tensor(segs))
    bank.set_step(rows, torch.tensor([0, 3]), [0])
    bank.add_(0, 2, x, moved, True)
    torch.testing.assert_close(moved[:, cols], plain, atol=1e-5, rtol=1e-5)


@needs_bank
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_interleaved_is_silu_and_mul_per_block(dtype):
    g = torch.randn(7, 192, generator=torch.Generator().manual_seed(2)).mul(3).to(dtype)
    interleaved = g[:, torch.argsort(interleaved_columns(192))].contiguous()
    assert torch.equal(ops.silu_and_mul_interleaved(interleaved, 16), ops.silu_and_mul(g))
    if FUSED["bfloat16"] and dtype == torch.bfloat16:  # the packed GEMM's epilogue, bit for bit
        w = torch.randn(192, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
        x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
        packed = ops.pack_bf16_weight(w.view(2, 6, 16, 64).transpose(0, 1).reshape(192, 64))
        product = ops.linear_bf16_packed(x, packed, None)
        assert torch.equal(ops.silu_and_mul_interleaved(product, 16),
                           ops.linear_bf16_packed_silu(x, packed, None))


# ----- a tiny Llama with adapters in its slots ----------------------------------------------

def random_adapter(hf, rank: int, targets: tuple[str, ...], pattern: dict, seed: int) -> dict:
    """{(layer, PEFT module): (A (r, in), B (out, r), scale)} for every layer."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer, block in enumerate(hf.model.layers):
        for name in targets:
            w = getattr(getattr(block, HF_MODULES[name]), name).weight
            r = pattern.get(name, rank)
            a = torch.randn(r, w.shape[1], generator=gen) / w.shape[1] ** 0.5
            out[layer, name] = (a, torch.randn(w.shape[0], r, generator=gen) * 0.05, 2.0 / r)
    return out


def module_loras(adapter: dict, hf, dtype: torch.dtype) -> dict[tuple[int, str], ModuleLoRA]:
    """The adapter as tokenmill's per-linear ModuleLoRAs (weights.py's layout)."""
    result = {}
    for layer, block in enumerate(hf.model.layers):
        for role, names in ROLES.items():
            widths = [getattr(getattr(block, HF_MODULES[n]), n).weight.shape[0] for n in names]
            parts = [(adapter.get((layer, n)), sum(widths[:i])) for i, n in enumerate(names)]
            parts = [(p, start, w) for (p, start), w in zip(parts, widths) if p is not None]
            if not parts:
                continue
            ranks = sum(p[0].shape[0] for p, _, _ in parts)
            a, b = torch.cat([p[0] for p, _, _ in parts]), torch.zeros(ranks, sum(widths))
            slices, at = [], 0
            for (pa, pb, scale), start, width in parts:
                b[at:at + pa.shape[0], start:start + width] = (pb * scale).T
                slices.append(LoRASlice(at, pa.shape[0], start, width))
                at += pa.shape[0]
            result[layer, role] = ModuleLoRA(a.to(dtype), b.to(dtype), tuple(slices))
    return result


def merged(hf, adapter: dict):
    """A copy of ``hf`` with the adapter merged into its weights."""
    copy = make_hf_model("llama", seed=3, **SIZES)
    copy.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for (layer, name), (a, b, scale) in adapter.items():
            block = copy.model.layers[layer]
            getattr(getattr(block, HF_MODULES[name]), name).weight += scale * b @ a
    return copy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The base model's directory, the three adapters and the merged models' directories."""
    hf = make_hf_model("llama", seed=3, **SIZES)
    adapters = [random_adapter(hf, *spec, seed=10 + i) for i, spec in enumerate(ADAPTERS)]
    dirs = [str(save_hf_model(hf, tmp_path_factory.mktemp("base")))]
    for i, adapter in enumerate(adapters):
        dirs.append(str(save_hf_model(merged(hf, adapter), tmp_path_factory.mktemp(f"m{i}"))))
    return hf, adapters, dirs


def runner(path: str, dtype: str, fused: bool, **load) -> ModelRunner:
    r = ModelRunner(load_model(path, "cpu", dtype=dtype, **load), num_blocks=64,
                    block_size=BLOCK)
    if fused:
        assert r.fuse_cpu_step().split(";")[0] == "fused"
    return r


def with_slots(r: ModelRunner, tiny, dtype: torch.dtype, kernels=ops) -> LoRASlots:
    hf, adapters, _ = tiny
    slots = LoRASlots(r.model, 4, kernels)
    for slot, adapter in zip((0, 2, 3), adapters):  # slot 1 left empty
        slots.set_slot(slot, module_loras(adapter, hf, dtype))
    return slots


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# a prompt step and a decode step of four sequences: the base model's, then adapters 0, 1, 2
PROMPTS = [ids(n, n) for n in (9, 21, 5, 17)]
TABLES = [[1, 2], [3, 4], [5], [6, 7]]
SLOT_OF = [None, 0, 2, 3]


def steps() -> list[list[Chunk]]:
    decode = [Chunk([i + 1], len(p), t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES))]
    return [[Chunk(p, 0, t) for p, t in zip(PROMPTS, TABLES)], decode]


def groups_of(chunks: list[Chunk], slot_of: list) -> list[tuple[int, torch.Tensor]]:
    starts = torch.tensor([0, *[len(c.token_ids) for c in chunks]]).cumsum(0).tolist()
    return [(slot, torch.arange(starts[i], starts[i + 1]))
            for i, slot in enumerate(slot_of) if slot is not None]


def run_steps(r: ModelRunner, slots: LoRASlots | None, slot_of=SLOT_OF) -> list[torch.Tensor]:
    out = []
    for chunks in steps():
        if slots is not None:
            slots.set_step(groups_of(chunks, slot_of))
        try:
            out.append(r.forward(chunks, all_logits=True))
        finally:
            if slots is not None:
                slots.clear_step()
    return out


def rows_of(logits: torch.Tensor, chunks: list[Chunk], i: int) -> torch.Tensor:
    start = sum(len(c.token_ids) for c in chunks[:i])
    return logits[start:start + len(chunks[i].token_ids)]


@needs_bank
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_batch_runs_each_row_under_its_adapter(tiny, dtype):
    """Base + three adapters in one batch: the adapters' rows as their merged models give them,
    the base rows bit for bit as without LoRA, fused == eager bit for bit; with no step set,
    the slots change nothing."""
    torch_dtype = getattr(torch, dtype)
    _, _, dirs = tiny
    fused, eager = runner(dirs[0], dtype, True), runner(dirs[0], dtype, False)
    fused_slots, eager_slots = with_slots(fused, tiny, torch_dtype), \
        with_slots(eager, tiny, torch_dtype)
    assert fused.model.model.fused_layers.lora is fused_slots
    got, got_eager = run_steps(fused, fused_slots), run_steps(eager, eager_slots)
    plain = run_steps(runner(dirs[0], dtype, True), None)
    for step, chunks in enumerate(steps()):
        assert torch.equal(got[step], got_eager[step]), step
        assert torch.equal(rows_of(got[step], chunks, 0), rows_of(plain[step], chunks, 0))
    for i in range(1, 4):
        want = run_steps(runner(dirs[i], dtype, True), None)
        for step, chunks in enumerate(steps()):
            lora, base = rows_of(got[step], chunks, i), rows_of(plain[step], chunks, i)
            ref = rows_of(want[step], chunks, i)
            if dtype == "float32":
                torch.testing.assert_close(lora, ref, atol=1e-4, rtol=1e-4)
            else:  # bf16 roundings of the merged weights: closer to them than the base is
                assert (lora - ref).abs().max() < 0.25 * (base - ref).abs().max(), (i, step)
    # installed and holding adapters, but no step: the model as it was
    again = run_steps(fused, fused_slots, [None] * 4)
    assert torch.equal(rows_of(again[0], steps()[0], 0), rows_of(plain[0], steps()[0], 0))
    assert fused_slots.nbytes() == sum(m.nbytes() for a in tiny[1]
                                       for m in module_loras(a, tiny[0], torch_dtype).values())


@needs_bank
@pytest.mark.skipif(not FUSED["float32"], reason="the CPU kernels' float32 GEMM is not built")
def test_each_row_of_a_mixed_batch_is_as_its_request_alone(tiny):
    _, _, dirs = tiny
    mixed = runner(dirs[0], "float32", True)
    got = run_steps(mixed, with_slots(mixed, tiny, torch.float32))
    for i in range(4):
        alone = runner(dirs[0], "float32", True)
        slots = with_slots(alone, tiny, torch.float32)
        for step, chunks in enumerate(steps()):
            one = [chunks[i]]
            slots.set_step(groups_of(one, [SLOT_OF[i]]))
            logits = alone.forward(one, all_logits=True)
            slots.clear_step()
            assert torch.equal(logits, rows_of(got[step], chunks, i)), (i, step)


@needs_bank
@pytest.mark.skipif(not FUSED["float32"], reason="the CPU kernels' float32 GEMM is not built")
def test_the_torch_reference_slots_give_the_kernels_results(tiny):
    """Slots without the kernels' bank (as on CUDA): the eager path with PyTorch's products, and
    the fused step hands a step with LoRA rows to it."""
    _, _, dirs = tiny
    fused = runner(dirs[0], "float32", True)
    want = run_steps(fused, with_slots(fused, tiny, torch.float32))
    for fused in (True, False):
        r = runner(dirs[0], "float32", fused)
        slots = with_slots(r, tiny, torch.float32, kernels=None)
        assert slots.bank is None
        for step, logits in enumerate(run_steps(r, slots)):
            torch.testing.assert_close(logits, want[step], atol=1e-5, rtol=1e-5)


@needs_bank
@pytest.mark.skipif(not FUSED["float32"], reason="the CPU kernels' float32 GEMM is not built")
def test_quantized_base_weights_take_the_deltas_after_their_kernel(tiny):
    """int8 weights (packed for the float32 step, or multiplied from their bytes eagerly): base
    rows as without LoRA, fused == eager, and the adapters' rows moved by their deltas."""
    _, _, dirs = tiny
    fused, eager = (runner(dirs[0], "float32", f, quantization="int8") for f in (True, False))
    got = run_steps(fused, with_slots(fused, tiny, torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(got, run_steps(eager, with_slots(eager, tiny,
                                                                                 torch.float32))))
    plain = run_steps(runner(dirs[0], "float32", True, quantization="int8"), None)
    for step, chunks in enumerate(steps()):
        assert torch.equal(rows_of(got[step], chunks, 0), rows_of(plain[step], chunks, 0))
        for i in range(1, 4):
            assert not torch.allclose(rows_of(got[step], chunks, i),
                                      rows_of(plain[step], chunks, i), atol=1e-3)


@needs_bank
@pytest.mark.parametrize("dtype", DTYPES)
def test_batches_routed_to_onednn_take_the_deltas_in_the_plain_column_order(tiny, monkeypatch,
                                                                           dtype):
    """From the rows routed to oneDNN, gate/up's product has its plain column order (bf16
    packs its blocks interleaved below them): fused == eager, base rows as without LoRA."""
    monkeypatch.setattr(linear_plan, "ONEDNN_TRIAL", "always")
    monkeypatch.setattr(routed, "dense_rows_from", lambda t: 16)
    _, _, dirs = tiny
    fused, eager, plain = (runner(dirs[0], dtype, f) for f in (True, False, True))
    got = run_steps(fused, with_slots(fused, tiny, getattr(torch, dtype)))  # 52 rows, then 4
    want = run_steps(eager, with_slots(eager, tiny, getattr(torch, dtype)))
    base = run_steps(plain, None)
    for step, chunks in enumerate(steps()):
        assert torch.equal(got[step], want[step]), step
        assert torch.equal(rows_of(got[step], chunks, 0), rows_of(base[step], chunks, 0))


@needs_bank
def test_slots_refuse_what_does_not_fit(tiny):
    hf, adapters, dirs = tiny
    r = runner(dirs[0], "float32", False)
    slots = LoRASlots(r.model, 2, ops)
    loras = module_loras(adapters[1], hf, torch.float32)
    with pytest.raises(ValueError, match="slot 2 outside"):
        slots.set_slot(2, loras)
    with pytest.raises(ValueError, match="layer 0 o: a LoRA of 96"):
        slots.set_slot(0, {(0, "o"): loras[0, "down"]})
    with pytest.raises(ValueError, match="no linear 'lm_head'"):
        slots.set_slot(0, {(0, "lm_head"): loras[0, "o"]})
    with pytest.raises(ValueError, match="slot 1 holds no adapter"):
        slots.set_step([(1, torch.arange(3))])
    slots.set_slot(1, {(1, "down"): loras[1, "down"]})
    assert slots.nbytes() == loras[1, "down"].nbytes()
    slots.set_step([(1, torch.arange(3))])
    assert slots.active
    slots.clear_slot(1)
    assert not slots.active and slots.nbytes() == 0
    assert COMMON["num_hidden_layers"] == 2
