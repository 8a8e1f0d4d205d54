"""What makes two KV caches' block bytes interchangeable: the model and the cache's layout.

Blocks move as raw bytes (``blocks.py``), so a sender and a receiver, or a server and the disk
files an earlier one left, must agree on everything that decides what those bytes mean. The
fingerprint is a plain JSON-able dict of exactly that; equal dicts <=> interchangeable bytes::

    {"format": 1,                        bump when the meaning of a backend's bytes changes
     "model": "smollm2.gguf:92x...:1f2e...",     model_identity() (+ what the caller adds)
     "layers": ["k=float32[16,3,64] v=float32[16,3,64]", ...],   one per layer: a block's
                                          shape and dtype (the number of blocks is not in it)
     "block_size": 16, "attention_backend": "cpu", "kv_cache_dtype": "auto",
     "rank": 0, "world_size": 1}          a TP rank holds its own shard's bytes

No torch here: the tensors are only asked for ``shape`` and ``dtype``, so the scheduler side
(and ``store.py``) can compare and digest fingerprints without loading torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from pathlib import Path
from typing import Any, Protocol

FINGERPRINT_FORMAT = 1
_EDGE = 1 << 20  # model_identity hashes this many bytes at each end of a model file
# the order fingerprint_mismatch names differences in: the likeliest cause first
_KEY_ORDER = ("model", "kv_cache_dtype", "attention_backend", "block_size", "layers", "rank",
              "world_size", "format")


class _Shaped(Protocol):
    """A cache tensor, as far as the fingerprint cares."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> Any: ...


def model_identity(model_path: str) -> str:
    """A cheap, stable name for the model's weights: the same file (or directory) gives the
    same string wherever it is mounted. A file: its name, size and a hash of its first and last
    MiB; a directory: its name, and a hash of its config.json and its safetensors' names and
    sizes. A path that does not exist is its own name (a model built in memory)."""
    path = Path(model_path)
    if path.is_dir():
        return _directory_identity(path)
    if path.is_file():
        return _file_identity(path)
    return f"name:{model_path}"


def _file_identity(path: Path) -> str:
    size = path.stat().st_size
    h = blake2b(digest_size=8)
    with path.open("rb") as f:
        h.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(size - _EDGE, _EDGE))
            h.update(f.read(_EDGE))
    return f"{path.name}:{size}:{h.hexdigest()}"


def _directory_identity(path: Path) -> str:
    h = blake2b(digest_size=8)
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    total = 0
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        total += size
        h.update(f"\0{weights.name}\0{size}".encode())
    return f"{path.name}:{total}:{h.hexdigest()}"


def layout_fingerprint(model_id: str, kv_caches: Sequence[tuple[_Shaped, _Shaped]], *,
                       block_size: int, attention_backend: str, kv_cache_dtype: str,
                       rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """The fingerprint of this rank's KV cache (see the module docstring). ``model_id`` names
    the weights as they compute K and V: a caller whose KV also depends on a weight quantization
    appends it (``model_identity(path) + "+int8"``)."""
    return {
        "format": FINGERPRINT_FORMAT,
        "model": model_id,
        "layers": [f"k={_block_layout(k)} v={_block_layout(v)}" for k, v in kv_caches],
        "block_size": int(block_size),
        "attention_backend": attention_backend,
        "kv_cache_dtype": kv_cache_dtype,
        "rank": int(rank),
        "world_size": int(world_size),
    }


def _block_layout(cache: _Shaped) -> str:
    """One block of a cache tensor, e.g. ``bfloat16[16,3,64]`` (dim 0, the blocks, left out)."""
    dtype = str(cache.dtype).removeprefix("torch.")
    return f"{dtype}[{','.join(str(int(d)) for d in list(cache.shape)[1:])}]"


def fingerprint_digest(fp: Mapping[str, Any]) -> str:
    """16 hex characters naming the fingerprint: the same for equal dicts in any key order."""
    text = json.dumps(fp, sort_keys=True, separators=(",", ":"))
    return blake2b(text.encode(), digest_size=8).hexdigest()


def fingerprint_mismatch(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> str | None:
    """None when the fingerprints are equal, else a sentence naming the first (at most three)
    differing keys with both sides' values."""
    keys = [k for k in _KEY_ORDER if k in mine or k in theirs]
    keys += sorted((set(mine) | set(theirs)) - set(keys))
    differing = [k for k in keys if mine.get(k) != theirs.get(k)]
    if not differing:
        return None
    parts = [_describe_difference(k, mine.get(k), theirs.get(k)) for k in differing[:3]]
    more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
    return "KV cache layouts differ: " + "; ".join(parts) + more


def _describe_difference(key: str, mine: Any, theirs: Any) -> str:
    if key == "layers" and isinstance(mine, list) and isinstance(theirs, list):
        if len(mine) != len(theirs):
            return f"{len(mine)} layers here, {len(theirs)} there"
        i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        return f"layer {i} is {mine[i]} here, {theirs[i]} there"
    return f"{key} is {mine!r} here, {theirs!r} there"

