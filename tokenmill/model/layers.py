"""Building blocks of Llama-family decoders.

Every parameter carries a ``weight_loader(param, loaded, shard_id)``, so loading a checkpoint is
one loop over (name, tensor) pairs, fused projections included (see ``model/weights.py``).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import RopeScaling
from tokenmill.model.quant import QuantWeight, concat_rows, dequantize, embedding_rows
from tokenmill.model.quant import quant_linear


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


# Rows of input up to which the CPU kernels' bf16 linear (on the plain weight; the layers that
# cannot be packed, see Linear.pack_for_cpu) beats oneDNN's on AVX512-BF16
# (1.2-1.9x at 1-4 rows alone, benchmarks/linear_kernels.py; in the whole default model's
# forward it is still 1.1-1.35x faster at 5-8 rows, the sizes a speculative verification of
# 4-7 drafts runs at; about even at 9, oneDNN ahead from 16 -- AMD EPYC Zen 4, 2 cores)
SMALL_M_ROWS = 8


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout (CPU, fp32)
        # float32 with the CPU kernels (AVX2/AVX512): the weight in their column-block layout
        # (float32; or uint8 for a 4/8-bit weight kept in its bits, widened as it is multiplied)
        self.packed_f32: torch.Tensor | None = None
        self.packed_kind: str | None = None  # the quantized format packed_f32 holds, if any
        # bf16 on a CPU with AVX512-BF16: the weight in the kernels' vdpbf16ps layout
        self.packed_bf16: torch.Tensor | None = None
        # a gate/up layer whose packed blocks are interleaved: forward gives silu(gate) * up
        self.gated = False
        self.cpu_ops = None  # set by the loader when the CPU kernels are in use
        # quantized weights (model/quant.py) replacing ``weight``, and the kernels that
        # multiply them (the CPU kernels whatever the attention backend; None: dequantize)
        self.quant: QuantWeight | None = None
        self.quant_ops = None
        self.quant_parts: dict = {}  # shard id -> QuantWeight, while a checkpoint loads
        # inputs of this many rows or more go to oneDNN on the dense weight, kept beside the
        # packed one for them (route_to_onednn: where it measured faster, e.g. with AMX)
        self.dense_from_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_linear(x, self.quant, self.bias, self.quant_ops)
        ops = self.cpu_ops
        if self.dense_from_rows is not None and x.numel() >= self.dense_from_rows * x.shape[-1]:
            out = F.linear(x.to(self.weight.dtype), self.weight, self.bias)
            return silu_and_mul(out, ops) if self.gated else out
        if self.packed_bf16 is not None:
            kernel = ops.linear_bf16_packed_silu if self.gated else ops.linear_bf16_packed
            return self._on_packed(x.to(torch.bfloat16), kernel, self.packed_bf16)
        if self.packed_f32 is not None:
            return self._on_packed(x, ops.linear_f32_packed, self.packed_f32)
        if (ops is not None and x.shape[0] <= SMALL_M_ROWS and x.dtype == torch.bfloat16
                and ops.has_bf16_dot and self.weight.shape[0] % 4 == 0):
            # a few rows (decode at small batch): a pass over bf16 weights at memory speed
            return ops.linear_bf16_rows(x, self.weight, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def packed_beside_dense(self) -> bool:
        """Whether the layer holds a packed weight and its dense one too (for oneDNN:
        ``route_to_onednn``)."""
        return self.weight is not None and (self.packed_bf16 is not None
                                            or self.packed_f32 is not None)

    def _on_packed(self, x: torch.Tensor, kernel, packed: torch.Tensor) -> torch.Tensor:
        """A packed-weight kernel (it takes rows with a unit inner stride) over ``x``'s rows,
        any leading dimensions."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        shape = x.shape
        out = kernel(x.reshape(-1, shape[-1]), packed, self.bias)
        return out.view(*shape[:-1], out.shape[-1])

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

    def pack_for_cpu(self, keep_dense: bool, ops=None, dtype: torch.dtype | None = None) -> bool:
        """Move the weight into the layout of the kernel that multiplies it best on a CPU.

        A quantized weight (``quant``) in a float32 model (``dtype``) with the CPU kernels'
        float32 GEMM, in 4 or 8 bits in groups of 32 with float16 scales (a GGUF's Q4_0 / Q4_1
        / Q8_0, or int4 / int8): that GEMM's layout in its own bits (``csrc/f32_gemm.h``),
        widened to float32 as it is multiplied. The sums are those of the dequantized float32
        weight through the same GEMM, bit for bit, and it reads 0.75 / 1.125 bytes per weight
        instead of 4: the whole linear work of the default model's decode step 2.2x faster at
        one row, 1.2-1.3x at 4-8 rows, within 3% at 16 rows and more (Zen 3, 2 cores).

        float32 with the CPU kernels on AVX2/AVX512 (N a multiple of their register width):
        their column-block layout (``csrc/f32_gemm.h``), ahead of oneDNN's prepacked weights
        at every batch size measured (all linears of a decode step: 1 row 27.4 -> 16.5 ms,
        8 rows 44.2 -> 17.3, 32 rows 65.5 -> 43.3, 512 rows 701 -> 664; Zen 4, 2 cores,
        benchmarks/linear_kernels.py). Otherwise oneDNN's: MKL's dense sgemm streams a [N, K]
        weight poorly when only a few rows of input come in; oneDNN's inner-product on the same
        weights is 1.4-1.7x faster at 1-32 rows (benchmarks/model_speed.py).
        bfloat16 with the CPU kernels on AVX512-BF16 (N a multiple of 16): their vdpbf16ps
        layout (``csrc/bf16_gemm.h``), ahead of oneDNN at every batch size measured, 1.3-2.2x at
        1-64 rows (benchmarks/linear_kernels.py).
        The dense copy is dropped unless another module shares it (tied embeddings). Returns
        whether the weight was packed.
        """
        if self.quant is not None:
            return self._pack_quant_f32(ops, dtype)
        w = self.weight
        if w is None or w.device.type != "cpu":
            return False
        if (w.dtype == torch.bfloat16 and ops is not None
                and getattr(ops, "has_bf16_gemm", False) and w.shape[0] % 16 == 0):
            self.packed_bf16 = ops.pack_bf16_weight(w.detach())
        elif (w.dtype == torch.float32 and ops is not None
              and getattr(ops, "f32_pack_cols", 0) and w.shape[0] % ops.f32_pack_cols == 0):
            self.packed_f32 = ops.pack_f32_weight(w.detach())
        elif w.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.packed = w.detach().to_mkldnn()
        else:
            return False
        if not keep_dense:
            self.weight = None
        return True

    def _pack_quant_f32(self, ops, dtype: torch.dtype | None) -> bool:
        """float32 with the CPU kernels: a 4/8-bit weight in groups of 32 packed for their
        GEMM, which widens it to float32 (``pack_f32_quant_weight``) or, for a weight that
        takes int8 activations, multiplies it with x's rows quantized to int8
        (``pack_a8_weight``, csrc/a8_gemm.h); ``linear_f32_packed`` takes either."""
        qw = self.quant
        a8 = qw.int8_activations
        cols = getattr(ops, "a8_pack_cols" if a8 else "f32_pack_cols", 0) if ops is not None else 0
        if not (dtype == torch.float32 and cols and qw.qweight.device.type == "cpu"
                and qw.bits in (4, 8) and qw.group_size == 32
                and qw.qweight.dtype == (torch.uint8 if qw.bits == 4 else torch.int8)
                and qw.scales.dtype == torch.float16 and qw.shape[0] % cols == 0
                and (qw.bits == 8 or qw.zeros is not None)):
            return False
        pack = ops.pack_a8_weight if a8 else ops.pack_f32_quant_weight
        self.packed_f32 = pack(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size)
        self.packed_kind = qw.kind
        self.quant = None  # a tied embedding keeps its own reference to the blocks
        return True

    def gate_in_epilogue(self) -> bool:
        """For a gate/up layer (gate rows, then as many up rows) packed for bf16: interleave
        its column blocks (gate 0, up 0, gate 1, ...) so the kernels compute silu(gate) * up
        in the GEMM's epilogue; ``forward`` then returns that, half the width, and the (T, 2I)
        product never goes to memory. Not with a bias, or halves that split a block. Returns
        whether it is done."""
        p = self.packed_bf16
        if (p is None or self.bias is not None or p.shape[0] % 2
                or not hasattr(self.cpu_ops, "linear_bf16_packed_silu")):
            return False
        self.packed_bf16 = p.view(2, p.shape[0] // 2, *p.shape[1:]).transpose(0, 1) \
            .reshape(p.shape).contiguous()
        self.gated = True
        return True


def _param_uses(module: nn.Module) -> dict[int, int]:
    """How many places of ``module`` hold each parameter (2 for a tied embedding's)."""
    uses: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return uses


def pack_linear_weights(module: nn.Module, ops=None, dtype: torch.dtype | None = None,
                        keep_dense: bool = False) -> int:
    """``Linear.pack_for_cpu`` over every linear layer of ``module`` (``ops``: the compiled CPU
    kernels, when in use; ``dtype``: the model's compute dtype; ``keep_dense``: every dense
    weight stays beside its packed one, for ``route_to_onednn``); returns how many."""
    uses = _param_uses(module)
    packed = 0
    for layer in module.modules():
        if isinstance(layer, Linear) and layer.quant is not None:
            packed += layer.pack_for_cpu(keep_dense=False, ops=ops, dtype=dtype)
        elif isinstance(layer, Linear) and layer.weight is not None:
            packed += layer.pack_for_cpu(keep_dense=keep_dense or uses[id(layer.weight)] > 1,
                                         ops=ops)
    return packed


# Rows of input at which the loader times the packed GEMM against oneDNN's, and how much faster
# oneDNN must be to take them: decode batches of 16 sequences and more, and prompt chunks (on a
# 2-core AMX Xeon a 32-sequence decode step took 64-68 ms through oneDNN, layer by layer,
# against 83-95 ms fused on the packed weights)
ONEDNN_TRIAL_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
ONEDNN_MARGIN = 1.15


def dense_rows_from(timings: dict[int, tuple[float, float]],
                    margin: float = ONEDNN_MARGIN) -> int | None:
    """From ``{rows: (packed seconds, oneDNN seconds)}``: the fewest rows from which oneDNN was
    at least ``margin`` times faster at every row count timed, or None (packed throughout)."""
    start = None
    for rows in sorted(timings, reverse=True):
        packed, dense = timings[rows]
        if packed < dense * margin:
            break
        start = rows
    return start


def time_packed_and_dense(layers: list[Linear], rows: tuple[int, ...] = ONEDNN_TRIAL_ROWS,
                          repeats: int = 2) -> dict[int, tuple[float, float]]:
    """``{rows: (packed seconds, oneDNN seconds)}`` for one forward through every layer of
    ``layers`` (packed, their dense weights kept), best of ``repeats``."""
    timings = {}
    with torch.inference_mode():
        for n in rows:
            xs = [torch.randn(n, layer.weight.shape[1]).to(layer.weight.dtype) for layer in layers]
            best = [math.inf, math.inf]
            for _ in range(repeats + 1):  # the first round warms up
                for i, dense in enumerate((None, n)):
                    for layer in layers:
                        layer.dense_from_rows = dense
                    start = time.perf_counter()
                    for layer, x in zip(layers, xs):
                        layer(x)
                    best[i] = min(best[i], time.perf_counter() - start)
            timings[n] = (best[0], best[1])
    for layer in layers:
        layer.dense_from_rows = None
    return timings


def route_to_onednn(module: nn.Module, rows: int | None) -> None:
    """Send inputs of ``rows`` rows or more through oneDNN on every packed layer that kept its
    dense weight; None: packed throughout, and the dense weights that were kept only for this
    are dropped (a weight another module shares stays)."""
    uses = _param_uses(module)
    for layer in module.modules():
        if not isinstance(layer, Linear) or not layer.packed_beside_dense():
            continue
        if rows is not None:
            layer.dense_from_rows = rows
        elif uses[id(layer.weight)] == 1:
            layer.dense_from_rows = None
            layer.weight = None


class Embedding(nn.Module):
    """Token embedding; rows are looked up from ``quant`` when the table is stored quantized
    (a GGUF's Q8_0 table, or one tied to a quantized output layer)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
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


def fused_ops(x: torch.Tensor, ops):
    """The compiled CPU kernels where they pay: bfloat16/float16 on a CPU, where PyTorch runs
    each elementwise step as several passes (float32 stays on PyTorch's fused, exact ops)."""
    return ops if ops is not None and x.dtype != torch.float32 and x.device.type == "cpu" \
        else None


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


def silu_and_mul(x: torch.Tensor, ops=None) -> torch.Tensor:
    ops = fused_ops(x, ops)
    if ops is not None:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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
