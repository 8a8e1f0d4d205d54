"""Kernels on a weight packed once for the CPU kernels' GEMMs: float32 (``csrc/f32_gemm.h``,
also 4/8-bit weights kept in their bits and, in ``csrc/a8_gemm.h``'s layout, multiplied with
int8 rows of x) and bf16 (``csrc/bf16_gemm.h``, with SiLU·mul in the epilogue for gate/up; on
vdpbf16ps, from some rows by float32 FMAs with the same bits, or the same packing on AMX tiles;
and 4/8-bit weights kept in their bits: ``Bf16Blocks``).
Each ``build`` returns None for a weight its kernel cannot take (a size, a format); the loader
then tries the plan's next kernel."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from tokenmill.model.linear.base import LinearKernel, StepWeight, on_rows
from tokenmill.model.quant import QuantWeight

# output features per column block of the bf16 packing (csrc/bf16_gemm.h's kPackCols)
BF16_PACK_COLS = 16


class F32Packed(LinearKernel):
    """``linear_f32_packed`` over a weight in its column-block layout.

    float32 weights: ahead of oneDNN's prepacked ones at every batch size measured (all linears
    of a decode step: 1 row 27.4 -> 16.5 ms, 8 rows 44.2 -> 17.3, 32 rows 65.5 -> 43.3, 512
    rows 701 -> 664; Zen 4, 2 cores, benchmarks/linear_kernels.py).
    4/8-bit weights in groups of 32 with float16 scales (a GGUF's Q4_0 / Q4_1 / Q8_0, or int4 /
    int8) kept in their bits (``pack_f32_quant_weight``): widened to float32 as they are
    multiplied, the sums those of the dequantized float32 weight bit for bit, 0.75 / 1.125
    bytes read per weight instead of 4 (a decode step's linear work 2.2x faster at one row,
    1.2-1.3x at 4-8 rows, within 3% from 16 rows; Zen 3, 2 cores).
    Or packed for x's rows rounded to int8 in groups of 32 (``pack_a8_weight``, AVX2's
    vpmaddubsw): ``int8_activations``."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, ops, kind: str,
                 int8_activations: bool = False):
        self.packed, self.bias, self.ops, self.kind = packed, bias, ops, kind
        self.int8_activations = int8_activations

    @property
    def family(self) -> str:
        if self.kind == "float32":
            return "f32-packed"
        return "f32-packed-a8" if self.int8_activations else "f32-packed-bits"

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, ops) -> F32Packed | None:
        cols = getattr(ops, "f32_pack_cols", 0) if ops is not None else 0
        if (not cols or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or weight.shape[0] % cols):
            return None
        return cls(ops.pack_f32_weight(weight.detach()), bias, ops, "float32")

    @classmethod
    def build_quantized(cls, qw: QuantWeight, bias: torch.Tensor | None, ops,
                        int8_activations: bool) -> F32Packed | None:
        """``qw`` in its bits, or for int8 activations; None where the layout cannot hold it."""
        attr = "a8_pack_cols" if int8_activations else "f32_pack_cols"
        cols = getattr(ops, attr, 0) if ops is not None else 0
        if not _packable_in_bits(qw, cols):
            return None
        pack = ops.pack_a8_weight if int8_activations else ops.pack_f32_quant_weight
        packed = pack(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size)
        return cls(packed, bias, ops, qw.kind, int8_activations)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return on_rows(self.ops.linear_f32_packed, x, self.packed, self.bias)

    @property
    def weight_format(self) -> str:
        return self.kind

    def step_weight(self) -> StepWeight:
        return StepWeight("f32", self.packed, self.bias)


def _packable_in_bits(qw: QuantWeight, cols: int) -> bool:
    """Whether the packings of 4/8-bit weights in their bits (``pack_f32_quant_weight``,
    ``pack_a8_weight``) take ``qw`` in column blocks of ``cols`` (0: no such kernels): 4 or 8 bits
    in groups of 32 with float16 scales (4 bits with offsets), on the CPU."""
    return bool(cols and qw.qweight.device.type == "cpu" and qw.bits in (4, 8)
                and qw.group_size == 32
                and qw.qweight.dtype == (torch.uint8 if qw.bits == 4 else torch.int8)
                and qw.scales.dtype == torch.float16 and qw.shape[0] % cols == 0
                and (qw.bits == 8 or qw.zeros is not None))


