"""Sampler: processor order and batching, warpers' allowed sets, grammar bitmasks, seeded
reproducibility, logprobs.

Random logits stand in for a model; each test runs in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stats_support import chi_square_p_value
from tokenmill.params import SamplingParams
from tokenmill.runner import logits_processors as processors_module
from tokenmill.runner.logits_processors import LogitBias, LogitsProcessor, Temperature
from tokenmill.runner.sampler import (
    Sampler, SamplingRow, apply_penalties, apply_top_k_top_p, default_processors, position_seed,
    process_logits, token_counts, unpack_bitmask)

VOCAB = 64
EOS = 3
GREEDY = SamplingParams(temperature=0.0)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(params: SamplingParams = GREEDY, seq_id: str = "r", output: list[int] | None = None,
        prompt: list[int] | None = None, seq_index: int = 0, stops: frozenset[int] | None = None,
        bitmask: torch.Tensor | None = None) -> SamplingRow:
    return SamplingRow(seq_id, params, prompt or [1, 2], output or [],
                       frozenset({EOS}) if stops is None else stops, seq_index, bitmask)


def rand_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0,
                device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * scale).to(device)


def draw(params: SamplingParams, logits_row: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """n unseeded draws from one logits row, as one batch of n identical rows."""
    out = Sampler(seed=seed)(logits_row.expand(n, -1).contiguous(),
                             [row(params, f"s{i}") for i in range(n)])
    return torch.tensor(out.token_ids)


def run_steps(sampler: Sampler, logits: torch.Tensor, target: SamplingRow, steps: int,
              others: Sequence[SamplingRow] = (), position: int = 0,
              device: str = "cpu") -> list[int]:
    """Sample `steps` tokens for `target` from logits[0], batched with `others` at `position`
    (the other rows get fresh random logits every step); the target's output grows with them."""
    tokens: list[int] = []
    at = position % (len(others) + 1)
    for step in range(steps):
        batch = list(others)
        batch.insert(at, replace(target, output_token_ids=[*target.output_token_ids, *tokens]))
        noise = rand_logits(len(batch), seed=100 + step, device=device)
        noise[at] = logits[0].to(device)
        tokens.append(sampler(noise, batch).token_ids[at])
    return tokens


# --- greedy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = rand_logits(8, device=device)
    out = Sampler()(logits, [row(seq_id=str(i)) for i in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_plain_greedy_batch_is_not_copied() -> None:
    logits = rand_logits(4)
    assert process_logits(logits, [row(seq_id=str(i)) for i in range(4)]) is logits


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 1e-3])
def test_temperature_to_zero_equals_greedy(temperature: float) -> None:
    logits = rand_logits(16)
    # A gap of 0.05 makes every other token less likely than exp(-50) at T=1e-3.
    logits[torch.arange(16), logits.argmax(-1)] += 0.05
    rows = [row(SamplingParams(temperature=temperature), str(i)) for i in range(16)]
    assert Sampler(seed=1)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = rand_logits(32, scale=0.5)  # flat: plain sampling would rarely pick the argmax
    rows = [row(SamplingParams(top_k=1), str(i)) for i in range(32)]
    assert Sampler(seed=2)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, VOCAB), [])
    assert out.token_ids == [] and out.logprobs == []


# --- processors: order, batching, skipping ---------------------------------------------------

def test_default_processor_order_is_the_documented_one() -> None:
    names = [p.name for p in default_processors()]
    assert names == ["logit_bias", "grammar_mask", "min_tokens", "penalties", "thinking_budget",
                     "temperature", "top_k_top_p", "min_p"]
    assert [p.name for p in Sampler().processors] == names


class Recording(LogitsProcessor):
    """Wraps a processor and records the rows it is applied to."""

    def __init__(self, inner: LogitsProcessor) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[list[str], list[int]]] = []  # (seq_ids, indices) per apply

    def rows(self, rows: Sequence[SamplingRow]) -> list[int]:
        return self.inner.rows(rows)

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
              indices: list[int]) -> torch.Tensor:
        self.calls.append(([r.seq_id for r in rows], indices))
        return self.inner.apply(logits, rows, indices)


def recorded_batch() -> dict[str, list[tuple[list[str], list[int]]]]:
    """Calls each default processor received for a mixed batch, by processor name."""
    recorders = [Recording(p) for p in default_processors()]
    rows = [row(SamplingParams(temperature=0.0, top_k=5, min_p=0.5, logit_bias={1: 2.0}), "g"),
            row(SamplingParams(temperature=0.7, top_p=0.9), "t"),
            row(SamplingParams(repetition_penalty=1.2, min_p=0.1), "p", output=[4]),
            row(SamplingParams(), "plain")]
    Sampler(seed=0, processors=recorders)(rand_logits(len(rows)), rows)
    return {r.name: r.calls for r in recorders}


