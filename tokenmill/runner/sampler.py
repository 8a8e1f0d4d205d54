"""The sampler: one token per sequence from the logits of one step.

Per row, in this order (vLLM / HF semantics):

    raw logits ──► log_softmax ──────────────────────────────► logprobs ("raw" mode)
        │
        ├─ + logit_bias
        ├─ min_tokens: EOS (unless ignore_eos) and stop_token_ids -> -inf
        ├─ repetition penalty (prompt + output), presence / frequency penalties (output)
        ├─ greedy rows: argmax
        └─ sampled rows: / temperature -> top-k -> top-p -> min-p -> softmax
                         -> argmax(probs / Exponential(1))   (no multinomial, no host sync)

The caller's logits tensor is never written: processing happens on a copy, made only when
some row needs bias, masking or penalties (a plain greedy batch is a single argmax).

Randomness: a row whose ``params.seed`` is set draws from its own ``torch.Generator`` seeded
with ``seed + seq_index`` and kept per ``seq_id`` until ``forget``; so its tokens do not depend
on which other rows share the batch, or where. Unseeded rows share one generator.
"""

from __future__ import annotations

import array
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.params import SamplingParams

_U64 = (1 << 64) - 1  # torch.Generator.manual_seed takes seeds modulo 2**64
# Candidates a CPU top-p looks at before falling back to sorting the whole vocab.
_NUCLEUS_CANDIDATES = 1024
# Exponential(1) draws this close to 0 would turn probs / q into inf or nan.
_MIN_NOISE = 1e-20


@dataclass
class SamplingRow:
    """What the sampler needs of one sequence that samples this step."""

    seq_id: str  # stable id of the sequence ("req-1" or "req-1#2"): keys its seeded generator
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far, before this step's token
    eos_token_ids: frozenset[int]  # masked while fewer than min_tokens were generated
    seq_index: int = 0  # index within an n > 1 group: offsets the seed


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw model logits
    rank: int  # 1 = most likely; ties count against it, as in vLLM
    top: list[tuple[int, float]]  # top-N (token_id, logprob), most likely first; N = logprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


