"""Scheduler decisions -> the flat-batch tensors the model reads. The only place they're built."""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
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
    # Per-token arrays by numpy over the per-chunk columns: a large batch's step costs a few
    # list comprehensions, not a Python loop per token (host time per step at 1,024 sequences).
    n = len(chunks)
    lens_host = [len(c.token_ids) for c in chunks]
    lens = np.array(lens_host, dtype=np.int64)
    starts = np.array([c.start_pos for c in chunks], dtype=np.int64)
    query_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    width = max(len(c.block_table) for c in chunks)
    tables = padded_tables([c.block_table for c in chunks], width)  # (n, width)
    if (lens == 1).all():  # one token per chunk (decodes): the columns are per token
        input_ids = np.array([c.token_ids[0] for c in chunks], dtype=np.int64)
        positions, chunk_of = starts, np.arange(n)
    else:
        input_ids = flat_ids([c.token_ids for c in chunks])
        chunk_of = np.repeat(np.arange(n), lens)
        positions = np.arange(int(query_start[-1])) - (query_start[:-1] - starts)[chunk_of]
    slots = tables[chunk_of, positions // block_size] * block_size + positions % block_size
    num_logits = lens if all_logits else np.array([c.num_logits for c in chunks], np.int64)
    seq_lens = starts + lens
    ids, pos, qsl, lens_t, table, slot, rows = to_device(
        [input_ids, positions, query_start, seq_lens, tables.reshape(-1), slots,
         last_rows(query_start, num_logits)], device)
    seq_lens_host = seq_lens.tolist()
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=lens_t, block_tables=table.view(n, width),
        slot_mapping=slot, query_lens_host=lens_host,
        seq_lens_host=seq_lens_host, block_size=block_size,
        block_tables_host=[c.block_table for c in chunks],
        known_lens_host=[getattr(c, "num_known_tokens", None) or s
                         for c, s in zip(chunks, seq_lens_host)])
    return FlatBatch(ids, pos, meta, rows)


def padded_tables(tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """(len(tables), width) int64, each table zero-padded on the right, built through one
    array.array (several times faster than numpy or torch on nested lists)."""
    buf = array.array("q")
    for t in tables:
        buf.extend(t)
        if len(t) < width:
            buf.frombytes(bytes(8 * (width - len(t))))
    return np.frombuffer(buf, dtype=np.int64).reshape(len(tables), width)


def flat_ids(token_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """The chunks' token ids end to end, int64."""
    buf = array.array("q")
    for ids in token_ids:
        buf.extend(ids)
    return np.frombuffer(buf, dtype=np.int64)


def last_rows(query_start: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Flat-batch rows of each chunk's last ``counts[i]`` tokens, in order."""
    if (counts == 1).all():
        return query_start[1:] - 1
    ends = np.repeat(query_start[1:] - counts, counts)  # the first wanted row, per wanted row
    before = np.cumsum(counts) - counts
    return ends + np.arange(int(counts.sum())) - np.repeat(before, counts)


def query_starts(chunks: Sequence[SeqChunk]) -> list[int]:
    """Where each chunk's rows start in the flat batch, and the end: ``[0, n0, n0 + n1, ...]``."""
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + len(c.token_ids))
    return starts


def to_device(parts: Sequence[Sequence[int] | np.ndarray],
              device: torch.device | str) -> list[torch.Tensor]:
    """int64 tensors of ``parts`` (lists or 1-D arrays) on ``device``: on a GPU all of them
    through one pinned host tensor and one non-blocking copy (the host goes on building the
    step), then views."""
    arrays = [np.asarray(p, dtype=np.int64) for p in parts]
    if torch.device(device).type == "cpu":
        return [torch.from_numpy(a.copy()) for a in arrays]  # owned: no caller's buffer shared
    host = torch.from_numpy(np.concatenate(arrays)).pin_memory()
    return list(host.to(device, non_blocking=True).split([len(a) for a in arrays]))
