"""ModelRunner: owns the model, its KV cache and the sampler; turns one scheduler step into one
forward pass and, per sequence that asked for logits, a list of accepted tokens.

A chunk with ``num_logits == k + 1`` carries k draft tokens after its last known token. Every
scored position is sampled as usual (row j sees the drafts before it as history, for penalties
and min_tokens); the drafts are accepted while each equals the token sampled at the position
before it, and the first sample that differs (or the one after the last draft) is appended as
the model's own token. Sampling a position and keeping the draft only if it comes out equal is
exactly the rejection rule for a draft that proposes one token with certainty, so greedy output
is unchanged and sampled output keeps the model's distribution. A draft drawn from a
distribution q of its own (a draft model's, ``spec/``) brings q to its row, and the sampler
applies the general rule there (keep it with min(1, p/q), else draw from max(p - q, 0)); the
row's token then equals the draft exactly when it was kept, so acceptance below is the same.

A step with pooling chunks (embeddings, scores) also returns their vectors (``pooling.py``);
a step without any runs exactly as before. An encoder (``config.causal`` False) keeps no KV
cache: it reads each prompt whole in one step, so none is allocated (the scheduler is told of
the minimum, two blocks, and gives its requests none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.model.loader import LoadedModel
from tokenmill.runner.batch import Chunk, SeqChunk, build_flat_batch, query_starts
from tokenmill.runner.cpu_step import CpuStep, unsupported
from tokenmill.runner.cuda_graphs import DecodeGraphs
from tokenmill.runner.kv_cache import allocate_kv_cache
from tokenmill.runner.pooling import Pooler
from tokenmill.runner.sampler import (Sampler, SamplerOutput, SamplingRow,
                                      prompt_logprob_entries)
from tokenmill.runner.threads import ThreadGovernor
from tokenmill.sched.output import ModelOutput, ScheduledChunk, num_matching_drafts
from tokenmill.util import cdiv

if TYPE_CHECKING:
    from tokenmill.request import Request
    from tokenmill.runner.lora import LoRAManager
    from tokenmill.runner.rows import RowMasks


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16,
                 device: str = "cpu", kv_cache_dtype: str = "auto"):
        self.model = loaded.model
        self.config = loaded.config
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks if self.config.causal else 2
        dtype = getattr(torch, self.config.dtype)
        self.kv_caches = [] if not self.config.causal else allocate_kv_cache(
            self.config, num_blocks, block_size, self.device, dtype, kv_cache_dtype)
        self.pooler = Pooler(self.model, self.device)
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        # CPU: fewer forward threads while other processes take the cores (threads.py)
        self.governor: ThreadGovernor | None = None
        # LoRA adapters over the model (runner/lora.py), set by the worker build where enabled
        self.lora: LoRAManager | None = None

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Replay plain decode steps of up to ``max_num_seqs`` sequences from CUDA graphs (the
        model's attention backend must be graph-safe: ``triton``)."""
        if not self.config.causal:  # an encoder has no decode steps
            return
        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_num_seqs,
                              max_model_len, self.device)
        graphs.capture()
        self.graphs = graphs

    def fuse_cpu_step(self, all_reduce=None) -> str:
        """Run the decoder layers through one C++ call per forward where the model allows it
        (``cpu_step.py``); returns what the engine reports: "fused" (and from how many rows
        a batch's linears run through oneDNN: ``CpuStep.dense_from_rows``), or
        "eager: <why not>". ``all_reduce``: tensor parallel, the shared-memory all-reduce
        (``distributed/shm.py``) the step calls after o_proj and down_proj."""
        why = unsupported(self.model)
        if why is not None:
            return f"eager: {why}"
        step = self.model.model.fused_layers = CpuStep(self.model, all_reduce=all_reduce)
        if step.dense_from_rows is not None:
            return f"fused; linears through oneDNN from {step.dense_from_rows} rows"
        return "fused"

    def graphs_description(self) -> str:
        r = self.graphs.report if self.graphs is not None else None
        if r is None:
            return "off"
        return (f"batches {','.join(map(str, r.buckets))} ({r.seconds:.1f} s, "
                f"{r.memory_bytes / 2**20:.0f} MiB)")

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """Run one step; logits (float32) for the last ``num_logits`` positions of each chunk,
        in order (or for every token when ``all_logits``). With LoRA, each chunk's rows run
        under its request's adapter (none: the base model's)."""
        if self.lora is None:
            return self._forward(chunks, all_logits)
        try:
            with_lora = self.lora.prepare(chunks, query_starts(chunks))
            # graphs were captured without LoRA: a step with adapter rows runs eagerly
            return self._forward(chunks, all_logits, graphs=not with_lora)
        finally:
            self.lora.finish()

    def _forward(self, chunks: Sequence[SeqChunk], all_logits: bool,
                 graphs: bool = True) -> torch.Tensor:
        if graphs and self.graphs is not None and not all_logits:
            logits = self.graphs.run(chunks)
            if logits is not None:
                return logits
        batch = build_flat_batch(chunks, self.block_size, self.device, all_logits)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                          batch.logits_indices)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk], masks: RowMasks | None = None,
                draft_probs: Mapping[str, Sequence[torch.Tensor | None]] | None = None
                ) -> ModelOutput:
        """Forward the scheduler's chunks; the accepted tokens of each chunk with logits.
        Grammar ``masks``, filled by another thread while the forward runs, are applied to
        their rows before sampling. ``draft_probs``: per sequence, the distribution each draft
        was drawn from (a draft model's), for the rejection rule."""
        if any(c.request.pooling_params is not None for c in chunks):
            return self._execute_pooling(chunks, masks, draft_probs)
        logits = self._governed(lambda: self.forward(logits_view(chunks)))
        return sample_step(self.sampler, chunks, logits, masks, draft_probs)

    @torch.inference_mode()
    def launch(self, chunks: Sequence[ScheduledChunk], masks: RowMasks | None = None,
               draft_probs: Mapping[str, Sequence[torch.Tensor | None]] | None = None
               ) -> Callable[[], ModelOutput]:
        """``execute`` in two halves: the forward and the sampling queued on the GPU, and a
        function that waits for the sampled ids (overlapped scheduling builds the last step's
        outputs in between, on the same thread). A CPU's step, or one with pooling chunks,
        runs whole here."""
        if self.device.type != "cuda" or any(c.request.pooling_params is not None
                                             for c in chunks):
            done = self.execute(chunks, masks, draft_probs)
            return lambda: done
        logits = self.forward(logits_view(chunks))
        return launch_sample_step(self.sampler, chunks, logits, masks, draft_probs)

    def _governed(self, run: Callable[[], Any]) -> Any:
        """``run`` under the thread governor, where there is one."""
        return self.governor.run(run) if self.governor else run()

    def _execute_pooling(self, chunks: Sequence[ScheduledChunk], masks: RowMasks | None,
                         draft_probs: Mapping[str, Sequence[torch.Tensor | None]] | None
                         ) -> ModelOutput:
        """A step with pooling chunks: an encoder's whole prompts, or a decoder's pooling
        chunks (no logits) in one forward with the sampled ones (``pooling.py``)."""
        out = ModelOutput()  # its ``pooled``: sequence id -> vector, of prompts that ended here
        if not self.config.causal:
            out.pooled = self._governed(lambda: self.pooler.encode(chunks))
            return out
        sampled = any(c.num_logits for c in chunks)
        with self.pooler.hidden_states() as hidden:
            logits = self._governed(lambda: self.forward(logits_view(chunks)) if sampled
                                    else self._hidden_only(chunks))
        if sampled:  # pooling chunks have no logits rows: sampling skips them
            out = sample_step(self.sampler, chunks, logits, masks, draft_probs)
        out.pooled = self.pooler.collect(chunks, hidden[0])
        return out

    def _hidden_only(self, chunks: Sequence[ScheduledChunk]) -> None:
        """A forward with no logits rows: the inner model alone (lm_head would get none)."""
        batch = build_flat_batch(chunks, self.block_size, self.device)
        self.model.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)

    def greedy_generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_ids: frozenset[int] = frozenset()) -> list[int]:
        """Single-request greedy decoding on blocks 1..n (a convenience for tests and benches;
        serving goes through the engine and its scheduler). Block 0 is the tables' padding,
        which nothing ever writes."""
        total = len(prompt_ids) + max_new_tokens
        table = list(range(1, 1 + cdiv(total, self.block_size)))
        if len(table) >= self.num_blocks:
            raise ValueError(f"{total} tokens need {len(table)} blocks besides the padding "
                             f"block; the cache has {self.num_blocks - 1}")
        out: list[int] = []
        chunk = Chunk(list(prompt_ids), 0, table)
        while len(out) < max_new_tokens:
            token = int(self.forward([chunk])[-1].argmax())
            out.append(token)
            if token in stop_ids:
                break
            chunk = Chunk([token], len(prompt_ids) + len(out) - 1, table)
        return out


