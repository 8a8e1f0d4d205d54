"""Whole KV blocks as bytes: out of the cache tensors (to send or store) and back in.

A block id names the same slice of every layer's K and V tensor (``runner/kv_cache.py``), so a
block's bytes are those slices one after the other, whatever the backend's layout inside a block
(the cpu backend's transposed int8 K travels as it is). ``gather`` of n blocks gives one row of
``block_nbytes`` per block, in the order asked::

    cache tensors, each viewed as (num_blocks, bytes of one block) uint8
        layer 0 K: [b0][b1][b2][b3]...     layer 0 V: [b0][b1]...   ...   layer L-1 V
    gather([2, 0]) -> (2, block_nbytes) uint8, CPU
        row 0: | L0 K[b2] | L0 V[b2] | L1 K[b2] | L1 V[b2] | ... | L(L-1) V[b2] |
        row 1: | L0 K[b0] | L0 V[b0] | ...                                       |

Each layer tensor costs one ``index_select`` (gather, straight into its columns of the rows) or
one ``index_copy_`` (scatter). On a GPU the rows are assembled on the device and copied to the
host once; scatter copies the rows to the device once and waits for the copies before
returning, so a block reported loaded is loaded. The bytes mean something only to a cache of
the same layout: ``layout_fingerprint`` (re-exported here from the torch-free
``fingerprint.py``) says which.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.kv_transfer.fingerprint import (
    fingerprint_digest,
    fingerprint_mismatch,
    layout_fingerprint,
    model_identity,
)

__all__ = ["BlockIO", "fingerprint_digest", "fingerprint_mismatch", "layout_fingerprint",
           "model_identity"]

BlockBytes = torch.Tensor | bytes | bytearray | memoryview


class BlockIO:
    """Copies whole blocks (every layer's K and V) between the KV cache tensors and bytes.

    Safe to call from a thread other than the forward's for blocks nobody writes meanwhile."""

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        tensors = [t for pair in kv_caches for t in pair]
        if not tensors:
            raise ValueError("BlockIO needs at least one layer's KV cache")
        self.num_blocks = tensors[0].shape[0]
        self.device = tensors[0].device
        self._views = [_block_bytes_view(t, self.num_blocks, self.device) for t in tensors]
        widths = [v.shape[1] for v in self._views]
        self._offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]
        self.block_nbytes: int = self._offsets[-1]

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' bytes: uint8, CPU, contiguous, ``(len(block_ids), block_nbytes)``, a copy
        (still valid after the blocks are reused); written into ``out`` (a CPU tensor of that
        shape: a shared-memory segment) when given."""
        idx = self._index(block_ids)
        on_host = out is not None and self.device.type == "cpu"
        rows = out if on_host else torch.empty((len(block_ids), self.block_nbytes),
                                               dtype=torch.uint8, device=self.device)
        for view, start, end in zip(self._views, self._offsets, self._offsets[1:]):
            torch.index_select(view, 0, idx, out=rows[:, start:end])
        if out is None:
            return rows.cpu()
        if not on_host:
            out.copy_(rows)
        return out

    def scatter(self, block_ids: Sequence[int], data: BlockBytes) -> None:
        """Write ``data`` (``len(block_ids) * block_nbytes`` bytes in ``gather``'s layout) into
        the blocks ``block_ids``, row i into block ``block_ids[i]``."""
        idx = self._index(block_ids)
        rows = self._rows(data, len(block_ids)).to(self.device)  # (n, block_nbytes)
        for view, start, end in zip(self._views, self._offsets, self._offsets[1:]):
            view.index_copy_(0, idx, rows[:, start:end])
        if self.device.type == "cuda":
            # the copies are queued on this thread's stream: done before anyone is told so
            torch.cuda.current_stream(self.device).synchronize()

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(b) for b in block_ids]
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            # checked here: an index out of range on a GPU is a device-side assert, not an error
            raise ValueError(f"block ids {ids} out of range for a cache of {self.num_blocks} "
                             "blocks")
        return torch.tensor(ids, dtype=torch.long).to(self.device)

    def _rows(self, data: BlockBytes, n: int) -> torch.Tensor:
        """``data`` as a uint8 ``(n, block_nbytes)`` tensor, without a copy where it can."""
        if isinstance(data, torch.Tensor):
            flat = data.reshape(-1).view(torch.uint8)
        else:
            flat = _buffer_tensor(data)
        if flat.numel() != n * self.block_nbytes:
            raise ValueError(f"{flat.numel()} bytes for {n} blocks of {self.block_nbytes}")
        return flat.view(n, self.block_nbytes)


def _block_bytes_view(cache: torch.Tensor, num_blocks: int,
                      device: torch.device) -> torch.Tensor:
    """``cache`` as ``(num_blocks, bytes per block)`` uint8 sharing its memory (no copy)."""
    if cache.shape[0] != num_blocks or cache.device != device:
        raise ValueError(f"every KV cache tensor must hold {num_blocks} blocks on {device}, "
                         f"not {cache.shape[0]} on {cache.device}")
    if not cache.is_contiguous():
        raise ValueError("BlockIO needs contiguous KV cache tensors (a block's bytes in one "
                         "run)")
    return cache.view(num_blocks, -1).view(torch.uint8)  # (num_blocks, block bytes)


def _buffer_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A flat uint8 tensor over a buffer. A read-only buffer (bytes) is copied first: torch
    wraps only writable memory without a warning, and scatter must not depend on global
    warning filters, which are not thread-safe to change."""
    view = memoryview(data).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)
