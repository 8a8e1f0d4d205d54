"""Scheduler decisions -> the flat-batch tensors the model reads. The only place they're built."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.attention import AttentionMetadata


class SeqChunk(Protocol):
    """What the runner needs of one scheduled request (the scheduler's ScheduledChunk fits)."""

    token_ids: Sequence[int]  # new tokens to compute this step
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: Sequence[int]  # covers start_pos + len(token_ids) tokens
    num_logits: int  # logits wanted at the chunk's last num_logits positions (0: none)


@dataclass
class Chunk:
    """A plain SeqChunk, for callers that are not the scheduler (tests, benchmarks)."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    num_logits: int = 1


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are computed, in order


def build_flat_batch(chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str,
                     all_logits: bool = False) -> FlatBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = query_starts(chunks)
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    for c, end in zip(chunks, query_start[1:]):
        n, start = len(c.token_ids), c.start_pos
        input_ids.extend(c.token_ids)
        positions.extend(range(start, start + n))
        table = c.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(start, start + n))
        logits_rows.extend(range(end - (n if all_logits else c.num_logits), end))
        seq_lens.append(start + n)
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = [x for c in chunks
              for x in (*c.block_table, *[0] * (max_blocks - len(c.block_table)))]
    ids, pos, qsl, lens, table, slot, rows = to_device(
        [input_ids, positions, query_start, seq_lens, tables, slots, logits_rows], device)
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=lens, block_tables=table.view(len(chunks), max_blocks),
        slot_mapping=slot, query_lens_host=[len(c.token_ids) for c in chunks],
        seq_lens_host=seq_lens, block_size=block_size,
        block_tables_host=[c.block_table for c in chunks],
        known_lens_host=[getattr(c, "num_known_tokens", None) or c.start_pos + len(c.token_ids)
                         for c in chunks])
    return FlatBatch(ids, pos, meta, rows)


def query_starts(chunks: Sequence[SeqChunk]) -> list[int]:
    """Where each chunk's rows start in the flat batch, and the end: ``[0, n0, n0 + n1, ...]``."""
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + len(c.token_ids))
    return starts


def to_device(parts: list[list[int]], device: torch.device | str) -> list[torch.Tensor]:
    """int64 tensors of ``parts`` on ``device``: on a GPU all of them through one pinned host
    tensor and one non-blocking copy (the host goes on building the step), then views."""
    if torch.device(device).type == "cpu":
        return [torch.tensor(p, dtype=torch.int64) for p in parts]
    host = torch.tensor([x for p in parts for x in p], dtype=torch.int64).pin_memory()
    return list(host.to(device, non_blocking=True).split([len(p) for p in parts]))
