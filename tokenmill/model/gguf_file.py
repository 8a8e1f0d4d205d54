"""Read a Llama-family model from a GGUF file: config from metadata, tensors dequantized (or,
for ``--quantization auto``, Q8_0 / Q4_0 / Q4_1 tensors kept in their blocks: model/quant.py).

Tensor names are mapped to Hugging Face names so one weight loader serves both formats.
llama.cpp's converter interleaves the rows of Q and K for the ``llama`` architecture (its RoPE
rotates adjacent pairs); we undo that so the Hugging Face rotate-half RoPE applies.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.config import ModelConfig, RopeScaling
from tokenmill.errors import ModelLoadError
from tokenmill.gguf_meta import GgufIndex, read_gguf_index
from tokenmill.model.registry import GGUF_ARCHES, family, family_config_gguf

if TYPE_CHECKING:
    import torch

    from tokenmill.model.quant import QuantWeight

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


# The index last read: a load-time plan reads the config (make_plan), then the loader reads
# the weights, from one parse. The engine's build drops it once the weights are in
# (release_gguf), which unmaps the file.
_OPEN: dict[tuple[str, float], GgufIndex] = {}


def open_gguf(path: Path) -> GgufIndex:
    key = (str(path), Path(path).stat().st_mtime)
    if key not in _OPEN:
        index = read_gguf_index(path)
        _OPEN.clear()
        _OPEN[key] = index
    return _OPEN[key]


def release_gguf() -> None:
    """Forget the index ``open_gguf`` keeps (and with it the file's mapping)."""
    _OPEN.clear()


def field(reader: GgufIndex, key: str, default=None):
    return reader.fields.get(key, default)


def gguf_model_config(reader, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(sorted(GGUF_ARCHES))})")

    def meta(key: str, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
    cfg = ModelConfig(
        architecture=GGUF_ARCHES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta("context_length", 2048)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(x for x in [field(reader, "tokenizer.ggml.eos_token_id")]
                            if x is not None),
        sliding_window=int(field(reader, f"{arch}.attention.sliding_window") or 0) or None,
    )
    return family_config_gguf(reader, arch, cfg)


def _rope_scaling(reader, arch: str) -> RopeScaling:
    tensors = {t.name: t for t in reader.tensors if t.name in _ROPE_TENSORS}
    if "rope_freqs.weight" in tensors:
        # Llama 3.1 files carry the scaling as per-frequency divisors, not as parameters.
        return RopeScaling(kind="freq_factors", freq_factors=_floats(tensors["rope_freqs.weight"]))
    if "rope_factors_long.weight" in tensors:  # LongRoPE (Phi-3/4)
        return _gguf_longrope(reader, arch, tensors)
    kind = field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind in ("none", None) or factor == 1.0:
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "yarn":
        beta_fast = field(reader, f"{arch}.rope.scaling.yarn_beta_fast")
        beta_slow = field(reader, f"{arch}.rope.scaling.yarn_beta_slow")
        attention = field(reader, f"{arch}.rope.scaling.attn_factor")
        original = field(reader, f"{arch}.rope.scaling.original_context_length")
        return RopeScaling(kind="yarn", factor=factor, beta_fast=float(beta_fast or 32),
                           beta_slow=float(beta_slow or 1),
                           attention_factor=None if attention is None else float(attention),
                           original_max_position_embeddings=int(original or 4096))
    raise ModelLoadError(f"GGUF RoPE scaling type {kind!r} is not supported")


# RoPE tables a converter may store as tensors: read into the config, never loaded as weights
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _floats(tensor) -> tuple[float, ...]:
    return tuple(float(x) for x in np.asarray(tensor.data).ravel())


def _gguf_longrope(reader, arch: str, tensors: dict) -> RopeScaling:
    """llama.cpp's Phi-3 LongRoPE: the factors as tensors, the attention factor and the
    original context as metadata (the context length is the extended one)."""
    context = int(field(reader, f"{arch}.context_length", 4096))
    original = int(field(reader, f"{arch}.rope.scaling.original_context_length", context))
    attention = field(reader, f"{arch}.rope.scaling.attn_factor")
    return RopeScaling(kind="longrope", factor=context / original,
                       original_max_position_embeddings=original,
                       short_factor=_floats(tensors["rope_factors_short.weight"]),
                       long_factor=_floats(tensors["rope_factors_long.weight"]),
                       attention_factor=None if attention is None else float(attention))


def gguf_weights(reader, cfg: ModelConfig, path: Path, keep_quantized: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Yield (Hugging Face name, float32 tensor) for every weight tensor in the file; with
    ``keep_quantized``, 2-D tensors in Q8_0, Q4_0 or Q4_1 come as ``QuantWeight`` holding the
    file's own blocks instead."""
    import torch  # the config above is read without it (serve decides on it before importing)

    from tokenmill.model.quant import GGUF_BLOCKS, QuantWeight, dequantize, from_gguf_blocks

    # llama.cpp permutes Q and K for its "llama" architecture (Llama, Mistral, Mixtral)
    permuted = field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        if tensor.name in _ROPE_TENSORS:
            continue  # RoPE factors: in the config (_rope_scaling), not weights
        name = _hf_name(tensor.name, path, cfg)
        qtype = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape))  # innermost dimension last
        w: torch.Tensor | QuantWeight
        if qtype in GGUF_BLOCKS and len(shape) == 2:
            try:
                w = from_gguf_blocks(np.asarray(tensor.data), qtype, shape)
            except ValueError as e:
                raise ModelLoadError(f"{path}: tensor {tensor.name!r} ({qtype}) is corrupt: "
                                     f"{e}") from e
            if not keep_quantized:  # the values gguf.quants gives, bit for bit, in half the time
                w = dequantize(w)
        else:
            w = torch.from_numpy(_dequantize(tensor, path))
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            w = w.rows(_undo_qk_permute(torch.arange(shape[0]), heads)) \
                if isinstance(w, QuantWeight) else _undo_qk_permute(w, heads)
        yield name, w