class Sampler:
    """Picks one token per row; holds the random generators (and nothing else) between steps."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed  # of the generator shared by unseeded rows; None: nondeterministic
        self._shared: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """``logits``: (len(rows), vocab) float32, one row per sequence, left unmodified."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if not rows:
            return SamplerOutput([], [])
        logits = logits.float()
        tokens = self._choose(process_logits(logits, rows), rows)
        logprobs = compute_logprobs(logits, tokens, [r.params.logprobs for r in rows])
        return SamplerOutput(tokens.tolist(), logprobs)

    def forget(self, seq_ids: Iterable[str]) -> None:
        """Drop the generators of finished or aborted sequences."""
        for seq_id in seq_ids:
            self._seeded.pop(seq_id, None)

    def _choose(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not sampled:
            return x.argmax(dim=-1)
        if len(sampled) == len(rows):
            return self._sample(x, rows)
        tokens = x.argmax(dim=-1)
        idx = torch.tensor(sampled, device=x.device)
        tokens[idx] = self._sample(x[idx], [rows[i] for i in sampled])
        return tokens

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Sample the (non-greedy) rows of ``x``; ``x`` itself is not written."""
        params = [r.params for r in rows]
        x = apply_temperature(x, [p.temperature for p in params])  # a new tensor from here on
        apply_top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])
        apply_min_p(x, [p.min_p for p in params])
        probs = x.softmax(dim=-1)
        # argmax(p / q) with q ~ Exp(1) is a draw from p (the exponential race), with no sync.
        return probs.div_(self._noise(probs, rows)).argmax(dim=-1)

    def _noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        q = torch.empty_like(probs)
        seeded = [(i, r) for i, r in enumerate(rows) if r.params.seed is not None]
        if len(seeded) < len(rows):
            # Seeded rows are overwritten below; drawing them here too keeps this one kernel.
            exponential_(q, self._shared_generator(probs.device))
        for i, row in seeded:
            exponential_(q[i], self._row_generator(row, probs.device))
        return q.clamp_min_(_MIN_NOISE)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed & _U64)
            self._shared[device] = gen
        return gen

    def _row_generator(self, row: SamplingRow, device: torch.device) -> torch.Generator:
        gen = self._seeded.get(row.seq_id)
        if gen is None:
            # seed + seq_index: the n sequences of a seeded request differ, reproducibly.
            gen = torch.Generator(device=device)
            gen.manual_seed((row.params.seed + row.seq_index) & _U64)
            self._seeded[row.seq_id] = gen
        return gen


def exponential_(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill ``t`` in place with Exponential(1) draws.

    On CPU ``-log(U)`` is about 3x faster than torch's ``exponential_``; on CUDA the fused
    kernel wins. Either is an exact Exp(1) draw, but the streams differ, so a seed gives
    different tokens on CPU and on CUDA (as it does for any sampler).
    """
    if t.device.type == "cpu":
        return t.uniform_(generator=generator).log_().neg_()
    return t.exponential_(generator=generator)


# --- logits processing (before the greedy / sampled split) ---------------------------------

def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Logit bias, min_tokens masking and penalties, applied to a copy of ``logits``.

    Returns ``logits`` itself (not a copy) when no row asks for any of them.
    """
    vocab = logits.shape[-1]
    bias_rows, bias_ids, bias_values = _bias_entries(rows, vocab)
    ban_rows, ban_ids = _min_tokens_entries(rows, vocab)
    penalised = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
    if not (bias_rows or ban_rows or penalised):
        return logits
    x = logits.clone()
    if bias_rows:
        values = torch.tensor(bias_values, dtype=x.dtype, device=x.device)
        x.index_put_((_long(bias_rows, x), _long(bias_ids, x)), values, accumulate=True)
    if ban_rows:
        x[_long(ban_rows, x), _long(ban_ids, x)] = -math.inf
    if penalised:
        _penalise_rows(x, [rows[i] for i in penalised], penalised)
    return x


def _bias_entries(rows: Sequence[SamplingRow],
                  vocab: int) -> tuple[list[int], list[int], list[float]]:
    """(row, token, bias) triples; ids past the logits' width cannot be sampled, so are skipped."""
    r: list[int] = []
    t: list[int] = []
    v: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias.items():
            if token_id < vocab:
                r.append(i)
                t.append(token_id)
                v.append(float(bias))
    return r, t, v


def _min_tokens_entries(rows: Sequence[SamplingRow], vocab: int) -> tuple[list[int], list[int]]:
    """(row, token) pairs to mask: stop tokens of rows still short of min_tokens."""
    r: list[int] = []
    t: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) if p.ignore_eos else {*p.stop_token_ids, *row.eos_token_ids}
        ids = [tok for tok in stops if tok < vocab]
        r.extend([i] * len(ids))
        t.extend(ids)
    return r, t


def _has_penalties(p: SamplingParams) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0)


def _penalise_rows(x: torch.Tensor, rows: Sequence[SamplingRow], indices: list[int]) -> None:
    """Apply penalties in place to rows ``indices`` of ``x`` (``rows`` are their descriptions)."""
    whole = len(indices) == x.shape[0]
    idx = None if whole else _long(indices, x)
    sub = x if whole else x[idx]
    penalised = apply_penalties(
        sub, [r.prompt_token_ids for r in rows], [r.output_token_ids for r in rows],
        [r.params.repetition_penalty for r in rows], [r.params.presence_penalty for r in rows],
        [r.params.frequency_penalty for r in rows])
    if whole:
        x.copy_(penalised)
    else:
        x[idx] = penalised


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]], repetition: Sequence[float],
                    presence: Sequence[float], frequency: Sequence[float]) -> torch.Tensor:
    """Penalised copy of ``logits`` (rows, vocab); the other arguments hold one entry per row.

    Repetition (CTRL / HF): a token seen in prompt or output has its logit divided by the
    penalty when positive, multiplied when negative. Presence / frequency (OpenAI): over the
    output only, subtract ``presence * (count > 0) + frequency * count``.
    """
    vocab = logits.shape[-1]
    out_counts = token_counts(output_ids, vocab, logits.device, logits.dtype)
    x = logits
    if any(p != 1.0 for p in repetition):
        seen = (token_counts(prompt_ids, vocab, logits.device, logits.dtype) + out_counts) > 0
        rep = _column(repetition, logits)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(p != 0.0 for p in presence) or any(f != 0.0 for f in frequency):
        present = (out_counts > 0).to(logits.dtype)
        x = x - _column(frequency, logits) * out_counts - _column(presence, logits) * present
    return x.clone() if x is logits else x


