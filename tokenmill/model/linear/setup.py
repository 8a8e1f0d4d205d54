"""A model's linear layers put into the form a ``LinearPlan`` says, after its checkpoint loaded:
weights quantized (``apply_formats``), each layer's kernel built from the plan's families in
order (``build_kernels``: the first that takes the weight's size and format), and where the plan
says, the oneDNN trial and routing (``choose_onednn_rows``, ``route_to_onednn``) and the trial of
float32 FMAs for packed bf16 rows (``choose_widen_rows``, ``route_widened``)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.model.layers import Embedding, Linear
from tokenmill.model.linear import routed
from tokenmill.model.linear.base import LinearKernel
from tokenmill.model.linear.dense import SMALL_M_ROWS, Bf16Rows, Dense, OneDnn
from tokenmill.model.linear.packed import (Bf16Amx, Bf16AmxSilu, Bf16Blocks, Bf16BlocksSilu,
                                           Bf16Packed, Bf16PackedSilu, F32Packed)
from tokenmill.model.linear.plan import DEQUANTIZE, ORDER_FIXED, ROLE_OF, LinearPlan
from tokenmill.model.linear.quantized import DENSE_ROWS, Fp8, QuantBytes
from tokenmill.model.quant import INT4_GROUP, QuantWeight, concat_rows, dequantize
from tokenmill.model.quant import quantize_fp8, quantize_int4, quantize_int8
from tokenmill.model.quant import takes_int8_activations, use_int8_activations

log = logging.getLogger("tokenmill.model")


def named_linears(module: nn.Module) -> Iterator[tuple[str, str, Linear]]:
    """(name, role, layer) for every linear layer of ``module``."""
    for name, layer in module.named_modules():
        if isinstance(layer, Linear):
            yield name, layer_role(name), layer


def _param_uses(module: nn.Module) -> dict[int, int]:
    """How many places of ``module`` hold each parameter (2 for a tied embedding's)."""
    uses: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return uses


# ----- formats --------------------------------------------------------------------------------

def apply_formats(module: nn.Module, plan: LinearPlan) -> None:
    """Put the weights in the plan's formats after loading: join the GGUF blocks kept (a
    quantized embedding table too), quantize float weights for int8 / int4 / fp8; a tied
    embedding then looks its rows up from the output layer's quantized table."""
    lm_head = getattr(module, "lm_head", None)
    tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
    embeddings = [m for m in module.modules() if isinstance(m, Embedding)]
    for embedding in embeddings:  # auto: a quantized table in the file
        qw = embedding.quant_parts.pop(None, None)
        if qw is not None and tied and lm_head is not None:
            lm_head.set_quantized(qw)
        elif qw is not None:
            embedding.quant, embedding.weight = qw, None
    for _, role, layer in named_linears(module):
        format_linear(layer, role, plan)
    tie_quantized_head(module)


def tie_quantized_head(module: nn.Module) -> None:
    """Where the embeddings are tied to a quantized output layer, they look their rows up from
    its table, and their float one goes."""
    lm_head = getattr(module, "lm_head", None)
    if (getattr(getattr(module, "config", None), "tie_word_embeddings", False)
            and lm_head is not None and lm_head.quant is not None):
        for embedding in module.modules():
            if isinstance(embedding, Embedding):
                embedding.quant, embedding.weight = lm_head.quant, None


def format_linear(layer: Linear, role: str, plan: LinearPlan) -> None:
    """One layer's part of ``apply_formats``, which a load may also do as soon as the layer's
    weight is complete (``load_weights``' ``on_linear``): the float32 copy of a weight to
    quantize then goes before the next layer's is read."""
    layer.finish_quantized()
    fmt = plan.format_of(role)
    if fmt is not None and layer.weight is not None:
        layer.set_quantized(quantize_as(layer.weight.detach(), fmt))


def layer_role(name: str) -> str:
    """A linear layer's role in a plan (``ROLE_OF``) from its module name."""
    return ROLE_OF.get(name.rpartition(".")[2], "other")


def quantize_as(w: torch.Tensor, fmt: str) -> QuantWeight:
    """``w`` in ``fmt``: "fp8", "int8", or "int4" (int8 where K is not in groups of 32)."""
    if fmt == "fp8":
        return quantize_fp8(w)
    quantize = quantize_int4 if fmt == "int4" and w.shape[1] % INT4_GROUP == 0 else quantize_int8
    # a slice of rows at a time: the float32 temporaries of a whole output layer would add
    # hundreds of MB to the peak
    joined = concat_rows([quantize(w[i:i + 4096]) for i in range(0, w.shape[0], 4096)])
    return joined or quantize(w)  # slices may differ in scale dtype


# ----- kernels --------------------------------------------------------------------------------

@dataclass
class _Source:
    """One layer's weights and what its kernels may use."""

    weight: torch.Tensor | None
    quant: QuantWeight | None
    bias: torch.Tensor | None
    ops: object  # the layers' CPU kernels (None: PyTorch's ops)
    quant_ops: object  # the CPU kernels for quantized weights
    int8_activations: bool  # the plan's
    batch_invariant: bool  # the plan's: a kernel that switches by rows keeps one way

    def a8(self) -> bool:
        return self.int8_activations and takes_int8_activations(self.quant)

    def quant_bytes(self) -> QuantBytes:
        """From the bytes up to ``DENSE_ROWS`` rows (in the batch-invariant mode at every
        count)."""
        rows = None if self.batch_invariant else DENSE_ROWS
        return QuantBytes(self.quant, self.bias, self.quant_ops, dense_rows=rows)


def _quant_a8(s: _Source) -> LinearKernel | None:
    if not (s.a8() and getattr(s.quant_ops, "has_int8_dot", False)):
        return None
    use_int8_activations(s.quant)
    return s.quant_bytes()


# family -> kernel for a float weight, or None where it cannot take it
_FLOAT: dict[str, Callable[[_Source], LinearKernel | None]] = {
    "bf16-packed": lambda s: Bf16Packed.build(s.weight, s.bias, s.ops),
    "bf16-packed-silu": lambda s: Bf16PackedSilu.build(s.weight, s.bias, s.ops)
    or Bf16Packed.build(s.weight, s.bias, s.ops),
    "bf16-amx": lambda s: Bf16Amx.build(s.weight, s.bias, s.ops),
    "bf16-amx-silu": lambda s: Bf16AmxSilu.build(s.weight, s.bias, s.ops)
    or Bf16Amx.build(s.weight, s.bias, s.ops),
    "bf16-rows": lambda s: Bf16Rows.build(s.weight, s.bias, s.ops,
                                          None if s.batch_invariant else SMALL_M_ROWS),
    "f32-packed": lambda s: F32Packed.build(s.weight, s.bias, s.ops),
    "onednn": lambda s: OneDnn.build(s.weight, s.bias),
    "dense": lambda s: Dense(s.weight, s.bias),
}
# family -> kernel for a quantized weight
_QUANT: dict[str, Callable[[_Source], LinearKernel | None]] = {
    "bf16-blocks": lambda s: Bf16Blocks.build_quantized(s.quant, s.bias, s.ops),
    "bf16-blocks-silu": lambda s: Bf16BlocksSilu.build_quantized(s.quant, s.bias, s.ops)
    or Bf16Blocks.build_quantized(s.quant, s.bias, s.ops),
    "f32-packed-a8": lambda s: F32Packed.build_quantized(s.quant, s.bias, s.ops, True)
    if s.a8() else None,
    "f32-packed-bits": lambda s: F32Packed.build_quantized(s.quant, s.bias, s.ops, False),
    "quant-a8": _quant_a8,
    "quant": lambda s: s.quant_bytes(),
    "quant-torch": lambda s: QuantBytes(s.quant, s.bias, None),
    "fp8": lambda s: Fp8(s.quant, s.bias),
}


def build_kernel(layer: Linear, role: str, plan: LinearPlan, ops, quant_ops) -> LinearKernel:
    """The first of the plan's kernels for ``role`` that takes the layer's weight. A quantized
    weight that none takes where the plan ends in ``dequantize`` becomes a float weight."""
    s = _Source(layer.weight, layer.quant, layer.bias, ops, quant_ops, plan.int8_activations,
                plan.batch_invariant)
    quantized = layer.quant is not None
    for family in plan.kernels_for(role, quantized):
        if family == DEQUANTIZE:
            layer.weight = nn.Parameter(dequantize(layer.quant), requires_grad=False)
            layer.quant = s.quant = None
            s.weight = layer.weight
            return build_kernel(layer, role, plan, ops, quant_ops)
        kernel = (_QUANT if quantized else _FLOAT)[family](s)
        if kernel is not None:
            return kernel
    raise ValueError(f"no kernel of {plan.kernels_for(role, quantized)} takes this {role} layer")


def build_kernels(module: nn.Module, plan: LinearPlan, ops,
                  quant_ops) -> dict[str, LinearKernel]:
    """Every linear layer's kernel, as the plan says; returns them by layer name. The loaded
    weights go, but for a weight another module shares (tied embeddings) and, where the plan
    times oneDNN, the dense weights beside packed ones."""
    uses = _param_uses(module)
    kernels = {}
    for name, role, layer in named_linears(module):
        kernel = kernels[name] = build_kernel(layer, role, plan, ops, quant_ops)
        shared = layer.weight is not None and uses.get(id(layer.weight), 0) > 1
        beside = plan.onednn_trial and kernel.step_weight() is not None
        layer.use_kernel(kernel, keep_weight=shared or beside)
    if any(isinstance(k, QuantBytes) and k.ops is None for k in kernels.values()):
        log.warning("quantized weights without the CPU kernels: every step dequantizes them "
                    "(slow); install a C++ compiler")
    if plan.batch_invariant:
        _keep_one_order(module, kernels)
    return kernels


def _keep_one_order(module: nn.Module, kernels: dict[str, LinearKernel]) -> None:
    """The batch-invariant mode beyond the linears: attention's shared-prefix pass hands its
    softmax state to the main pass (``cascade = "resume"``) instead of a partial result merged
    after it, which rounds otherwise than one pass over the same keys. A layer left on a kernel
    whose sums follow the rows (a size no fixed-order kernel takes) is logged: its outputs may
    still move with the batch."""
    for layer in module.modules():
        backend = getattr(layer, "backend", None)
        if hasattr(backend, "cascade"):
            backend.cascade = "resume"
    loose = sorted(name for name, k in kernels.items() if k.family not in ORDER_FIXED)
    if loose:
        log.warning("batch-invariant mode: %d linear layers keep a kernel whose sums follow "
                    "the batch's rows (%s): their outputs may differ with the batch",
                    len(loose), ", ".join(loose[:4]) + (", ..." if len(loose) > 4 else ""))


def describe_weights(kernels: dict[str, LinearKernel], quantization: str) -> str:
    """What the linears hold, e.g. "q4_1 x120, q8_0 x1 (int8 activations: 121 layers)", "none",
    or for float32 from a GGUF's blocks "none (float32 from q4_1 x120, q8_0 x1 kept in their
    bits)"."""
    floats = ("float32", "bfloat16", "float16")
    kinds = Counter(k.weight_format for k in kernels.values() if k.weight_format not in floats)
    if not kinds:
        return "none"
    held = ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))
    if quantization == "none":
        return f"none (float32 from {held} kept in their bits)"
    a8 = sum(k.int8_activations for k in kernels.values())
    return held + (f" (int8 activations: {a8} layers)" if a8 else "")


