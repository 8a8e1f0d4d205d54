"""The pooling side of a step: the hidden states of pooling requests' rows -> their vectors.

A decoder's pooling chunks (``num_logits`` 0: they want no token) run in the same forward as
the step's sampled chunks. A forward hook on the model's inner module (``model.model``, whose
output is the final norm's, before lm_head) keeps that forward's hidden states; the sampled
rows' logits come out of the usual path untouched, so generation beside embeddings is the
same computation as without them. Each pooling chunk's rows go into its prompt's
``PartialPool`` (a chunked prompt pools across steps) and the prompt's last chunk yields the
vector. An encoder's step holds whole prompts only (the scheduler never chunks them): one
forward, then each prompt pooled, or scored by the model's classifier.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from tokenmill.model.pooling import PartialPool, finish_vector, pool_rows
from tokenmill.request import Request
from tokenmill.runner.batch import query_starts, to_device
from tokenmill.sched.output import ScheduledChunk


class Pooler:
    """Turns a step's pooling chunks into vectors (``ModelOutput.pooled``)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._partial: dict[str, tuple[Request, PartialPool]] = {}  # prompts under way

    @contextmanager
    def hidden_states(self) -> Iterator[list[torch.Tensor]]:
        """A decoder forward inside this block leaves its final hidden states (tokens, hidden)
        in the yielded list."""
        inner = getattr(self.model, "model", None)
        if inner is None:
            raise RuntimeError(f"{type(self.model).__name__} has no inner model whose hidden "
                               "states could be pooled")
        box: list[torch.Tensor] = []
        handle = inner.register_forward_hook(lambda _module, _args, out: box.append(out))
        try:
            yield box
        finally:
            handle.remove()

    def collect(self, chunks: Sequence[ScheduledChunk],
                hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each pooling chunk's rows of ``hidden`` into its prompt's partial pool; returns the
        vectors of the prompts whose last chunk this was."""
        self._partial = {k: v for k, v in self._partial.items() if not v[0].is_finished}
        out: dict[str, torch.Tensor] = {}
        starts = query_starts(chunks)
        for c, start, end in zip(chunks, starts, starts[1:]):
            params = c.request.pooling_params
            if params is None:
                continue
            _, partial = self._partial.setdefault(c.request_id,
                                                  (c.request, PartialPool(params.pooling)))
            partial.add(hidden[start:end], c.start_pos)
            if c.start_pos + len(c.token_ids) == c.request.num_prompt_tokens:
                del self._partial[c.request_id]
                out[c.request_id] = finish_vector(partial.result(), params.normalize,
                                                  params.dimensions)
        return out

    def encode(self, chunks: Sequence[ScheduledChunk]) -> dict[str, torch.Tensor]:
        """An encoder's step: whole prompts -> their embeddings or classifier logits."""
        ids: list[int] = []
        positions: list[int] = []
        types: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            ids += c.token_ids
            positions += range(n)
            types += c.request.token_type_ids or [0] * n
        ids_t, pos_t, types_t = to_device([ids, positions, types], self.device)
        hidden = self.model(ids_t, pos_t, types_t, [len(c.token_ids) for c in chunks])
        starts = query_starts(chunks)
        out = self._scores(chunks, hidden, starts)
        for c, start, end in zip(chunks, starts, starts[1:]):
            params = c.request.pooling_params
            if params.task == "embed":
                out[c.request_id] = finish_vector(pool_rows(hidden[start:end], params.pooling),
                                                  params.normalize, params.dimensions)
        return out

    def _scores(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor,
                starts: list[int]) -> dict[str, torch.Tensor]:
        """A cross-encoder's logits for the step's score requests, from their CLS rows."""
        rows = [(c.request_id, start) for c, start in zip(chunks, starts)
                if c.request.pooling_params.task == "score"]
        if not rows:
            return {}
        classify = getattr(self.model, "classify", None)
        if classify is None:
            raise RuntimeError(f"{type(self.model).__name__} has no classifier to score with")
        index = torch.tensor([start for _, start in rows], device=hidden.device)
        logits = classify(hidden.index_select(0, index)).cpu()  # (pairs, num_labels)
        return {request_id: logits[i] for i, (request_id, _) in enumerate(rows)}
