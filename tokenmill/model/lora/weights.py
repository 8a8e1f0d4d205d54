"""One adapter's LoRA weights in the form the compute reads them: per decoder layer and per
tokenmill linear (``LORA_ROLES``), the A matrices of the PEFT modules it fuses stacked, and the B
matrices transposed with the adapter's scale folded in, each in its own block. A fused linear
(qkv, gate/up) has one slice per PEFT module, each with its own rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# tokenmill's linears of a decoder layer that an adapter may adapt
LORA_ROLES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class LoRASlice:
    """One PEFT module inside a tokenmill linear: rows ``rank_start .. + rank`` of
    ``ModuleLoRA.a`` / ``.b``, adding to output features ``out_start .. + out_size``."""

    rank_start: int
    rank: int
    out_start: int
    out_size: int


@dataclass(frozen=True)
class ModuleLoRA:
    """One adapter's LoRA on one linear of one layer. ``delta(x)``, added to the linear's
    output: for every slice s, ``(x @ a[s].T) @ b[s]`` into its output columns.

    ``a``: (sum of ranks, in_features), every slice's A stacked; ``b``: (sum of ranks,
    out_features), each slice's ``B.T * scale`` in its block, zero elsewhere; both contiguous,
    in the compute dtype. Output features in tokenmill's fused order (q, k, v; gate, up)."""

    a: torch.Tensor
    b: torch.Tensor
    slices: tuple[LoRASlice, ...]

    def __post_init__(self) -> None:
        ranks = sum(s.rank for s in self.slices)
        if self.a.dim() != 2 or self.b.dim() != 2 or self.a.shape[0] != ranks \
                or self.b.shape[0] != ranks:
            raise ValueError(f"ModuleLoRA: a {tuple(self.a.shape)} and b {tuple(self.b.shape)} "
                             f"must have {ranks} rows (the slices' ranks)")
        for s in self.slices:
            if s.out_start < 0 or s.out_start + s.out_size > self.b.shape[1]:
                raise ValueError(f"ModuleLoRA: slice {s} outside {self.b.shape[1]} outputs")

    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: ``x @ a.T @ b`` in float32, (rows, out_features)."""
        return (x.float() @ self.a.float().T) @ self.b.float()
