"""From a prompt's hidden states to one vector: pooling (last token, mean, CLS), truncation to
the first n dimensions (Matryoshka) and L2 normalisation; and the model's own defaults, read
from a sentence-transformers directory (``modules.json`` + ``1_Pooling/config.json``).

Without such a directory a decoder embeds as Qwen3-Embedding does (the last token's final-norm
hidden state, normalised) and an encoder by its CLS row, normalised. A chunked decoder prompt is
pooled across its chunks by ``PartialPool`` (a running float32 sum for the mean, the first
row for CLS), so a prompt longer than the step's token budget embeds as if read whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError

if TYPE_CHECKING:  # reading a model's pooling set-up needs no torch (serve's frontend)
    import torch

# sentence-transformers' Pooling modes -> ours; the others (max, mean_sqrt_len, weightedmean)
# are refused at load rather than served differently
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class ModelPooling:
    """What a model serves by default and how it pools: ``task`` ("generate", "embed",
    "score"), ``pooling`` ("last", "mean", "cls"), ``normalize``, where that was read, the
    longest prompt it embeds (sentence_bert_config.json's ``max_seq_length``; None: the
    context), and whether it may be truncated to fewer dimensions."""

    task: str
    pooling: str
    normalize: bool
    source: str
    max_tokens: int | None = None
    # Matryoshka truncation (``dimensions``): the sizes the model was trained to keep, () for
    # any, None where it was not (config.json's matryoshka_dimensions / is_matryoshka)
    matryoshka: tuple[int, ...] | None = None


def model_pooling(model_path: str | Path, cfg: ModelConfig) -> ModelPooling:
    """The model's pooling defaults: a sentence-transformers directory's modules (which make
    it an embedding model), else the config's task with the family's usual pooling."""
    path = Path(model_path)
    st = read_sentence_transformers(path) if path.is_dir() else None
    if st is None and not cfg.causal:
        st = ModelPooling(cfg.task, "cls", True, "an encoder's default: CLS, normalised")
    elif st is None:
        st = ModelPooling(cfg.task, "last", True,
                          "a decoder's default: the last token, normalised (Qwen3-Embedding)")
    return replace(st, matryoshka=read_matryoshka(path / "config.json"))


def read_matryoshka(config_file: Path) -> tuple[int, ...] | None:
    """The sizes a model's embeddings may be cut to, as vLLM reads them from config.json:
    ``matryoshka_dimensions`` (those), ``is_matryoshka`` (any: ()), else None (not trained
    for it, so truncation would only lose quality)."""
    raw = _read(config_file) if config_file.is_file() else {}
    sizes = raw.get("matryoshka_dimensions")
    if sizes:
        return tuple(int(n) for n in sizes)
    return () if raw.get("is_matryoshka") else None


def read_sentence_transformers(model_dir: Path) -> ModelPooling | None:
    """The pooling a sentence-transformers directory declares (None: it is not one)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read(modules_file)
    kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
    unknown = [k for k in kinds if k not in _ST_MODULES]
    if unknown:
        raise ModelLoadError(f"{modules_file}: sentence-transformers modules {unknown} are not "
                             f"supported (supported: {', '.join(_ST_MODULES)})")
    pooling = "cls"
    if "Pooling" in kinds:
        folder = modules[kinds.index("Pooling")].get("path") or "1_Pooling"
        pooling = _pooling_mode(_read(model_dir / folder / "config.json"), model_dir / folder)
    bert_config = model_dir / "sentence_bert_config.json"
    longest = _read(bert_config).get("max_seq_length") if bert_config.is_file() else None
    return ModelPooling("embed", pooling, "Normalize" in kinds, str(modules_file), longest)


def _pooling_mode(config: dict, where: Path) -> str:
    on = [key for key, value in config.items() if key.startswith("pooling_mode") and value]
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise ModelLoadError(f"{where}: pooling {on} is not supported (one of "
                             f"{', '.join(_ST_MODES)})")
    if config.get("include_prompt", True) is False:
        raise ModelLoadError(f"{where}: include_prompt false (pooling without the instruction "
                             "prefix) is not supported")
    return _ST_MODES[on[0]]


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def pool_rows(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    """One float32 vector from a whole prompt's rows ``hidden`` (tokens, hidden)."""
    if kind == "last":
        return hidden[-1].float()
    if kind == "cls":
        return hidden[0].float()
    if kind == "mean":
        return hidden.float().mean(dim=0)
    raise ValueError(f"unknown pooling {kind!r}")


def finish_vector(vector: torch.Tensor, normalize: bool,
                  dimensions: int | None = None) -> torch.Tensor:
    """Keep the first ``dimensions`` (Matryoshka), then L2-normalise where asked: a float32
    CPU vector."""
    if dimensions is not None:
        if dimensions > vector.shape[-1]:
            raise ValueError(f"dimensions {dimensions} exceeds the model's {vector.shape[-1]}")
        vector = vector[..., :dimensions]
    vector = vector.float()
    if normalize:
        import torch.nn.functional as F

        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector.cpu()


class PartialPool:
    """A prompt's pooling over the chunks it is computed in: each chunk's rows arrive in
    order (``start_pos`` 0 starts over: a first chunk, or a recompute after preemption)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.value: torch.Tensor | None = None  # running sum (mean) or the first row (cls)
        self.count = 0

    def add(self, rows: torch.Tensor, start_pos: int) -> None:
        if start_pos == 0:
            self.value, self.count = None, 0
        if self.kind == "mean":
            total = rows.float().sum(dim=0)  # (hidden,)
            self.value = total if self.value is None else self.value + total
        elif self.kind == "cls" and start_pos == 0:
            self.value = rows[0].float()
        elif self.kind == "last":
            self.value = rows[-1].float()
        self.count += rows.shape[0]

    def result(self) -> torch.Tensor:
        if self.value is None:
            raise ValueError("no rows were pooled")
        return self.value / self.count if self.kind == "mean" else self.value
