"""The step being built by ``Scheduler.schedule``: planned chunks and the token budget left."""

from __future__ import annotations

from tokenmill.request import Request

# One planned chunk: (request, start_pos, known tokens, draft tokens after them). A plain
# tuple: a NamedTuple costs a Python-level __new__ per sequence per step.
Planned = tuple[Request, int, int, int]


class StepBatch:
    """Chunks are keyed by request id so that a sequence preempted later in the same step can be
    taken out again and its tokens returned to the budget."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.tokens_left = token_budget
        self.chunks: dict[str, Planned] = {}
        self.preempted_ids: list[str] = []

    def add(self, request: Request, num_tokens: int, num_drafts: int = 0) -> None:
        start = request.num_computed_tokens
        self.chunks[request.request_id] = (request, start, num_tokens, num_drafts)
        request.num_computed_tokens += num_tokens + num_drafts
        self.tokens_left -= num_tokens + num_drafts

    def drop(self, request: Request) -> int:
        """Take the request's chunk out; returns its number of tokens (0 when it had none)."""
        entry = self.chunks.pop(request.request_id, None)
        if entry is None:
            return 0
        scheduled = entry[2] + entry[3]
        self.tokens_left += scheduled
        return scheduled

    def computed_before(self, request: Request) -> int:
        """Tokens of the request computed before this step (its KV written and, for full
        blocks, shared with the cache)."""
        planned = self.chunks.get(request.request_id)
        return planned[1] if planned is not None else request.num_computed_tokens
