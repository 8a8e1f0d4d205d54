"""A model's config without its weights: what a load-time plan needs to size things."""

from __future__ import annotations

from tokenmill.config import ModelConfig
from tokenmill.model_source import ModelSource, resolve_model


def read_model_config(model: str) -> tuple[ModelSource, ModelConfig]:
    """(where ``model`` resolved to, its config in the file's dtype); reads metadata only."""
    source = resolve_model(model)
    if source.kind == "gguf":
        from tokenmill.model.gguf_file import gguf_model_config, open_gguf

        return source, gguf_model_config(open_gguf(source.path), source.path)
    from tokenmill.model.hf_files import hf_model_config

    return source, hf_model_config(source.path)


def stored_block_formats(source: ModelSource) -> frozenset[str]:
    """The 4/8-bit block formats (GGUF's Q8_0, Q4_0, Q4_1) the decoder layers' 2-D weights
    are stored in; empty for a float checkpoint."""
    if source.kind != "gguf":
        return frozenset()
    from tokenmill.model.gguf_file import open_gguf
    from tokenmill.model.quant import GGUF_BLOCKS

    return frozenset(t.tensor_type.name for t in open_gguf(source.path).tensors
                      if t.name.startswith("blk.") and len(t.shape) == 2
                      and t.tensor_type.name in GGUF_BLOCKS)
