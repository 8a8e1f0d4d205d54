"""The fused CPU step: a model's decoder layers run by one C++ call per forward.

The CPU analogue of the decode step's CUDA graphs (``cuda_graphs.py``): where every linear layer
is packed for the CPU kernels' GEMM (bf16 on AVX512-BF16, float32 on AVX2/AVX512) and attention
is the CPU paged backend, the layers' kernels are called from C++
(``kernels/csrc/decoder_step.h``) instead of from ~40 small Python operations per layer, with
the GIL released throughout. The kernels and their order are the eager path's (in float32 its
PyTorch ops too), so the results are the same, bit for bit; the embeddings, RoPE table lookup,
final norm, lm_head and sampling stay in Python. Any batch works (decode, prompt chunks, cached
prefixes, shared-prefix cascades), so unlike a graph nothing is captured per batch size and
there is no start-up cost. ``--enforce-eager`` keeps the Python path. Each linear's kernel
(``model/linear/``) hands over what the C++ step multiplies it with (``StepWeight``), filled
into the kernels' named ``LayerWeights``; ``num_layers`` runs only the first layers, as the
eager model does for layer-skip drafting. A sliding-window layer (Mistral, Phi-3) carries its
window in ``LayerWeights.window`` and takes the backend's plan for that window (one window per
model); attention sinks are not fused (gpt-oss runs eagerly). A mixture-of-experts layer
(Mixtral) hands its router and grouped experts over as one ``MoEExperts`` (``model/moe.py``'s
``build_grouped``, ``csrc/moe.h``) in ``LayerWeights.moe``; a shared expert (Qwen2-MoE) runs
eagerly.

Under tensor parallelism the model's layers hold a rank's share (its heads, its part of the
MLP), and the step takes the group's shared-memory all-reduce (``distributed/shm.py``'s
``native``), which sums the o_proj and down outputs over the ranks inside the C++ call. A
pipeline stage after the first passes the previous stage's ``residual`` beside ``h``.

With LoRA (``model/lora/slots.py``), the slots' ``LoRABank`` is handed to the stack once
(``attach_lora``); a step whose rows it groups by adapter adds their deltas inside the same call.
"""

from __future__ import annotations

import torch

from tokenmill.attention.cpu_paged import CASCADE_TILE, TILE, CpuPagedBackend
from tokenmill.model.linear import StepWeight
from tokenmill.model.lora.slots import LoRASlots, layer_linears
from tokenmill.model.moe import build_grouped

# the packed GEMM the kernels' DecoderStack runs for each compute dtype (StepWeight.gemm)
_GEMM = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _step_weights(layer: torch.nn.Module) -> dict[str, StepWeight | None]:
    if _routed(layer):  # its experts run through their own MoEExperts (model/moe.py)
        a = layer.self_attn
        return {"qkv": a.qkv_proj.kernel.step_weight(), "o": a.o_proj.kernel.step_weight()}
    return {name: lin.kernel.step_weight() for name, lin in layer_linears(layer).items()}


def _routed(layer: torch.nn.Module) -> bool:
    """A mixture-of-experts layer: routed experts for an MLP (model/moe.py's SparseMoE)."""
    return hasattr(layer.mlp, "experts")


def _moe_unsupported(layer: torch.nn.Module, ops) -> str | None:
    """Why a mixture-of-experts layer cannot run fused (None: it can, by its MoEExperts)."""
    if getattr(layer.mlp, "shared_expert", None) is not None:
        return "a shared expert (Qwen2-MoE) runs eagerly"
    if getattr(layer.self_attn, "sinks", None) is not None:
        return "attention sinks (gpt-oss) run eagerly"
    if build_grouped(layer.mlp, ops) is None:
        return "experts without packed weights of one kind run eagerly"
    return None


