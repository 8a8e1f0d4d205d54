"""Adapters applied to the rows of one batch: ``LoRASlots`` holds up to ``max_loras`` adapters,
one per slot, and for a forward the rows of each slot (``set_step``); every linear an adapter
adapts adds ``(x A^T) B`` to those rows of its output, each adapter with its own ranks (none
padded to the largest), in float32, rounded once into the output. Rows in no group run the base
model only, bit for bit as without LoRA: the base kernels multiply every row as before and the
deltas are added after them.

Where it runs:

- the fused CPU step (``runner/cpu_step.py``, ``kernels/csrc/decoder_step.h``): the kernels'
  ``LoRABank`` (``csrc/lora.h``) holds the slots' weights and the step's groups, and the stack
  calls it after each linear's GEMM, one call per layer and linear for all slots;
- the eager path: each decoder linear's ``Linear.lora`` hook calls the same bank on the CPU;
- elsewhere (CUDA, or no compiler) ``lora_reference``: per slot, its rows gathered, the two
  products in float32, the rows put back.

A linear whose kernel applies SiLU·mul in its GEMM's epilogue (bf16 gate/up) runs unfused when
LoRA rows adapt it: its plain product (column blocks interleaved as the weight is packed), the
deltas in that column order, then SiLU·mul over the interleaved blocks -- the epilogue's
roundings, so base rows keep their bits. A segment table per module maps each PEFT slice's B
columns to the product's columns, plain and, for that layout, interleaved.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.linear.activation import silu_and_mul
from tokenmill.model.linear.base import LinearKernel
from tokenmill.model.linear.packed import Bf16PackedSilu, interleaved_columns
from tokenmill.model.linear.routed import OneDnnRouted
from tokenmill.model.lora.weights import LORA_ROLES, ModuleLoRA

ROLE_INDEX = {role: i for i, role in enumerate(LORA_ROLES)}  # csrc/lora.h's kLoRAQkv ...

# (rank start, ranks, B column, output column, width): output[:, col .. + width] +=
# t[:, ranks] @ B[ranks, B column .. + width], t = x A^T
Segment = tuple[int, int, int, int, int]


def layer_linears(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's linears by LoRA role (``LORA_ROLES``)."""
    a, mlp = layer.self_attn, layer.mlp
    return {"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}


def linear_sizes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) features of each role's linear for a ``ModelConfig``."""
    h, i, q = cfg.hidden_size, cfg.intermediate_size, cfg.q_size
    return {"qkv": (h, q + 2 * cfg.kv_size), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}


def lora_reference(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, segments: Sequence[Segment]) -> None:
    """``y[rows] += (x[rows] A^T) B`` over ``segments``, in float32, each row rounded once into
    y's dtype: the kernels' ``LoRABank.add_`` in PyTorch (any device)."""
    if rows.numel() == 0:
        return
    t = x.index_select(0, rows).float() @ a.float().T  # (rows, ranks)
    out = y.index_select(0, rows).float()  # (rows, N)
    for start, ranks, b_col, col, width in segments:
        out[:, col:col + width] += t[:, start:start + ranks] @ b[start:start + ranks,
                                                               b_col:b_col + width].float()
    y.index_copy_(0, rows, out.to(y.dtype))


def plain_segments(m: ModuleLoRA) -> tuple[Segment, ...]:
    """One segment per slice, its columns where the linear's output has them."""
    return tuple((s.rank_start, s.rank, s.out_start, s.out_start, s.out_size)
                 for s in m.slices if s.rank and s.out_size)


def moved_segments(m: ModuleLoRA, columns: torch.Tensor) -> tuple[Segment, ...]:
    """The slices for a product whose output feature c sits at column ``columns[c]``: each cut
    into runs of consecutive columns."""
    out = []
    for s in m.slices:
        if not (s.rank and s.out_size):
            continue
        cols = columns[s.out_start:s.out_start + s.out_size]
        cuts = ((cols[1:] != cols[:-1] + 1).nonzero().flatten() + 1).tolist()
        for lo, hi in itertools.pairwise([0, *cuts, s.out_size]):
            out.append((s.rank_start, s.rank, s.out_start + lo, int(cols[lo]), hi - lo))
    return tuple(out)


def packed_silu(kernel: LinearKernel) -> Bf16PackedSilu | None:
    """The interleaved bf16 gate/up kernel inside ``kernel`` (alone, or below a oneDNN route)."""
    if isinstance(kernel, OneDnnRouted):
        kernel = kernel.packed
    return kernel if isinstance(kernel, Bf16PackedSilu) else None