def sample_step(sampler: Sampler, chunks: Sequence[ScheduledChunk], logits: torch.Tensor,
                masks: RowMasks | None = None,
                draft_probs: Mapping[str, Sequence[torch.Tensor | None]] | None = None
                ) -> ModelOutput:
    """Sample a step's ``logits`` (one row per scored position, in chunk order) and accept
    each chunk's tokens (``launch_sample_step`` waited for at once)."""
    return launch_sample_step(sampler, chunks, logits, masks, draft_probs)()


def launch_sample_step(sampler: Sampler, chunks: Sequence[ScheduledChunk],
                       logits: torch.Tensor, masks: RowMasks | None = None,
                       draft_probs: Mapping[str, Sequence[torch.Tensor | None]] | None = None
                       ) -> Callable[[], ModelOutput]:
    """``sample_step`` in two halves: the sampling queued (on a GPU, no host sync but what
    prompt scoring and the grammar ``masks`` need: those are waited for and applied first),
    and a function that waits for the ids and accepts each chunk's tokens. Where
    ``logits_view`` asked for rows of prompt positions, they are scored (the prompt tokens'
    logprobs) and set aside first."""
    scored: dict[str, tuple[int, list]] = {}
    scoring = prompt_scoring(chunks)
    if scoring and logits.shape[0] > sum(c.num_logits for c in chunks):
        logits, scored = score_prompts(chunks, scoring, logits)
    rows = sampling_rows(chunks, draft_probs)
    if masks is not None:
        masks.apply(rows)
    pending = sampler.launch(logits, rows, owned=True)

    def accept() -> ModelOutput:
        out = accept_tokens(chunks, pending.result())
        out.prompt_logprobs = scored
        return out

    return accept


