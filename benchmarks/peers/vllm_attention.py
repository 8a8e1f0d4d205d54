"""vLLM's CPU attention ops timed on the cases of ``benchmarks/attention_speed.py``, run by the
Python of vLLM's own environment (``attention_speed.py --vllm-python PATH`` starts it; it imports
nothing of tokenmill). A call stores the new K/V (``cpu_attn_reshape_and_cache``) and attends
(``cpu_attention_with_kv_cache``) as vLLM's CPU backend does for one layer, in vLLM's layout and
default block size, the scheduler metadata built once per ``layers`` calls as a step builds it.

    python benchmarks/peers/vllm_attention.py '{"cases": {...}, "dtype": "float32", ...}'

Before a case is timed, one call with every key stored through vLLM's own op is checked against
a float64 softmax (``check``): a case whose arguments vLLM reads otherwise stops the run. Prints
one JSON object: case name -> ms per layer and the check's error, vLLM's version, and the ISA
and block size its choice gave (``_get_attn_isa``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def time_call(fn, min_time: float = 0.5) -> float:
    """Seconds a call of ``fn`` takes: one call to warm up, then as many as ``min_time`` holds."""
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def paged_layout(shapes: list, shared_tokens: int, block: int
                 ) -> tuple[list[list[int]], list[int], list[int]]:
    """Block tables, query start offsets and the new tokens' slots for sequences of (cached,
    new) tokens whose first ``shared_tokens`` (whole blocks of them, as a prefix cache shares)
    sit in the same blocks, each sequence's other blocks its own."""
    shared = shared_tokens // block
    tables, next_block, starts = [], shared, [0]
    for cached, new in shapes:
        assert cached >= shared * block, "a sequence holds the whole shared prefix"
        own = -(-(cached + new) // block) - shared
        tables.append(list(range(shared)) + list(range(next_block, next_block + own)))
        next_block += own
        starts.append(starts[-1] + new)
    slots = [slot_of(tables[i], p, block)
             for i, (cached, new) in enumerate(shapes) for p in range(cached, cached + new)]
    return tables, starts, slots


def slot_of(table: list[int], position: int, block: int) -> int:
    return table[position // block] * block + position % block


class Batch:
    """One case's batch as vLLM's CPU backend hands it to its ops: the tensors of the layout,
    caches in its layout, the scheduler metadata and the attention call."""

    def __init__(self, shapes: list, shared_tokens: int, spec: dict, isa: str):
        from vllm import _custom_ops as ops

        self.ops, self.spec, self.isa = ops, spec, isa
        self.dtype = getattr(torch, spec["dtype"])
        self.tables, self.starts, self.slots = paged_layout(shapes, shared_tokens, spec["block"])
        self.blocks = 1 + max(b for t in self.tables for b in t)
        width = max(map(len, self.tables))
        self.block_table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables],
                                        dtype=torch.int32)
        self.seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32)
        self.query_start_loc = torch.tensor(self.starts, dtype=torch.int32)

    def cache(self, fill) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches: vLLM's [blocks, kv heads, block, 2 x head_dim], viewed as its
        kernels read it; ``fill(shape)`` makes the tensor."""
        spec, blocks = self.spec, self.blocks
        kv = fill((blocks, spec["kv_heads"], spec["block"], 2 * spec["head_dim"])).to(self.dtype)
        return kv.view(blocks, spec["kv_heads"], spec["block"] * 2, spec["head_dim"]).chunk(2, 2)

    def metadata(self) -> torch.Tensor:
        spec = self.spec
        return self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(self.tables), num_heads=spec["heads"], num_kv_heads=spec["kv_heads"],
            head_dim=spec["head_dim"], seq_lens=self.seq_lens, dtype=self.dtype,
            query_start_loc=self.query_start_loc, causal=True, sliding_window_size=-1,
            isa=self.isa, enable_kv_split=True)

    def attend(self, q: torch.Tensor, cache: tuple, out: torch.Tensor,
               meta: torch.Tensor) -> None:
        self.ops.cpu_attention_with_kv_cache(
            query=q, key_cache=cache[0], value_cache=cache[1], output=out,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            scale=self.spec["head_dim"] ** -0.5, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=self.block_table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)


def case_call(shapes: list, shared_tokens: int, spec: dict, isa: str):
    """The call timed for one case: sequences of (cached, new) tokens whose first
    ``shared_tokens`` sit in the same blocks (a prefix cache's hit)."""
    batch = Batch(shapes, shared_tokens, spec, isa)
    heads, kv_heads, dim = spec["heads"], spec["kv_heads"], spec["head_dim"]
    gen = torch.Generator().manual_seed(0)
    tokens = batch.starts[-1]
    q = torch.randn(tokens, heads, dim, generator=gen).to(batch.dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(batch.dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(batch.dtype)
    out = torch.empty_like(q)
    slot_mapping = torch.tensor(batch.slots, dtype=torch.int64)
    caches = [batch.cache(lambda shape: torch.randn(shape, generator=gen))
              for _ in range(spec["layers"])]

    def call():
        meta = batch.metadata()
        for cache in caches:
            batch.ops.cpu_attn_reshape_and_cache(k, v, *cache, slot_mapping, isa)
            batch.attend(q, cache, out, meta)

    return call


def check(shapes: list, shared_tokens: int, spec: dict, isa: str) -> float:
    """One call with every key and value stored through vLLM's own op (no assumption about its
    cache's inner layout) against a float64 softmax over the same keys: the arguments the timed
    call passes mean what this script takes them to. Returns the largest error relative to the
    output's largest value."""
    batch = Batch(shapes, shared_tokens, spec, isa)
    heads, kv_heads, dim, block = spec["heads"], spec["kv_heads"], spec["head_dim"], spec["block"]
    gen = torch.Generator().manual_seed(1)
    shared = shared_tokens // block * block
    common = torch.randn(2, shared, kv_heads, dim, generator=gen).to(batch.dtype)
    full = [torch.cat([common, torch.randn(2, c + n - shared, kv_heads, dim, generator=gen)
                       .to(batch.dtype)], dim=1) for c, n in shapes]
    slots = [slot_of(t, p, block) for t, (c, n) in zip(batch.tables, shapes)
             for p in range(c + n)]
    cache = batch.cache(torch.zeros)
    batch.ops.cpu_attn_reshape_and_cache(torch.cat([f[0] for f in full]),
                                         torch.cat([f[1] for f in full]), *cache,
                                         torch.tensor(slots, dtype=torch.int64), isa)
    starts = batch.starts
    q = torch.randn(starts[-1], heads, dim, generator=gen).to(batch.dtype)
    out = torch.empty_like(q)
    batch.attend(q, cache, out, batch.metadata())
    group = heads // kv_heads
    want = torch.empty(out.shape, dtype=torch.float64)
    for i, (c, n) in enumerate(shapes):
        keys = full[i][0].double().repeat_interleave(group, dim=1)  # (positions, heads, dim)
        values = full[i][1].double().repeat_interleave(group, dim=1)
        rows = q[starts[i]:starts[i + 1]].double()
        scores = torch.einsum("thd,phd->htp", rows, keys) * dim ** -0.5
        later = torch.arange(c + n)[None, :] > torch.arange(c, c + n)[:, None]
        probs = scores.masked_fill(later, float("-inf")).softmax(-1)
        want[starts[i]:starts[i + 1]] = torch.einsum("htp,phd->thd", probs, values)
    return ((out.double() - want).abs().max() / want.abs().max()).item()


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # as benchmarks/peers/peers.py serves it
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the build for this CPU's ISA (_C, _C_AVX512, _C_AVX2)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    import vllm

    isa = _get_attn_isa(getattr(torch, spec["dtype"]), spec["block"], spec["head_dim"])
    result = {"version": vllm.__version__, "isa": isa, "block_size": spec["block"],
              "threads": torch.get_num_threads(), "ms_per_layer": {}}
    with torch.inference_mode():
        for name, case in spec["cases"].items():
            error = check(case["shapes"], case.get("shared_tokens", 0), spec, isa)
            if not error < (1e-4 if spec["dtype"] == "float32" else 3e-2):
                raise SystemExit(f"{name}: vLLM's output is off by {error:.2g} of its largest "
                                 "value: the case's arguments are not what vLLM reads")
            result.setdefault("check_error", {})[name] = error
            call = case_call(case["shapes"], case.get("shared_tokens", 0), spec, isa)
            ms = time_call(call, spec["min_time"]) * 1e3 / spec["layers"]
            result["ms_per_layer"][name] = round(ms, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
