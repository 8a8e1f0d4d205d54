"""The paged KV cache tensors: per layer a ``(k_cache, v_cache)`` pair, each
``(num_blocks, block_size, num_kv_heads, head_dim)`` in the compute dtype.

    block id:      0          1          2          3   ...
                 +----------+----------+----------+----------+
    K, layer l   | 16 slots | 16 slots | 16 slots | 16 slots |  each slot: (kv_heads, head_dim)
                 +----------+----------+----------+----------+
    request A's block table [2, 0]: token 17 lives in block 0, offset 1 (slot 1).

``kv_cache_dtype="int8"`` (``--kv-cache-dtype int8``): K and V are stored as int8 with a float16
scale per (token, KV head), symmetric (scale = absmax / 127 rounded up to float16, see
``attention/kv_quant.py``). The scales live in the same int8 tensors, two bytes after each
(token, head)'s values, so the pair of tensors stays a pair:

    k_cache, v_cache: int8 (num_blocks, block_size, num_kv_heads, head_dim + 2)

    reference layout (torch backend; V of the cpu backend), one (token, head) row:
        | q_0 q_1 ... q_{head_dim-1} | scale (float16, 2 bytes) |
    cpu backend's K, the same bytes of one block read per head as (head_dim + 2, block_size):
        | head_dim rows of block_size int8: keys transposed | block_size float16 scales |

Bytes per (token, head) for head_dim 64: 66 (int8) against 128 (bfloat16 / float16) and 256
(float32), so the same budget holds 64/33 = 1.94x the tokens of bf16 and 3.88x of float32.

``kv_cache_dtype="bfloat16"``: the compute dtype's layout with the values rounded to bfloat16 (to
nearest even) as they are stored, half the bytes of a float32 cache; attention reads them back
widened to the compute dtype. For a float32 model on a CPU without native bf16 (where
``--dtype auto`` keeps the weights in float32): decode attention reads every cached K/V once per
step and is bound by memory bandwidth there, so half the bytes is close to half the time, and the
same budget holds twice the tokens. A bfloat16 model's cache is bfloat16 already.

``kv_cache_dtype="fp8"``: the same rows in uint8 tensors, the values float8 e4m3 bits (for GPUs,
read by the triton and torch backends; the cpu backend reads int8 only).
"""

from __future__ import annotations

import math
import mmap

import torch

from tokenmill.attention.kv_quant import SCALE_BYTES
from tokenmill.config import ModelConfig
from tokenmill.platform import host_memory_available

KVCache = tuple[torch.Tensor, torch.Tensor]
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8")
_QUANTIZED = {"int8": torch.int8, "fp8": torch.uint8}  # the cache tensors' dtype


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")


def kv_row_shape(cfg: ModelConfig, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto") -> tuple[tuple[int, int], torch.dtype]:
    """One slot's shape, (num_kv_heads, head_dim [+ scale bytes]), and the cache tensors' dtype."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype in _QUANTIZED:
        if cfg.head_dim % 2:  # the float16 scale after the values must be aligned
            raise ValueError(f"an {kv_cache_dtype} KV cache needs an even head_dim, not "
                             f"{cfg.head_dim}")
        return (cfg.num_kv_heads, cfg.head_dim + SCALE_BYTES), _QUANTIZED[kv_cache_dtype]
    return (cfg.num_kv_heads, cfg.head_dim), (torch.bfloat16 if kv_cache_dtype == "bfloat16"
                                              else dtype)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V, every layer, for one block of tokens (int8: values and scales)."""
    (heads, row), cache_dtype = kv_row_shape(cfg, dtype, kv_cache_dtype)
    element = torch.tensor([], dtype=cache_dtype).element_size()
    return 2 * cfg.num_layers * block_size * heads * row * element


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      device: torch.device | str, dtype: torch.dtype,
                      kv_cache_dtype: str = "auto") -> list[KVCache]:
    row_shape, cache_dtype = kv_row_shape(cfg, dtype, kv_cache_dtype)
    shape = (num_blocks, block_size, *row_shape)
    return [(zeroed(shape, cache_dtype, device), zeroed(shape, cache_dtype, device))
            for _ in range(cfg.num_layers)]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On the host its memory is an anonymous mapping: the kernel hands out zero
    pages as they are first written, so the cache costs resident memory for the blocks that
    have held tokens, not for the whole budget at start-up (nor the time to fill it)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds the mapping (frombuffer keeps its buffer alive); unmapped when freed
    pages = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return pages.view(dtype).view(shape)


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory where the cache will live: free GPU memory, or MemAvailable of the host."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_memory_available()


def default_kv_cache_bytes(device: torch.device | str, free: int | None = None) -> int:
    """90% of free GPU memory (the model is already loaded); on a CPU a fifth of the available
    RAM, at most 4 GiB, since the host keeps running everything else too. ``free``: the free
    bytes, when known (a plan made for a described machine), else measured now."""
    free = available_memory_bytes(device) if free is None else free
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
    check_kv_cache_dtype(kv_cache_dtype)
    if num_blocks is not None:
        return num_blocks
    budget = kv_cache_memory if kv_cache_memory is not None else default_kv_cache_bytes(device)
    blocks = budget // (bytes_per_block(cfg, block_size, dtype, kv_cache_dtype)
                        + extra_bytes_per_block)
    if blocks < 2:
        raise ValueError(f"KV cache budget of {budget} bytes holds less than 2 blocks of "
                         f"{block_size} tokens; raise --kv-cache-memory")
    return int(blocks)
