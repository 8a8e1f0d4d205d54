"""What the sampler needs of one position: ``SamplingRow``, shared by the logits processors and
the sampler (both import it from here, so neither imports the other for a type), and
``RowMasks``, what the runner asks of grammar masks filled elsewhere (``structured/`` fills
them; the runner does not import it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs of one position to sample this step."""

    seq_id: str  # stable id of the sequence ("req-1" or "req-1#2"): keys its seeded generator
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated before this row's position
    # Tokens that would end the sequence (its stop_token_ids, plus its EOS ids unless
    # ignore_eos), resolved by the caller; min_tokens masks exactly these.
    stop_token_ids: frozenset[int]
    seq_index: int = 0  # index within an n > 1 group: offsets the seed
    # Grammar slot: allowed tokens as a packed int32 bitmask of ceil(vocab / 32) words
    # (bit j of word i allows token 32 * i + j); None = unconstrained.
    token_bitmask: torch.Tensor | None = None
    # Speculative verification with a draft model: the draft token at this position and the
    # draft's distribution q (vocab,) it was drawn from; None: a plain draw.
    draft_token: int | None = None
    draft_probs: torch.Tensor | None = None


class RowMasks(Protocol):
    """A step's grammar masks, being filled while the forward runs."""

    def apply(self, rows: Sequence[SamplingRow]) -> None:
        """Wait for the masks and set ``token_bitmask`` on the constrained rows."""
