"""CPU attention that reads K/V through the block tables in place (``kernels/csrc``).

One kernel call covers the whole flat batch — decode rows, prompt chunks and chunks after a
cached prefix — without gathering any sequence's K/V. Where several sequences of the step share
leading KV blocks (a common system prompt through the prefix cache, or the n > 1 siblings of a
request), the shared blocks are attended once for all of their queries (cascade attention): a
second call reads each shared block once per tile of queries from many sequences, and its
partial softmax state is merged with that of each sequence's own blocks.

The plan (per-token key limits, cascade groups) is made once per step, on the first layer, from
host lists; every layer then makes one or two kernel calls.

A sliding-window layer has its own plan, made once per step and window: each query token's
lower key bound (position - window + 1), so the kernel starts every tile at the first block
its tokens see and masks below each bound. That plan has no cascade pass (a shared prefix is
not seen whole by every windowed query); where no query of the step reaches past its window,
the window changes nothing and the layer takes the plain plan, cascade included. Sinks are
given to the main pass only, so merging the shared pass still counts each sink once.

Batch invariance (``docs/batch_invariance.md``): one work item holds every key of its (request,
KV head, tile of query tokens), so no split of the keys depends on the batch, and the kernel's
softmax steps end at fixed multiples of blocks, so a query row's sums round the same whatever
rows share its tile. A merged cascade pass rounds otherwise than one pass over the same keys,
so the batch-invariant mode runs it the other way round (``cascade = "resume"``): the shared
pass first, over whole softmax steps of the shared blocks, handing each row's softmax state to
the main pass, which continues it as one pass would: the plain path's bits, reads still shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.attention.kv_quant import cache_head_dim
from tokenmill.attention.torch_ref import TorchReferenceBackend

# Query tokens of one request computed together; a larger tile shares each K/V load more
# widely (the shared-prefix pass) at the cost of fewer parallel work items.
TILE = 16
CASCADE_TILE = 16
# paged_attention's ``combine`` (csrc/paged_attention.h's Combine)
WRITE, MERGE, SAVE_STATE, RESUME = range(4)
# Cascade only where it saves reads: at least this many sequences sharing this many blocks.
MIN_CASCADE_SEQS = 2
MIN_CASCADE_BLOCKS = 2
# How the shared-prefix pass joins the main one: "merge" (after it, normalised results merged
# by their log-sum-exp), "resume" (before it, handing over its softmax state: batch-invariant)
CASCADES = ("merge", "resume")


@dataclass
class CascadeGroup:
    rows: list[int]  # requests (rows of the batch) sharing the prefix
    blocks: list[int]  # the shared block ids


@dataclass
class AttentionPlan:
    key_start_block: torch.Tensor  # (R,) first block each request reads in the main pass
    key_limit: torch.Tensor  # (T,) keys visible to each query token: its position + 1
    empty: torch.Tensor
    # (T,) the first key each query token sees (its window's start); empty: no window
    key_low: torch.Tensor
    # the shared-prefix pass (None when no group qualifies)
    shared: tuple[torch.Tensor, ...] | None = None
    resume: bool = False  # the shared pass first, its softmax state resumed (CASCADES)


def find_cascade_groups(tables: list[list[int]], query_lens: list[int], seq_lens: list[int],
                        block_size: int, step_blocks: int = 1) -> list[CascadeGroup]:
    """Sets of requests whose block tables start with the same blocks. Only blocks before a
    request's first new token count (every query of the request then sees all of them), and
    of those a multiple of ``step_blocks`` (the kernel's softmax step, for a pass that hands
    its state over)."""
    least = max(MIN_CASCADE_BLOCKS, step_blocks)
    by_first: dict[int, list[int]] = {}
    for r, table in enumerate(tables):
        # a table starting with the null block released it behind a sliding window
        if table[0] != 0 and (seq_lens[r] - query_lens[r]) // block_size >= least:
            by_first.setdefault(table[0], []).append(r)
    groups = []
    for rows in by_first.values():
        if len(rows) < MIN_CASCADE_SEQS:
            continue
        lead = tables[rows[0]]
        common = min((seq_lens[r] - query_lens[r]) // block_size for r in rows)
        for r in rows[1:]:
            table = tables[r]
            n = 0
            while n < common and table[n] == lead[n]:
                n += 1
            common = n
        common -= common % step_blocks
        if common >= least:
            groups.append(CascadeGroup(rows, lead[:common]))
    return groups


def window_lows(meta: AttentionMetadata, window: int) -> list[int] | None:
    """Each query token's first visible key under ``window`` (its position - window + 1, at
    least 0); None when every one is 0 (no query of the step reaches past the window)."""
    lows: list[int] = []
    for q, s in zip(meta.query_lens_host, meta.seq_lens_host):
        lows.extend(max(0, p - window + 1) for p in range(s - q, s))
    return lows if any(lows) else None


def make_window_plan(meta: AttentionMetadata, lows: list[int]) -> AttentionPlan:
    """The plan of a sliding-window layer: causal limits and ``lows``, no cascade pass."""
    plan = make_plan(meta, cascade=False)
    plan.key_low = torch.tensor(lows)
    return plan


def make_plan(meta: AttentionMetadata, cascade: bool = True,
              step_blocks: int | None = None) -> AttentionPlan:
    """The step's plan: causal key limits and, with ``cascade``, the shared-prefix pass (merged
    after the main one; given ``step_blocks``, the kernel's blocks per softmax step, over whole
    steps of the shared blocks, its state resumed by the main pass)."""
    q_lens, s_lens, bs = meta.query_lens_host, meta.seq_lens_host, meta.block_size
    limits: list[int] = []
    for q, s in zip(q_lens, s_lens):
        limits.extend(range(s - q + 1, s + 1))
    start_block = [0] * len(q_lens)
    empty = torch.empty(0, dtype=torch.int64)
    plan = AttentionPlan(key_start_block=torch.tensor(start_block),
                         key_limit=torch.tensor(limits), empty=empty, key_low=empty)
    tables = meta.block_tables_host if cascade else None
    if tables is None or len(q_lens) < MIN_CASCADE_SEQS:
        return plan
    groups = find_cascade_groups(tables, q_lens, s_lens, bs, step_blocks or 1)
    if not groups:
        return plan
    plan.resume = step_blocks is not None
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    width = max(len(g.blocks) for g in groups)
    g_tables, g_starts, g_limits, g_rows = [], [0], [], []
    for g in groups:
        g_tables.append(g.blocks + [0] * (width - len(g.blocks)))
        for r in g.rows:
            start_block[r] = len(g.blocks)
            g_rows.extend(range(starts[r], starts[r + 1]))
        g_starts.append(len(g_rows))
        g_limits.extend([len(g.blocks) * bs] * (g_starts[-1] - g_starts[-2]))
    plan.key_start_block = torch.tensor(start_block)
    plan.shared = (torch.tensor(g_tables), torch.tensor(g_starts),
                   torch.zeros(len(groups), dtype=torch.int64), torch.tensor(g_limits),
                   torch.tensor(g_rows))
    return plan


class CpuPagedBackend(AttentionBackend):
    """K is kept transposed inside each block, ``(KVH, head_dim, block_size)`` per block (V as
    the reference keeps it), so a block's keys for one head are contiguous and a query's
    scores for a run of keys are plain vector FMAs; ``store_kv`` writes that layout. A model
    whose head size the kernel does not take runs on the reference instead (layout included).

    An int8 cache (``runner/kv_cache.py``) keeps the same arrangement with its scales beside
    the values: per block and head, K is ``head_dim`` rows of ``block_size`` int8 then the
    block's ``block_size`` float16 scales; V is token-major rows of ``head_dim`` int8 and the
    float16 scale. The kernel reads the int8 values in place and applies the K scale to each
    score and the V scale to each probability, so no block is ever dequantized to memory. A
    bfloat16 cache under a float32 model is read in place too, widened in registers. An fp8
    cache (meant for GPUs) is attended by the reference, in the reference's layout."""

    name = "cpu"

    def __init__(self, ops):
        self.ops = ops
        # how a step's shared-prefix pass joins the main one (CASCADES): "resume" in the
        # batch-invariant mode, whose rows must round as one pass over their keys does
        # (model/linear/setup.py sets it)
        self.cascade = "merge"
        self._fallback: TorchReferenceBackend | None = None
        self._checked: tuple | None = None

    def _reference_for(self, kv_cache, dtype: torch.dtype) -> TorchReferenceBackend | None:
        """The reference backend when the kernel cannot take this cache with K/V of ``dtype``
        (a head size it does not take, fp8, bfloat16 under float16); None when it can."""
        k_cache = kv_cache[0]
        key = (cache_head_dim(k_cache), k_cache.shape[1], k_cache.dtype, dtype)  # head_dim, block
        if key != self._checked:
            self._checked = key
            readable = k_cache.dtype in (dtype, torch.int8) or (
                k_cache.dtype == torch.bfloat16 and dtype == torch.float32)
            ok = self.ops.supports(*key[:2]) and readable
            self._fallback = None if ok else TorchReferenceBackend()
        return self._fallback

    def store_kv(self, k, v, kv_cache, slot_mapping) -> None:
        ref = self._reference_for(kv_cache, k.dtype)
        if ref is not None:
            return ref.store_kv(k, v, kv_cache, slot_mapping)
        self.ops.store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)

    def plan(self, meta: AttentionMetadata, window: int | None = None) -> AttentionPlan:
        """The step's plan for layers of ``window``, made on the first such layer and kept in
        ``meta`` for the others (keyed by this backend's name and the window)."""
        key = (self.name, window)
        plan = meta.plans.get(key)
        if plan is None:
            lows = None if window is None else window_lows(meta, window)
            if lows is not None:
                plan = make_window_plan(meta, lows)
            elif window is not None:
                plan = self.plan(meta)
            else:
                steps = self.ops.attention_step_blocks if self.cascade == "resume" else None
                plan = make_plan(meta, step_blocks=steps)
            meta.plans[key] = plan
        return plan

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, *,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        ref = self._reference_for(kv_cache, q.dtype)
        if ref is not None:
            return ref.forward(q, k, v, kv_cache, meta, scale, window=window, sinks=sinks)
        self.store_kv(k, v, kv_cache, meta.slot_mapping)
        plan = self.plan(meta, window)
        sinks = plan.empty if sinks is None else sinks.float().contiguous()
        k_cache, v_cache = kv_cache
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # rows may be strided, heads not
            q = q.contiguous()
        if plan.resume:
            return self._resumed(q, kv_cache, meta, plan, scale)
        # the two passes merge in float32; without a second pass write q's dtype directly
        out = torch.empty(q.shape, dtype=torch.float32 if plan.shared else q.dtype)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        no_state = torch.empty(0)
        self.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                 plan.key_start_block, plan.key_limit, plan.key_low, plan.empty,
                                 sinks, out, lse, no_state, scale, WRITE, TILE)
        if plan.shared is not None:
            tables, starts, key_start, limits, rows = plan.shared
            self.ops.paged_attention(q, k_cache, v_cache, tables, starts, key_start, limits,
                                     plan.empty, rows, plan.empty, out, lse, no_state, scale,
                                     MERGE, CASCADE_TILE)
            out = out.to(q.dtype)
        return out

    def _resumed(self, q, kv_cache, meta: AttentionMetadata, plan: AttentionPlan,
                 scale: float) -> torch.Tensor:
        """The shared pass first, saving each row's softmax state (rows it leaves keep the
        initial one), then the main pass resuming it (``CASCADES``' "resume")."""
        k_cache, v_cache = kv_cache
        out = torch.zeros(q.shape, dtype=torch.float32)  # raw accumulators between the passes
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        state = torch.empty(*q.shape[:2], 2)  # (T, H, (m, l))
        state[..., 0], state[..., 1] = float("-inf"), 0.0
        tables, starts, key_start, limits, rows = plan.shared
        self.ops.paged_attention(q, k_cache, v_cache, tables, starts, key_start, limits,
                                 plan.empty, rows, plan.empty, out, lse, state, scale,
                                 SAVE_STATE, CASCADE_TILE)
        self.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                 plan.key_start_block, plan.key_limit, plan.empty, plan.empty,
                                 plan.empty, out, lse, state, scale, RESUME, TILE)
        return out.to(q.dtype)
