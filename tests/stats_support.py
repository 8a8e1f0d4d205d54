"""Statistics for tests that check distributions (the sampler, speculative decoding)."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed ``counts`` against ``probs`` (cells expecting < 5 pooled);
    0.0 when anything was observed where ``probs`` is 0."""
    if bool((counts[probs <= 0] > 0).any()):
        return 0.0
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(len(exp) - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))  # the chi-square survival function