def gated_product(kernel: LinearKernel,
                  x: torch.Tensor) -> tuple[torch.Tensor, Bf16PackedSilu | None]:
    """A gate/up kernel that applies SiLU·mul, taken apart: its product for ``x`` (rows, K)
    before SiLU·mul, and the packed kernel whose interleaved column order it has (None: plain
    order, gate then up)."""
    if isinstance(kernel, OneDnnRouted):
        if x.shape[0] >= kernel.from_rows:  # the route kernel.__call__ takes
            return F.linear(x.to(kernel.weight.dtype), kernel.weight, kernel.bias), None
        kernel = kernel.packed
    if isinstance(kernel, Bf16PackedSilu):
        return kernel.product(x), kernel
    raise TypeError(f"LoRA on gate/up: no product before SiLU·mul for {kernel.describe()}")


@dataclass(frozen=True)
class _Entry:  # one adapter on one linear, as the slots keep it
    lora: ModuleLoRA
    segments: tuple[Segment, ...]
    interleaved: tuple[Segment, ...] | None  # for a product with interleaved blocks


class _LinearHook:
    """``Linear.lora`` of one decoder linear: the kernel alone unless the step's LoRA rows
    adapt this linear."""

    __slots__ = ("slots", "layer", "role", "index")

    def __init__(self, slots: LoRASlots, layer: int, role: str):
        self.slots, self.layer, self.role = slots, layer, role
        self.index = layer * len(LORA_ROLES) + ROLE_INDEX[role]

    def __call__(self, kernel: LinearKernel, x: torch.Tensor) -> torch.Tensor:
        if not self.slots._touched[self.index]:
            return kernel(x)
        return self.slots._forward(self.layer, self.role, kernel, x)


