"""The engine's side of structured output: a grammar per constrained sequence, its masks each
step, and jump-forward.

Per step (``LLMEngine.step``):

    propose       a sequence whose grammar forces text gets that text's tokens as drafts
                  (jump-forward); other drafts are cut where the grammar would refuse them
    start_masks   a worker thread fills the bitmask of every scored position of every
                  constrained sequence (after each draft prefix) while the forward runs
    runner        waits for the masks, applies them to the logits, samples, verifies drafts
    advance       the grammar consumes the tokens the sequence accepted; a complete grammar
                  allows only EOS, which ends the sequence

Jump-forward is verification, not blind appending: forced tokens are drafts, and the runner
keeps each only if the masked model picks it at its position. There the mask allows only
tokens that spell the forced text, so nearly all are kept, several per forward pass; and the
output is token for token what decoding one token per step gives, greedy or sampled, whatever
tokenization the model prefers at a boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenmill.params import StructuredOutputs
from tokenmill.request import Request
from tokenmill.sched.output import ScheduledChunk
from tokenmill.structured.backend import CompiledGrammar, GrammarBackend, GrammarStats

logger = logging.getLogger("tokenmill.engine")


class PendingMasks:
    """Bitmasks being filled for one step; ``apply`` waits and puts them on the rows."""

    def __init__(self, future: Future, rows: list[int]):
        self._future = future
        self._rows = rows  # logits rows that have a grammar

    def apply(self, rows: Sequence) -> None:
        """Set ``token_bitmask`` on the constrained ``rows`` (``SamplingRow`` objects)."""
        words = self._future.result()
        for i in self._rows:
            rows[i].token_bitmask = words[i]


class StructuredOutputManager:
    """Compiles constraints, owns per-sequence grammar state, and counts what it did."""

    def __init__(self, backend: GrammarBackend, jump_forward: bool = True):
        self.backend = backend
        self.jump_forward = jump_forward
        self.num_requests = 0  # requests with a constraint, total
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._failed: dict[str, str] = {}  # group id -> why (mask fills run in the worker)

    @property
    def stats(self) -> GrammarStats:
        return self.backend.stats

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Thread-safe and cached, a hit without a lock: the server compiles off the event loop
        and hands the grammar to ``add_request``, so the engine's loop compiles only for the
        offline API."""
        return self.backend.compile(spec)

    def attach(self, sequences: Sequence[Request], compiled: CompiledGrammar) -> None:
        self.num_requests += 1
        for seq in sequences:
            seq.grammar = compiled.matcher()

    # ----- drafts ------------------------------------------------------------------------------

    def propose(self, running: Sequence[Request],
                drafts: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """Drafts for the step: forced text (jump-forward) for constrained sequences where the
        grammar forces any, else the proposer's drafts cut to what the grammar allows."""
        out = {seq_id: list(d) for seq_id, d in drafts.items()}
        for seq in running:
            grammar = seq.grammar
            if grammar is None:
                continue
            try:
                forced = grammar.forced_tokens() if self.jump_forward else []
                if forced:
                    out[seq.request_id] = forced
                elif seq.request_id in out:
                    proposed = out[seq.request_id]
                    out[seq.request_id] = proposed[:grammar.valid_prefix(proposed)]
            except Exception as e:  # no drafts for it; it fails after the step
                out.pop(seq.request_id, None)
                self._fail(seq, e)
        return out

    def _fail(self, seq: Request, error: Exception) -> None:
        logger.error("the grammar of %s failed: %s: %s", seq.request_id, type(error).__name__,
                     error)
        self._failed[seq.group_id] = f"its output constraint failed: {type(error).__name__}: " \
                                     f"{error}"

    def take_failed(self) -> dict[str, str]:
        """Requests (group ids) whose grammar raised since the last call, and why; the engine
        fails them."""
        failed, self._failed = self._failed, {}
        return failed

    # ----- masks -------------------------------------------------------------------------------

    def start_masks(self, chunks: Sequence[ScheduledChunk]) -> PendingMasks | None:
        """Start filling this step's bitmasks in the worker thread; None without constraints.
        Logits rows follow the runner's order: ``num_logits`` rows per chunk."""
        work: list[tuple[ScheduledChunk, int]] = []
        rows: list[int] = []
        row = 0
        for c in chunks:
            if c.num_logits and c.request.grammar is not None:
                work.append((c, row))
                rows.extend(range(row, row + c.num_logits))
            row += c.num_logits
        if not work:
            return None
        words = self.backend.new_masks(row)
        return PendingMasks(self._worker().submit(self._fill, work, words), rows)

    def _fill(self, work: list[tuple[ScheduledChunk, int]], words: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        for chunk, row in work:
            try:
                chunk.request.grammar.fill_masks(chunk.draft_token_ids, words, row)
            except Exception as e:  # this request's grammar broke: it fails, the step goes on
                words[row:row + chunk.num_logits] = -1  # any token: its rows are dropped
                self._fail(chunk.request, e)
        self.stats.num_mask_steps += 1
        self.stats.mask_seconds += time.perf_counter() - start
        return words

    def _worker(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
            return self._pool

    # ----- after the step ----------------------------------------------------------------------

    @staticmethod
    def advance(seq: Request, token_ids: Sequence[int]) -> bool:
        """Consume a running sequence's accepted tokens; True when its grammar is complete."""
        seq.grammar.accept(token_ids)
        return seq.grammar.is_stopped