def test_each_processor_gets_only_the_rows_that_use_it() -> None:
    calls = recorded_batch()
    assert calls["logit_bias"] == [(["g"], [0])]
    assert calls["penalties"] == [(["p"], [2])]
    assert calls["temperature"] == [(["t"], [1])]
    # The greedy row's top_k and min_p cannot change its argmax: it is not passed.
    assert calls["top_k_top_p"] == [(["t"], [1])]
    assert calls["min_p"] == [(["p"], [2])]


def test_processor_used_by_no_row_is_skipped() -> None:
    calls = recorded_batch()
    assert calls["grammar_mask"] == [] and calls["min_tokens"] == []


def test_skipped_processors_do_no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> torch.Tensor:
        raise AssertionError("applied to no rows")

    for cls in {type(p) for p in default_processors()} - {LogitBias}:
        monkeypatch.setattr(cls, "apply", fail)
    logits = rand_logits(2)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0, logit_bias={5: 100.0}), "a"),
                             row(GREEDY, "b")])
    assert out.token_ids == [5, int(logits[1].argmax())]


def test_default_sampling_batch_is_not_copied() -> None:
    logits = rand_logits(3)
    rows = [row(SamplingParams(), str(i)) for i in range(2)] + [row(GREEDY, "g")]
    assert process_logits(logits, rows) is logits


def test_greedy_rows_are_untouched_by_sampling_warpers() -> None:
    logits = rand_logits(2)
    greedy = SamplingParams(temperature=0.0, top_k=2, top_p=0.1, min_p=0.9)
    x = process_logits(logits, [row(greedy, "g"), row(SamplingParams(top_k=2), "s")])
    assert torch.equal(x[0], logits[0])
    assert torch.isfinite(x[1]).sum() == 2


def test_bias_comes_before_penalties() -> None:
    # Token 0 was generated: bias then penalty gives (2 + 2) / 2 = 2 < 2.5, so token 1 wins;
    # penalty then bias would give 2 / 2 + 2 = 3 and pick token 0.
    logits = torch.tensor([[2.0, 2.5, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 2.0})
    rows = [row(params, output=[0], prompt=[3], stops=frozenset())]
    assert process_logits(logits, rows)[0, 0] == 2.0
    assert Sampler()(logits, rows).token_ids == [1]


def test_bias_comes_before_temperature_and_a_custom_order_is_honoured() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    rows = [row(SamplingParams(temperature=0.5, logit_bias={0: 1.0}))]
    assert process_logits(logits, rows)[0, 0] == (1.0 + 1.0) / 0.5
    reversed_order = [Temperature(), LogitBias()]
    assert process_logits(logits, rows, reversed_order)[0, 0] == 1.0 / 0.5 + 1.0


def test_custom_processor_list() -> None:
    class BanToken(LogitsProcessor):
        name = "ban_token"

        def rows(self, rows: Sequence[SamplingRow]) -> list[int]:
            return [i for i, r in enumerate(rows) if r.seq_id.startswith("ban")]

        def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                  indices: list[int]) -> torch.Tensor:
            logits[indices, 7] = -math.inf
            return logits

    logits = rand_logits(2)
    logits[:, 7] = 100.0
    params = SamplingParams(temperature=0.0, logit_bias={7: -100.0})
    sampler = Sampler(processors=[BanToken()])  # no default processors: the bias is ignored
    assert [p.name for p in sampler.processors] == ["ban_token"]
    out = sampler(logits, [row(params, "ban-a"), row(params, "keep")]).token_ids
    assert out[0] == int(logits[0].topk(2).indices[1]) and out[1] == 7
    assert logits[0, 7] == 100.0  # the custom processor wrote a copy


# --- grammar bitmask --------------------------------------------------------------------------

