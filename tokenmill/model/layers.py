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
from tokenmill.model.linear.quantized import QuantBytes
from tokenmill.model.quant import QuantWeight, concat_rows, dequantize, embedding_rows

__all__ = ["Embedding", "Linear", "RMSNorm", "RotaryEmbedding", "ShardedLinear", "apply_rope",
           "default_weight_loader", "empty_param", "fused_ops", "rope_attention_factor",
           "rope_inv_freq", "silu_and_mul"]


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
        """Hold ``qw`` instead of the float weight, which goes (the placeholder kernel's
        reference to it too: until the plan's kernel is built, PyTorch dequantizes ``qw``)."""
        self.quant = qw.to(self.weight.device)
        self.weight = None
        self.kernel = QuantBytes(self.quant, self.bias, None)


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
        self.gpu_ops = None  # the fused Triton kernels (kernels/triton_fused.py), by the loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` (or ``x + residual``, returning the sum as the new residual)."""
        gpu = self.gpu_ops
        if gpu is not None and x.dim() == 2 and gpu.takes(x):  # one kernel, add included
            out, res = gpu.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, res)
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


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling, *,
                  long: bool = False) -> torch.Tensor:
    """RoPE's (head_dim / 2,) frequencies under ``scaling``; ``head_dim``: the dims rotated
    (partial rotary: a fraction of the head). ``long``: LongRoPE's set for sequences beyond
    the original context (else its short set)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / theta ** exponents
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.kind == "freq_factors":
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.kind == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(theta ** exponents, head_dim, theta, scaling)
    if scaling.kind != "default":
        raise ValueError(f"unsupported RoPE scaling type {scaling.kind!r}")
    return inv_freq


def rope_attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by: the config's ``attention_factor``, else LongRoPE's
    sqrt(1 + ln(factor) / ln(original context)) or YaRN's 0.1 ln(factor) + 1 (1 unscaled)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.kind not in ("longrope", "yarn") or scaling.factor <= 1.0:
        return 1.0
    if scaling.kind == "longrope":
        return math.sqrt(1 + math.log(scaling.factor)
                         / math.log(scaling.original_max_position_embeddings))
    return 0.1 * math.log(scaling.factor) + 1.0


def _yarn_inv_freq(powers: torch.Tensor, dim: int, theta: float,
                   s: RopeScaling) -> torch.Tensor:
    """YaRN: dims that turn more than ``beta_fast`` times within the original context keep
    their frequency, those turning under ``beta_slow`` times are slowed by ``factor``, a linear
    ramp between. ``powers``: theta ** (2i / dim), (dim / 2,): 1 / the plain frequencies."""
    def dim_of(turns: float) -> float:  # the dim that turns ``turns`` times in the context
        ctx = s.original_max_position_embeddings
        return dim * math.log(ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:  # gpt-oss keeps the exact (untruncated) bounds
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low
                                                                  else 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: the original frequency, 0: slowed by factor
    return 1.0 / (s.factor * powers) * (1 - keep) + 1.0 / powers * keep


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
    """Rotate-half RoPE (the Hugging Face layout) with a precomputed cos/sin table of the first
    ``rotary_dim`` dims of a head (partial rotary, Phi-4-mini: the rest pass unrotated), both
    multiplied by the scaling's attention factor (LongRoPE, YaRN).

    LongRoPE (Phi-3/4) keeps two tables in one: rows ``[0, max)`` from the long factors at
    every position, then rows ``[max, max + original)`` from the short ones at the positions
    within the original context (no later position takes them); ``rows`` picks each token's.
    The choice is per sequence, as transformers makes it: every token of a sequence longer
    than the original context takes the long factors. transformers' Phi-3 generate recomputes
    the whole sequence when it crosses that length while decoding; here the K cached before
    the crossing keep the short factors unless the scheduler recomputes the sequence then
    (a prompt longer than the original context takes the long factors from its first token).
    Prefix-cache blocks are shared by token ids alone: one written under the other factors is
    reused as it is unless the cache tells the two apart."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling,
                 rotary_dim: int | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        # LongRoPE: a sequence up to this long takes the short factors
        self.original_max = scaling.original_max_position_embeddings \
            if scaling.kind == "longrope" else None
        tables = [(max_positions, True)] if self.original_max is None else \
            [(max_positions, True), (min(self.original_max, max_positions), False)]
        freqs = torch.cat([  # (rows, rotary_dim / 2)
            torch.outer(torch.arange(n, dtype=torch.float32),
                        rope_inv_freq(self.rotary_dim, theta, scaling, long=long))
            for n, long in tables])
        scale = rope_attention_factor(scaling)
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the batch's table rows (its positions, or ``rows``' for LongRoPE);
        looked up once per step, used by every layer."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # (num_tokens, 1, rotary_dim / 2)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return cos, sin

    def rows(self, positions: torch.Tensor, meta) -> torch.Tensor:
        """The table row of each token of a flat batch (``meta``: its ``AttentionMetadata``):
        its position, in the short table where its sequence is within the original context.
        A sequence's length is every token of it known when the step was scheduled
        (``meta.known_lens_host``) where the batch says, else its length after this step: a
        prompt longer than the original context then takes the short factors in a first chunk
        that ends within it. A position beyond the original context is always long."""
        if self.original_max is None:
            return positions
        if meta.is_pure_decode:  # a sequence's length is its seq_len: read on the device, so
            # a captured decode graph (whose host lists are placeholders) stays right
            return positions + (meta.seq_lens <= self.original_max) * self.max_positions
        lengths = getattr(meta, "known_lens_host", None) or meta.seq_lens_host
        long_requests = [n > self.original_max for n in lengths]
        if all(long_requests):
            return positions
        if not any(long_requests) and max(meta.seq_lens_host) <= self.original_max:
            return positions + self.max_positions  # all within the original context: short
        long = torch.tensor(long_requests).repeat_interleave(torch.tensor(meta.query_lens_host))
        short = ~(long.to(positions.device) | (positions >= self.original_max))  # (num_tokens,)
        return positions + short * self.max_positions


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
               ops=None) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` (num_tokens, heads, head_dim); q and k heads may be stacked.
    Partial rotary (cos/sin narrower than half a head): the leading ``rotary_dim`` dims of each
    head rotate among themselves, the rest pass through. With the CPU kernels (bf16/fp16) ``x``
    is rotated in place and returned."""
    cos, sin = cos_sin
    rotary_dim = 2 * cos.shape[-1]
    ops = fused_ops(x, ops)
    if ops is not None:  # the kernel takes any (tokens, heads) strides: no copy for partial
        ops.rope_(x[..., :rotary_dim], cos.squeeze(1), sin.squeeze(1))
        return x
    x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)  # (num_tokens, heads, rotary_dim / 2)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)
