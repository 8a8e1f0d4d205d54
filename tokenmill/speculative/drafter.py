"""A model that drafts: run autoregressively for k steps per sequence, with its own paged KV cache
and block tables. Two kinds of model fit: a separate draft model sharing the target's
vocabulary, and the target's own first layers (``EarlyExit``, self-speculative layer skip).

Per sequence the drafter remembers which tokens its cache holds. A propose call

    1. keeps the cached prefix that still equals the sequence (the real tokens, then as many of
       its previous drafts as were accepted) and drops the rest: the draft cache's rollback;
    2. catches up: one chunk of the sequence's tokens not yet cached, logits at the last one
       (a new sequence's whole prompt, within ``max_catch_up`` tokens per call; a longer one
       is cached over several calls and drafts nothing until it is done);
    3. drafts: the catch-up's logits give draft 1; each further round is one batched forward
       of one token per sequence still drafting.

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
        body = self.target.model
        h = body.embed_tokens(input_ids)
        rope = body.rotary(positions)
        residual = None
        for layer, kv_cache in zip(body.layers[:self.num_layers], kv_caches):
            h, residual = layer(rope, h, residual, kv_cache, meta)
        h, _ = body.norm(h, residual)
        if logits_indices is not None:
            h = h[logits_indices]
        return self.target.lm_head(h).float()


@dataclass
class _DraftSeq:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # what the cache holds, position by position
    num_real: int = 0  # of those, the sequence's own tokens when last seen (the rest: drafts)
    last_used: int = 0


@dataclass
class Proposal:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    # per sequence and draft: the distribution it was drawn from (None: greedy, no rule needed)
    probs: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)


class ModelDrafter:
    """Drafts with ``model`` (a ``forward(input_ids, positions, kv_caches, meta,
    logits_indices)`` module of ``config``'s shape) and its own KV cache of ``num_blocks``."""

    def __init__(self, model: nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 device: str, sampler: Sampler | None = None, max_catch_up: int = 512):
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_cache(config, num_blocks, block_size, self.device,
                                           getattr(torch, config.dtype))
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # block 0: the tables' padding
        self.sampler = sampler or Sampler()
        self.max_catch_up = max_catch_up
        self._seqs: dict[str, _DraftSeq] = {}
        self._calls = 0
        # (tokens, seconds) per drafting forward, its draw included; the decoder drains it
        self.forward_log: list[tuple[int, float]] = []

    def propose(self, requests: Sequence[Request], num_tokens: Mapping[str, int]) -> Proposal:
        """Up to ``num_tokens[seq_id]`` drafts for each sequence listed there."""
        self._calls += 1
        budget = self.max_catch_up
        chunks: list[Chunk] = []
        drafting: list[tuple[Request, _DraftSeq, int]] = []  # (request, state, k)
        live = {r.request_id for r in requests}
        for r in requests:
            k = min(num_tokens.get(r.request_id, 0),
                    self.config.max_position_embeddings - r.num_tokens)
            if k <= 0:
                continue
            st = self._sync(r)
            todo = r.num_tokens - len(st.tokens)
            if todo > budget:  # a long prompt: cache part of it now, draft from a later call
                if budget and self._reserve(st, len(st.tokens) + budget, live):
                    chunks.append(self._catch_up(r, st, budget, logits=False))
                    budget = 0
                continue
            if not self._reserve(st, r.num_tokens + k - 1, live):
                continue
            budget -= todo
            chunks.append(self._catch_up(r, st, todo, logits=True))
            drafting.append((r, st, k))
        proposal = Proposal()
        if not drafting:
            if chunks:
                self._forward(chunks)
            return proposal
        started = time.perf_counter()  # each round timed through the draw that reads it
        logits = self._forward(chunks)
        rounds = max(k for _, _, k in drafting)
        num_batched = sum(len(c.token_ids) for c in chunks)
        for j in range(rounds):
            rows = [sampling_row(r, proposal.token_ids.get(r.request_id, ()))
                    for r, _, _ in drafting]
            tokens, probs = self.sampler.draft(logits, rows, owned=True)
            self.forward_log.append((num_batched, time.perf_counter() - started))
            still: list[tuple[Request, _DraftSeq, int]] = []
            for (r, st, k), token, q in zip(drafting, tokens, probs):
                proposal.token_ids.setdefault(r.request_id, []).append(token)
                proposal.probs.setdefault(r.request_id, []).append(q)
                if j + 1 < k and token not in r.stop_token_ids:
                    still.append((r, st, k))
            drafting = still
            if not drafting or j + 1 == rounds:
                break
            chunks = []
            for r, st, _ in drafting:
                token = proposal.token_ids[r.request_id][-1]
                chunks.append(Chunk([token], len(st.tokens), st.blocks))
                st.tokens.append(token)
            started = time.perf_counter()
            logits = self._forward(chunks)
            num_batched = len(chunks)
        return proposal

    def forget(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            st = self._seqs.pop(seq_id, None)
            if st is not None:
                self.free_blocks.extend(reversed(st.blocks))

    # ----- internals --------------------------------------------------------------------------

    def _sync(self, r: Request) -> _DraftSeq:
        """The sequence's state with its cache cut to the prefix that still matches, and short
        of the last token (whose logits the catch-up must compute)."""
        st = self._seqs.get(r.request_id)
        if st is None:
            st = self._seqs[r.request_id] = _DraftSeq()
        st.last_used = self._calls
        base = keep = min(st.num_real, r.num_tokens)
        if len(st.tokens) > base:  # drafts past the real tokens: keep those that came true
            real = r.token_ids_slice(base, len(st.tokens))
            while keep - base < len(real) and st.tokens[keep] == real[keep - base]:
                keep += 1
        del st.tokens[min(keep, r.num_tokens - 1):]
        st.num_real = len(st.tokens)
        return st

    def _catch_up(self, r: Request, st: _DraftSeq, n: int, logits: bool) -> Chunk:
        start = len(st.tokens)
        tokens = r.token_ids_slice(start, start + n)
        st.tokens.extend(tokens)
        st.num_real = len(st.tokens)
        return Chunk(tokens, start, st.blocks, num_logits=1 if logits else 0)

    def _reserve(self, st: _DraftSeq, num_positions: int, live: set[str]) -> bool:
        """Blocks for ``num_positions`` positions; evicts sequences not running now (least
        recently used first) when the pool runs short. False: not enough even then."""
        need = -(-num_positions // self.block_size) - len(st.blocks)
        if need > len(self.free_blocks):
            idle = sorted((s.last_used, seq_id) for seq_id, s in self._seqs.items()
                          if seq_id not in live)
            for _, seq_id in idle:
                self.forget([seq_id])
                if need <= len(self.free_blocks):
                    break
        if need > len(self.free_blocks):
            return False
        for _ in range(max(0, need)):
            st.blocks.append(self.free_blocks.pop())
        return True

    @torch.inference_mode()
    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        batch = build_flat_batch(chunks, self.block_size, self.device)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                          batch.logits_indices)