def token_counts(token_ids: Sequence[Sequence[int]], vocab: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(rows, vocab) occurrence counts, by one scatter_add over a padded id tensor."""
    # Padding points at an extra column `vocab`, cut off at the end.
    counts = torch.zeros(len(token_ids), vocab + 1, dtype=dtype, device=device)
    padded = _padded_ids(token_ids, vocab)
    if padded is not None:
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=dtype))
    return counts[:, :vocab]


def _padded_ids(token_ids: Sequence[Sequence[int]], pad: int) -> torch.Tensor | None:
    """(rows, longest) int64 CPU tensor, short rows filled with ``pad``; None if all are empty.

    Built through one array.array: several times faster than torch.tensor on nested lists,
    which matters with long prompts in a large batch.
    """
    width = max((len(ids) for ids in token_ids), default=0)
    if width == 0:
        return None
    buf = array.array("q")
    for ids in token_ids:
        buf.extend(ids)
        buf.extend([pad] * (width - len(ids)))
    return torch.frombuffer(buf, dtype=torch.long).view(len(token_ids), width)


# --- sampling warpers (sampled rows only; each masks in place and returns its input) --------

def apply_temperature(logits: torch.Tensor, temperature: Sequence[float]) -> torch.Tensor:
    """``logits / temperature`` per row, as a new tensor."""
    return logits / _column(temperature, logits)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int],
                      top_p: Sequence[float]) -> torch.Tensor:
    """Mask to -inf, in place, tokens outside each row's top-k, then outside its nucleus.

    Top-p keeps the most likely tokens until their (top-k renormalised) mass reaches p, so the
    most likely token always stays. top_k <= 0 or >= vocab and top_p >= 1 are off.

    Both cut at a logit value, not at a position in a sort: tokens tied with the last kept one
    are kept too. So the mask depends only on the row's values, never on how a sort ordered
    ties or on which path (full sort, partial top-k) the rest of the batch asked for; that is
    what keeps a seeded sequence reproducible in any batch.
    """
    ks = _effective_k(top_k, logits.shape[-1])
    use_p = any(p < 1.0 for p in top_p)
    if not use_p and max(ks) == 0:
        return logits
    ordered = _descending(logits, ks, top_p if use_p else None)
    cutoff = _kth_value(ordered, ks)
    if use_p:
        cutoff = torch.maximum(cutoff, _nucleus_cutoff(logits, ordered, cutoff, top_p))
    return logits.masked_fill_(logits < cutoff, -math.inf)


def _effective_k(top_k: Sequence[int], vocab: int) -> list[int]:
    return [k if 0 < k < vocab else 0 for k in top_k]  # 0: off


def _descending(logits: torch.Tensor, ks: list[int],
                top_p: Sequence[float] | None) -> torch.Tensor:
    """The largest logits of each row, sorted: enough of them to find every row's cutoff."""
    if top_p is None or min(ks) > 0:
        return logits.topk(max(ks), dim=-1).values  # every cutoff lies within the max-k largest
    if logits.device.type == "cpu" and logits.shape[-1] >= 4 * _NUCLEUS_CANDIDATES:
        # A full sort dominates a CPU step; a partial top-k usually holds the nucleus. Checking
        # that costs a host sync, which is free on CPU (on CUDA the sort is cheap instead).
        values = logits.topk(_NUCLEUS_CANDIDATES, dim=-1).values
        if _holds_cutoffs(logits, values, ks, top_p):
            return values
    return logits.sort(dim=-1, descending=True).values


def _holds_cutoffs(logits: torch.Tensor, values: torch.Tensor, ks: list[int],
                   top_p: Sequence[float]) -> bool:
    """Whether the sorted prefix ``values`` reaches every row's top-k or top-p cutoff."""
    mass = (values.logsumexp(dim=-1) - logits.logsumexp(dim=-1)).exp()
    k = _long(ks, logits)
    p = torch.tensor(top_p, dtype=mass.dtype)
    # A top-k past the prefix needs its k-th value (it normalises the nucleus): not held.
    # The margin covers rounding in `mass`; falling back to a full sort is always correct.
    k_held = (k > 0) & (k <= values.shape[-1])
    p_held = (k == 0) & (p < 1.0) & (mass >= p + 1e-3)
    return bool((k_held | p_held).all())


def _kth_value(descending: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """(rows, 1): the k-th largest value per row, -inf for rows with top-k off (k == 0)."""
    k = _long(ks, descending)
    kth = descending.gather(-1, (k - 1).clamp_min(0).unsqueeze(-1))
    return kth.masked_fill_((k == 0).unsqueeze(-1), -math.inf)


def _nucleus_cutoff(logits: torch.Tensor, descending: torch.Tensor, k_cutoff: torch.Tensor,
                    top_p: Sequence[float]) -> torch.Tensor:
    """(rows, 1): the smallest logit of each row's nucleus among its top-k survivors.

    ``descending`` may be only a sorted prefix of each row, so probabilities are normalised by
    the whole row's (top-k masked) logsumexp rather than by a softmax over the prefix.
    """
    lse = logits.masked_fill(logits < k_cutoff, -math.inf).logsumexp(dim=-1, keepdim=True)
    survivors = descending.masked_fill(descending < k_cutoff, -math.inf)
    mass = (survivors - lse).exp().cumsum(dim=-1)
    mass_before = torch.nn.functional.pad(mass[:, :-1], (1, 0))  # 0 for the top token
    # p >= 1 becomes 2: cumsum rounding must not cut far-tail tokens of a row with top-p off.
    p = _column([q if q < 1.0 else 2.0 for q in top_p], logits)
    kept = (mass_before < p).sum(dim=-1, keepdim=True)  # a prefix: mass_before never decreases
    return descending.gather(-1, kept - 1)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Mask to -inf, in place, tokens with p < min_p * p_max.

    Compared in logit space: p_i / p_max = exp(x_i - x_max), so no softmax is needed.
    """
    if not any(m > 0.0 for m in min_p):
        return logits
    log_min_p = _column([math.log(m) if m > 0.0 else -math.inf for m in min_p], logits)
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p
    return logits.masked_fill_(logits < threshold, -math.inf)


# --- logprobs ------------------------------------------------------------------------------

def compute_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Logprobs of the chosen tokens under the raw model logits (before any processing).

    ``num_top[i]`` is row i's ``params.logprobs``: None for no logprobs, else the top-N size.
    Host syncs are per batch (a few ``tolist``), not per row.
    """
    wanted = [i for i, n in enumerate(num_top) if n is not None]
    result: list[TokenLogprobs | None] = [None] * len(num_top)
    if not wanted:
        return result
    idx = _long(wanted, raw_logits)
    lp = raw_logits[idx].float().log_softmax(dim=-1)  # (wanted, vocab)
    chosen = token_ids[idx].unsqueeze(-1)
    chosen_lp = lp.gather(-1, chosen)
    ranks = (lp >= chosen_lp).sum(dim=-1)  # vLLM's rank: ties count against the token
    max_n = max(num_top[i] for i in wanted)
    top_lp, top_ids = lp.topk(max_n, dim=-1)  # sorted, most likely first
    rows = zip(wanted, chosen.squeeze(-1).tolist(), chosen_lp.squeeze(-1).tolist(),
               ranks.tolist(), top_ids.tolist(), top_lp.tolist())
    for i, token, logprob, rank, ids, lps in rows:
        n = num_top[i]
        result[i] = TokenLogprobs(token, logprob, rank, list(zip(ids[:n], lps[:n])))
    return result


# --- small tensor helpers ------------------------------------------------------------------

def _long(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """(rows, 1) tensor that broadcasts one value per row across the vocab."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(-1)
