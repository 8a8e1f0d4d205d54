"""Phi-3 and Phi-4 (Hugging Face model_type "phi3", GGUF architecture "phi3"): Llama's layers.

What differs from the Llama family is in the files and in RoPE, not in the layers:
- checkpoints store q/k/v as one ``qkv_proj`` and the MLP's gate and up rows as one
  ``gate_up_proj`` (GGUF: ``attn_qkv`` and a fused ``ffn_up``); ``checkpoint_weights`` cuts them
  into the q/k/v and gate/up shards the model's ``ShardedLinear``s load, so quantized blocks
  keep their rows and every shard goes through the usual loader;
- LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): short and long frequency factors and an attention
  factor, chosen per token (``RotaryEmbedding.rows``);
- partial rotary (Phi-4-mini: 0.75): only the leading dims of each head rotate;
- a sliding window on every layer (Phi-3-mini: 2047), read like every family's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.config import ModelConfig
from tokenmill.model.layers import RotaryEmbedding
from tokenmill.model.llama import KVCache, LlamaForCausalLM, LlamaModel
from tokenmill.model.quant import QuantWeight

Weight = torch.Tensor | QuantWeight


class Phi3Model(LlamaModel):
    """``LlamaModel`` with a RoPE table of the rotated dims only, LongRoPE's rows included."""

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                               cfg.rope_scaling, rotary_dim(cfg))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata, *args, **kwargs):
        """``LlamaModel.forward``, whose positions only pick rows of the RoPE table: here each
        token's row, which under LongRoPE depends on its sequence's length too."""
        return super().forward(input_ids, self.rotary.rows(positions, meta), kv_caches, meta,
                               *args, **kwargs)


class Phi3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` (its forward, its parts) over a ``Phi3Model``."""

    model_class = Phi3Model

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]
                           ) -> Iterator[tuple[str, Weight]]:
        """The checkpoint with its fused projections cut into the shards the model loads:
        ``qkv_proj`` into q/k/v rows, ``gate_up_proj`` into gate and up (gate rows first)."""
        cfg = self.config
        cuts = {".qkv_proj.": {".q_proj.": cfg.q_size, ".k_proj.": cfg.kv_size,
                               ".v_proj.": cfg.kv_size},
                ".gate_up_proj.": {".gate_proj.": cfg.intermediate_size,
                                   ".up_proj.": cfg.intermediate_size}}
        for name, tensor in weights:
            fused = next((part for part in cuts if part in name), None)
            if fused is None:
                yield name, tensor
                continue
            start = 0
            for part, rows in cuts[fused].items():
                yield name.replace(fused, part), _rows(tensor, start, rows)
                start += rows


def _rows(w: Weight, start: int, count: int) -> Weight:
    if isinstance(w, QuantWeight):  # blocks run along a row: whole rows cut cleanly
        return w.rows(torch.arange(start, start + count))
    return w.narrow(0, start, count)


def rotary_dim(cfg: ModelConfig) -> int:
    """The dims of each head RoPE rotates (rounded: a GGUF's count came divided by head_dim)."""
    return round(cfg.head_dim * cfg.partial_rotary_factor)


__all__ = ["Phi3ForCausalLM", "Phi3Model", "rotary_dim"]