class Bf16Packed(LinearKernel):
    """``linear_bf16_packed`` over a weight packed for vdpbf16ps (AVX512-BF16, N a multiple of
    16): ahead of oneDNN at every batch size measured, 1.3-2.2x at 1-64 rows
    (benchmarks/linear_kernels.py)."""

    family = "bf16-packed"

    amx = False  # on AMX tiles (Bf16Amx)

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, ops):
        self.packed, self.bias, self.ops = packed, bias, ops
        # from this many rows the products run as float32 FMAs over the widened weight, the
        # same bits as vdpbf16ps's (WidenRows in csrc/bf16_gemm.h; the load's trial sets it
        # where it measured faster: setup.py's ``choose_widen_rows``); 0: never
        self.widen_from = 0

    @property
    def in_features(self) -> int:
        """K as the packing holds it (an odd K padded to even)."""
        return self.packed.shape[1] * 2

    @property
    def widens(self) -> bool:
        """Whether its rows may run as float32 FMAs with vdpbf16ps's bits (``widen_from``)."""
        return not self.amx

    def gemm(self, kernel: Callable) -> Callable:
        """``kernel`` (a packed bf16 GEMM binding) as this layer runs it: on AMX tiles, or
        by vdpbf16ps and from ``widen_from`` rows by float32 FMAs."""
        return partial(kernel, amx=self.amx, widen_from=self.widen_from)

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, ops) -> Bf16Packed | None:
        if (ops is None or not getattr(ops, "has_bf16_gemm", False)
                or weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
                or weight.shape[0] % 16):
            return None
        return cls(ops.pack_bf16_weight(weight.detach()), bias, ops)

    def interleaved(self) -> torch.Tensor:
        """The packed weight of a gate/up layer (gate rows, then as many up rows) with its
        column blocks taken in turn (gate 0, up 0, gate 1, ...), as ``Bf16PackedSilu``
        multiplies it."""
        p = self.packed  # (blocks, ...): gate's blocks, then up's
        return p.view(2, p.shape[0] // 2, *p.shape[1:]).transpose(0, 1).reshape(p.shape) \
            .contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return on_rows(self.gemm(self.ops.linear_bf16_packed), x.to(torch.bfloat16),
                       self.packed, self.bias)

    @property
    def weight_format(self) -> str:
        return "bfloat16"

    def step_weight(self) -> StepWeight:
        return StepWeight("bf16", self.packed, self.bias, self.applies_silu, amx=self.amx,
                          widen_from=self.widen_from)

    def describe(self) -> str:
        wide = f", float32 FMAs from {self.widen_from} rows" if self.widen_from else ""
        return super().describe() + wide


class Bf16PackedSilu(Bf16Packed):
    """A gate/up layer (gate rows, then as many up rows) packed for bf16 with its column blocks
    interleaved (gate 0, up 0, gate 1, ...), so ``linear_bf16_packed_silu`` computes
    silu(gate) * up in the GEMM's epilogue: it returns that, half the width, and the (T, 2I)
    product never goes to memory. ``product`` then ``activate`` is the same in two steps, bit for
    bit, for a caller that adds to the product between them (LoRA rows: ``model/lora/``)."""

    family = "bf16-packed-silu"
    applies_silu = True

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None,
              ops) -> Bf16PackedSilu | None:
        """None with a bias, or where the halves split a block of 16 features."""
        if bias is not None or not hasattr(ops, "linear_bf16_packed_silu"):
            return None
        plain = Bf16Packed.build(weight, bias, ops)
        if plain is None or plain.packed.shape[0] % 2:
            return None
        return cls(plain.interleaved(), None, ops)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return on_rows(self.gemm(self.ops.linear_bf16_packed_silu), x.to(torch.bfloat16),
                       self.packed, self.bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, K) times the gate/up weight, before SiLU·mul: (rows, 2I), each output
        feature where ``interleaved_columns`` puts it."""
        return on_rows(self.gemm(self.ops.linear_bf16_packed), x.to(torch.bfloat16),
                       self.packed, None)

    def activate(self, y: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of ``product``'s output, rounded as the epilogue rounds: (rows, I)."""
        return self.ops.silu_and_mul_interleaved(y, BF16_PACK_COLS)


def _blocks_ready(qw: QuantWeight, ops) -> bool:
    """Whether ``pack_f32_quant_weight`` takes ``qw`` in the bf16 GEMM's column blocks (its
    float32 packing's blocks are 16 features wide, as the bf16 GEMM's are, on AVX512)."""
    return (ops is not None and getattr(ops, "has_bf16_gemm", False)
            and getattr(ops, "f32_pack_cols", 0) == BF16_PACK_COLS
            and _packable_in_bits(qw, BF16_PACK_COLS))


