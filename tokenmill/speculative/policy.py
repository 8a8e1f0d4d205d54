"""How many tokens to draft, per sequence and step: from the measured acceptance of each
sequence and the measured cost of a step, so speculation runs only where it pays.

A sequence gains g_1 + ... + g_k tokens from k drafts, g_j the chance that its first j drafts
are all accepted (``AcceptanceTracker.gains``). Every draft adds a token to the target's forward
(and, for a model drafter, to its rounds). The policy picks the drafts that maximise the tokens
per second the step keeps:

    rate(drafts) = (T + sum of the chosen gains)
                   / (t_target(T + #drafts) + t_draft(rounds, #drafts))

where T is the step's tokens without drafts: the running sequences' (one per decode, the rest
of a prompt in progress) and the prompt tokens of the waiting requests the step would admit
after them. Every one of those is work the server has to do, an output token or a prompt token
alike. Drafts are scheduled before any prompt, so a draft past the token budget
(``token_budget - T``) would push a prompt token out of the step: one token of work for less
than one expected, which never pays. Drafts only fill the room the budget leaves, and a step
the waiting queue fills drafts nothing. Gains shrink with j, so the best set for a given number
of drafts takes the largest gains; the policy tries every number (and, for a drafter, every
number of rounds) and keeps the best, which is none at all when a large batch makes extra
tokens expensive or acceptance is poor.

The target's step time is measured per token count (``StepCost``: a running average for every
count seen, straight lines between them), because its shape is not a line: on a CPU a forward of
2-8 tokens can cost far more than one token more each (the 1-row matmul is memory-bound, a few
rows are not) and then flatten. One step in ``probe_every`` drafts a cycling cap instead of the
best choice, so the counts the policy does not pick keep being measured. A drafter's rounds are
a line fitted to its forwards. Acceptance is counted per sequence, starting from the running
average of all sequences.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np


class LinearCost:
    """seconds ~ a + b * tokens, least squares over samples decayed by ``decay`` each."""

    def __init__(self, decay: float = 0.98, a: float = 0.0, b: float = 0.0) -> None:
        self.decay = decay
        self.a, self.b = a, b  # current fit (the prior until there is spread to fit)
        self._s = np.zeros(5)  # weight, sum x, sum y, sum x^2, sum x*y

    def add(self, tokens: int, seconds: float) -> None:
        self._s *= self.decay
        self._s += (1.0, tokens, seconds, tokens * tokens, tokens * seconds)
        w, sx, sy, sxx, sxy = self._s
        var = sxx / w - (sx / w) ** 2
        if var > 1.0:  # token counts spread enough to separate slope from intercept
            b = (sxy / w - sx * sy / w / w) / var
            self.b = max(b, 0.0)
            self.a = max(sy / w - self.b * sx / w, 0.0)
        elif self.b == 0.0:  # no spread yet: the mean
            self.a = sy / w

    def __call__(self, tokens: float) -> float:
        return self.a + self.b * tokens


class StepCost:
    """Seconds of a step by its token count: a running average (weight ``alpha`` for the newest)
    per count measured, straight lines between measured counts, and beyond them the slope of
    a line fitted to all steps."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.line = LinearCost()
        self._avg: dict[int, float] = {}
        self._table: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, tokens: int, seconds: float) -> None:
        self.line.add(tokens, seconds)
        old = self._avg.get(tokens)
        self._avg[tokens] = seconds if old is None else old + self.alpha * (seconds - old)
        self._table = None

    @property
    def fitted(self) -> bool:
        return len(self._avg) >= 2

    def __call__(self, tokens):
        """Seconds for ``tokens`` (a number or an array of them)."""
        if self._table is None:
            xs = np.array(sorted(self._avg), dtype=np.float64)
            self._table = xs, np.array([self._avg[int(x)] for x in xs])
        xs, ys = self._table
        t = np.asarray(tokens, dtype=np.float64)
        b = self.line.b
        out = np.interp(t, xs, ys)
        out = np.where(t > xs[-1], ys[-1] + b * (t - xs[-1]), out)
        out = np.where(t < xs[0], np.maximum(ys[0] - b * (xs[0] - t), 0.0), out)
        return float(out) if out.ndim == 0 else out


