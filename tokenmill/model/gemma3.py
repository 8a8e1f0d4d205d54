"""Gemma 3 (text): Gemma3ForCausalLM, and the text model inside Gemma3ForConditionalGeneration.

What differs from the Llama family (``llama.py``):
- the embeddings are multiplied by sqrt(hidden_size), the factor rounded to the model's dtype;
- RMSNorm multiplies by (1 + w) in float32 and rounds once (``GemmaRMSNorm``); GGUF files from
  llama.cpp store 1 + w already, Hugging Face checkpoints w (``norm_offset``: the config
  hooks in ``family_config.py``);
- four norms per layer: before and after attention, before and after the MLP, the residual
  added after each post-norm; q and k normalised per head before RoPE;
- attention scaled by query_pre_attn_scalar ** -0.5, head_dim 256;
- sliding-window attention on most layers (``cfg.window(i)``), whose RoPE uses the local base
  (rope_local_base_freq, no scaling) while global layers use rope_theta and its scaling;
- a GeGLU MLP (gelu-tanh(gate) * up), tied embeddings, and optional final logit softcapping.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import AttentionBackend, AttentionMetadata
from tokenmill.config import ModelConfig, RopeScaling
from tokenmill.model.layers import Embedding, Linear, RotaryEmbedding, ShardedLinear
from tokenmill.model.layers import apply_rope
from tokenmill.model.linear.base import LinearKernel
from tokenmill.model.linear.dense import Dense
from tokenmill.model.linear.packed import Bf16Packed

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]

# ----- layers ---------------------------------------------------------------------------------

class GemmaRMSNorm(nn.Module):
    """RMSNorm as Gemma computes it: x normalised and multiplied by the effective weight
    (1 + w, held as such, in float32) in float32, rounded to x's dtype once. With
    ``residual``, ``x + residual`` (rounded to the dtype first, as transformers adds) is
    normalised and returned as the new residual."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = _load_norm
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:
            x32 = x.float()
            out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
                   * self.weight).to(x.dtype)
        return out if residual is None else (out, residual)


def _load_norm(param: nn.Parameter, loaded: torch.Tensor) -> None:
    # the offset (1 + w or already 1 + w) is applied by GemmaForCausalLM.checkpoint_weights
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded.float())


class GeluGateUp(ShardedLinear):
    """The fused gate/up projection of a GeGLU MLP. The load plan may give a gate/up layer a
    kernel with SiLU·mul in its epilogue (``Bf16PackedSilu``, the Llama family's); this layer
    takes the plain product instead, on the same packed GEMM."""

    def use_kernel(self, kernel: LinearKernel, keep_weight: bool = False) -> None:
        if kernel.applies_silu:
            ops = getattr(kernel, "ops", None)
            kernel = Bf16Packed.build(self.weight, self.bias, ops) or Dense(self.weight, self.bias)
        super().use_kernel(kernel, keep_weight)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = GeluGateUp(cfg.hidden_size, {0: size, 1: size})
        self.down_proj = Linear(size, cfg.hidden_size)
        tanh = "tanh" in cfg.extra.get("hidden_activation", "gelu_pytorch_tanh")
        self.approximate = "tanh" if tanh else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (num_tokens, intermediate) each
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        shards = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
        self.qkv_proj = ShardedLinear(cfg.hidden_size, shards, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.backend = backend
        self.scale = cfg.extra["query_pre_attn_scalar"] ** -0.5
        self.window = cfg.window(layer)
        self.cpu_ops = None  # set by the loader when the CPU kernels are in use

    def forward(self, rope: Rope, h: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        n, d = h.shape[0], self.head_dim
        q, k, v = self.qkv_proj(h).split([self.num_heads * d, self.num_kv_heads * d,
                                          self.num_kv_heads * d], dim=-1)
        q = apply_rope(self.q_norm(q.view(n, self.num_heads, d)), rope, self.cpu_ops)
        k = apply_rope(self.k_norm(k.view(n, self.num_kv_heads, d)), rope, self.cpu_ops)
        v = v.view(n, self.num_kv_heads, d)  # (num_tokens, kv_heads, head_dim)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(n, -1))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend):
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sliding = cfg.window(layer) is not None
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = GemmaAttention(cfg, layer, backend)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, rope: Rope, h: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's post-normed output, the residual stream before it is added): the next
        layer's input norm, or the final one, adds the two."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(rope, h, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5,
                                                         dtype=torch.float32)
                             .to(torch.get_default_dtype()), persistent=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.extra["rope_local_base_freq"], RopeScaling())
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, backend)
                                    for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.embed_scale
        ropes = {False: self.rotary(positions), True: self.rotary_local(positions)}
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(ropes[layer.sliding], h, residual, kv_cache, meta)
        h, _ = self.norm(h, residual)
        return h


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, comm=None):
        super().__init__()
        if comm is not None:
            raise ValueError("Gemma 3 runs in one process (no tensor / pipeline parallel)")
        self.config = cfg
        self.model = GemmaModel(cfg, backend)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.share_weight(self.model.embed_tokens.weight)
        self.softcap = cfg.extra.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(len(logits_indices), vocab)`` (float32) for the chosen rows only."""
        h = self.model(input_ids, positions, kv_caches, meta)
        if logits_indices is not None:
            h = h[logits_indices]  # (rows, hidden)
        logits = self.lm_head(h)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """A Gemma3ForConditionalGeneration's text weights under the causal LM's names (its
        vision tower and projector dropped), and the norm offset added."""
        offset = self.config.extra.get("norm_offset", 1.0)
        for name, tensor in weights:
            name = _text_name(name)
            if name is None:
                continue
            if offset and name.endswith("norm.weight"):
                tensor = tensor.float() + offset
            yield name, tensor


def _text_name(name: str) -> str | None:
    """The Gemma3ForCausalLM name of a checkpoint tensor; None for the multimodal parts."""
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith(("language_model.lm_head.", "lm_head.")):
        return "lm_head." + name.rpartition("lm_head.")[2]
    if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")):
        return None
    return name
