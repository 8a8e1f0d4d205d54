"""The fused CPU step: a model's decoder layers run by one C++ call per forward.

The CPU analogue of the decode step's CUDA graphs (``cuda_graphs.py``): where every linear layer
is packed for the CPU kernels' GEMM (bf16 on AVX512-BF16, float32 on AVX2/AVX512) and attention
is the CPU paged backend, the layers' kernels are called from C++
(``kernels/csrc/decoder_step.h``) instead of from ~40 small Python operations per layer, with
the GIL released throughout. The kernels and their order are the eager path's (in float32 its
PyTorch ops too), so the results are the same, bit for bit; the embeddings, RoPE table lookup,
final norm, lm_head and sampling stay in Python. Any batch works (decode, prompt chunks, cached prefixes,
shared-prefix cascades), so unlike a graph nothing is captured per batch size and there is no
start-up cost. ``--enforce-eager`` keeps the Python path.
"""

from __future__ import annotations

import torch

from tokenmill.attention.cpu_paged import CASCADE_TILE, TILE, CpuPagedBackend


class CpuStep:
    """Runs ``LlamaModel``'s layer loop through the kernels' ``DecoderStack``; installed as the
    model's ``fused_layers``. Returns None for a forward it cannot take (a cache the kernel
    does not read), which then runs eagerly."""

    def __init__(self, model: torch.nn.Module):
        """The fused step for ``model``, a ``LlamaForCausalLM`` that ``unsupported`` passed."""
        inner = model.model
        attn = inner.layers[0].self_attn
        self.dtype = inner.norm.weight.dtype
        weights = []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            for t in (layer.input_layernorm.weight, _packed(a.qkv_proj), a.qkv_proj.bias,
                      _packed(a.o_proj), a.o_proj.bias, layer.post_attention_layernorm.weight,
                      _packed(mlp.gate_up_proj), mlp.gate_up_proj.bias,
                      _packed(mlp.down_proj), mlp.down_proj.bias):
                weights.append(_NONE if t is None else t.detach())
        self.stack = attn.backend.ops.DecoderStack(
            weights, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            inner.layers[0].input_layernorm.eps, attn.scale, TILE, CASCADE_TILE)
        self.backend: CpuPagedBackend = attn.backend

    def __call__(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        if h.dtype != self.dtype or self.backend._reference_for(kv_caches[0]) is not None:
            return None
        plan = self.backend.plan(meta)
        cos, sin = rope
        h, residual = self.stack.forward(
            h, cos.squeeze(1), sin.squeeze(1), [k for k, _ in kv_caches],
            [v for _, v in kv_caches], meta.slot_mapping,
            meta.block_tables, meta.query_start_loc, plan.key_start_block, plan.key_limit,
            plan.empty, list(plan.shared) if plan.shared is not None else [])
        return h, residual


_NONE = torch.empty(0)


def _packed(linear) -> torch.Tensor | None:
    return linear.packed_bf16 if linear.packed_bf16 is not None else linear.packed_f32


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
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        if a.q_norm is not None:
            return "per-head q/k norms (Qwen3) run eagerly"
        linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if dtype == torch.bfloat16:
            if not getattr(ops, "has_bf16_gemm", False):
                return "bf16 needs the CPU kernels' bf16 GEMM (AVX512-BF16)"
            if any(lin.packed_bf16 is None for lin in linears):
                return "not every linear layer is a packed bf16 weight (quantized, or a size " \
                       "the kernels do not pack)"
            if not mlp.gate_up_proj.gated:
                return "gate/up takes no SiLU·mul in its epilogue (an MLP bias)"
        elif dtype == torch.float32:
            if any(lin.packed_f32 is None for lin in linears):
                return "not every linear layer is a packed float32 weight (quantized, or a " \
                       "size the kernels do not pack)"
        else:
            return f"{dtype} runs eagerly"
    return None