class Bf16Blocks(Bf16Packed):
    """A 4/8-bit weight in groups of 32 (a GGUF's Q4_0 / Q4_1 / Q8_0 blocks under
    ``--quantization auto``, or int4 / int8) multiplied by the packed bf16 GEMM, x staying bf16
    (no int8 activations). 4 bits (``pack_bf16_nibbles``, csrc/bf16_nibbles.h): vdpbf16ps reads
    each nibble q as the bf16 number 16 + q, and each group's sums are scaled in float32 -- the
    blocks' weights summed without rounding each to bf16, in one order per row at every row
    count, by vdpbf16ps or float32 FMAs from ``widen_from`` rows alike. 8 bits
    (``pack_f32_quant_weight``, csrc/bf16_q8.h): float32 FMAs over scale * q, x widened to
    float32, one order per row at every row count (``widen_from`` does not apply). Neither runs
    on AMX tiles. A step reads 0.75 (4 bits) or 1.125 (8 bits) bytes per weight instead of 2."""

    family = "bf16-blocks"

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, ops, kind: str):
        super().__init__(packed, bias, ops)
        self.kind = kind

    @classmethod
    def build_quantized(cls, qw: QuantWeight, bias: torch.Tensor | None,
                        ops) -> Bf16Blocks | None:
        if not _blocks_ready(qw, ops):
            return None
        pack = ops.pack_bf16_nibbles if qw.bits == 4 else ops.pack_f32_quant_weight
        packed = pack(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size)
        return cls(packed, bias, ops, qw.kind)

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 32  # groups of 32

    @property
    def widens(self) -> bool:
        """4 bits (the nibbles' 4-dim pack) only: 8-bit blocks run float32 FMAs throughout."""
        return not self.amx and self.packed.dim() == 4

    @property
    def weight_format(self) -> str:
        return self.kind


class Bf16BlocksSilu(Bf16Blocks, Bf16PackedSilu):
    """``Bf16Blocks`` for a gate/up layer, its column blocks interleaved as ``Bf16PackedSilu``
    takes them (SiLU·mul in the epilogue)."""

    family = "bf16-blocks-silu"

    @classmethod
    def build_quantized(cls, qw: QuantWeight, bias: torch.Tensor | None,
                        ops) -> Bf16BlocksSilu | None:
        if bias is not None:
            return None
        plain = Bf16Blocks.build_quantized(qw, None, ops)
        if plain is None or plain.packed.shape[0] % 2:
            return None
        return cls(plain.interleaved(), None, ops, qw.kind)


def _amx_ready(weight: torch.Tensor, ops) -> bool:
    """AMX tiles this process may use, and K in whole tiles of 32."""
    return getattr(ops, "has_bf16_amx", False) and weight.shape[-1] % 32 == 0


class Bf16Amx(Bf16Packed):
    """``Bf16Packed``'s weight multiplied on AMX tiles (csrc/bf16_gemm.h's AmxRows): each row's
    sums in one order along K at every row count, so one kernel for decode and prompts alike
    (the batch-invariant mode on a CPU with AMX, where the packed GEMM is 3-5x slower for
    prompt chunks and oneDNN's sums change with the batch's rows)."""

    family = "bf16-amx"
    amx = True

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, ops) -> Bf16Amx | None:
        plain = Bf16Packed.build(weight, bias, ops) if _amx_ready(weight, ops) else None
        return None if plain is None else cls(plain.packed, bias, ops)


class Bf16AmxSilu(Bf16PackedSilu):
    """``Bf16PackedSilu`` on AMX tiles (``Bf16Amx``)."""

    family = "bf16-amx-silu"
    amx = True

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None,
              ops) -> Bf16AmxSilu | None:
        plain = Bf16PackedSilu.build(weight, bias, ops) if _amx_ready(weight, ops) else None
        return None if plain is None else cls(plain.packed, None, ops)


def interleaved_columns(out_features: int) -> torch.Tensor:
    """Where ``Bf16PackedSilu.product`` puts each output feature of a gate/up layer (gate
    features, then up): (out_features,) column indices, the halves' blocks of
    ``BF16_PACK_COLS`` taken in turn."""
    blocks = torch.arange(out_features).view(2, -1, BF16_PACK_COLS)  # (half, block, column)
    return torch.argsort(blocks.transpose(0, 1).reshape(-1))
