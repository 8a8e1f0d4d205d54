"""The routed-experts MLP of mixture-of-experts decoders (Qwen2/3-MoE, Mixtral, gpt-oss).

A router picks ``top_k`` of ``num_experts`` expert MLPs per token and weighs their outputs; a
Qwen2-MoE layer adds a shared expert scaled by a sigmoid gate. Each expert is an ordinary
gated MLP of ``Linear`` layers (``gate_up_proj`` (2I, H), ``down_proj`` (H, I)), so the load
plan quantizes and packs every expert like any other linear (int8 / int4, packed float32 /
bf16 GEMMs); checkpoints that stack the experts in 3-D tensors (gpt-oss, GGUF's
``ffn_*_exps``) are cut into per-expert tensors as they load (``split_experts``).

The experts run grouped: the (token, slot) pairs sorted by expert, one multiplication per
expert over all of its rows, the weighted outputs summed in float32. On the CPU with the
compiled kernels (``csrc/moe.h``, ``MoEExperts``) that loop runs in C++ over the experts'
packed weights; elsewhere (CUDA, no compiler, kernels it cannot take) in PyTorch over each
expert's own kernel. Both add the same products in the same order: their results are equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.layers import Linear, empty_param

__all__ = ["ClampedExpert", "Router", "SparseMoE", "build_grouped", "grouped_experts", "route",
           "split_experts"]


def route(logits: torch.Tensor, top_k: int, softmax_first: bool,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each token takes and their weights, (T, top_k) each; weights rounded to the
    logits' dtype as the reference implementations leave them, returned in float32.
    ``softmax_first``: softmax over every expert, then the top k (renormalised to sum to one
    where ``renormalize``: Qwen3-MoE's norm_topk_prob, Mixtral); else the top k logits, then
    their softmax (gpt-oss)."""
    if softmax_first:
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    return weights.to(logits.dtype).float(), ids


