"""Building blocks of Llama-family decoders.

Every parameter carries a ``weight_loader(param, loaded, shard_id)``, so loading a checkpoint is
one loop over (name, tensor) pairs, fused projections included (see ``model/loader.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import RopeScaling
from tokenmill.model.linear.activation import fused_ops, silu_and_mul
from tokenmill.model.linear.base import LinearKernel
from tokenmill.model.linear.dense import Dense
from tokenmill.model.quant import QuantWeight, concat_rows, dequantize, embedding_rows

__all__ = ["Embedding", "Linear", "RMSNorm", "RotaryEmbedding", "ShardedLinear", "apply_rope",
           "default_weight_loader", "empty_param", "fused_ops", "rope_inv_freq", "silu_and_mul"]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


def empty_param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: every value is overwritten by the checkpoint.
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


class Linear(nn.Module):
    """``y = x W^T + b``. It holds what loading needs -- the ``weight`` and ``bias`` parameters
    with their ``weight_loader``s, and a weight kept in its quantized form (``quant``, joined
    from ``quant_parts`` shard by shard while a checkpoint loads) -- and ``kernel``, the way it
    multiplies (``model/linear/``), chosen once at load from the plan; until then
    ``F.linear``. The kernel holds its own weights: once it is built, ``weight`` stays only
    where another module shares it or the oneDNN trial may route batches to it. ``lora``: None,
    or the adapters' hook (``model/lora/slots.py``), which is called instead of the kernel,
    with it, and adds LoRA rows' deltas to its output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None
        self.quant: QuantWeight | None = None
        self.quant_parts: dict = {}  # shard id -> QuantWeight, while a checkpoint loads
        self.kernel: LinearKernel = Dense(self.weight, self.bias)
        self.lora: Callable[[LinearKernel, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.kernel(x)
        return self.lora(self.kernel, x)

    def share_weight(self, weight: nn.Parameter) -> None:
        """Multiply by another module's weight (an output layer tied to the embeddings)."""
        self.weight = weight
        self.kernel = Dense(weight, self.bias)

    def use_kernel(self, kernel: LinearKernel, keep_weight: bool = False) -> None:
        """Multiply with ``kernel`` from now on; the loaded weights go unless ``keep_weight``."""
        self.kernel = kernel
        self.quant = None
        if not keep_weight:
            self.weight = None

    def load_quantized(self, qw: QuantWeight, shard_id=None) -> None:
        """Take a checkpoint tensor that stays quantized (a GGUF block format); the shards of a
        fused layer are joined by ``finish_quantized``."""
        rows = self.weight.shape[0] if shard_id is None else self.offsets[shard_id][1]
        if qw.shape != (rows, self.weight.shape[1]):
            raise ValueError(f"shape mismatch: parameter {(rows, self.weight.shape[1])} vs "
                             f"checkpoint {qw.shape}")
        self.quant_parts[shard_id] = qw

    def finish_quantized(self) -> bool:
        """Join the quantized shards loaded into one weight; where they differ in format (or
        some shards came as floats), dequantize them into ``weight`` instead. Returns whether
        the layer is now quantized."""
        parts, self.quant_parts = self.quant_parts, {}
        if not parts:
            return False
        order = list(getattr(self, "offsets", {None: None}))
        joined = concat_rows([parts[s] for s in order]) if set(parts) == set(order) else None
        if joined is None:
            for shard, qw in parts.items():
                rows = self.weight.data if shard is None else \
                    self.weight.data.narrow(0, *self.offsets[shard])
                rows.copy_(dequantize(qw, rows.dtype))
            return False
        self.set_quantized(joined)
        return True

    def set_quantized(self, qw: QuantWeight) -> None:
        self.quant = qw.to(self.weight.device)
        self.weight = None


class Embedding(nn.Module):
    """Token embedding; rows are looked up from ``quant`` when the table is stored quantized
    (a GGUF's Q8_0 table, or one tied to a quantized output layer). Vocabulary-parallel (a
    ``comm`` given): this rank holds rows ``vocab_start ..`` of the table, looks up the ids
    that fall there, zeros for the others, and the ranks' lookups are all-reduced."""

    def __init__(self, num_embeddings: int, dim: int, vocab_start: int = 0, comm=None):
        super().__init__()
        self.vocab_start, self.comm, self.num_embeddings = vocab_start, comm, num_embeddings
        self.weight = empty_param(num_embeddings, dim)
        self.quant: QuantWeight | None = None
        self.quant_parts: dict = {}
        self.dtype = self.weight.dtype

    def load_quantized(self, qw: QuantWeight, shard_id=None) -> None:
        if qw.shape != tuple(self.weight.shape):
            raise ValueError(f"shape mismatch: parameter {tuple(self.weight.shape)} vs "
                             f"checkpoint {qw.shape}")
        self.quant_parts[None] = qw

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return self._lookup(input_ids)
        ids = input_ids - self.vocab_start
        elsewhere = (ids < 0) | (ids >= self.num_embeddings)
        h = self._lookup(ids.masked_fill(elsewhere, 0))
        h.masked_fill_(elsewhere.unsqueeze(1), 0)
        return self.comm.all_reduce(h)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return embedding_rows(input_ids, self.quant, self.dtype)
        return F.embedding(input_ids, self.weight)


class ShardedLinear(Linear):
    """Several projections of the same input fused into one matmul (qkv, gate/up).

    ``shards`` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its output size; checkpoint
    tensors for each shard are copied into their row range of the fused weight.
    """

    def __init__(self, in_features: int, shards: dict, bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias)
        self.offsets: dict = {}
        start = 0
        for shard_id, size in shards.items():
            self.offsets[shard_id] = (start, size)
            start += size
        self.weight.weight_loader = self._load_shard
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        start, size = self.offsets[shard_id]
        default_weight_loader(param.data.narrow(0, start, size), loaded)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = empty_param(size)
        self.eps = eps
        self.cpu_ops = None  # set by the loader when the CPU kernels are in use

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` (or ``x + residual``, returning the sum as the new residual)."""
        ops = fused_ops(x, self.cpu_ops)
        if ops is not None:  # the kernel takes (tokens, size): e.g. Qwen3's per-head q/k norm
            shape = x.shape  # is (tokens, heads, head_dim)
            out, res = ops.rms_norm(x.reshape(-1, shape[-1]), _NO_RESIDUAL if residual is None
                                    else residual.reshape(-1, shape[-1]), self.weight, self.eps)
            return out.view(shape) if residual is None else (out.view(shape), res.view(shape))
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        else:  # low precision: normalise in float32 like the reference implementations
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


_NO_RESIDUAL = torch.empty(0)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.kind == "freq_factors":
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.kind != "default":
        raise ValueError(f"unsupported RoPE scaling type {scaling.kind!r}")
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    old_ctx = s.original_max_position_embeddings
    low_freq_wavelen = old_ctx / s.low_freq_factor
    high_freq_wavelen = old_ctx / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_positions, head_dim / 2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the batch's positions; looked up once per step, used by every layer."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # (num_tokens, 1, head_dim / 2)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
               ops=None) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` (num_tokens, heads, head_dim); q and k heads may be stacked.
    With the CPU kernels (bf16/fp16) ``x`` is rotated in place and returned."""
    cos, sin = cos_sin
    ops = fused_ops(x, ops)
    if ops is not None:
        ops.rope_(x, cos.squeeze(1), sin.squeeze(1))
        return x
    x1, x2 = x.float().chunk(2, dim=-1)  # (num_tokens, heads, head_dim / 2) each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