# ----- oneDNN routing -------------------------------------------------------------------------

def _routable(module: nn.Module) -> Iterator[Linear]:
    """Layers on a packed kernel with their dense weight beside it."""
    for _, _, layer in named_linears(module):
        if layer.weight is not None and layer.kernel.step_weight() is not None \
                and not isinstance(layer.kernel, routed.OneDnnRouted):
            yield layer


# The trial's timings per (one layer's linears: kernel, shape, dtype; threads), for this
# process: the same model loaded again (a second engine, a test's twin runner) routes as the
# first did, rather than timing anew on a busy machine into another answer and other bits.
_TRIAL_TIMINGS: dict[tuple, dict[int, tuple[float, float]]] = {}


def _first_layer(module: nn.Module) -> nn.Module | None:
    """The first decoder layer: the trials time its linears."""
    return getattr(getattr(module, "model", None), "layers", [None])[0]


def _log_trial(what: str, timings: dict[int, tuple[float, float]], ways: tuple[str, str],
               choice: str) -> None:
    """One line: a trial's timings per row count, each way's in milliseconds, and its choice."""
    ms = ["/".join(f"{t[i] * 1e3:.2f}" for t in timings.values()) for i in (0, 1)]
    log.info("linear kernels, one layer's %s at %s rows: %s %s ms, %s %s ms -> %s", what,
             "/".join(map(str, timings)), ways[0], ms[0], ways[1], ms[1], choice)