def pack(allowed: set[int], words: int) -> torch.Tensor:
    """Reference packing, one bit at a time: (words,) int32, bit j of word i = token 32i + j."""
    values = [0] * words
    for t in allowed:
        values[t // 32] |= 1 << (t % 32)
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def words_for(vocab: int) -> int:
    return -(-vocab // 32)


def test_unpack_bitmask_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    sets = [set(torch.randperm(vocab, generator=gen)[:n].tolist()) for n in (1, 31, 64, 100)]
    sets.append({31, 63, 95})  # sign bits: the arithmetic shift must not leak into other bits
    unpacked = unpack_bitmask(torch.stack([pack(a, words_for(vocab)) for a in sets]), vocab)
    for i, allowed_ids in enumerate(sets):
        assert set(unpacked[i].nonzero().flatten().tolist()) == allowed_ids


def test_bitmask_constrains_greedy_rows() -> None:
    logits = rand_logits(1)
    allowed_ids = {5, 40, 63}
    out = Sampler()(logits, [row(bitmask=pack(allowed_ids, 2))])
    best = max(allowed_ids, key=lambda t: logits[0, t].item())
    assert out.token_ids == [best]


def test_bitmask_constrains_sampled_rows_and_leaves_others_alone() -> None:
    logits = rand_logits(1, scale=0.5)[0]
    allowed_ids = {0, 2, 17, 31, 32, 50, 63}
    n = 2000
    batch = logits.expand(n + 1, -1).contiguous()
    rows = [row(SamplingParams(), f"s{i}", bitmask=pack(allowed_ids, 2)) for i in range(n)]
    rows.append(row(GREEDY, "free"))
    out = Sampler(seed=0)(batch, rows).token_ids
    assert set(out[:n]) == allowed_ids  # never outside, and every allowed token turns up
    assert out[n] == int(logits.argmax())
    x = process_logits(batch[-2:], rows[-2:])
    assert torch.equal(x[1], logits)
    inside = torch.zeros(x.shape[1], dtype=torch.bool)
    inside[sorted(allowed_ids)] = True
    assert torch.equal(x[0][inside], logits[inside])  # allowed tokens untouched
    assert (x[0][~inside] <= torch.finfo(x.dtype).min / 2).all()  # the rest can never be drawn


def drawable(x: torch.Tensor) -> set[int]:
    """Tokens a processed row can still draw: a mask leaves the rest at or near the lowest
    float (or -inf)."""
    return set((x > torch.finfo(x.dtype).min / 2).nonzero().flatten().tolist())


@pytest.mark.parametrize("vocab", [37, 70, 95])
def test_bitmask_with_odd_vocab(vocab: int) -> None:
    logits = rand_logits(3, vocab=vocab)
    last = vocab - 1
    exact = pack({last, 32}, words_for(vocab))
    exact[-1] = -1  # bits past the vocab in the last word are ignored
    wide = torch.cat([pack({1}, words_for(vocab)), torch.full((2,), -1, dtype=torch.int32)])
    short = torch.full((1,), -1, dtype=torch.int32)  # covers tokens 0..31 only
    rows = [row(SamplingParams(), "a", bitmask=exact), row(GREEDY, "b", bitmask=wide),
            row(GREEDY, "c", bitmask=short)]
    x = process_logits(logits, rows)
    allowed_a = set(range(32 * (words_for(vocab) - 1), vocab)) | {32}
    assert drawable(x[0]) == allowed_a
    assert drawable(x[1]) == {1}
    assert drawable(x[2]) == set(range(32))
    assert Sampler()(logits, rows).token_ids[1:] == [1, int(logits[2, :32].argmax())]


@pytest.mark.parametrize("vocab, bitmask", [
    (64, torch.zeros(2, dtype=torch.int32)),
    (40, pack({45, 63}, 2)),  # only tokens past the vocab
    (64, torch.empty(0, dtype=torch.int32)),
])
def test_bitmask_allowing_nothing_raises(vocab: int, bitmask: torch.Tensor) -> None:
    rows = [row(GREEDY, "fine", bitmask=pack({1}, 2)), row(GREEDY, "req-7", bitmask=bitmask)]
    with pytest.raises(ValueError, match="req-7"):
        Sampler()(rand_logits(2, vocab=vocab), rows)


# --- warpers never leave their allowed set ----------------------------------------------------

def nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches p."""
    values, ids = probs.sort(descending=True)
    keep = int((values.cumsum(0) < p).sum().item()) + 1
    return set(ids[:keep].tolist())


def allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Reference allowed set for one row: top-k, then top-p on the renormalised rest, then min-p."""
    x = logits / params.temperature
    ids = torch.arange(x.numel())
    if params.top_k > 0:
        ids = x.topk(params.top_k).indices
    probs = x[ids].softmax(0)
    keep = nucleus(probs, params.top_p) if params.top_p < 1 else set(range(len(ids)))
    keep = {i for i in keep if probs[i] >= params.min_p * probs.max()}
    return {int(ids[i]) for i in keep}


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(top_p=0.9, temperature=0.7),
    SamplingParams(min_p=0.2), SamplingParams(top_k=10, top_p=0.6),
    SamplingParams(top_k=8, top_p=0.8, min_p=0.3, temperature=1.3),
])
def test_warpers_stay_in_allowed_set(params: SamplingParams) -> None:
    logits = rand_logits(1, seed=1, scale=1.0)[0]
    expected = allowed(logits, params)
    assert 1 < len(expected) < VOCAB  # the test means something
    seen = set(draw(params, logits, 3000).tolist())
    assert seen <= expected
    assert len(seen) >= len(expected) // 2  # and sampling actually spreads over it


