"""A prefix being computed is computed once: which waiting requests hold back this step.

A waiting request whose first ``key_tokens`` prompt tokens (and prefix-cache namespace: cache
salt and LoRA adapter) equal those of a request still prefilling, admitted earlier or in this
step, waits while requests behind it are admitted, until that request has computed the full
blocks the two prompts share or the cache holds them; it then takes them from the cache.
Shorter prompts are never held.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.cache import KVBlockManager
from tokenmill.cache.radix import NullPrefixCache
from tokenmill.request import Request
from tokenmill.sched.step_batch import StepBatch


class PrefillHolds:
    """This step's prompts in prefill, by prefix key, and the test a newcomer takes."""

    def __init__(self, key_tokens: int, block_manager: KVBlockManager, batch: StepBatch,
                 running: Iterable[Request]) -> None:
        self._key_tokens = key_tokens
        self._blocks = block_manager
        self._batch = batch
        self._computing: dict[tuple, list[Request]] = {}
        for request in running:
            self.admitted(request)

    @classmethod
    def for_step(cls, key_blocks: int, block_manager: KVBlockManager, batch: StepBatch,
                 running: Iterable[Request]) -> PrefillHolds | None:
        """The holds for this step's admissions, keyed by ``key_blocks`` whole blocks of prompt;
        None when nothing is ever held: without a prefix cache there is nothing to wait for."""
        if isinstance(block_manager.prefix_cache, NullPrefixCache):
            return None
        return cls(key_blocks * block_manager.block_size, block_manager, batch, running)

    def admitted(self, request: Request) -> None:
        """Count a running request whose prompt, longer than the key, was not all computed
        before this step."""
        # The cheap test first: most running requests are decoding, their prompts long computed.
        if self._batch.computed_before(request) < request.num_prompt_tokens:
            key = self._key(request)
            if key is not None:
                self._computing.setdefault(key, []).append(request)

    def holds(self, request: Request) -> bool:
        """Whether a prefilling request has yet to compute (before this step) full blocks this
        one's prompt shares with it, which the cache does not hold yet (never one that would not
        read the cache anyway)."""
        key = self._key(request) if request.reuses_cached_prefix else None
        if key is None:
            return False
        prompt, bs = request.prompt_token_ids, self._blocks.block_size
        for leader in self._computing.get(key, ()):
            other = leader.prompt_token_ids
            common = next((i for i, (a, b) in enumerate(zip(prompt, other)) if a != b),
                          min(len(prompt), len(other)))
            shared = common // bs * bs
            if (self._batch.computed_before(leader) < shared
                    and self._blocks.cached_prefix_len(request) < shared):
                return True
        return False

    def _key(self, request: Request) -> tuple | None:
        """The request's first ``key_tokens`` of prompt and its prefix-cache namespace (salt and
        LoRA adapter); None when its prompt is not longer."""
        n = self._key_tokens
        if request.num_prompt_tokens <= n:
            return None
        return (request.prefix_namespace, *request.prompt_token_ids[:n])
