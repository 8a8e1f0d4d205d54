"""Sampler: processing order, warpers' allowed sets, seeded reproducibility, logprobs.

Random logits stand in for a model; each test runs in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.params import SamplingParams
from tokenmill.runner import sampler as sampler_module
from tokenmill.runner.sampler import (
    Sampler, SamplingRow, apply_penalties, apply_top_k_top_p, process_logits, token_counts)

VOCAB = 64
EOS = 3
GREEDY = SamplingParams(temperature=0.0)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(params: SamplingParams = GREEDY, seq_id: str = "r", output: list[int] | None = None,
        prompt: list[int] | None = None, seq_index: int = 0) -> SamplingRow:
    return SamplingRow(seq_id, params, prompt or [1, 2], output or [], frozenset({EOS}), seq_index)


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
    (the other rows get fresh random logits every step)."""
    tokens = []
    at = position % (len(others) + 1)
    for step in range(steps):
        batch = list(others)
        batch.insert(at, target)
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


@pytest.mark.parametrize("scale, ks, partial", [
    (4.0, [-1, 20, 500], True),  # peaked: the CPU partial top-k holds every cutoff
    (0.5, [-1, 20, 500], False),  # flat: row 0's nucleus is too wide, full sort
    (4.0, [-1, 20, 3000], False),  # a top-k past the partial prefix: full sort
])
def test_top_p_large_vocab_matches_reference(scale: float, ks: list[int], partial: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[bool] = []
    check = sampler_module._holds_cutoffs

    def spy(*args: object) -> bool:  # records which path each call took
        held.append(check(*args))
        return held[-1]

    monkeypatch.setattr(sampler_module, "_holds_cutoffs", spy)
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


@pytest.mark.parametrize("ignore_eos, expected", [(False, 11), (True, EOS)])
def test_min_tokens_masks_eos_and_stop_ids(ignore_eos: bool, expected: int) -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9],
                            ignore_eos=ignore_eos)
    logits = eos_favoured_logits()
    short = process_logits(logits, [row(params, output=[5])])
    assert short[0, 9] == -math.inf
    assert (short[0, EOS] == -math.inf) is not ignore_eos
    assert Sampler()(logits, [row(params, output=[5])]).token_ids == [expected]
    # Reached min_tokens: nothing is masked any more.
    assert Sampler()(logits, [row(params, output=[5, 6])]).token_ids == [EOS]
    assert torch.equal(process_logits(logits, [row(params, output=[5, 6])]), logits)


def test_ignore_eos_alone_does_not_mask_eos() -> None:
    logits = eos_favoured_logits()
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    assert Sampler()(logits, [row(params)]).token_ids == [EOS]


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


def test_forget_restarts_the_stream() -> None:
    sampler = Sampler()
    target = row(SamplingParams(seed=3), "t")
    first = run_steps(sampler, flat_logits(), target, 6)
    continued = run_steps(sampler, flat_logits(), target, 6)
    sampler.forget(["t", "never-seen"])
    assert continued != first
    assert run_steps(sampler, flat_logits(), target, 6) == first


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