class LoRASlots:
    """Up to ``max_loras`` adapters, one per slot, applied to a forward's rows by slot."""

    def __init__(self, model: nn.Module, max_loras: int, ops) -> None:
        """``model``: a loaded ``LlamaForCausalLM``; its decoder linears get this as their
        ``lora`` hook, and its fused CPU step, if installed, takes it (``attach_lora``).
        ``ops``: the CPU kernels (``kernels.cpu.load()``), or None: PyTorch throughout."""
        if max_loras < 1:
            raise ValueError(f"LoRASlots: max_loras must be at least 1, got {max_loras}")
        inner = model.model
        self.max_loras = max_loras
        self._linears = [layer_linears(layer) for layer in inner.layers]
        self._sizes = linear_sizes(model.config)
        self.dtype, self.device = inner.norm.weight.dtype, inner.norm.weight.device
        # the kernels' bank (csrc/lora.h) where they have one and the model is on the CPU
        self.bank = ops.LoRABank(max_loras, len(self._linears)) \
            if ops is not None and hasattr(ops, "LoRABank") and self.device.type == "cpu" \
            else None
        self._slots: list[dict[tuple[int, str], _Entry] | None] = [None] * max_loras
        self._groups: list[tuple[int, torch.Tensor]] = []
        self._none = [False] * (len(self._linears) * len(LORA_ROLES))
        self._touched = self._none  # per (layer, role): the step's rows adapt it
        self.active = False  # the step has LoRA rows
        for i, linears in enumerate(self._linears):
            for role, linear in linears.items():
                linear.lora = _LinearHook(self, i, role)
        attach = getattr(inner.fused_layers, "attach_lora", None)
        if attach is not None:
            attach(self)

    def set_slot(self, slot: int, weights: Mapping[tuple[int, str], ModuleLoRA]) -> None:
        """Put an adapter's weights (``{(layer, role): ModuleLoRA}``) in ``slot``, replacing
        what it held; a linear absent from ``weights`` is not adapted."""
        self._check_slot(slot)
        entries = {key: self._entry(*key, m) for key, m in weights.items()}
        self.clear_slot(slot)
        if self.bank is not None:
            for (layer, role), e in entries.items():
                alt = None if e.interleaved is None else _segment_tensor(e.interleaved)
                self.bank.set(slot, layer, ROLE_INDEX[role], e.lora.a, e.lora.b,
                              _segment_tensor(e.segments), alt)
        self._slots[slot] = entries
        self._refresh()

    def clear_slot(self, slot: int) -> None:
        self._check_slot(slot)
        if self.bank is not None:
            self.bank.clear(slot)
        self._slots[slot] = None
        self._refresh()

    def set_step(self, groups: Sequence[tuple[int, torch.Tensor]]) -> None:
        """The next forward's LoRA rows: (slot, int64 row indices of the flat batch) per slot
        with rows; rows in no group run the base model only. ``[]``: no LoRA."""
        groups = [(int(slot), rows.reshape(-1)) for slot, rows in groups if rows.numel()]
        for slot, _ in groups:
            self._check_slot(slot)
            if self._slots[slot] is None:
                raise ValueError(f"LoRASlots: slot {slot} holds no adapter")
        if self.bank is not None:
            if groups:
                rows = torch.cat([r for _, r in groups]).to("cpu", torch.int64)
                bounds = torch.tensor([0, *itertools.accumulate(r.numel() for _, r in groups)])
                self.bank.set_step(rows, bounds, [slot for slot, _ in groups])
            else:
                self.bank.clear_step()
        self._groups = [(slot, r.to(self.device, torch.int64)) for slot, r in groups]
        self._refresh()

    def clear_step(self) -> None:
        """After the forward: the next ones run without LoRA until ``set_step``."""
        self.set_step([])

    def nbytes(self) -> int:
        """Bytes of the adapters' weights the slots hold."""
        return sum(e.lora.nbytes() for entries in self._slots if entries
                   for e in entries.values())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRASlots: slot {slot} outside 0 .. {self.max_loras - 1}")

    def _entry(self, layer: int, role: str, m: ModuleLoRA) -> _Entry:
        """``m`` checked against the linear it adapts, in the model's dtype and device."""
        if not 0 <= layer < len(self._linears) or role not in ROLE_INDEX:
            raise ValueError(f"LoRASlots: no linear {role!r} in layer {layer} "
                             f"({len(self._linears)} layers, roles {', '.join(LORA_ROLES)})")
        k, n = self._sizes[role]
        if m.a.shape[1] != k or m.b.shape[1] != n:
            raise ValueError(f"LoRASlots: layer {layer} {role}: a LoRA of {m.a.shape[1]} -> "
                             f"{m.b.shape[1]} features on a linear of {k} -> {n}")
        if m.a.dtype != self.dtype or m.a.device != self.device or not m.a.is_contiguous() \
                or m.b.dtype != self.dtype or m.b.device != self.device \
                or not m.b.is_contiguous():
            m = ModuleLoRA(m.a.to(self.device, self.dtype).contiguous(),
                           m.b.to(self.device, self.dtype).contiguous(), m.slices)
        packed = packed_silu(self._linears[layer][role].kernel) if role == "gate_up" else None
        interleaved = None if packed is None else moved_segments(m, interleaved_columns(n))
        return _Entry(m, plain_segments(m), interleaved)

    def _refresh(self) -> None:
        """Which linears the step's rows adapt, after the step or a slot changed."""
        touched = list(self._none)
        for slot, _ in self._groups:
            for layer, role in self._slots[slot] or {}:
                touched[layer * len(LORA_ROLES) + ROLE_INDEX[role]] = True
        self.active = any(touched)
        self._touched = touched if self.active else self._none

    def _forward(self, layer: int, role: str, kernel: LinearKernel,
                 x: torch.Tensor) -> torch.Tensor:
        """``kernel``'s output for ``x`` with the step's LoRA rows' deltas added."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (rows, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if not kernel.applies_silu:
            y = kernel(x2)
            self._add(layer, role, x2.to(y.dtype), y, False)
        else:
            product, packed = gated_product(kernel, x2)
            self._add(layer, role, x2.to(product.dtype), product, packed is not None)
            y = silu_and_mul(product, getattr(kernel, "ops", None)) if packed is None \
                else packed.activate(product)
        return y.view(*shape[:-1], y.shape[-1])

    def _add(self, layer: int, role: str, x: torch.Tensor, y: torch.Tensor,
             interleaved: bool) -> None:
        """y += the deltas of the step's rows whose adapter adapts (layer, role)."""
        if self.bank is not None:
            self.bank.add_(layer, ROLE_INDEX[role], x, y, interleaved)
            return
        for slot, rows in self._groups:
            e = self._slots[slot].get((layer, role))
            if e is not None:
                segments = e.interleaved if interleaved else e.segments
                lora_reference(x, y, rows, e.lora.a, e.lora.b, segments)


def _segment_tensor(segments: Sequence[Segment]) -> torch.Tensor:
    return torch.tensor(segments, dtype=torch.int64).view(len(segments), 5)  # (S, 5)