class CpuStep:
    """Runs ``LlamaModel``'s layer loop through the kernels' ``DecoderStack``; installed as the
    model's ``fused_layers``. Returns None for a forward it cannot take (a cache the kernel
    does not read), which then runs eagerly."""

    def __init__(self, model: torch.nn.Module, all_reduce: object | None = None):
        """The fused step for ``model``, a ``LlamaForCausalLM`` that ``unsupported`` passed.
        ``all_reduce``: None (one rank), or the kernels' ``ShmAllReduce`` of the model's
        tensor-parallel group, which then sums the o_proj and down outputs over the ranks."""
        inner = model.model
        attn = inner.layers[0].self_attn
        ops = attn.backend.ops
        self.dtype = inner.norm.weight.dtype
        steps = [_step_weights(layer) for layer in inner.layers]
        # batches of this many rows or more multiply on the dense weights through oneDNN, still
        # in the one call (OneDnnRouted, where it measured faster at load: bf16 with AMX);
        # route_to_onednn gives every linear that kept a dense weight the same rows
        onednn = {w.dense_from_rows for ws in steps for w in ws.values()} - {None}
        if len(onednn) > 1:
            raise ValueError(f"CpuStep: the linears route different rows to oneDNN: {onednn}")
        self.dense_from_rows: int | None = onednn.pop() if onednn else None
        layers = [_layer_weights(ops, layer, ws) for layer, ws in zip(inner.layers, steps)]
        self.stack = ops.DecoderStack(
            layers, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            inner.layers[0].input_layernorm.eps, attn.scale, TILE, CASCADE_TILE,
            self.dense_from_rows or 0, all_reduce)
        self.all_reduce = all_reduce
        self.backend: CpuPagedBackend = attn.backend
        windows = {getattr(layer.self_attn, "window", None) for layer in inner.layers} - {None}
        self.window: int | None = windows.pop() if windows else None  # unsupported: at most one
        self.lora: LoRASlots | None = None
        hook = inner.layers[0].self_attn.qkv_proj.lora  # LoRA slots built before this step
        if hook is not None:
            self.attach_lora(hook.slots)

    def attach_lora(self, lora: LoRASlots) -> None:
        """Run ``lora``'s step rows inside the call: the stack reads its kernels' bank. Without
        one (slots on PyTorch), a step with LoRA rows runs eagerly."""
        if self.all_reduce is not None:
            raise ValueError("CpuStep: LoRA under tensor parallelism")
        self.lora = lora
        if lora.bank is not None:
            self.stack.set_lora(lora.bank)

    def __call__(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list, meta, num_layers: int | None = None,
                 residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h, residual) after the first ``num_layers`` layers (all: None), before the final
        norm; None for a forward the kernels do not take. ``residual``: a pipeline stage's
        input beside ``h`` (the previous stage's output), which the first layer's input norm
        adds ``h`` to; None on the first stage."""
        if h.dtype != self.dtype or self.backend._reference_for(kv_caches[0], h.dtype):
            return None
        if self.lora is not None and self.lora.active and self.lora.bank is None:
            return None
        n = len(kv_caches) if num_layers is None else num_layers
        plan = self.backend.plan(meta)
        # the windowed layers' plan, unless the window hides no key this step (the same plan)
        local = plan if self.window is None else self.backend.plan(meta, self.window)
        windowed = [] if local is plan else [local.key_start_block, local.key_low]
        cos, sin = rope
        h, residual = self.stack.forward(
            h, cos.squeeze(1), sin.squeeze(1), [k for k, _ in kv_caches[:n]],
            [v for _, v in kv_caches[:n]], meta.slot_mapping,
            meta.block_tables, meta.query_start_loc, plan.key_start_block, plan.key_limit,
            plan.empty, list(plan.shared) if plan.shared is not None else [], plan.resume,
            windowed, n, residual)
        return h, residual


def _layer_weights(ops, layer: torch.nn.Module, steps: dict[str, StepWeight]):
    """The kernels' ``LayerWeights`` of one decoder layer: its norms' weights, and per linear
    its packed weight, its bias and the dense weight oneDNN multiplies (None: it has none)."""
    w = ops.LayerWeights()
    w.input_norm = layer.input_layernorm.weight.detach()
    w.post_norm = layer.post_attention_layernorm.weight.detach()
    w.window = getattr(layer.self_attn, "window", None) or 0
    if _routed(layer):
        w.moe = build_grouped(layer.mlp, ops)
    w.amx = any(step.amx for step in steps.values())  # unsupported() saw all or none
    w.widen_from = max(step.widen_from for step in steps.values())  # the same bits either way
    for name, step in steps.items():
        setattr(w, name, step.packed)
        setattr(w, f"{name}_bias", None if step.bias is None else step.bias.detach())
        setattr(w, f"{name}_dense", step.dense)
    return w


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused step cannot run ``model``; None when it can."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not hasattr(inner, "fused_layers"):
        return "not a Llama-family model"
    attn = layers[0].self_attn
    ops = getattr(attn.backend, "ops", None)
    if not isinstance(attn.backend, CpuPagedBackend) or not hasattr(ops, "DecoderStack"):
        return "needs the CPU kernels' attention and GEMM (AVX2 or AVX512)"
    dtype = inner.norm.weight.dtype
    if dtype not in _GEMM:
        return f"{dtype} runs eagerly"
    if dtype == torch.bfloat16 and not getattr(ops, "has_bf16_gemm", False):
        return "bf16 needs the CPU kernels' bf16 GEMM (AVX512-BF16)"
    if len({getattr(layer.self_attn, "window", None) for layer in layers} - {None}) > 1:
        return "layers with different sliding windows run eagerly"
    for layer in layers:
        if layer.self_attn.q_norm is not None:
            return "per-head q/k norms (Qwen3) run eagerly"
        reason = _moe_unsupported(layer, ops) if _routed(layer) else None
        if reason is not None:
            return reason
        steps = _step_weights(layer)
        if any(s is None or s.gemm != _GEMM[dtype] for s in steps.values()):
            name = "bf16" if dtype == torch.bfloat16 else "float32"
            return f"not every linear layer is a packed {name} weight (quantized, or a size " \
                   "the kernels do not pack)"
        if dtype == torch.bfloat16 and "gate_up" in steps and not steps["gate_up"].applies_silu:
            return "gate/up takes no SiLU·mul in its epilogue (an MLP bias)"
        if len({s.amx for s in steps.values()}) > 1:
            return "a layer's linears split between AMX tiles and vdpbf16ps (a K not in 32s)"
    return None
