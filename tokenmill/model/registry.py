"""Architecture family -> model class. New families register here, not in if-chains."""

from __future__ import annotations

from torch import nn

from tokenmill.errors import ModelLoadError


def _llama() -> type[nn.Module]:
    from tokenmill.model.llama import LlamaForCausalLM

    return LlamaForCausalLM


_REGISTRY = {"llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _llama}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _REGISTRY:
        raise ModelLoadError(f"architecture {architecture!r} is not supported "
                             f"(supported: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[architecture]()