def choose_onednn_rows(module: nn.Module, ops) -> int | None:
    """The rows from which the first decoder layer's linears ran faster through oneDNN on
    their dense weights than on the packed ones (``routed.time_packed_and_dense``, once per
    shape in a process), or None."""
    first = _first_layer(module)
    layers = list(_routable(first)) if first is not None else []
    if not layers:
        return None
    key = (tuple((m.kernel.family, tuple(m.weight.shape), m.weight.dtype) for m in layers),
           torch.get_num_threads())
    timings = _TRIAL_TIMINGS.get(key)
    if timings is None:
        timings = _TRIAL_TIMINGS[key] = routed.time_packed_and_dense(
            [routed.OneDnnRouted(m.kernel, m.weight, m.bias, 0, ops) for m in layers])
    rows = routed.dense_rows_from(timings)
    _log_trial("linears", timings, ("packed", "oneDNN"),
               f"oneDNN from {rows} rows" if rows else "packed throughout")
    return rows


def route_to_onednn(module: nn.Module, rows: int | None, ops) -> None:
    """Send inputs of ``rows`` rows or more through oneDNN on every packed layer that kept its
    dense weight; None: packed throughout, and the dense weights that were kept only for this
    are dropped (a weight another module shares stays)."""
    uses = _param_uses(module)
    for layer in list(_routable(module)):
        if rows is not None:
            layer.kernel = routed.OneDnnRouted(layer.kernel, layer.weight, layer.bias, rows, ops)
        elif uses[id(layer.weight)] == 1:
            layer.weight = None