@settings(max_examples=40, deadline=None, derandomize=True)  # CI sees the same cases
@given(top_k=st.integers(-1, VOCAB + 5), top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 1.0),
       temperature=st.floats(0.2, 2.0), seed=st.integers(0, 1000))
def test_warpers_property(top_k: int, top_p: float, min_p: float, temperature: float,
                          seed: int) -> None:
    params = SamplingParams(top_k=top_k if top_k < VOCAB else -1, top_p=top_p, min_p=min_p,
                            temperature=temperature)
    logits = rand_logits(1, seed=seed)[0]
    assert set(draw(params, logits, 200, seed=seed).tolist()) <= allowed(logits, params)


def test_top_k_top_p_helper_rows_are_independent() -> None:
    logits = rand_logits(3)
    masked = apply_top_k_top_p(logits.clone(), [2, -1, 0], [1.0, 1.0, 0.3])
    assert torch.isfinite(masked[0]).sum() == 2
    assert torch.equal(masked[1], logits[1])  # both off: untouched (even in the sorted path)
    kept = set(torch.isfinite(masked[2]).nonzero().flatten().tolist())
    assert kept == nucleus(logits[2].softmax(0), 0.3)


@pytest.mark.parametrize("top_p", [1e-46, 1e-320, 1e-45])  # 0 in float32, denormal, tiny
def test_top_p_that_rounds_to_zero_keeps_the_top_token(top_p: float) -> None:
    logits = rand_logits(2)
    masked = apply_top_k_top_p(logits.clone(), [-1, 5], [top_p, top_p])
    for row in range(2):
        kept = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert kept == [int(logits[row].argmax())]


@pytest.mark.parametrize("scale, ks, partial", [
    (4.0, [-1, 20, 500], True),  # peaked: the CPU partial top-k holds every cutoff
    (0.5, [-1, 20, 500], False),  # flat: row 0's nucleus is too wide, full sort
    (4.0, [-1, 20, 3000], False),  # a top-k past the partial prefix: full sort
])
def test_top_p_large_vocab_matches_reference(scale: float, ks: list[int], partial: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[bool] = []
    check = processors_module._holds_cutoffs

    def spy(*args: object) -> bool:  # records which path each call took
        held.append(check(*args))
        return held[-1]

    monkeypatch.setattr(processors_module, "_holds_cutoffs", spy)
    logits = rand_logits(3, vocab=8192, scale=scale)
    ps = [0.9, 0.8, 0.95]
    masked = apply_top_k_top_p(logits.clone(), ks, ps)
    assert held == [partial]
    for i, (k, p) in enumerate(zip(ks, ps)):
        expected = allowed(logits[i], SamplingParams(top_k=k, top_p=p))
        assert set(torch.isfinite(masked[i]).nonzero().flatten().tolist()) == expected


def test_top_k_top_p_cut_at_values_so_ties_do_not_depend_on_the_batch() -> None:
    # bf16-rounded logits are full of ties, as a bf16 model's are.
    logits = rand_logits(2, vocab=4096, scale=2.0).to(torch.bfloat16).float()
    alone = apply_top_k_top_p(logits[:1].clone(), [200], [0.7])  # partial top-k path
    batched = apply_top_k_top_p(logits.clone(), [200, -1], [0.7, 0.5])  # other paths
    assert torch.equal(alone[0], batched[0])
    kept = torch.isfinite(batched)
    for i in range(2):  # every token tied with the smallest kept logit is kept too
        assert torch.equal(kept[i], logits[i] >= logits[i][kept[i]].min())


def test_plain_sampling_matches_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    n = 4000
    probs = logits[0].softmax(0)
    for tokens in (draw(SamplingParams(), logits[0], n, seed=3),
                   seeded_draws(logits[0], n)):
        counts = torch.bincount(tokens, minlength=8).float()
        expected = probs * n
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def seeded_draws(logits_row: torch.Tensor, n: int) -> torch.Tensor:
    """One draw from each of n seeded sequences (the per-row generator path)."""
    rows = [row(SamplingParams(seed=1000 + i), f"q{i}") for i in range(n)]
    return torch.tensor(Sampler()(logits_row.expand(n, -1).contiguous(), rows).token_ids)


# --- logit bias, min_tokens, penalties --------------------------------------------------------

def test_logit_bias_forces_and_forbids() -> None:
    logits = rand_logits(2)
    top = int(logits[0].argmax())
    forced = SamplingParams(logit_bias={7: 100.0})
    forbid = SamplingParams(temperature=0.0, logit_bias={top: -100.0})
    assert Sampler(seed=0)(logits, [row(forced, "a"), row(forbid, "b")]).token_ids[0] == 7
    processed = process_logits(logits, [row(forced, "a"), row(forbid, "b")])
    assert processed[0, 7] == pytest.approx(logits[0, 7] + 100.0)
    assert processed[1, top] == pytest.approx(logits[1, top] - 100.0)


def test_logit_bias_forbids_greedy_argmax() -> None:
    logits = rand_logits(1)
    top = int(logits[0].argmax())
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0, logit_bias={top: -100.0}))])
    assert out.token_ids[0] != top
    assert out.token_ids[0] == int(logits[0].topk(2).indices[1])


