"""The linear layers' part of the load-time plan: which kernel each layer gets, which weights
stay in their bits, int8 activations, the oneDNN trial. Made from a ``Machine`` (this one, or a
described one) without touching it: no torch ops, no kernels loaded. ``load_model`` then builds
every layer as the plan says (``setup.py``); a layer whose size or format a kernel cannot take
gets the plan's next kernel, and the load records it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.model.quant import QUANTIZATIONS
from tokenmill.platform import KernelCaps, Machine

# float32 on the CPU kernels keeps a GGUF's quantized blocks in their bits (F32Packed); off,
# they are dequantized at load (the same sums, 4-5x the memory)
FLOAT32_IN_BITS = True
# bf16 with 4/8-bit weights in groups of 32 (GGUF's Q8_0 / Q4_0 / Q4_1 under auto, int8, int4)
# on the packed bf16 GEMM, dequantized to bf16 per task (Bf16Blocks: the bf16 model's products,
# bit for bit, from a quarter to a half of its bytes); off, they take the kernels below. Not on
# a CPU with AMX: there bf16 prompts go to oneDNN's tiles and so do these weights' (dequantized
# above 16 rows), which vdpbf16ps over the blocks would take 3-5x longer (tiles over the
# dequantized panel are not measured yet)
BF16_BLOCKS = True
# Quantized weights in groups of 32 (int8, int4, and GGUF's Q8_0 / Q4_0 / Q4_1 under auto)
# otherwise multiply int8 activations (dynamic per-token scales) where the CPU has int8 dot products
# (AVX512-VNNI) or float32's packed int8 GEMM (AVX2), as llama.cpp multiplies its blocks with
# activations quantized to 8 bits
INT8_ACTIVATIONS = True
# When to time the packed GEMM against oneDNN's at load and send batches of enough rows to
# whichever is faster (routed.py): "amx", a bf16 model on a CPU with AMX, whose tiles oneDNN
# uses and the packed GEMM (vdpbf16ps) does not; "always", any model with packed weights; "never"
ONEDNN_TRIAL = "amx"
# bf16 on a CPU with AMX: the packed weights multiply on its tiles (Bf16Amx) at every row count
# the oneDNN trial leaves them; off, by vdpbf16ps. On 2 cores of an Emerald Rapids Xeon the
# default model's 121 projections took 12.8 / 14.8 / 20.5 / 74 ms on the tiles at 1 / 8 / 32 /
# 128 rows, 14.9 / 18.4 / 62 / 247 by vdpbf16ps, 29 / 33 / 32 / 47 through oneDNN
# (benchmarks/linear_kernels.py, the 49,152-feature output layer included); the load's trial
# over one decoder layer there kept the tiles up to 1,024 rows and chose oneDNN from 2,048
AMX_TILES = True
# Time, at load, packed bf16 weights' rows by vdpbf16ps against float32 FMAs over the widened
# weight (csrc/bf16_gemm.h's WidenRows: the same bits) and take the FMAs from the rows where
# they measure faster (a CPU whose vdpbf16ps issues at half its FMA rate); off AMX tiles
WIDEN_TRIAL = True

ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
# the module names of each role's layers (a Linear named otherwise is planned as "other")
ROLE_OF = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down",
           "lm_head": "lm_head"}
# quantized weights a kernel multiplies in their bits (QuantWeight), fp8 aside
STORED_QUANTIZED = ("int8", "int4")
# the last of a chain of kernels for quantized weights: dequantize the weight at load and
# build it as a float weight
DEQUANTIZE = "dequantize"
# Kernels whose sums for a row of x are the same whatever the other rows of the batch: one
# reduction order per weight at every row count (each output's products summed along K in
# one fixed order, threads split over output columns only), bf16-rows and quant keeping their
# own kernel at every row count in the batch-invariant mode. The rest (oneDNN, F.linear,
# fp8) choose their blocking by the number of rows.
ORDER_FIXED = frozenset({"bf16-packed", "bf16-packed-silu", "bf16-amx", "bf16-amx-silu",
                         "bf16-rows", "f32-packed", "f32-packed-bits", "f32-packed-a8", "quant",
                         "quant-a8", "bf16-blocks", "bf16-blocks-silu"})
# the SiLU·mul epilogue's variant of each packed bf16 family (gate/up)
_SILU = {"bf16-packed": "bf16-packed-silu", "bf16-amx": "bf16-amx-silu",
         "bf16-blocks": "bf16-blocks-silu"}


@dataclass(frozen=True)
class LinearPlan:
    """How the linear layers multiply, decided once per load. ``formats``: per role, what the
    load makes of its weights ("int8", "int4", "fp8"; a role not named keeps the checkpoint's:
    float, or a GGUF's blocks where ``keep_gguf_blocks``). ``float_kernels`` /
    ``quant_kernels``: the kernel families tried, in order, for a float weight and for a 4/8-bit
    one."""

    device: str  # "cpu" or "cuda"
    dtype: str
    quantization: str  # what the load does (after the notes: e.g. CPU-only formats on a GPU)
    formats: tuple[tuple[str, str], ...]
    float_kernels: tuple[str, ...]
    quant_kernels: tuple[str, ...]
    keep_gguf_blocks: bool
    int8_activations: bool
    onednn_trial: bool
    gate_silu: bool  # gate/up with SiLU·mul in its packed bf16 GEMM's epilogue
    notes: tuple[str, ...] = ()  # what the load logs as warnings
    # one kernel per layer at every row count, and the attention backend's shared-prefix pass
    # resumed rather than merged (setup.py): a row's results do not depend on its batch
    # (``with_batch_invariance``)
    batch_invariant: bool = False
    amx: bool = False  # bf16 on a CPU with AMX: the packed weights may multiply on its tiles
    # packed bf16 rows timed by vdpbf16ps against float32 FMAs at load (the same bits)
    widen_trial: bool = False

    def format_of(self, role: str) -> str | None:
        return dict(self.formats).get(role)

    def kernels_for(self, role: str, quantized: bool) -> tuple[str, ...]:
        """The families a ``role`` layer's weight tries: ``quantized`` for 4/8-bit or fp8."""
        if self.format_of(role) == "fp8":
            return ("fp8",)
        chain = self.quant_kernels if quantized else self.float_kernels
        if role == "gate_up" and self.gate_silu:
            chain = tuple(_SILU.get(f, f) for f in chain)
        return chain

    def kernel_for(self, role: str) -> str:
        """The family a ``role`` layer gets where its size allows (a GGUF's blocks kept: see
        ``kernels_for(role, quantized=True)``)."""
        return self.kernels_for(role, self.format_of(role) in STORED_QUANTIZED)[0]

    @property
    def needs_quant_ops(self) -> bool:
        """Whether quantized weights multiply on the CPU kernels (loaded even where attention
        runs on PyTorch's reference)."""
        return any(f in ("quant", "quant-a8") for f in self.quant_kernels) \
            and self.quantization != "none"

    def order_blocker(self) -> str | None:
        """Why some layer's planned kernel would sum a row in an order its batch decides (a
        kernel outside ``ORDER_FIXED``); None: every one keeps one order."""
        chains = [("float", self.float_kernels)]
        if self.quantization != "none" or self.keep_gguf_blocks:
            chains.append(("quantized", self.quant_kernels))
        for kind, chain in chains:
            if chain[0] not in ORDER_FIXED:
                return f"{kind} weights multiply on {chain[0]}, whose blocking follows the rows"
        return None

    def with_batch_invariance(self) -> LinearPlan:
        """This plan in the batch-invariant mode: no oneDNN trial (oneDNN's sums for a row
        change with the batch's rows), each layer on one kernel at every row count: with AMX,
        the packed weights on its tiles (near oneDNN's pace for prompts, one order per row)."""
        floats = self.float_kernels
        if self.amx and floats[0] != "bf16-amx":
            floats = ("bf16-amx",) + floats
        return replace(self, batch_invariant=True, onednn_trial=False, float_kernels=floats)

    def describe(self) -> dict[str, object]:
        """The plan for logs and ``/server_info``."""
        return {"dtype": self.dtype, "quantization": self.quantization,
                "kernels": {role: self.kernel_for(role) for role in ROLES},
                "fallbacks": {"float": list(self.float_kernels),
                              "quantized": list(self.quant_kernels)},
                "gguf_blocks": "kept" if self.keep_gguf_blocks else "dequantized at load",
                "int8_activations": self.int8_activations, "onednn_trial": self.onednn_trial,
                "widen_trial": self.widen_trial,
                "batch_invariant": self.batch_invariant, "notes": list(self.notes)}


def plan_linears(machine: Machine, dtype: str, quantization: str = "none", *,
                 cpu_kernels: bool = True) -> LinearPlan:
    """The linear plan for ``dtype`` weights and ``--quantization`` on ``machine``.
    ``cpu_kernels``: whether the layers run on tokenmill's CPU kernels (with the ``cpu``
    attention backend; PyTorch's reference backend keeps PyTorch's ops, and only quantized
    weights still multiply on the kernels)."""
    quantization, notes = _effective_quantization(machine, dtype, quantization)
    caps = machine.kernel_caps
    layer_caps = caps if cpu_kernels else KernelCaps()
    in_bits = (FLOAT32_IN_BITS and quantization == "none" and dtype == "float32"
               and layer_caps.f32_gemm)
    a8 = (INT8_ACTIVATIONS and quantization in ("auto", "int8", "int4")
          and (caps.int8_dot or caps.a8_gemm))
    float_kernels = _float_kernels(machine, dtype, layer_caps)
    amx = float_kernels[0] == "bf16-packed" and caps.amx
    if amx and AMX_TILES:
        float_kernels = ("bf16-amx",) + float_kernels
    return LinearPlan(
        device="cuda" if machine.on_gpu else "cpu", dtype=dtype, quantization=quantization,
        formats=_formats(quantization), float_kernels=float_kernels,
        quant_kernels=_quant_kernels(machine, dtype, quantization, layer_caps, a8, in_bits),
        keep_gguf_blocks=quantization == "auto" or in_bits, int8_activations=a8,
        onednn_trial=_onednn_trial(dtype, caps, layer_caps),
        gate_silu=float_kernels[0] in _SILU, notes=notes, amx=amx,
        widen_trial=WIDEN_TRIAL and float_kernels[0] == "bf16-packed" and not caps.amx)


def _effective_quantization(machine: Machine, dtype: str,
                            quantization: str) -> tuple[str, tuple[str, ...]]:
    """(what the load does, warnings): 4/8-bit formats run on CPUs only; fp8 needs an Ada or
    Hopper GPU computing in bfloat16, and on a CPU runs PyTorch's reference."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of "
                         f"{', '.join(QUANTIZATIONS)}")
    where = "cuda" if machine.on_gpu else "cpu"
    if quantization == "fp8" and machine.on_gpu:
        _check_fp8(machine, dtype)
        return quantization, ()
    if quantization == "fp8":
        return quantization, ("--quantization fp8 is meant for GPUs (Hopper); on cpu it runs "
                              "through PyTorch's reference fp8 matmul",)
    if quantization != "none" and machine.on_gpu:
        return "none", (f"--quantization {quantization} runs on CPUs only for now: on {where} "
                        "the weights are dequantized at load",)
    return quantization, ()


def _check_fp8(machine: Machine, dtype: str) -> None:
    """fp8 matmuls on CUDA need compute capability 8.9 or above (Ada, Hopper), and their
    per-row scales a bfloat16 result."""
    major, minor = machine.gpu_capability or (0, 0)
    if (major, minor) < (8, 9):
        raise ValueError(f"--quantization fp8 needs a GPU of compute capability 8.9 or "
                         f"above (Ada, Hopper); this one is {major}.{minor}")
    if dtype != "bfloat16":
        raise ValueError(f"--quantization fp8 on a GPU computes in bfloat16, not {dtype}; "
                         "use --dtype bfloat16 (or auto)")


def _formats(quantization: str) -> tuple[tuple[str, str], ...]:
    """int4 and int8 quantize every layer at load, the output layer to int8 in both (as
    llama.cpp keeps it at 6-8 bits: it decides every token); fp8 every layer but the output
    layer (vLLM's fp8 keeps it in the compute dtype too); auto keeps a GGUF's blocks."""
    layers = ROLES[:-1]
    if quantization in ("int8", "int4"):
        return tuple((role, quantization) for role in layers) + (("lm_head", "int8"),)
    if quantization == "fp8":
        return tuple((role, "fp8") for role in layers)
    return ()


def _float_kernels(machine: Machine, dtype: str, layer_caps: KernelCaps) -> tuple[str, ...]:
    if machine.on_gpu:
        return ("dense",)
    if dtype == "bfloat16" and layer_caps.bf16_gemm:
        return ("bf16-packed", "bf16-rows", "dense")
    if dtype == "float32":
        return ("f32-packed",) * layer_caps.f32_gemm + ("onednn", "dense")
    return ("dense",)


def _quant_kernels(machine: Machine, dtype: str, quantization: str, layer_caps: KernelCaps,
                   a8: bool, in_bits: bool) -> tuple[str, ...]:
    """For a 4/8-bit weight: in bf16, the packed bf16 GEMM over its blocks (``BF16_BLOCKS``);
    float32's packed GEMM (in its bits, or with int8 activations); else the kernels multiplying
    from the bytes; unquantized ("none") weights kept in their bits for the GEMM that it cannot
    take are dequantized at load instead."""
    if quantization == "fp8":
        return ("fp8",)
    if in_bits:
        return ("f32-packed-bits", DEQUANTIZE)
    packed = ()
    if (BF16_BLOCKS and dtype == "bfloat16" and layer_caps.bf16_gemm and layer_caps.f32_gemm
            and not machine.kernel_caps.amx):
        packed = ("bf16-blocks",)
    if dtype == "float32" and layer_caps.f32_gemm:
        packed = ("f32-packed-a8",) * (a8 and layer_caps.a8_gemm) + ("f32-packed-bits",)
    if not machine.kernels_built:
        return packed + ("quant-torch",)
    return packed + ("quant-a8",) * (a8 and machine.kernel_caps.int8_dot) + ("quant",)


def _onednn_trial(dtype: str, caps: KernelCaps, layer_caps: KernelCaps) -> bool:
    if not layer_caps.attention:  # no packed kernels to time against
        return False
    if ONEDNN_TRIAL == "always":
        return True
    return ONEDNN_TRIAL == "amx" and dtype == "bfloat16" and layer_caps.bf16_gemm and caps.amx
