"""tokenmill: an LLM inference serving engine.

Importing the package is cheap on purpose (no torch, no server): ``LLM`` and the engine load
on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.config import DEFAULT_MODEL
from tokenmill.params import SamplingParams
from tokenmill.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.loras import LoRARequest

__version__ = "0.1.0"

__all__ = ["DEFAULT_MODEL", "LLM", "LoRARequest", "SamplingParams", "StructuredOutputs",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "LoRARequest":  # vLLM's ``from vllm.lora.request import LoRARequest``
        from tokenmill.engine.loras import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
