"""A model that drafts: run autoregressively for k steps per sequence. Two kinds of model fit:
a separate draft model sharing the target's vocabulary, and the target's own first layers
(``EarlyExit``, self-speculative layer skip).

Its KV lives in the sequence's own blocks, like every other KV: the draft cache tensors have as
many blocks as the target's (each block id was budgeted for both) and are indexed by the ids of
the sequence's block table in the scheduler's ``KVBlockManager``, holding the draft model's
layers. So draft KV is allocated, shared, trimmed and freed with the sequence's blocks, and
there is no free list here. Drafting writes past the blocks the target holds (up to position
num_tokens + k - 2); the drafter reserves those first (``KVBlockManager.reserve_lookahead``),
leaving free what the running sequences' own tokens need this step, and a sequence the manager
cannot grow drafts nothing this step. ``end_step`` (after every step) gives back what the step
did not use, and forgets what was written there.

Per sequence the drafter remembers which tokens it wrote, and into which blocks; it trusts no
other draft KV (a block from the prefix cache or shared with an n > 1 sibling may hold another
sequence's, or stale values), and a preemption, which freed the table, starts the record over.
A propose call

    1. keeps the written prefix that still equals the sequence (the real tokens, then as many of
       its previous drafts as were accepted) and still lies in the blocks it was written to,
       and drops the rest: the draft cache's rollback;
    2. catches up: one chunk of the sequence's tokens not yet written, logits at the last one
       (a new sequence's whole prompt, within ``max_catch_up`` tokens per call; a longer one
       is written over several calls, within the blocks the target already holds, and drafts
       nothing until it is done);
    3. drafts: the catch-up's logits give draft 1; each further round is one batched forward
       of one token per sequence still drafting.

Catching up writes into shared blocks too: the same tokens after the same prefix, so the values
any other sequence wrote there. Positions are always inside the table, so block 0 (the tables'
padding) is never written.

Drafts are chosen by the target's own sampler on the draft's logits (``Sampler.draft``): the
argmax for greedy requests, a draw from the processed distribution q for sampled ones, q kept
for the rejection rule.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from tokenmill.cache import KVBlockManager
from tokenmill.config import ModelConfig
from tokenmill.request import Request
from tokenmill.runner.batch import Chunk, build_flat_batch
from tokenmill.runner.kv_cache import allocate_kv_cache
from tokenmill.runner.model_runner import sampling_row
from tokenmill.runner.sampler import Sampler


class EarlyExit(nn.Module):
    """The target's first ``num_layers`` layers, then its final norm and lm_head: a draft model
    that shares every weight with the target (LayerSkip / Draft & Verify's self-speculation)."""

    def __init__(self, target: nn.Module, num_layers: int):
        super().__init__()
        total = len(target.model.layers)
        if not 1 <= num_layers < total:
            raise ValueError(f"layer-skip drafting needs 1 to {total - 1} of the target's "
                             f"{total} layers; got {num_layers}")
        self.target = target
        self.num_layers = num_layers
        self.config = replace(target.config, num_layers=num_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                meta, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        # the target's own forward, stopped early: one decoder loop (eager or fused) for both
        return self.target(input_ids, positions, kv_caches, meta, logits_indices,
                           num_layers=self.num_layers)


@dataclass
class _DraftSeq:
    preemptions: int  # the sequence's count when the record began (a preemption frees blocks)
    tokens: list[int] = field(default_factory=list)  # what it wrote, position by position
    blocks: list[int] = field(default_factory=list)  # the block ids it wrote them into
    num_real: int = 0  # of those tokens, the sequence's own when last seen (the rest: drafts)


@dataclass
class Proposal:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    # per sequence and draft: the distribution it was drawn from (None: greedy, no rule needed)
    probs: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)


_Drafting = list[tuple[Request, _DraftSeq, int]]  # (sequence, its record, k)


class ModelDrafter:
    """Drafts with ``model`` (a ``forward(input_ids, positions, kv_caches, meta,
    logits_indices)`` module of ``config``'s shape), its KV at the block ids ``block_manager``
    (the scheduler's) gives the sequences. ``max_catch_up``: the most tokens a call catches up
    on, the step's token budget."""

    def __init__(self, model: nn.Module, config: ModelConfig, block_manager: KVBlockManager,
                 device: str, sampler: Sampler | None = None, max_catch_up: int = 512):
        self.model = model
        self.config = config
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_cache(config, block_manager.pool.num_blocks,
                                           self.block_size, self.device,
                                           getattr(torch, config.dtype))
        self.sampler = sampler or Sampler()
        self.max_catch_up = max_catch_up
        self._seqs: dict[str, _DraftSeq] = {}
        self._lookahead: dict[str, Request] = {}  # sequences that reserved blocks this step
        # (tokens, seconds) per drafting forward, its draw included; the decoder drains it
        self.forward_log: list[tuple[int, float]] = []

    def propose(self, requests: Sequence[Request], num_tokens: Mapping[str, int]) -> Proposal:
        """Up to ``num_tokens[seq_id]`` drafts for each running sequence listed there."""
        self.end_step()  # a lookahead an earlier step left (observe normally returned it)
        chunks, drafting = self._catch_up_all(requests, num_tokens)
        if not drafting:
            if chunks:
                self._forward(chunks)
            return Proposal()
        return self._draft(chunks, drafting)

    def end_step(self) -> None:
        """Give back the lookahead blocks the step did not use (the scheduler's allocation
        holds what it verifies) and forget what was written into them."""
        for seq_id, request in self._lookahead.items():
            self.blocks.release_lookahead(request)
            st = self._seqs.get(seq_id)
            if st is not None:
                self._keep_written_blocks(st, self.blocks.block_table(seq_id))
        self._lookahead.clear()

    def forget(self, seq_ids: Iterable[str]) -> None:
        """Ended sequences (their blocks are the scheduler's to free)."""
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)
            self._lookahead.pop(seq_id, None)

    # ----- internals --------------------------------------------------------------------------

    def _catch_up_all(self, requests: Sequence[Request],
                      num_tokens: Mapping[str, int]) -> tuple[list[Chunk], _Drafting]:
        """The catch-up chunks, and the sequences that draft after them."""
        budget = self.max_catch_up
        needs = {r.request_id: self._own_blocks_needed(r) for r in requests}
        held = sum(needs.values())  # blocks the lookahead must leave free
        chunks: list[Chunk] = []
        drafting: _Drafting = []
        for r in requests:
            k = min(num_tokens.get(r.request_id, 0),
                    self.config.max_position_embeddings - r.num_tokens)
            table = self.blocks.block_table(r.request_id)
            if k <= 0 or not table:
                continue
            st = self._sync(r, table)
            todo = r.num_tokens - len(st.tokens)
            if todo > budget:  # a long prompt: write part of it now, draft from a later call
                n = min(budget, len(table) * self.block_size - len(st.tokens))
                if n > 0:
                    chunks.append(self._catch_up(r, st, n, logits=False))
                    budget -= n
            elif self._reserve(r, r.num_tokens + k - 1, held - needs[r.request_id]):
                held -= needs[r.request_id]  # its lookahead covers its own next tokens
                budget -= todo
                chunks.append(self._catch_up(r, st, todo, logits=True))
                drafting.append((r, st, k))
        return chunks, drafting

    def _reserve(self, r: Request, num_positions: int, keep_free: int) -> bool:
        """Blocks for the positions drafting writes, from the sequence's own table."""
        if not self.blocks.reserve_lookahead(r, num_positions, keep_free):
            return False
        self._lookahead[r.request_id] = r
        return True

    def _own_blocks_needed(self, r: Request) -> int:
        """Blocks the sequence's own next tokens (a step's budget at most) would take."""
        return self.blocks.num_blocks_needed(
            r, min(r.num_tokens - r.num_computed_tokens, self.max_catch_up))

    def _draft(self, chunks: list[Chunk], drafting: _Drafting) -> Proposal:
        """Run the catch-up, then a round per draft position, one token per sequence each."""
        proposal = Proposal()
        started = time.perf_counter()  # each round timed through the draw that reads it
        logits = self._forward(chunks)
        rounds = max(k for _, _, k in drafting)
        num_batched = sum(len(c.token_ids) for c in chunks)
        for j in range(rounds):
            rows = [sampling_row(r, proposal.token_ids.get(r.request_id, ()))
                    for r, _, _ in drafting]
            tokens, probs = self.sampler.draft(logits, rows, owned=True)
            self.forward_log.append((num_batched, time.perf_counter() - started))
            drafting = _record(proposal, drafting, tokens, probs, j)
            if not drafting or j + 1 == rounds:
                break
            chunks = [self._write_draft(r, st, proposal.token_ids[r.request_id][-1])
                      for r, st, _ in drafting]
            started = time.perf_counter()
            logits = self._forward(chunks)
            num_batched = len(chunks)
        return proposal

    def _sync(self, r: Request, table: list[int]) -> _DraftSeq:
        """The sequence's record cut to the prefix that still matches, and short of the last
        token (whose logits the catch-up must compute)."""
        st = self._seqs.get(r.request_id)
        if st is None or st.preemptions != r.num_preemptions:
            st = self._seqs[r.request_id] = _DraftSeq(r.num_preemptions)
        self._keep_written_blocks(st, table)
        base = keep = min(st.num_real, r.num_tokens)
        if len(st.tokens) > base:  # drafts past the real tokens: keep those that came true
            real = r.token_ids_slice(base, len(st.tokens))
            while keep - base < len(real) and st.tokens[keep] == real[keep - base]:
                keep += 1
        del st.tokens[min(keep, r.num_tokens - 1):]
        st.num_real = len(st.tokens)
        return st

    def _keep_written_blocks(self, st: _DraftSeq, table: list[int]) -> None:
        """Cut the record to the blocks the sequence still holds as they were when written."""
        n = min(len(st.blocks), len(table))
        if st.blocks[:n] != table[:n]:
            n = next(i for i, (a, b) in enumerate(zip(st.blocks, table)) if a != b)
        del st.blocks[n:]
        del st.tokens[n * self.block_size:]
        st.num_real = min(st.num_real, len(st.tokens))

    def _catch_up(self, r: Request, st: _DraftSeq, n: int, logits: bool) -> Chunk:
        start = len(st.tokens)
        tokens = r.token_ids_slice(start, start + n)
        st.tokens.extend(tokens)
        st.num_real = len(st.tokens)
        table = self.blocks.block_table(r.request_id)
        st.blocks = list(table)  # it covers every position written in this call
        return Chunk(tokens, start, table, num_logits=1 if logits else 0)

    def _write_draft(self, r: Request, st: _DraftSeq, token: int) -> Chunk:
        chunk = Chunk([token], len(st.tokens), self.blocks.block_table(r.request_id))
        st.tokens.append(token)
        return chunk

    @torch.inference_mode()
    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        batch = build_flat_batch(chunks, self.block_size, self.device)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                          batch.logits_indices)


def _record(proposal: Proposal, drafting: _Drafting, tokens: Sequence[int],
            probs: Sequence[torch.Tensor | None], j: int) -> _Drafting:
    """Add the draws of round ``j`` to the proposal; returns the sequences that go on (k not
    reached, and no stop token drawn)."""
    still: _Drafting = []
    for (r, st, k), token, q in zip(drafting, tokens, probs):
        proposal.token_ids.setdefault(r.request_id, []).append(token)
        proposal.probs.setdefault(r.request_id, []).append(q)
        if j + 1 < k and token not in r.stop_token_ids:
            still.append((r, st, k))
    return still