class AcceptanceTracker:
    """How likely drafts are accepted: per sequence for its first draft, and over all sequences
    for each later draft given the one before it was accepted.

    Drafts of one run are not independent: an n-gram match that was right once tends to be
    right for a while, so a draft after an accepted one is accepted more often than a first
    draft. A sequence's expected gain from draft j is its first-draft rate times the conditional
    rates of positions 2..j. One verification of n drafts of which m were accepted tries
    positions 1..min(m + 1, n) and succeeds at 1..m.

    Every step forgets a little (``step``): a sequence's own counts fade within a few steps (a
    sequence that moves from copying to free text is noticed, and one that stopped drafting
    returns to the average and is tried again), and the averages over all sequences drift back
    to their start (0.5) over a few hundred steps without news, so a method switched off by a
    bad spell is tried again later. A sequence starts from the average first-draft rate,
    counted as ``prior_weight`` tries.
    """

    def __init__(self, max_k: int, decay: float = 0.9, prior_weight: float = 2.0,
                 global_decay: float = 0.995) -> None:
        self.decay, self.prior_weight, self.global_decay = decay, prior_weight, global_decay
        self._seq: dict[str, list[float]] = {}  # seq_id -> first drafts [accepted, tried]
        self._pos = np.tile([1.0, 2.0], (max_k, 1))  # per position: [accepted, tried]

    @property
    def overall(self) -> float:
        """The first-draft rate over all sequences."""
        return float(self._pos[0, 0] / self._pos[0, 1])

    def rate(self, seq_id: str) -> float:
        """The sequence's first-draft acceptance."""
        s, t = self._seq.get(seq_id, (0.0, 0.0))
        w = self.prior_weight
        return (s + w * self.overall) / (t + w)

    def gains(self, seq_ids: Sequence[str]) -> np.ndarray:
        """(len(seq_ids), max_k): expected accepted tokens from each draft position."""
        first = np.array([self.rate(s) for s in seq_ids])
        later = self._pos[1:, 0] / self._pos[1:, 1]
        return first[:, None] * np.concatenate([[1.0], np.cumprod(later)])[None, :]

    def step(self, seq_ids: Iterable[str]) -> None:
        """A step went by for these sequences."""
        for seq_id in seq_ids:
            counts = self._seq.get(seq_id)
            if counts is not None:
                counts[0] *= self.decay
                counts[1] *= self.decay
        g = self.global_decay
        self._pos = self._pos * g + np.array([1.0, 2.0]) * (1 - g)

    def record(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        counts = self._seq.setdefault(seq_id, [0.0, 0.0])
        counts[0] += num_accepted > 0
        counts[1] += 1
        tried = min(num_accepted + 1, num_drafts, len(self._pos))
        self._pos[:tried, 1] += 1
        self._pos[:min(num_accepted, len(self._pos)), 0] += 1

    def forget(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._seq.pop(seq_id, None)


class AdaptivePolicy:
    """Chooses k per sequence (0 to ``max_k``) for one step; see the module docstring.
    ``token_budget``: the most tokens a step computes (None: no bound)."""

    def __init__(self, max_k: int, drafter: bool, adaptive: bool = True,
                 probe_every: int | None = None, token_budget: int | None = None) -> None:
        self.max_k = max_k
        self.drafter = drafter  # a model drafts: rounds cost time of their own
        self.adaptive = adaptive
        # A drafter's probe costs its rounds and a catch-up on every token since it last
        # drafted (a few forwards of the draft model): rarer than an n-gram's, which is free.
        self.probe_every = probe_every or (256 if drafter else 32)
        self.token_budget = math.inf if token_budget is None else token_budget
        self.acceptance = AcceptanceTracker(max_k)
        self.target_cost = StepCost()
        self.draft_cost = LinearCost()
        self._steps = 0

    def choose(self, seq_ids: Sequence[str], num_tokens: int, *, waiting_tokens: int = 0,
               limits: Mapping[str, int] | None = None) -> dict[str, int]:
        """k per sequence of ``seq_ids`` (those that could draft) for a step whose running
        sequences compute ``num_tokens`` tokens without drafts, with ``waiting_tokens`` prompt
        tokens of waiting requests to admit after them; ``limits`` caps a sequence's k (e.g.
        the drafts there are)."""
        caps = np.array([min(self.max_k, limits.get(s, self.max_k)) if limits else self.max_k
                         for s in seq_ids], dtype=np.int64)
        self.acceptance.step(seq_ids)
        self._steps += 1
        if not self.adaptive:  # a fixed k: every draft there is, wherever it lands
            return {s: int(c) for s, c in zip(seq_ids, caps) if c > 0}
        tokens = min(num_tokens + waiting_tokens, self.token_budget)
        room = self.token_budget - tokens  # drafts that push no prompt token out of the step
        if not len(seq_ids) or room <= 0:
            return {}
        gains = self.acceptance.gains(seq_ids)  # (B, max_k): expected tokens of draft j
        j = np.arange(1, self.max_k + 1)
        if not self.target_cost.fitted:  # nothing to compare yet: draft, and measure
            return _take(seq_ids, np.where(j[None, :] > caps[:, None], 0.0, gains), room)
        if self._steps % self.probe_every == 0:  # measure a cap the policy may never pick
            cap = np.minimum(caps, (self._steps // self.probe_every) % (self.max_k + 1))
            return _take(seq_ids, np.where(j[None, :] > cap[:, None], 0.0, gains), room)
        gains[j[None, :] > caps[:, None]] = 0.0
        rounds, num_drafts = self._best(gains, tokens, room)
        return _take(seq_ids, gains[:, :rounds], num_drafts)

    def _best(self, gains: np.ndarray, tokens: int, room: float) -> tuple[int, int]:
        """(rounds, drafts) with the most kept tokens per second for a step of ``tokens``
        tokens without drafts and ``room`` for more; (0, 0) when drafting does not pay."""
        best_rate = tokens / max(self.target_cost(tokens), 1e-9)
        best = (0, 0)
        for rounds in range(1, self.max_k + 1) if self.drafter else (self.max_k,):
            g = np.sort(gains[:, :rounds].ravel())[::-1]
            g = g[g > 0][:int(min(room, g.size))]
            if not len(g):
                break
            m = np.arange(1, len(g) + 1)
            cost = self.target_cost(tokens + m)
            if self.drafter:
                cost = cost + rounds * self.draft_cost.a + m * self.draft_cost.b
            rate = (tokens + np.cumsum(g)) / np.maximum(cost, 1e-9)
            i = int(rate.argmax())
            if rate[i] > best_rate:
                best_rate, best = float(rate[i]), (rounds, i + 1)
        return best


def _take(seq_ids: Sequence[str], gains: np.ndarray, num_drafts: float) -> dict[str, int]:
    """k per sequence when the ``num_drafts`` largest positive gains are drafted. A sequence's
    gains shrink with the position (ties: the earlier first), so what it drafts is a prefix."""
    flat = gains.ravel()
    top = np.argsort(-flat, kind="stable")[:int(min(num_drafts, flat.size))]
    top = top[flat[top] > 0]
    ks = np.bincount(top // max(gains.shape[1], 1), minlength=len(seq_ids))
    return {s: int(k) for s, k in zip(seq_ids, ks) if k > 0}
