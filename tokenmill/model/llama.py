"""One implementation for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3.

The differences are config flags: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), RoPE
scaling (Llama 3), tied embeddings (SmolLM2, small Qwens). Input is a flat batch of tokens of
many requests; K/V go to and come from the paged cache through the attention backend.

Under tensor / pipeline parallelism (``comm``, a ``distributed.groups.Comm``) the model is built
from the rank's own shape (``RankPosition.local_config``): the o_proj and down_proj outputs are
partial sums, all-reduced over the rank's TP group before the residual add; the embedding looks
up the rank's vocabulary rows and is all-reduced; lm_head's logits are gathered to TP rank 0. A
stage after the first starts from the previous stage's ``(h, residual)``, a stage before the last
returns them instead of logits.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention import AttentionBackend, AttentionMetadata
from tokenmill.config import ModelConfig
from tokenmill.model.layers import Linear, RMSNorm, RotaryEmbedding, ShardedLinear, apply_rope
from tokenmill.model.layers import Embedding, silu_and_mul
from tokenmill.model.linear.dense import Dense

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, comm=None, layer: int = 0):
        super().__init__()
        self.window = cfg.window(layer)  # sliding window (Mistral, Phi-3); None: every key
        self.comm = comm  # partial o_proj sums are all-reduced (tensor parallel)
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.split = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        shards = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
        self.qkv_proj = ShardedLinear(cfg.hidden_size, shards, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.cpu_ops = None  # set by the loader when the CPU kernels are in use
        # the fused Triton kernels (kernels/triton_fused.py), set by the loader where they
        # apply: the backend is then Triton's, told when the K/V are stored already
        self.gpu_ops = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n = h.shape[0]
        qkv = self.qkv_proj(h)  # (num_tokens, (heads + 2 * kv_heads) * head_dim)
        gpu = self.gpu_ops
        if gpu is not None and self.q_norm is None and gpu.takes(qkv):
            # RoPE and the K/V write in one kernel (a quantized cache: the backend stores)
            q, k, v, stored = gpu.rope_qkv(qkv, rope, self.num_heads, self.num_kv_heads,
                                           kv_cache, meta.slot_mapping)
            o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window,
                                     kv_stored=stored)
        else:
            q, k, v = self._rotated_qkv(qkv, rope)
            o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window)
        out = self.o_proj(o.reshape(n, -1))
        return out if self.comm is None else self.comm.all_reduce(out)

    def _rotated_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k (q/k-normed where the model does) with RoPE applied, and v."""
        n = qkv.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is None:
            # q and k heads rotated together: one RoPE pass instead of two
            qk = apply_rope(qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d), rope,
                            self.cpu_ops)
            q, k = qk.split([heads, kv_heads], dim=1)
        else:
            q, k, _ = qkv.split(self.split, dim=-1)
            q = apply_rope(self.q_norm(q.view(n, heads, d)), rope)
            k = apply_rope(self.k_norm(k.view(n, kv_heads, d)), rope)
        v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm=None):
        super().__init__()
        self.comm = comm
        size = cfg.intermediate_size
        self.gate_up_proj = ShardedLinear(cfg.hidden_size, {0: size, 1: size}, bias=cfg.mlp_bias)
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.cpu_ops = None  # set by the loader when the CPU kernels are in use
        self.gpu_ops = None  # the fused Triton kernels (kernels/triton_fused.py), by the loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if not self.gate_up_proj.kernel.applies_silu:  # else done in the GEMM's epilogue
            h = self._silu_and_mul(h)
        out = self.down_proj(h)
        return out if self.comm is None else self.comm.all_reduce(out)

    def _silu_and_mul(self, h: torch.Tensor) -> torch.Tensor:
        gpu = self.gpu_ops
        if gpu is not None and h.dim() == 2 and gpu.takes(h):
            return gpu.silu_and_mul(h)
        return silu_and_mul(h, self.cpu_ops)


