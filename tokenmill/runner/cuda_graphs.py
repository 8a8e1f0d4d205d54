"""CUDA graphs of the decode step, one per batch-size bucket, over persistent input buffers.

A decode step of ``n`` sequences (one new token each, one logits row each) is replayed from the
graph of the smallest bucket ``b >= n`` (1, 2, 4, 8, then every 16 up to ``max_num_seqs``); the
``b - n`` padded rows have a slot of -1 (their K/V are written nowhere) and a sequence length
of 0 (they read nothing and come out as zeros), and their logits are dropped. Prompt chunks,
speculative verification and anything above the largest bucket run eagerly.

The inputs live in device tensors allocated once (``StepBuffers``): per step the host fills one
pinned staging tensor (numpy over the step's columns, no loop per sequence; two staging sets in
turn, so a fill never overwrites a copy still queued) and copies it with a single non-blocking
transfer; a block table row is copied only up to the longest table of the step (the kernel
never reads past a sequence's length). All buckets share one memory pool, captured largest
first. The model's attention backend must read only device tensors and shapes of its metadata
(``TritonPagedBackend`` does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.runner.batch import SeqChunk, padded_tables
from tokenmill.util import cdiv, tracked

log = logging.getLogger("tokenmill.runner")


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (which is always the last)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted(set(sizes) | {max_num_seqs})


def is_plain_decode(chunks: Sequence[SeqChunk]) -> bool:
    """One new token and its logits per sequence: the steps a graph replays."""
    return all(len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks)


class StepBuffers:
    """Persistent device tensors holding one decode step's inputs for up to ``rows`` sequences,
    filled from a pinned host tensor with one non-blocking copy per step."""

    # the int64 fields of a row, in the staging tensor's column order
    FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens")

    def __init__(self, rows: int, max_blocks: int, device: torch.device):
        self.rows, self.max_blocks = rows, max_blocks
        self.device = device
        self.flat = torch.zeros(len(self.FIELDS), rows, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.flat.unbind(0)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        # Two staging sets, used in turn: the host fills one while the other's non-blocking
        # copy may still be queued behind a running step (overlapped scheduling).
        self._staging = [torch.zeros(len(self.FIELDS), rows, dtype=torch.int64, pin_memory=pin)
                         for _ in range(2)]
        self._tables = [torch.zeros(rows, max_blocks, dtype=torch.int64, pin_memory=pin)
                        for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each set's last copy
        self._turn = 0
        self.slot_mapping.fill_(-1)

    def fill(self, chunks: Sequence[SeqChunk], padded: int, block_size: int) -> None:
        """The step's ``len(chunks)`` sequences in rows ``0..n``, padding rows up to
        ``padded`` (slot -1, length 0)."""
        n = len(chunks)
        if padded > self.rows or n > padded:
            raise ValueError(f"{n} sequences padded to {padded} do not fit {self.rows} rows")
        width = max(len(c.block_table) for c in chunks)
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds {self.max_blocks}")
        turn = self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # that set's copy is done: its memory is free
        staging, stage = self._staging[turn].numpy(), self._tables[turn][:n, :width]
        tables = padded_tables([c.block_table for c in chunks], width)  # (n, width)
        pos = np.array([c.start_pos for c in chunks], dtype=np.int64)
        staging[0, :n] = [c.token_ids[0] for c in chunks]
        staging[1, :n] = pos
        staging[2, :n] = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
        staging[3, :n] = pos + 1
        staging[:, n:] = 0
        staging[2, n:] = -1
        stage.numpy()[:] = tables
        # all rows every time (a few KiB, one contiguous copy); only the step's table columns
        self.flat.copy_(self._staging[turn], non_blocking=True)
        self.block_tables[:n, :width].copy_(stage, non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()

    def metadata(self, rows: int, block_size: int) -> AttentionMetadata:
        """Views of the first ``rows`` rows as a pure-decode batch's metadata (the host lists
        are placeholders: a graph-safe backend does not read them)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:rows + 1], seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows], slot_mapping=self.slot_mapping[:rows],
            query_lens_host=[1] * rows, seq_lens_host=[1] * rows, block_size=block_size)


@dataclass
class CaptureReport:
    buckets: list[int]
    seconds: float
    memory_bytes: int


class DecodeGraphs:
    """Captures and replays the decode step of ``model`` for each bucket."""

    def __init__(self, model: nn.Module, kv_caches, block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.buckets = graph_buckets(max_num_seqs)
        max_blocks = cdiv(max_model_len, block_size)
        self.buffers = StepBuffers(self.buckets[-1], max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.report: CaptureReport | None = None  # set by capture()

    def _forward(self, rows: int) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids[:rows], b.positions[:rows], self.kv_caches,
                          b.metadata(rows, self.block_size))

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        pool = None
        # largest first: the rest fit in its pool
        for rows in tracked(reversed(self.buckets), "capturing CUDA graphs",
                            len(self.buckets), "graphs"):
            self._forward(rows)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[rows] = self._forward(rows)
            pool = graph.pool()
            self.graphs[rows] = graph
        torch.cuda.synchronize()
        report = self.report = CaptureReport(list(self.buckets), time.perf_counter() - start,
                                             free_before - torch.cuda.mem_get_info()[0])
        log.info("captured CUDA graphs for decode batches of %s sequences in %.1f s (%.0f MiB)",
                 ",".join(map(str, report.buckets)), report.seconds,
                 report.memory_bytes / 2**20)
        return report

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, chunks: Sequence[SeqChunk]) -> torch.Tensor | None:
        """Logits of a plain decode step by replay, or None when no graph fits it."""
        rows = self.bucket(len(chunks))
        if rows is None or not is_plain_decode(chunks):
            return None
        self.buffers.fill(chunks, rows, self.block_size)
        self.graphs[rows].replay()
        return self.outputs[rows][:len(chunks)]
