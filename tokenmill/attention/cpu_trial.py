"""The load's trial of the CPU attention kernel's two routes for bf16 products: vdpbf16ps, or
float32 FMAs that give its bits (``csrc/attention_wide.h``). Where vdpbf16ps issues at half the
FMA units' rate (a Xeon with AVX512-BF16 and no AMX exposed) the FMAs take prompt tiles and a
shared prefix's pass ~1.3-1.4x faster; where vdpbf16ps keeps pace with the FMAs (expected of
AMD Zen 4, not measured) they would be slower. So the loader times both on the model's head
shapes and takes the FMAs for the work items where they measured faster: items of one decode
token's heads (``group`` rows) and items of a prompt tile or a shared prefix (``TILE`` tokens'
heads) are timed apart.

The route changes the pace only: the trial first checks, on random prompt and decode batches,
that both give the same bits on this CPU, and keeps vdpbf16ps where they do not."""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.attention.cpu_paged import TILE, WRITE

log = logging.getLogger(__name__)

# Whether the loader runs the trial (False: vdpbf16ps throughout)
WIDEN_TRIAL = True
# How much faster the FMAs must be to take a kind of item
WIDEN_MARGIN = 1.05
BLOCK = 16
# (sequences, query tokens each, keys each): a decode batch, a prompt chunk after a prefix
DECODE_CASE = (32, 1, 512)
TILE_CASE = (1, 8 * TILE, 512)
EXACT_CASES = ((7, 1, 300), (3, 40, 170), (1, 2 * TILE + 5, 77))


class _Case:
    """Random bf16 queries and a paged cache in the kernel's layout, and one call over them."""

    def __init__(self, ops, heads: int, kv_heads: int, head_dim: int, shape, seed: int):
        seqs, queries, keys = shape
        gen = torch.Generator().manual_seed(seed)
        per = -(-keys // BLOCK)
        blocks = seqs * per + 1  # block 0 left unused, as the engine's padding block
        cache = (blocks, BLOCK, kv_heads, head_dim)
        self.k_cache = torch.zeros(cache, dtype=torch.bfloat16)
        self.v_cache = torch.zeros(cache, dtype=torch.bfloat16)
        kv = torch.randn(2, seqs * keys, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        slots = torch.tensor([(1 + s * per) * BLOCK + p for s in range(seqs) for p in range(keys)])
        ops.store_kv(kv[0], kv[1], self.k_cache, self.v_cache, slots)
        self.q = torch.randn(seqs * queries, heads, head_dim, generator=gen).to(torch.bfloat16)
        self.tables = torch.tensor([[1 + s * per + i for i in range(per)] for s in range(seqs)])
        self.starts = torch.arange(seqs + 1) * queries
        self.key_start = torch.zeros(seqs, dtype=torch.long)
        self.limits = torch.tensor([keys - queries + 1 + i for _ in range(seqs)
                                    for i in range(queries)])
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(self.q.shape[:2])
        self.ops, self.scale = ops, head_dim ** -0.5

    def __call__(self) -> torch.Tensor:
        empty = torch.empty(0, dtype=torch.long)
        self.ops.paged_attention(self.q, self.k_cache, self.v_cache, self.tables, self.starts,
                                 self.key_start, self.limits, empty, empty, torch.empty(0),
                                 self.out, self.lse, torch.empty(0), self.scale, WRITE, TILE)
        return self.out


def _with_rows(ops, rows: int, fn):
    before = ops.attention_widen_from()
    ops.set_attention_widen_from(rows)
    try:
        return fn()
    finally:
        ops.set_attention_widen_from(before)


def widened_exact(ops, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the FMAs give vdpbf16ps's bits on this CPU for random prompt and decode
    batches of these head shapes."""
    for seed, shape in enumerate(EXACT_CASES):
        case = _Case(ops, heads, kv_heads, head_dim, shape, seed)
        dot, wide = (_with_rows(ops, rows, lambda: case().clone()) for rows in (0, 1))
        if not torch.equal(dot.view(torch.int16), wide.view(torch.int16)):
            return False
    return True


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def choose_widen_rows(ops, heads: int, kv_heads: int, head_dim: int,
                      repeats: int = 5) -> int | None:
    """The rows of a work item from which bf16 attention ran faster as float32 FMAs (1: every
    item; ``group + 1``: all but single decode tokens), or None (vdpbf16ps throughout: not
    faster, not this CPU's bits, or a build or head size without the two routes)."""
    if (not getattr(ops, "has_bf16_dot", False) or head_dim % 32
            or not ops.supports(head_dim, BLOCK)):
        return None
    if not widened_exact(ops, heads, kv_heads, head_dim):
        log.warning("attention: float32 FMAs do not give vdpbf16ps's bits on this CPU; bf16 "
                    "attention stays on vdpbf16ps")
        return None
    group = heads // kv_heads
    timings = {}
    with torch.inference_mode():
        for name, shape in (("decode", DECODE_CASE), ("tile", TILE_CASE)):
            case = _Case(ops, heads, kv_heads, head_dim, shape, seed=len(timings))
            timings[name] = tuple(_with_rows(ops, rows, lambda: _best_time(case, repeats))
                                  for rows in (0, 1))
    faster = {name: dot / wide >= WIDEN_MARGIN for name, (dot, wide) in timings.items()}
    rows = 1 if faster["decode"] and faster["tile"] else group + 1 if faster["tile"] else None
    log.info("attention, one layer's bf16 products: decode %s, prompt tile %s ms "
             "(vdpbf16ps/FMAs) -> %s",
             *("/".join(f"{t * 1e3:.2f}" for t in timings[n]) for n in ("decode", "tile")),
             f"float32 FMAs from {rows} rows per item" if rows else "vdpbf16ps throughout")
    return rows