def test_processing_does_not_write_callers_logits() -> None:
    logits = rand_logits(2)
    before = logits.clone()
    params = SamplingParams(logit_bias={1: 5.0}, repetition_penalty=1.5, min_tokens=2,
                            top_k=3, top_p=0.5, min_p=0.1, logprobs=2)
    Sampler()(logits, [row(params, "a"), row(GREEDY, "b")])
    assert torch.equal(logits, before)


def eos_favoured_logits() -> torch.Tensor:
    logits = rand_logits(1)
    logits[0, EOS] = 50.0
    logits[0, 9] = 40.0
    logits[0, 11] = 30.0
    return logits


# The caller resolves stop_token_ids (ignore_eos drops EOS from them): the sampler masks those.
@pytest.mark.parametrize("stops, expected", [({9, EOS}, 11), ({9}, EOS)])
def test_min_tokens_masks_stop_token_ids(stops: set[int], expected: int) -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2)
    logits = eos_favoured_logits()
    short = process_logits(logits, [row(params, output=[5], stops=frozenset(stops))])
    assert short[0, 9] == -math.inf
    assert bool(short[0, EOS] == -math.inf) is (EOS in stops)
    assert Sampler()(logits, [row(params, output=[5], stops=frozenset(stops))]).token_ids == \
        [expected]
    # Reached min_tokens: nothing is masked any more.
    done = row(params, output=[5, 6], stops=frozenset(stops))
    assert Sampler()(logits, [done]).token_ids == [EOS]
    assert process_logits(logits, [done]) is logits


def test_min_tokens_honours_each_rows_own_eos() -> None:
    logits = eos_favoured_logits().expand(2, -1).contiguous()
    params = SamplingParams(temperature=0.0, min_tokens=3)
    # Row b's request overrides EOS with token 9: EOS is an ordinary token for it.
    rows = [row(params, "a", output=[5]), row(params, "b", output=[5], stops=frozenset({9}))]
    x = process_logits(logits, rows)
    assert x[0, EOS] == -math.inf and x[0, 9] == logits[0, 9]
    assert x[1, 9] == -math.inf and x[1, EOS] == logits[1, EOS]
    assert Sampler()(logits, rows).token_ids == [9, EOS]


def test_no_min_tokens_masks_nothing() -> None:
    logits = eos_favoured_logits()
    assert Sampler()(logits, [row(SamplingParams(temperature=0.0))]).token_ids == [EOS]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0, 0.0, 3.0]])
    out = apply_penalties(logits, [[0, 1]], [[2, 2]], [2.0], [0.0], [0.0])
    # Prompt (0, 1) and output (2) tokens penalised once however often seen; 3..5 untouched.
    assert out.tolist() == [[1.0, -4.0, 2.0, -1.0, 0.0, 3.0]]
    assert logits[0, 0] == 2.0  # input unchanged


def test_presence_and_frequency_penalties_count_output_only() -> None:
    logits = torch.zeros(1, 6)
    out = apply_penalties(logits, [[0, 0, 1]], [[2, 2, 2, 3]], [1.0], [0.5], [0.25])
    assert out[0].tolist() == pytest.approx([0.0, 0.0, -0.5 - 3 * 0.25, -0.5 - 0.25, 0.0, 0.0])


