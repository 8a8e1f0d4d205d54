"""LoRA adapters served from start-up: ``tokenmill serve --lora-modules name=path ...`` (and
vLLM's JSON form), their flags, and loading them into the engine before any request is taken."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class LoRAModule:
    """An adapter to serve from start-up (one of ``tokenmill serve --lora-modules``)."""

    name: str
    path: str
    base_model_name: str | None = None  # the model it was trained on (/v1/models' parent)

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """``name=path``, or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``
        (base_model_name optional); ValueError saying what is wrong."""
        if text.lstrip().startswith("{"):
            return cls._from_json(text)
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules: {text!r} is not name=path (nor a JSON object)")
        return cls(name.strip(), path.strip())

    @classmethod
    def _from_json(cls, text: str) -> LoRAModule:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not JSON: {e}") from None
        if not isinstance(values, dict) or set(values) - {"name", "path", "base_model_name"}:
            raise ValueError(f"--lora-modules: {text!r}: a JSON module is an object with name, "
                             "path and optionally base_model_name")
        if not all(isinstance(values.get(k), str) and values[k] for k in ("name", "path")):
            raise ValueError(f"--lora-modules: {text!r} needs a name and a path (strings)")
        base = values.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: {text!r}: base_model_name must be a string")
        return cls(values["name"], values["path"], base)


def _module_arg(text: str) -> LoRAModule:
    try:
        return LoRAModule.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s LoRA flags (the engine's own, --enable-lora, --max-loras..., are with the
    other engine flags)."""
    g = p.add_argument_group("LoRA adapters (their limits: --max-loras, --max-cpu-loras, "
                             "--max-lora-rank)")
    g.add_argument("--lora-modules", nargs="+", type=_module_arg, default=[],
                   metavar="NAME=PATH", help="PEFT adapters served from start-up, which clients "
                   "name in `model`: name=path, or vLLM's JSON {\"name\": ..., \"path\": ..., "
                   "\"base_model_name\": ...}; implies --enable-lora")
    g.add_argument("--allow-runtime-lora", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API "
                        "key; also env VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); implies "
                        "--enable-lora")


def load_lora_modules(engine: LLMEngine, served_model_name: str,
                      modules: Sequence[LoRAModule]) -> None:
    """Serve ``modules`` (before any request is taken) over the model clients call
    ``served_model_name``, which no adapter may take. The first that fails to load raises its
    ``LoRAError``, and the engine is shut down: the server does not start."""
    engine.served_model_name = served_model_name
    try:
        for module in modules:
            engine.add_lora(module.name, module.path, module.base_model_name)
    except BaseException:
        engine.shutdown()
        raise
