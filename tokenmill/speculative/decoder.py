"""The engine's proposer for speculative decoding: a method that drafts (n-gram lookup or a
drafting model), the adaptive policy that decides how much, and the counters behind the
``tokenmill:spec_decode_*`` metrics.

Each step the engine calls ``propose`` with the running sequences (before scheduling) and the
prompt tokens the waiting queue would add to the step (the policy leaves them the room), passes
``draft_probs`` of the drafts it kept to the runner's verifier, and after the step calls
``observe`` with what verification accepted and what the step cost (a drafter then returns the
blocks it reserved ahead of the step and the step did not use), and ``forget`` with the
sequences that ended.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tokenmill.request import Request
from tokenmill.sched.output import ScheduledChunk, num_matching_drafts
from tokenmill.speculative.drafter import ModelDrafter
from tokenmill.speculative.ngram import NgramProposer
from tokenmill.speculative.policy import AdaptivePolicy


@dataclass(frozen=True)
class SpecStats:
    """Totals since start (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications that carried at least one draft of ours
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # accepted drafts by index in their run
    propose_seconds: float = 0.0  # drafting, policy included

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification: the accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / max(1, self.num_drafts)


class SpeculativeDecoder:
    def __init__(self, method: NgramProposer | ModelDrafter, max_k: int, name: str = "ngram",
                 adaptive: bool = True, max_num_batched_tokens: int = 2048) -> None:
        self.method = method
        self.name = name  # ngram | draft | layerskip
        self.max_k = max_k
        self.policy = AdaptivePolicy(max_k, drafter=isinstance(method, ModelDrafter),
                                     adaptive=adaptive, token_budget=max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.draft_probs: dict[str, list] = {}  # of the latest proposal (drafting models only)
        self._proposed: dict[str, list[int]] = {}
        self._num_drafts = self._num_draft_tokens = self._num_accepted = 0
        self._per_position = [0] * max_k
        self._seconds = 0.0

    def propose(self, requests: Sequence[Request],
                waiting_tokens: int = 0) -> Mapping[str, Sequence[int]]:
        """Drafts for the running ``requests``, in a step that would also admit
        ``waiting_tokens`` prompt tokens of waiting requests."""
        start = time.perf_counter()
        self.draft_probs = {}
        remaining = [r.num_tokens - r.num_computed_tokens for r in requests]
        step_tokens = min(self.max_num_batched_tokens, sum(remaining))
        seq_ids = [r.request_id for r in requests]
        if isinstance(self.method, NgramProposer):
            # Lookups cost next to nothing: find what is there, then keep what pays.
            found = self.method.propose(requests, dict.fromkeys(seq_ids, self.max_k))
            ks = self.policy.choose(list(found), step_tokens, waiting_tokens=waiting_tokens,
                                    limits={s: len(d) for s, d in found.items()})
            drafts = {s: found[s][:k] for s, k in ks.items()}
        else:
            ks = self.policy.choose(seq_ids, step_tokens, waiting_tokens=waiting_tokens)
            proposal = self.method.propose(requests, ks) if ks else None
            drafts = proposal.token_ids if proposal else {}
            self.draft_probs = proposal.probs if proposal else {}
            for tokens, seconds in self.method.forward_log:
                self.policy.draft_cost.add(tokens, seconds)
            self.method.forward_log.clear()
        self._proposed = drafts
        self._seconds += time.perf_counter() - start
        return drafts

    def observe(self, chunks: Sequence[ScheduledChunk], accepted: Mapping[str, Sequence[int]],
                num_batched_tokens: int, seconds: float) -> None:
        """One step's outcome: its cost, and per chunk that verified drafts of ours how many
        of them the target accepted (``accepted``: the runner's tokens per sequence). A
        drafter gives back the lookahead blocks the step did not use."""
        if isinstance(self.method, ModelDrafter):
            self.method.end_step()
        if num_batched_tokens:
            self.policy.target_cost.add(num_batched_tokens, seconds)
        for c in chunks:
            ours = self._proposed.get(c.request_id)
            drafts = c.draft_token_ids
            if not drafts or ours is None or ours[:len(drafts)] != drafts:
                continue  # no drafts, or a grammar's forced text instead of ours
            n = num_matching_drafts(drafts, accepted.get(c.request_id, ()))
            self.policy.acceptance.record(c.request_id, len(drafts), n)
            self._num_drafts += 1
            self._num_draft_tokens += len(drafts)
            self._num_accepted += n
            for j in range(n):
                self._per_position[j] += 1
        self._proposed = {}

    def forget(self, seq_ids: Iterable[str]) -> None:
        seq_ids = list(seq_ids)
        self.method.forget(seq_ids)
        self.policy.acceptance.forget(seq_ids)

    def stats(self) -> SpecStats:
        return SpecStats(self._num_drafts, self._num_draft_tokens, self._num_accepted,
                         tuple(self._per_position), self._seconds)