def test_negative_penalties_reward() -> None:
    out = apply_penalties(torch.zeros(1, 4), [[]], [[1, 1]], [1.0], [-1.0], [-0.5])
    assert out[0].tolist() == [0.0, 2.0, 0.0, 0.0]


def test_penalties_only_touch_rows_that_ask() -> None:
    logits = rand_logits(3)
    rows = [row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4), "a", output=[7, 7]),
            row(GREEDY, "b", output=[7, 7]),
            row(SamplingParams(presence_penalty=1.0), "c", prompt=[5], output=[8])]
    x = process_logits(logits, rows)
    expected0 = apply_penalties(logits[:1], [[1, 2]], [[7, 7]], [1.3], [0.0], [0.4])
    assert torch.allclose(x[0], expected0[0])
    assert torch.equal(x[1], logits[1])
    assert x[2, 8] == pytest.approx(logits[2, 8] - 1.0)
    assert x[2, 5] == logits[2, 5]  # prompt tokens have no presence penalty
    assert torch.equal(torch.cat([x[2, :8], x[2, 9:]]), torch.cat([logits[2, :8], logits[2, 9:]]))


def test_token_counts_pads_ragged_rows() -> None:
    counts = token_counts([[1, 1, 3], [], [0]], 4, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


# --- seeds ------------------------------------------------------------------------------------

def flat_logits() -> torch.Tensor:
    return rand_logits(1, vocab=VOCAB, seed=7, scale=0.3)  # near-uniform: streams diverge fast


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_in_any_batch(device: str) -> None:
    target = row(SamplingParams(seed=42, top_p=0.95), "t")
    alone = run_steps(Sampler(), flat_logits(), target, 12, device=device)
    others = [row(SamplingParams(), f"u{i}") for i in range(5)]
    others += [row(SamplingParams(seed=42, temperature=0.8), "o1"), row(GREEDY, "g")]
    for position in (0, 3, 7):
        for batch in (others, others[:2], others[::-1]):
            assert run_steps(Sampler(seed=position), flat_logits(), target, 12, batch,
                             position, device) == alone


def test_unseeded_rows_do_not_disturb_seeded_rows() -> None:
    target = row(SamplingParams(seed=5), "t")
    crowd = [row(SamplingParams(), f"u{i}") for i in range(20)]
    assert run_steps(Sampler(), flat_logits(), target, 10, crowd, 4) == \
        run_steps(Sampler(), flat_logits(), target, 10)


def test_seq_index_gives_different_reproducible_streams() -> None:
    params = SamplingParams(seed=9, n=2)
    first = [run_steps(Sampler(), flat_logits(), row(params, f"r#{i}", seq_index=i), 16)
             for i in range(2)]
    again = [run_steps(Sampler(), flat_logits(), row(params, f"r#{i}", seq_index=i), 16)
             for i in range(2)]
    assert first == again
    assert first[0] != first[1]


def test_different_seeds_differ_and_unseeded_is_random() -> None:
    a = run_steps(Sampler(), flat_logits(), row(SamplingParams(seed=1)), 16)
    b = run_steps(Sampler(), flat_logits(), row(SamplingParams(seed=2)), 16)
    assert a != b
    c = run_steps(Sampler(), flat_logits(), row(SamplingParams()), 16)
    d = run_steps(Sampler(), flat_logits(), row(SamplingParams()), 16)
    assert c != d  # no sampler seed: nondeterministic


def test_rows_of_one_seeded_sequence_draw_by_position() -> None:
    # Speculative verification: k + 1 positions of one sequence, each with its output prefix.
    params = SamplingParams(seed=11)
    rows = [row(params, "t", output=[9] * i) for i in range(6)]
    others = [row(SamplingParams(), "u"), row(SamplingParams(seed=2), "v")]
    logits = flat_logits().expand(len(rows) + 2, -1).contiguous()
    first = Sampler(seed=0)(logits, rows + others).token_ids[:6]
    again = Sampler(seed=1)(logits, others[::-1] + rows).token_ids[2:]
    assert first == again
    assert len(set(first)) > 1
    # The same draws as six consecutive steps of that sequence, and as any split of them.
    assert first == run_steps(Sampler(), flat_logits(), rows[0], 6)
    assert first[3:] == Sampler()(logits[:3], rows[3:]).token_ids


def test_position_seeds_are_spread() -> None:
    seeds = {position_seed(s, p, k) for s in range(4) for p in range(64) for k in range(4)}
    assert len(seeds) == 4 * 64 * 4 and all(0 <= x < 2 ** 64 for x in seeds)


# --- speculative verification: the rejection rule ----------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=20),
                                    SamplingParams(seed=5)])