def _hf_name(name: str, path: Path, cfg: ModelConfig) -> str:
    m = _LAYER_RE.match(name)
    if m:
        sub = family(cfg.architecture).gguf_names.get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
        if sub:
            return f"model.layers.{m.group(1)}.{sub}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a {cfg.architecture} model")


# gguf.quants.dequantize works through a tensor 16 rows per call: for a 262k-row embedding
# (Gemma 3) that is 16k rounds of a dozen numpy calls. Its per-type classes take any number of
# rows (``dequantize_rows``): the same elementwise arithmetic, over 16 MiB of blocks at a time.
_DEQUANTIZE_BYTES = 16 << 20


def _gguf_dequantize(data: np.ndarray, qtype) -> np.ndarray:
    from gguf import quants

    rows_of = getattr(getattr(quants, qtype.name, None), "dequantize_rows", None)
    if rows_of is None or data.ndim == 0 or data.size == 0:
        return quants.dequantize(data, qtype)  # NotImplementedError for a type it lacks
    rows = np.asarray(data).reshape(-1, data.shape[-1])
    step = max(1, _DEQUANTIZE_BYTES // rows.shape[1])  # rows.shape[1] > 0: data.size > 0
    return np.concatenate([rows_of(rows[i:i + step]) for i in range(0, len(rows), step)])


def _dequantize(tensor, path: Path) -> np.ndarray:
    import gguf

    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    try:
        if qtype == gguf.GGMLQuantizationType.F32:
            data = np.array(tensor.data, dtype=np.float32)  # a copy: the file is mapped read-only
        elif qtype == gguf.GGMLQuantizationType.F16:
            data = np.asarray(tensor.data).astype(np.float32)
        else:
            data = _gguf_dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} has type {qtype.name}, which "
                             "tokenmill cannot dequantize") from e
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} ({qtype.name}) is corrupt: "
                             f"{e}") from e
    return np.ascontiguousarray(data, dtype=np.float32).reshape(shape)


def _undo_qk_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp stored, per head, rows (0, d/2, 1, d/2+1, ...) pairwise; swap back to halves.
    rows = w.shape[0]
    pairs = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
    return pairs.transpose(1, 2).reshape(w.shape)