class Router(nn.Module):
    """The router's (E, H) weight and bias, multiplied by ``F.linear`` as loaded: not a
    ``Linear``, so the load plan neither quantizes nor repacks it (routing stays as the
    checkpoint decides it) and the fused step (``csrc/moe.h``) calls the same op."""

    def __init__(self, hidden: int, experts: int, bias: bool):
        super().__init__()
        self.weight = empty_param(experts, hidden)
        self.bias = empty_param(experts) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ClampedExpert(nn.Module):
    """gpt-oss's expert: ``(clamp(up) + 1) * g * sigmoid(alpha g)`` with ``g = min(gate,
    limit)``, biases on both linears. Its gate/up linear is ``gate_up`` (gate rows, then up
    rows), not ``gate_up_proj``, so no kernel gives it the plain SiLU·mul epilogue."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inter, bias=True)
        self.down_proj = Linear(inter, hidden, bias=True)
        self.alpha, self.limit = alpha, limit

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(self.gate_up(x)))


class SparseMoE(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert). ``cfg.extra`` says how the family
    routes: ``softmax_first`` / ``norm_topk_prob`` (see ``route``), ``router_bias``,
    ``expert_bias``, ``swiglu_limit`` / ``swiglu_alpha`` (gpt-oss's clamped experts) and
    ``shared_expert_intermediate_size`` (0: none)."""

    def __init__(self, cfg: ModelConfig, expert_mlp: type[nn.Module]):
        super().__init__()
        x = cfg.extra
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts
        self.softmax_first = x.get("softmax_first", True)
        self.renormalize = x.get("norm_topk_prob", True)
        self.gate = Router(cfg.hidden_size, cfg.num_experts, x.get("router_bias", False))
        inter = cfg.moe_intermediate_size
        if "swiglu_limit" in x:
            self.experts = nn.ModuleList(
                ClampedExpert(cfg.hidden_size, inter, x["swiglu_alpha"], x["swiglu_limit"])
                for _ in range(cfg.num_experts))
        else:
            one = replace(cfg, intermediate_size=inter, mlp_bias=x.get("expert_bias", False))
            self.experts = nn.ModuleList(expert_mlp(one) for _ in range(cfg.num_experts))
        shared = x.get("shared_expert_intermediate_size", 0)
        self.shared_expert = expert_mlp(replace(cfg, intermediate_size=shared)) if shared \
            else None
        self.shared_expert_gate = Router(cfg.hidden_size, 1, False) if shared else None
        self.cpu_ops = None  # set by the loader when the CPU kernels are in use
        self._grouped = None  # the C++ MoEExperts over the packed weights, built on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.softmax_first, self.renormalize)
        out = self._run_experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _run_experts(self, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
        if self._grouped is None and self.cpu_ops is not None and x.device.type == "cpu":
            self._grouped = build_grouped(self, self.cpu_ops) or False
        if self._grouped:
            return self._grouped.forward(x, ids, weights)
        return grouped_experts(self.experts, x, weights, ids)


def grouped_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t, in x's dtype: the
    (token, slot) pairs sorted by expert, one call per expert that has any, the products
    summed in float32 (expert by expert, as ``csrc/moe.h`` adds them)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (T * top_k,) slots grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    slot_weights = weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // top_k
        y = experts[e](x.index_select(0, tokens))  # (count, hidden)
        out.index_add_(0, tokens, y.float() * slot_weights[slots].unsqueeze(1))
    return out.to(x.dtype)


def split_experts(weights: Iterable[tuple[str, torch.Tensor]], renames: dict[str, str]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's expert tensors as the per-expert names the model has: sub-names renamed
    by ``renames`` (e.g. Mixtral's ``.block_sparse_moe.`` -> ``.mlp.``), and 3-D stacks
    ``...experts.<proj>.weight`` (E, out, in) -- GGUF's ``ffn_*_exps`` -- cut into
    ``...experts.<e>.<proj>.weight``."""
    for name, tensor in weights:
        for old, new in renames.items():
            name = name.replace(old, new)
        head, sep, tail = name.partition(".experts.")
        if sep and not tail.split(".", 1)[0].isdigit() and tensor.dim() >= 2:
            for e in range(tensor.shape[0]):
                yield f"{head}.experts.{e}.{tail}", tensor[e]
        else:
            yield name, tensor


def build_grouped(moe: SparseMoE, ops):
    """``csrc/moe.h``'s MoEExperts over the experts' packed weights, or None where the kernels
    lack it or the experts' kernels have no packed weights of one kind for it (the PyTorch
    loop then runs: CUDA, a dequantizing or oneDNN-only kernel, QuantBytes)."""
    if not hasattr(ops, "MoEExperts"):
        return None
    pairs = [(_gate_up_of(e).kernel.step_weight(), e.down_proj.kernel.step_weight())
             for e in moe.experts]
    if any(g is None or d is None for g, d in pairs):
        return None
    first = pairs[0][0]
    kinds = {(g.gemm, d.gemm, g.applies_silu, g.dense_from_rows, d.dense_from_rows)
             for g, d in pairs}
    if len(kinds) != 1 or first.gemm != pairs[0][1].gemm:
        return None
    grouped = ops.MoEExperts()
    grouped.gate_up, grouped.down = [g.packed for g, _ in pairs], [d.packed for _, d in pairs]
    grouped.gate_up_bias, grouped.down_bias = [g.bias for g, _ in pairs], [d.bias for _, d in pairs]
    grouped.gate_up_dense = [g.dense for g, _ in pairs]
    grouped.down_dense = [d.dense for _, d in pairs]
    grouped.bf16, grouped.silu_epilogue = first.gemm == "bf16", first.applies_silu
    grouped.dense_from_rows = first.dense_from_rows or 0
    grouped.router = moe.gate.weight.detach()
    grouped.router_bias = None if moe.gate.bias is None else moe.gate.bias.detach()
    grouped.top_k, grouped.softmax_first = moe.top_k, moe.softmax_first
    grouped.renormalize = moe.renormalize
    clamped = moe.experts[0]
    if isinstance(clamped, ClampedExpert):
        grouped.alpha, grouped.limit = clamped.alpha, clamped.limit
    return grouped


def _gate_up_of(expert: nn.Module) -> Linear:
    return expert.gate_up if isinstance(expert, ClampedExpert) else expert.gate_up_proj
