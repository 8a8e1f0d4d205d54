"""The fused CPU step: a model's decoder layers run by one C++ call per forward.

The CPU analogue of the decode step's CUDA graphs (``cuda_graphs.py``): where every linear layer
is packed for the CPU kernels' GEMM (bf16 on AVX512-BF16, float32 on AVX2/AVX512) and attention
is the CPU paged backend, the layers' kernels are called from C++
(``kernels/csrc/decoder_step.h``) instead of from ~40 small Python operations per layer, with
the GIL released throughout. The kernels and their order are the eager path's (in float32 its
PyTorch ops too), so the results are the same, bit for bit; the embeddings, RoPE table lookup,
final norm, lm_head and sampling stay in Python. Any batch works (decode, prompt chunks, cached
prefixes, shared-prefix cascades), so unlike a graph nothing is captured per batch size and
there is no start-up cost. ``--enforce-eager`` keeps the Python path.
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
        weights, onednn = [], set()
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            packed = [getattr(lin, _PACKED[self.dtype]) for lin in linears]
            onednn.update(lin.dense_from_rows for lin in linears)
            dense = [lin.weight if lin.dense_from_rows is not None else None for lin in linears]
            for t in (layer.input_layernorm.weight, packed[0], a.qkv_proj.bias,
                      packed[1], a.o_proj.bias, layer.post_attention_layernorm.weight,
                      packed[2], mlp.gate_up_proj.bias, packed[3], mlp.down_proj.bias, *dense):
                weights.append(_NONE if t is None else t.detach())
        # batches of this many rows or more multiply on the dense weights through oneDNN, still
        # in the one call (Linear.dense_from_rows, where it measured faster at load: bf16 with
        # AMX); route_to_onednn gives every linear that kept a dense weight the same rows
        onednn.discard(None)
        if len(onednn) > 1:
            raise ValueError(f"CpuStep: the linears route different rows to oneDNN: {onednn}")
        self.dense_from_rows: int | None = onednn.pop() if onednn else None
        self.stack = attn.backend.ops.DecoderStack(
            weights, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            inner.layers[0].input_layernorm.eps, attn.scale, TILE, CASCADE_TILE,
            self.dense_from_rows or 0)
        self.backend: CpuPagedBackend = attn.backend

    def __call__(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        if h.dtype != self.dtype or self.backend._reference_for(kv_caches[0], h.dtype):
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
# the dtypes the kernels' DecoderStack runs, and the Linear attribute holding each one's weights
_PACKED = {torch.bfloat16: "packed_bf16", torch.float32: "packed_f32"}


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
    if dtype not in _PACKED:
        return f"{dtype} runs eagerly"
    if dtype == torch.bfloat16 and not getattr(ops, "has_bf16_gemm", False):
        return "bf16 needs the CPU kernels' bf16 GEMM (AVX512-BF16)"
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        if a.q_norm is not None:
            return "per-head q/k norms (Qwen3) run eagerly"
        if any(getattr(lin, _PACKED[dtype]) is None
               for lin in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            name = "bf16" if dtype == torch.bfloat16 else "float32"
            return f"not every linear layer is a packed {name} weight (quantized, or a size " \
                   "the kernels do not pack)"
        if dtype == torch.bfloat16 and not mlp.gate_up_proj.gated:
            return "gate/up takes no SiLU·mul in its epilogue (an MLP bias)"
    return None