def test_rejection_rule_keeps_the_target_distribution(params: SamplingParams) -> None:
    """Drafts from a deliberately bad q, verified by the rule: tokens are distributed as p."""
    n = 20000
    target = rand_logits(1, seed=21, scale=2.0)[0]
    bad = rand_logits(1, seed=22, scale=2.0)[0]  # unrelated to the target
    q = bad.softmax(-1)
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    rows = [SamplingRow(f"s{i}", replace(params, seed=None if params.seed is None else i),
                        [1], [], frozenset(), draft_token=d, draft_probs=q)
            for i, d in enumerate(drafts)]
    out = torch.tensor(Sampler(seed=1)(target.expand(n, -1).contiguous(), rows).token_ids)
    # the target's distribution after its own processing (temperature, top-k)
    p = process_logits(target[None], rows[:1]).softmax(-1)[0] if not params.greedy else None
    counts = torch.bincount(out, minlength=VOCAB)
    assert chi_square_p_value(counts, p) > 1e-3
    accepted = (out == torch.tensor(drafts)).float().mean().item()
    assert accepted == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.02)


def test_rejection_rule_accepts_a_perfect_draft_and_rejects_an_impossible_one() -> None:
    logits = rand_logits(1, seed=3)[0]
    p = logits.softmax(-1)
    perfect = [SamplingRow(f"a{i}", SamplingParams(), [1], [], frozenset(), draft_token=t,
                           draft_probs=p) for i, t in enumerate(range(VOCAB))]
    out = Sampler(seed=0)(logits.expand(VOCAB, -1).contiguous(), perfect).token_ids
    assert out == list(range(VOCAB))  # q == p: always accepted
    banned = SamplingParams(logit_bias={7: -100.0})
    q = torch.zeros(VOCAB)
    q[7] = 1.0
    rows = [SamplingRow(f"b{i}", banned, [1], [], frozenset(), draft_token=7, draft_probs=q)
            for i in range(200)]
    out = Sampler(seed=0)(logits.expand(200, -1).contiguous(), rows).token_ids
    assert 7 not in out and len(set(out)) > 5


def test_greedy_rows_ignore_draft_distributions() -> None:
    logits = rand_logits(4, seed=8)
    q = torch.full((VOCAB,), 1.0 / VOCAB)
    rows = [SamplingRow(str(i), GREEDY, [1], [], frozenset(), draft_token=0, draft_probs=q)
            for i in range(4)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_seeded_verification_is_reproducible() -> None:
    logits = rand_logits(1, seed=9, scale=1.0)[0].expand(8, -1).contiguous()
    q = rand_logits(1, seed=10, scale=1.0)[0].softmax(-1)
    rows = [SamplingRow("t", SamplingParams(seed=3), [1], [5] * i, frozenset(), draft_token=i,
                        draft_probs=q) for i in range(8)]
    first = Sampler(seed=0)(logits, rows).token_ids
    assert Sampler(seed=1)(logits, rows).token_ids == first


def test_draft_draws_from_q_and_greedy_drafts_take_the_argmax() -> None:
    logits = rand_logits(1, seed=12, scale=1.5)[0]
    n = 20000
    rows = [row(SamplingParams(temperature=0.8), f"d{i}") for i in range(n)]
    tokens, probs = Sampler(seed=2).draft(logits.expand(n, -1).contiguous(), rows)
    q = (logits / 0.8).softmax(-1)
    assert torch.allclose(probs[0], q, atol=1e-6)
    assert chi_square_p_value(torch.bincount(torch.tensor(tokens), minlength=VOCAB), q) > 1e-3
    tokens, probs = Sampler().draft(logits[None], [row(GREEDY)])
    assert tokens == [int(logits.argmax())] and probs == [None]


# --- logprobs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_come_from_raw_logits(device: str) -> None:
    logits = rand_logits(3, device=device)
    params = [SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.5,
                             logit_bias={4: 3.0}),
              SamplingParams(logprobs=3, temperature=0.0, presence_penalty=2.0),
              SamplingParams(logprobs=None)]
    out = Sampler(seed=4)(logits, [row(p, str(i), output=[4, 5]) for i, p in enumerate(params)])
    raw = logits.cpu().log_softmax(-1)
    for i, n in ((0, 5), (1, 3)):
        lp = out.logprobs[i]
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        assert len(lp.top) == n
        assert [t for t, _ in lp.top] == raw[i].topk(n).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(raw[i].topk(n).values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert out.logprobs[2] is None


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    logits = rand_logits(1)
    out = Sampler(seed=0)(logits, [row(SamplingParams(logprobs=0))])
    lp = out.logprobs[0]
    assert lp.top == [] and lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(logits[0].log_softmax(0)[lp.token_id].item(), abs=1e-5)


def test_greedy_logprob_rank_is_one() -> None:
    logits = rand_logits(4)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=1), str(i))
                             for i in range(4)])
    assert all(lp.rank == 1 and lp.top[0][0] == lp.token_id for lp in out.logprobs)