class LlamaDecoderLayer(nn.Module):
    # a family on these layers swaps its parts here (model/moe_families.py)
    attention_class: type[nn.Module] = LlamaAttention  # (cfg, backend, comm, layer index)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, comm=None, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, backend, comm, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, comm, layer)

    def make_mlp(self, cfg: ModelConfig, comm, layer: int) -> nn.Module:
        return LlamaMLP(cfg, comm)

    def forward(self, rope, h, residual, kv_cache: KVCache, meta: AttentionMetadata):
        gpu = self.self_attn.gpu_ops if type(self.self_attn) is LlamaAttention else None
        if gpu is not None and self._gemm_fusable(gpu, h, rope, kv_cache):
            return self._gemm_fused(gpu, rope, h, residual, kv_cache, meta)
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(rope, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def _gemm_fusable(self, gpu, h: torch.Tensor, rope, kv_cache: KVCache) -> bool:
        """Whether this step's rows take the GEMM-fused GPU kernels (``FusedOps.gemm_fuses``:
        an eager step of up to ``GEMM_ROWS`` tokens): plain 16-bit q/k/v and gate/up weights
        (no LoRA, no tensor-parallel sums, no q/k norm, a dense gated MLP), RoPE over whole
        heads."""
        attn, mlp = self.self_attn, self.mlp
        if attn.q_norm is not None or attn.comm is not None or type(mlp) is not LlamaMLP \
                or mlp.comm is not None or attn.qkv_proj.lora is not None \
                or mlp.gate_up_proj.lora is not None:
            return False
        qkv, gate_up = attn.qkv_proj.kernel, mlp.gate_up_proj.kernel
        half = rope[0].shape[-1]
        return (type(qkv) is Dense and type(gate_up) is Dense and 2 * half == attn.head_dim
                and half >= 16 and half & (half - 1) == 0
                and gpu.gemm_fuses(h, qkv.weight, kv_cache) and gate_up.weight.dtype == h.dtype)

    def _gemm_fused(self, gpu, rope, h, residual, kv_cache: KVCache, meta: AttentionMetadata):
        """The layer in five launches (``kernels/triton_fused.py``): norm + QKV GEMM + RoPE +
        K/V write, attention, o_proj, norm + gate/up GEMM + SiLU·mul, down_proj."""
        attn, mlp = self.self_attn, self.mlp
        qkv, gate_up = attn.qkv_proj.kernel, mlp.gate_up_proj.kernel
        norm = self.input_layernorm
        q, residual = gpu.norm_qkv_rope(h, residual, norm.weight, norm.eps, qkv.weight, qkv.bias,
                                        rope, attn.num_heads, attn.num_kv_heads, kv_cache,
                                        meta.slot_mapping)
        o = attn.backend.forward(q, None, None, kv_cache, meta, attn.scale, window=attn.window,
                                 kv_stored=True)
        h = attn.o_proj(o.reshape(h.shape[0], -1))
        norm = self.post_attention_layernorm
        act, residual = gpu.norm_gate_up_silu(h, residual, norm.weight, norm.eps,
                                              gate_up.weight, gate_up.bias)
        return mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    layer_class: type[nn.Module] = LlamaDecoderLayer  # (cfg, backend, comm, layer index)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, comm=None):
        super().__init__()
        self.comm = comm
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size,
                                      *((comm.vocab_start, comm) if comm is not None else ()))
        self.rotary = self.make_rotary(cfg)
        self.layers = nn.ModuleList(self.layer_class(cfg, backend, comm, i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the layer loop in one call (runner/cpu_step.py), set by the runner where it applies;
        # it returns None for a batch it does not take, which then runs layer by layer
        self.fused_layers = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                num_layers: int | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states after the first ``num_layers`` decoder layers (all: None) and the
        final norm; ``kv_caches`` holds at least those layers' caches. A pipeline stage after
        the first starts from the previous stage's ``intermediate`` (h, residual); one before
        the last returns its (h, residual) without the norm."""
        n = self.layer_count(num_layers, kv_caches)
        h, residual = (self.embed_tokens(input_ids), None) if intermediate is None \
            else intermediate
        rope = self.rotary(positions)
        fused = None if self.fused_layers is None else \
            self.fused_layers(h, rope, kv_caches, meta, n, residual=residual)
        if fused is not None:
            h, residual = fused
        else:
            for layer, kv_cache in zip(self.layers, kv_caches[:n]):
                h, residual = layer(rope, h, residual, kv_cache, meta)
        if self.comm is not None and not self.comm.is_last_stage:
            return h, residual
        h, _ = self.norm(h, residual)
        return h

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        """The RoPE table every layer reads (Phi-3's rotates part of each head)."""
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                               cfg.rope_scaling)

    def layer_count(self, num_layers: int | None, kv_caches: list[KVCache]) -> int:
        """The layers a forward runs: ``num_layers`` of them (an early exit) or all."""
        total = len(self.layers)
        n = total if num_layers is None else num_layers
        if not 1 <= n <= total or len(kv_caches) < n:
            raise ValueError(f"a forward through {n} of {total} layers with "
                             f"{len(kv_caches)} KV caches")
        return n


class LlamaForCausalLM(nn.Module):
    model_class: type[nn.Module] = LlamaModel  # (cfg, backend, comm)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, comm=None):
        super().__init__()
        self.config = cfg
        self.comm = comm
        self.model = self.model_class(cfg, backend, comm)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.share_weight(self.model.embed_tokens.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                logits_indices: torch.Tensor | None = None, *,
                num_layers: int | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Logits ``(len(logits_indices), vocab)`` for the chosen rows of the flat batch only.
        ``num_layers``: run only the first that many decoder layers, then the final norm and
        lm_head (early exit: layer-skip drafting); ``kv_caches`` may then hold just theirs.
        Parallel: a stage before the last returns its (h, residual), the last stage's TP
        ranks other than the first return None (their logits went to it)."""
        h = self.model(input_ids, positions, kv_caches, meta, num_layers, intermediate)
        if isinstance(h, tuple):
            return h
        if logits_indices is not None:
            h = h[logits_indices]  # (rows, hidden)
        logits = self.lm_head(h)
        if self.comm is not None:
            logits = self.comm.gather_logits(logits)
        return None if logits is None else logits.float()