# ----- float32 FMAs for bf16 rows --------------------------------------------------------------

def _widenable(module: nn.Module) -> Iterator[Linear]:
    """Layers on a packed bf16 kernel multiplying by vdpbf16ps (not on AMX tiles, not 8-bit
    blocks, which run float32 FMAs at every row count)."""
    for _, _, layer in named_linears(module):
        if isinstance(layer.kernel, Bf16Packed) and layer.kernel.widens:
            yield layer


def choose_widen_rows(module: nn.Module) -> int | None:
    """The rows from which the first decoder layer's packed bf16 linears ran faster as float32
    FMAs over their widened weights than by vdpbf16ps (``routed.time_two_ways``, once per shape
    in a process), or None: slower, or not the same bits on this CPU."""
    first = _first_layer(module)
    kernels = [m.kernel for m in _widenable(first)] if first is not None else []
    if not kernels:
        return None
    key = ("widen", tuple((k.family, tuple(k.packed.shape)) for k in kernels),
           torch.get_num_threads())
    timings = _TRIAL_TIMINGS.get(key)
    if timings is None:
        if not routed.widened_exact(kernels):
            log.warning("linear kernels: float32 FMAs do not give vdpbf16ps's bits on this CPU; "
                        "bf16 rows stay on vdpbf16ps")
            timings = {}
        else:
            gemm = kernels[0].ops.linear_bf16_packed
            timings = routed.time_two_ways(
                kernels, [k.in_features for k in kernels], torch.bfloat16,
                lambda k, x: gemm(x, k.packed, k.bias),
                lambda k, x: gemm(x, k.packed, k.bias, widen_from=1), routed.WIDEN_TRIAL_ROWS)
        _TRIAL_TIMINGS[key] = timings
    rows = routed.dense_rows_from(timings, routed.WIDEN_MARGIN)
    if timings:
        _log_trial("bf16 linears", timings, ("vdpbf16ps", "float32 FMAs"),
                   f"float32 FMAs from {rows} rows" if rows else "vdpbf16ps throughout")
    return rows


def route_widened(module: nn.Module, rows: int | None) -> None:
    """Multiply ``rows`` rows or more as float32 FMAs on every packed bf16 layer off AMX (the
    same bits as vdpbf16ps: only the pace changes); None: vdpbf16ps throughout."""
    for layer in _widenable(module):
        layer.kernel.widen_from = rows or 0
