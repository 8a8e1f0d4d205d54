"""What the engine asks of a draft proposer (speculative decoding, ``speculative/``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from tokenmill.request import Request


class DraftProposer(Protocol):
    """Proposes continuations to verify (speculative decoding, ``speculative/``).

    Optional, used where present (``speculative.SpeculativeDecoder`` has them): ``draft_probs``
    (per sequence, the distributions of the latest drafts), ``observe(chunks, accepted tokens,
    num_batched_tokens, seconds)`` after every step (a drafting model gives back there the
    lookahead blocks the step did not use), ``forget(seq_ids)`` for ended sequences,
    ``stats()`` (``speculative.SpecStats``).
    """

    def propose(self, requests: Sequence[Request],
                waiting_tokens: int) -> Mapping[str, Sequence[int]]:
        """Draft tokens per sequence id for the running sequences; omitted ids get none.
        ``waiting_tokens``: prompt tokens the step would admit from the waiting queue after
        them (``Scheduler.waiting_prompt_tokens``), which drafts scheduled first push out."""
