"""Mixture-of-experts decoders: Qwen2-MoE, Qwen3-MoE, Mixtral and gpt-oss.

Each is the Llama decoder (``llama.py``'s attention, norms and layer loop) with the MLP of
some or all layers replaced by routed experts (``moe.py``). What differs is config: how the
router weighs (softmax then top-k, renormalised or not; gpt-oss: top-k then softmax), a
shared expert (Qwen2-MoE), q/k norm (Qwen3-MoE), and for gpt-oss biases on every projection
and on the router, a clamped SwiGLU, per-head attention sinks and a sliding window on
alternate layers (given to the attention backend per layer). Each family's ``config.json`` /
GGUF fields are read by its hooks in ``family_config.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.attention import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.model.layers import Linear, empty_param
from tokenmill.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.model.llama import LlamaMLP, LlamaModel
from tokenmill.model.moe import SparseMoE, split_experts

# checkpoint sub-names -> ours (Mixtral's experts, gpt-oss's router)
_RENAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
            ".w2.": ".down_proj.", ".mlp.router.": ".mlp.gate."}
# GGUF per-layer names of the expert tensors (llama.cpp's) -> ours before split_experts
GGUF_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


class _SinksBackend:
    """The model's attention backend as a gpt-oss layer calls it: with the layer's attention
    sinks (per-head logits in every softmax's denominator) added to every call."""

    def __init__(self, backend: AttentionBackend, attn: nn.Module):
        self._backend, self._attn = backend, attn

    def forward(self, q, k, v, kv_cache, meta, scale, **kw):
        return self._backend.forward(q, k, v, kv_cache, meta, scale,
                                     sinks=self._attn.sinks.float(), **kw)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)


class MoEAttention(LlamaAttention):
    """Llama's attention (with the layer's sliding window); gpt-oss adds an o_proj bias and
    attention sinks."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, comm, layer: int):
        super().__init__(cfg, backend, comm, layer)
        if cfg.extra.get("attention_sinks", False):
            self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=True)
            self.sinks = empty_param(cfg.num_heads)
            self.backend = _SinksBackend(backend, self)


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether decoder layer ``layer`` routes to experts (Qwen-MoE may keep some dense)."""
    step = cfg.extra.get("decoder_sparse_step", 1)
    return (cfg.num_experts > 0 and layer not in cfg.extra.get("mlp_only_layers", ())
            and (layer + 1) % step == 0)


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with this family's attention and, where the layer routes, experts."""

    attention_class = MoEAttention

    def make_mlp(self, cfg: ModelConfig, comm, layer: int) -> nn.Module:
        return SparseMoE(cfg, LlamaMLP) if is_moe_layer(cfg, layer) else LlamaMLP(cfg)


class MoEModel(LlamaModel):
    layer_class = MoEDecoderLayer


class MoEForCausalLM(LlamaForCausalLM):
    """A mixture-of-experts decoder of any of the families above (their config decides)."""

    model_class = MoEModel

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, comm=None):
        if comm is not None:
            raise ValueError("mixture-of-experts models run on one rank")
        super().__init__(cfg, backend)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert tensors under our names, from any of the layouts checkpoints use."""
        for name, tensor in split_experts(_gpt_oss_experts(weights), _RENAMES):
            if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = tensor.unsqueeze(0)  # GGUF stores the (1, H) gate as (H,)
            yield name, tensor


def _gpt_oss_experts(weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked experts, (E, H, 2I) gate/up with gate and up columns interleaved and
    (E, I, H) down, as per-expert (out, in) weights: gate rows then up rows."""
    for name, t in weights:
        head, sep, tail = name.partition(".experts.")
        if not sep or tail not in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                   "down_proj_bias"):
            yield name, t
            continue
        for e in range(t.shape[0]):
            w = t[e].transpose(0, 1) if t.dim() == 3 else t[e]  # (out, in) or (out,)
            if tail.startswith("gate_up"):
                w = torch.cat((w[0::2], w[1::2]))
                sub = "gate_up"
            else:
                sub = "down_proj"
            yield f"{head}.experts.{e}.{sub}.{'bias' if tail.endswith('bias') else 'weight'}", w

