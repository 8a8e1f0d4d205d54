"""ModelRunner: owns the model, its KV cache and the sampler; turns one scheduler step into one
forward pass and one sampled token per sampling sequence."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from tokenmill.model.loader import LoadedModel
from tokenmill.runner.batch import Chunk, SeqChunk, build_flat_batch
from tokenmill.runner.kv_cache import allocate_kv_cache
from tokenmill.runner.sampler import Sampler, SamplerOutput, SamplingRow


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16,
                 device: str = "cpu"):
        self.model = loaded.model
        self.config = loaded.config
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        dtype = getattr(torch, self.config.dtype)
        self.kv_caches = allocate_kv_cache(self.config, num_blocks, block_size, self.device, dtype)
        self.sampler = Sampler()

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """Run one step; logits (float32) for the last token of each sampling chunk, in order
        (or for every token when ``all_logits``)."""
        batch = build_flat_batch(chunks, self.block_size, self.device, all_logits)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                          batch.logits_indices)

    @torch.inference_mode()
    def execute(self, chunks: Sequence, eos_token_ids: frozenset[int]) -> SamplerOutput:
        """Forward the scheduled chunks and sample one token for each chunk with ``sample``.

        ``chunks`` are the scheduler's ScheduledChunks (they carry ``request``); the result
        lists tokens in the order of the sampling chunks."""
        logits = self.forward(chunks)
        rows = [SamplingRow(c.request_id, c.request.sampling_params, c.request.prompt_token_ids,
                            c.request.output_token_ids, eos_token_ids, c.request.seq_index)
                for c in chunks if c.sample]
        return self.sampler(logits, rows)

    def forget(self, seq_ids: Iterable[str]) -> None:
        """Drop per-sequence state (seeded generators) of finished sequences."""
        self.sampler.forget(seq_ids)

    def greedy_generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_ids: frozenset[int] = frozenset()) -> list[int]:
        """Single-request greedy decoding on blocks 0..n (a convenience for tests and benches;
        serving goes through the engine and its scheduler)."""
        total = len(prompt_ids) + max_new_tokens
        table = list(range(-(-total // self.block_size)))
        if len(table) > self.num_blocks:
            raise ValueError(f"{total} tokens need {len(table)} blocks; cache has {self.num_blocks}")
        out: list[int] = []
        chunk = Chunk(list(prompt_ids), 0, table)
        while len(out) < max_new_tokens:
            token = int(self.forward([chunk])[-1].argmax())
            out.append(token)
            if token in stop_ids:
                break
            chunk = Chunk([token], len(prompt_ids) + len(out) - 1, table)
        return out
