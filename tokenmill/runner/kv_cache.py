"""The paged KV cache tensors: per layer, K and V of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``.

    block id:      0          1          2          3   ...
                 +----------+----------+----------+----------+
    K, layer l   | 16 slots | 16 slots | 16 slots | 16 slots |  each slot: (kv_heads, head_dim)
                 +----------+----------+----------+----------+
    request A's block table [2, 0]: token 17 lives in block 0, offset 1 (slot 1).
"""

from __future__ import annotations

import torch

from tokenmill.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> int:
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # K and V, every layer
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      device: torch.device | str, dtype: torch.dtype,
                      kv_cache_dtype: str = "auto") -> list[KVCache]:
    if kv_cache_dtype != "auto":
        raise ValueError(f"KV cache dtype {kv_cache_dtype!r} is not supported")
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory where the cache will live: free GPU memory, or MemAvailable of the host."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def default_kv_cache_bytes(device: torch.device | str) -> int:
    """90% of free GPU memory (the model is already loaded); on a CPU a fifth of the available
    RAM, at most 4 GiB, since the host keeps running everything else too."""
    free = available_memory_bytes(device)
    if torch.device(device).type == "cuda":
        return int(free * 0.9)
    return min(free // 5, 4 << 30)


def num_kv_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                  device: torch.device | str, kv_cache_memory: int | None = None,
                  num_blocks: int | None = None, extra_bytes_per_block: int = 0,
                  kv_cache_dtype: str = "auto") -> int:
    """Blocks of KV cache to allocate: given outright, from a byte budget, or from free memory.
    ``extra_bytes_per_block``: what each block costs elsewhere too (a draft model's cache of as
    many tokens), paid from the same budget."""
    if num_blocks is not None:
        return num_blocks
    budget = kv_cache_memory if kv_cache_memory is not None else default_kv_cache_bytes(device)
    blocks = budget // (bytes_per_block(cfg, block_size, dtype, kv_cache_dtype)
                        + extra_bytes_per_block)
    if blocks < 2:
        raise ValueError(f"KV cache budget of {budget} bytes holds less than 2 blocks of "
                         f"{block_size} tokens; raise --kv-cache-memory")
    return int(blocks)