def _scores_prompt(chunk: ScheduledChunk) -> bool:
    """Whether the chunk holds prompt positions followed by a prompt token, of a request
    that asked for the prompt's logprobs."""
    request = chunk.request
    return request.sampling_params.prompt_logprobs is not None and \
        chunk.start_pos < request.num_prompt_tokens - 1


def prompt_scoring(chunks: Sequence[ScheduledChunk]) -> list[bool] | None:
    """Per chunk, whether it scores prompt tokens; None when none does (the common step)."""
    flags = [_scores_prompt(c) for c in chunks]
    return flags if any(flags) else None


def logits_view(chunks: Sequence[ScheduledChunk]) -> Sequence[ScheduledChunk]:
    """The chunks as the forward sees them: a chunk scoring prompt tokens wants the logits of
    every position it computes (its sampled rows stay its last ``num_logits``)."""
    scoring = prompt_scoring(chunks)
    if scoring is None:
        return chunks
    return [replace(c, num_logits=c.num_tokens) if flag else c
            for c, flag in zip(chunks, scoring)]


def score_prompts(chunks: Sequence[ScheduledChunk], scoring: Sequence[bool],
                  logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[int, list]]]:
    """Split ``logits_view``'s rows: the rows to sample, and per request (its group id) the
    index of the first prompt token scored and the entries scoring it and those after it."""
    keep: list[int] = []
    score_rows: list[int] = []
    next_ids: list[int] = []
    num_top: list[int] = []
    spans: list[tuple[str, int, int]] = []  # group id, first token scored, how many
    row = 0
    for c, flag in zip(chunks, scoring):
        width = c.num_tokens if flag else c.num_logits
        keep.extend(range(row + width - c.num_logits, row + width))
        if flag:
            prompt = c.request.prompt_token_ids
            k = min(width, len(prompt) - 1 - c.start_pos)  # positions whose next is prompt
            score_rows.extend(range(row, row + k))
            next_ids.extend(prompt[c.start_pos + 1:c.start_pos + 1 + k])
            num_top.extend([c.request.sampling_params.prompt_logprobs] * k)
            spans.append((c.request.group_id, c.start_pos + 1, k))
        row += width
    index = torch.tensor(score_rows, dtype=torch.int64, device=logits.device)
    entries = prompt_logprob_entries(logits.index_select(0, index), next_ids, num_top)
    scored, taken = {}, 0
    for group_id, first, k in spans:
        scored[group_id] = (first, entries[taken:taken + k])
        taken += k
    sampled = logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
    return sampled, scored


def sampling_rows(chunks: Sequence[ScheduledChunk],
                  draft_probs: Mapping[str, Sequence[torch.Tensor | None]] | None = None
                  ) -> list[SamplingRow]:
    """One row per logits row: a chunk's j-th scored position follows its first j drafts and,
    where the draft there came with its distribution, verifies it by the rejection rule."""
    rows = []
    for c in chunks:
        r = c.request
        drafts = c.draft_token_ids
        probs = draft_probs.get(c.request_id, ()) if draft_probs else ()
        for j in range(c.num_logits):
            row = sampling_row(r, drafts[:j])
            if j < len(drafts) and j < len(probs) and probs[j] is not None:
                row.draft_token, row.draft_probs = drafts[j], probs[j]
            rows.append(row)
    return rows


def sampling_row(request: Request, drafts: Sequence[int] = ()) -> SamplingRow:
    """The row that samples the position after ``request``'s tokens and ``drafts``."""
    output = [*request.output_token_ids, *drafts] if drafts else request.output_token_ids
    return SamplingRow(request.request_id, request.sampling_params, request.prompt_token_ids,
                       output, request.stop_token_ids, request.seq_index)


def accept_tokens(chunks: Sequence[ScheduledChunk], sampled: SamplerOutput) -> ModelOutput:
    """Per chunk: its samples up to and including the first that differs from the draft it
    follows (all of them when every draft matched)."""
    out = ModelOutput()
    row = 0
    for c in chunks:
        if not c.num_logits:
            continue
        tokens = sampled.token_ids[row:row + c.num_logits]
        kept = num_matching_drafts(c.draft_token_ids, tokens) + 1
        out.token_ids[c.request_id] = tokens[:kept]
        out.logprobs[c.request_id] = sampled.logprobs[row:row + kept]
        row += c.num_logits
    return out
