"""Speculative decoding: proposers and the lossless verification they rely on.

    ngram      prompt lookup (``ngram.NgramProposer``): no model, drafts without a distribution
    draft      a draft model sharing the target's vocabulary (``drafter.ModelDrafter``); its KV
               lives at the block ids of the sequences' own block tables (the scheduler's
               ``KVBlockManager``), in cache tensors of its own shape
    layerskip  the target's first layers as the draft model (``drafter.EarlyExit``): no second
               set of weights, only KV for the layers that draft, at the same block ids

Verification is the step contract's: drafts ride in the target's forward after the last known
token; the sampler keeps a draft only as the rejection rule allows (``runner/sampler.py``), the
scheduler rolls rejected KV back. ``policy.AdaptivePolicy`` decides how many drafts pay for
themselves each step; ``decoder.SpeculativeDecoder`` is what the engine talks to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.config import ModelConfig, SpeculativeConfig
from tokenmill.speculative.decoder import SpecStats, SpeculativeDecoder
from tokenmill.speculative.drafter import EarlyExit, ModelDrafter
from tokenmill.speculative.ngram import NgramProposer
from tokenmill.speculative.policy import AdaptivePolicy

if TYPE_CHECKING:
    from torch import nn

    from tokenmill.cache import KVBlockManager
    from tokenmill.model.loader import LoadedModel
    from tokenmill.tokenizer import Tokenizer


@dataclass
class DraftModel:
    """A drafting model and the shape of its KV cache (decided before the target's is sized)."""

    module: nn.Module
    config: ModelConfig


def load_draft_model(spec: SpeculativeConfig, target: LoadedModel | None,
                     target_config: ModelConfig, tokenizer: Tokenizer, device: str, dtype: str,
                     attention_backend: str) -> DraftModel | None:
    """The model that drafts for ``draft`` and ``layerskip``; None for the others. ``target``:
    the target model where it is in this process (layerskip drafts with its first layers);
    ``target_config``: its shape."""
    if spec.speculative_method == "layerskip":
        if target is None:
            raise ValueError("layerskip drafts with the target's own layers, which run in "
                             "other processes here")
        module = EarlyExit(target.model, layerskip_layers(spec, target_config.num_layers))
        return DraftModel(module, module.config)
    if spec.speculative_method != "draft":
        return None
    from tokenmill.model.loader import load_model
    from tokenmill.tokenizer import load_tokenizer

    draft = load_model(spec.speculative_model, device, dtype, attention_backend)
    if draft.config.vocab_size != target_config.vocab_size:
        raise ValueError(f"draft model {spec.speculative_model!r} has a vocabulary of "
                         f"{draft.config.vocab_size} tokens, the target {target_config.vocab_size}"
                         "; speculative decoding needs the same vocabulary")
    if load_tokenizer(spec.speculative_model).backend.get_vocab() != \
            tokenizer.backend.get_vocab():
        raise ValueError(f"draft model {spec.speculative_model!r} tokenizes differently from "
                         "the target; speculative decoding needs the same vocabulary")
    return DraftModel(draft.model, draft.config)


def build_decoder(spec: SpeculativeConfig, draft: DraftModel | None, num_blocks: int,
                  block_size: int, device: str, max_num_batched_tokens: int, *,
                  block_manager: KVBlockManager | None = None) -> SpeculativeDecoder | None:
    """The engine's proposer for ``spec`` (None when speculation is off). A drafting model
    (``draft``, ``layerskip``) keeps its KV in the sequences' blocks: it needs the scheduler's
    ``block_manager``, of ``num_blocks`` blocks of ``block_size`` tokens."""
    if spec.speculative_method is None:
        return None
    if spec.speculative_method == "ngram":
        method = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        _check_manager(block_manager, num_blocks, block_size, spec.speculative_method)
        # the drafter catches up on as many tokens per step as the target may compute
        method = ModelDrafter(draft.module, draft.config, block_manager, device,
                              max_catch_up=max_num_batched_tokens)
    return SpeculativeDecoder(method, spec.num_speculative_tokens, spec.speculative_method,
                              spec.speculative_adaptive, max_num_batched_tokens)


def _check_manager(manager: KVBlockManager | None, num_blocks: int, block_size: int,
                   method: str) -> None:
    if manager is None:
        raise ValueError(f"speculative method {method!r} keeps its KV in the scheduler's "
                         "blocks: pass build_decoder(..., block_manager=scheduler.block_manager)")
    if (manager.pool.num_blocks, manager.block_size) != (num_blocks, block_size):
        raise ValueError(f"the block manager has {manager.pool.num_blocks} blocks of "
                         f"{manager.block_size}, the KV budget {num_blocks} of {block_size}")


def layerskip_layers(spec: SpeculativeConfig, num_layers: int) -> int:
    """How many of the target's ``num_layers`` layers draft under ``layerskip`` (by default a
    quarter)."""
    return spec.speculative_draft_layers or max(1, num_layers // 4)


def spec_description(spec: SpeculativeConfig, draft_layers: int | None = None) -> dict:
    """The settings that matter for ``spec``'s method (for the plan, the log and
    ``/server_info``); ``draft_layers``: layerskip's drafting layers."""
    out = {"method": spec.speculative_method, "num_speculative_tokens":
           spec.num_speculative_tokens, "adaptive": spec.speculative_adaptive}
    if spec.speculative_method == "ngram":
        out.update(prompt_lookup_min=spec.prompt_lookup_min,
                   prompt_lookup_max=spec.prompt_lookup_max)
    elif spec.speculative_method == "draft":
        out["model"] = spec.speculative_model
    elif draft_layers is not None:
        out["draft_layers"] = draft_layers
    return out


__all__ = ["AdaptivePolicy", "DraftModel", "EarlyExit", "ModelDrafter", "NgramProposer",
           "SpecStats", "SpeculativeDecoder", "build_decoder", "layerskip_layers",
           "load_draft_model", "spec_description"]
