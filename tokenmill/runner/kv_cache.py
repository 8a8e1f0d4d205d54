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


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # K and V, every layer
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      device: torch.device | str, dtype: torch.dtype) -> list[KVCache]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
