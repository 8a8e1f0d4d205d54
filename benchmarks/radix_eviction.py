"""Prefix-cache bookkeeping cost: ``evict`` with many cached leaves, and ``match`` on a long prompt.

    python benchmarks/radix_eviction.py                        # 8,000 one-block leaves
    PYTHONPATH=/path/to/other/checkout python benchmarks/radix_eviction.py --leaves 2000

The tree: a shared path of ``--shared-blocks`` blocks, ``--leaves`` distinct leaves of
``--leaf-blocks`` blocks under it (all unlocked), and one long cached prompt of
``--prompt-blocks`` blocks inserted last (so the leaves are the least recently used). Times
``evict(1)`` ``--evictions`` times (ms per evicted block), then ``match`` of the long prompt
(ending on a node boundary, and diverging inside its last node). Imports only tokenmill.cache
and the public PrefixCache API, so it runs against older checkouts too; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import tokenmill.cache.radix as radix
from machine import machine  # benchmarks/machine.py
from tokenmill.cache import BlockPool
from tokenmill.cache.radix import RadixPrefixCache

def put(pool: BlockPool, cache: RadixPrefixCache, tokens: Sequence[int], block_size: int) -> None:
    """Cache ``tokens`` as a finished request would: its own blocks, inserted, then released."""
    blocks = [pool.allocate() for _ in range(len(tokens) // block_size)]
    cache.insert(tokens, blocks)
    for block_id in reversed(blocks):
        pool.free(block_id)


def build(args: argparse.Namespace) -> tuple[RadixPrefixCache, list[int]]:
    """The tree described in the module docstring; returns it and the long prompt's tokens."""
    bs = args.block_size
    shared = list(range(1, args.shared_blocks * bs + 1))
    leaf_tokens = args.leaf_blocks * bs
    total = args.shared_blocks + args.leaves * args.leaf_blocks + args.prompt_blocks
    # Room for the tree plus one request's worth of blocks in flight while inserting.
    pool = BlockPool(total + args.shared_blocks + args.prompt_blocks + args.leaf_blocks + 2)
    cache = RadixPrefixCache(pool, bs)
    base = len(shared) + 1
    for i in range(args.leaves):
        start = base + i * leaf_tokens
        put(pool, cache, shared + list(range(start, start + leaf_tokens)), bs)
    start = base + args.leaves * leaf_tokens
    prompt = shared + list(range(start, start + args.prompt_blocks * bs))
    put(pool, cache, prompt, bs)
    assert cache.num_cached_blocks == total, cache.num_cached_blocks
    return cache, prompt


def median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def time_evictions(cache: RadixPrefixCache, evictions: int) -> dict[str, float]:
    freed, calls = 0, []
    for _ in range(evictions):
        start = time.perf_counter()
        freed += cache.evict(1)
        calls.append(time.perf_counter() - start)
    return {"evicted_blocks": freed,
            "evict_ms_per_block": sum(calls) / max(1, freed) * 1e3,
            "evict_call_ms_p50": statistics.median(calls) * 1e3,
            "evict_call_ms_max": max(calls) * 1e3}


def time_matches(cache: RadixPrefixCache, prompt: list[int], args: argparse.Namespace
                 ) -> dict[str, float]:
    bs = args.block_size
    whole = prompt + [0] * (bs // 2)  # a partial trailing block, as a new request has
    # Diverges after all but the last two blocks: the match ends inside the prompt's node
    # (the old code splits it on the first call; later calls end on that boundary).
    partial = prompt[:len(prompt) - 2 * bs] + [0] * (2 * bs)
    assert cache.match(whole).num_tokens == len(prompt)
    return {"match_tokens": len(prompt),
            "match_full_us": median_us(lambda: cache.match(whole), args.repeats),
            "match_partial_us": median_us(lambda: cache.match(partial), args.repeats)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=8000)
    parser.add_argument("--leaf-blocks", type=int, default=1)
    parser.add_argument("--shared-blocks", type=int, default=8)
    parser.add_argument("--prompt-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--evictions", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=200, help="match() calls timed")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cache, prompt = build(args)
    build_s = time.perf_counter() - start
    result = {"radix_module": radix.__file__, **machine(),
              "python": platform.python_version(),
              "leaves": args.leaves, "leaf_blocks": args.leaf_blocks,
              "cached_blocks": cache.num_cached_blocks, "build_s": build_s}
    result |= time_matches(cache, prompt, args)
    result |= time_evictions(cache, args.evictions)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