# --- mixed batches ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_sampled_rows(device: str) -> None:
    logits = rand_logits(6, device=device)
    rows = [row(GREEDY, "g0"), row(SamplingParams(top_k=2), "k"), row(GREEDY, "g1"),
            row(SamplingParams(seed=8), "s"), row(SamplingParams(top_k=1, seed=1), "k1"),
            row(SamplingParams(temperature=1e-6), "g2")]
    out = Sampler(seed=0)(logits, rows).token_ids
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 4, 5)] == [argmax[i] for i in (0, 2, 4, 5)]
    assert out[1] in logits[1].topk(2).indices.tolist()
    alone = Sampler()(logits[3:4], [row(SamplingParams(seed=8), "s")]).token_ids[0]
    assert out[3] == alone


def test_tied_logprobs_list_the_greedy_token_first():
    """bf16 logits tie often; argmax takes the lowest id, and the top list orders ties so."""
    from tokenmill.runner.sampler import compute_logprobs

    logits = torch.tensor([[0.0, 1.0, 3.0, 1.0, 0.5, 3.0, 3.0]])
    token = logits.argmax(dim=-1)
    assert token.item() == 2
    (lp,) = compute_logprobs(logits, token, [3])
    assert [t for t, _ in lp.top] == [2, 5, 6]
    assert lp.rank == 3  # vLLM's rank: ties count against the token


# --- seeded rows drawn in one batch (the GPU's way) ---------------------------------------------

def test_hashed_uniform_is_splitmix64_of_seed_and_column() -> None:
    from tokenmill.runner.sampler import _signed, hashed_uniform

    def reference(seed: int, j: int) -> float:  # the unsigned 64-bit arithmetic, in Python
        mask = (1 << 64) - 1
        z = (seed + j * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        return ((z >> 41) * 2 + 1) / (1 << 24)

    seeds = [0, 5, (1 << 64) - 7, position_seed(3, 10, 1)]
    u = hashed_uniform(torch.tensor([_signed(s) for s in seeds]), 2000)
    for r, seed in enumerate(seeds):
        for j in (0, 1, 999, 1999):
            assert u[r, j].item() == reference(seed, j + 1)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.std().item() - 12 ** -0.5) < 0.01


def test_hashed_seeds_draw_by_position_in_any_batch() -> None:
    sampler = lambda seed=None: Sampler(seed=seed, hashed_seeds=True)  # noqa: E731
    target = row(SamplingParams(seed=42, top_p=0.95), "t")
    alone = run_steps(sampler(), flat_logits(), target, 12)
    assert len(set(alone)) > 1
    others = [row(SamplingParams(), "u"), row(SamplingParams(seed=42, temperature=0.8), "o"),
              row(GREEDY, "g")]
    for position in (0, 2):
        assert run_steps(sampler(position), flat_logits(), target, 12, others,
                         position) == alone
    assert run_steps(sampler(), flat_logits(), row(SamplingParams(seed=43), "t"), 12) != alone
    # speculative rows of one sequence: the same draws as consecutive steps
    rows = [row(SamplingParams(seed=11), "s", output=[9] * i) for i in range(6)]
    logits = flat_logits().expand(6, -1).contiguous()
    assert sampler()(logits, rows).token_ids == run_steps(sampler(), flat_logits(), rows[0], 6)


def test_hashed_seeded_draws_match_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    n = 4000
    rows = [row(SamplingParams(seed=1000 + i), f"q{i}") for i in range(n)]
    tokens = torch.tensor(Sampler(hashed_seeds=True)(logits.expand(n, -1).contiguous(),
                                                      rows).token_ids)
    expected = logits[0].softmax(0) * n
    counts = torch.bincount(tokens, minlength=8).float()
    assert ((counts - expected) ** 2 / expected).sum().item() < 24.3  # chi-square, p = 0.001
