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
    slots = [tables[i][p // block] * block + p % block
             for i, (cached, new) in enumerate(shapes) for p in range(cached, cached + new)]
    return tables, starts, slots


def case_call(shapes: list, shared_tokens: int, spec: dict, isa: str):
    """The call timed for one case: sequences of (cached, new) tokens whose first
    ``shared_tokens`` sit in the same blocks (a prefix cache's hit)."""
    from vllm import _custom_ops as ops

    heads, kv_heads, dim, block = spec["heads"], spec["kv_heads"], spec["head_dim"], spec["block"]
    dtype = getattr(torch, spec["dtype"])
    gen = torch.Generator().manual_seed(0)
    tables, starts, slots = paged_layout(shapes, shared_tokens, block)
    next_block = 1 + max(b for t in tables for b in t)
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    tokens = starts[-1]
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)

    def cache():  # vLLM's [blocks, kv heads, block, 2 x head_dim] viewed as its kernels read it
        kv = torch.randn(next_block, kv_heads, block, 2 * dim, generator=gen).to(dtype)
        return kv.view(next_block, kv_heads, block * 2, dim).chunk(2, dim=2)

    caches = [cache() for _ in range(spec["layers"])]

    def call():
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(shapes), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True)
        for key_cache, value_cache in caches:
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, isa)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                query_start_loc=query_start_loc, seq_lens=seq_lens, scale=dim ** -0.5,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table,
                softcap=0.0, scheduler_metadata=meta, s_aux=None)

    return call


def check(shapes: list, shared_tokens: int, spec: dict, isa: str) -> float:
    """One call with every key and value stored through vLLM's own op (no assumption about its
    cache's inner layout) against a float64 softmax over the same keys: the arguments the timed
    call passes mean what this script takes them to. Returns the largest error relative to the
    output's largest value."""
    from vllm import _custom_ops as ops

    heads, kv_heads, dim, block = spec["heads"], spec["kv_heads"], spec["head_dim"], spec["block"]
    dtype = getattr(torch, spec["dtype"])
    gen = torch.Generator().manual_seed(1)
    tables, starts, _ = paged_layout(shapes, shared_tokens, block)
    shared = shared_tokens // block * block
    common = torch.randn(2, shared, kv_heads, dim, generator=gen).to(dtype)
    full = [torch.cat([common, torch.randn(2, c + n - shared, kv_heads, dim, generator=gen)
                       .to(dtype)], dim=1) for c, n in shapes]
    slots = [t[p // block] * block + p % block for t, (c, n) in zip(tables, shapes)
             for p in range(c + n)]
    blocks = 1 + max(b for t in tables for b in t)
    kv = torch.zeros(blocks, kv_heads, block, 2 * dim, dtype=dtype)
    key_cache, value_cache = kv.view(blocks, kv_heads, block * 2, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(torch.cat([f[0] for f in full]),
                                   torch.cat([f[1] for f in full]), key_cache, value_cache,
                                   torch.tensor(slots, dtype=torch.int64), isa)
    q = torch.randn(starts[-1], heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(shapes), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=True)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=dim ** -0.5, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
        scheduler_metadata=meta, s_aux=None)
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
