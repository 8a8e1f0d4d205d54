"""A rank's slice of each checkpoint tensor (tensor parallelism) and which decoder layers it
loads (pipeline parallelism), applied while the checkpoint streams in, so a rank never holds
more than its own part of the model.

Tensor parallelism, per decoder layer: q/k/v and gate/up are split by output rows (the rank's
heads, KV heads and intermediate features: column parallel), o_proj and down_proj by input
columns (row parallel: each rank's product is a partial sum, all-reduced by the model; their
bias is added once, by TP rank 0). The embedding and lm_head are split by vocabulary rows.
Weights kept in a GGUF's quantized blocks are sliced in their bytes: rows as they are, columns
in whole blocks of 32 (a slice that would cut a block is dequantized instead).
"""

from __future__ import annotations

import re

import torch

from tokenmill.config import ModelConfig
from tokenmill.distributed.layout import RankPosition
from tokenmill.model.quant import QuantWeight, dequantize

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

Tensor = torch.Tensor | QuantWeight


def stage_name(name: str, position: RankPosition) -> str | None:
    """The checkpoint tensor ``name`` as this rank's stage names it (its layers numbered from 0),
    or None when it belongs to another stage's layers."""
    m = _LAYER.match(name)
    if m is None:
        return name
    layers = position.layers
    index = int(m.group(1))
    if index not in layers:
        return None
    return f"model.layers.{index - layers.start}.{name[m.end():]}"


def rank_slice(target: str, shard, tensor: Tensor, position: RankPosition,
               cfg: ModelConfig) -> Tensor:
    """The part of checkpoint tensor ``tensor`` (loaded into ``target``, fused shard
    ``shard``) that this rank holds; ``cfg`` is the whole model's shape."""
    if position.layout.tp_size == 1:
        return tensor
    rows = _row_range(target, shard, position, cfg)
    if rows is not None:
        return _rows(tensor, rows, cfg.vocab_size)
    cols = _column_range(target, position, cfg)
    if cols is not None:
        return _columns(tensor, cols)
    if target.endswith((".o_proj.bias", ".down_proj.bias")) and position.tp_rank:
        return torch.zeros_like(tensor)  # added once, by TP rank 0, after the all-reduce
    return tensor  # norms: every rank holds them whole


def _row_range(target: str, shard, position: RankPosition, cfg: ModelConfig) -> range | None:
    d = cfg.head_dim
    if ".qkv_proj." in target:
        heads = position.head_range(cfg) if shard == "q" else position.kv_head_range(cfg)
        return range(heads.start * d, heads.stop * d)
    if ".gate_up_proj." in target:
        return position.intermediate_range(cfg)
    if target in ("model.embed_tokens.weight", "lm_head.weight"):
        return position.vocab_range(cfg)
    return None


def _column_range(target: str, position: RankPosition, cfg: ModelConfig) -> range | None:
    if target.endswith(".o_proj.weight"):
        heads = position.head_range(cfg)
        return range(heads.start * cfg.head_dim, heads.stop * cfg.head_dim)
    if target.endswith(".down_proj.weight"):
        return position.intermediate_range(cfg)
    return None


def _rows(tensor: Tensor, rows: range, limit: int) -> Tensor:
    """Rows ``rows`` of ``tensor``; rows at or past ``limit`` (the vocabulary's padding up to a
    multiple of the ranks) are zeros."""
    real = range(rows.start, min(rows.stop, limit))
    pad = len(rows) - len(real)
    if isinstance(tensor, QuantWeight):
        if pad:  # a vocabulary that does not split evenly: padded in floats
            return _rows(dequantize(tensor), rows, limit)
        return tensor.rows(torch.arange(real.start, real.stop))
    part = tensor[real.start:real.stop]
    if pad:
        part = torch.cat([part, part.new_zeros(pad, *part.shape[1:])])
    return part.contiguous()


def _columns(tensor: Tensor, cols: range) -> Tensor:
    if not isinstance(tensor, QuantWeight):
        return tensor[:, cols.start:cols.stop].contiguous()
    g = tensor.group_size
    if cols.start % g or len(cols) % g or tensor.act_offsets is not None:
        return dequantize(tensor)[:, cols.start:cols.stop].contiguous()
    per_byte = 2 if tensor.bits == 4 else 1
    groups = slice(cols.start // g, cols.stop // g)
    pick = lambda t: None if t is None else t[:, groups].contiguous()  # noqa: E731
    return QuantWeight(tensor.qweight[:, cols.start // per_byte:cols.stop // per_byte].contiguous(),
                       pick(tensor.scales), pick(tensor.zeros), tensor.bits, g, tensor.kind)
