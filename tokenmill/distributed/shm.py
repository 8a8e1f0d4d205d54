"""The all-reduce between the tensor-parallel ranks of one host: the CPU kernels' ``ShmAllReduce``
(``kernels/csrc/shm_allreduce.h``) over a file on ``/dev/shm`` that every rank maps.

It sums float32 or bf16 tensors in place, in rank order in float32, so every rank gets the same
bits, and the fused CPU step (``runner/cpu_step.py``) calls it from C++ between its GEMMs
(``native``). Where the kernels are not built (no compiler), ``create`` returns None and callers
keep gloo; across hosts gloo (or NCCL) is the only path.

The file lives only while the ranks open it: rank 0 creates it, every rank maps it, and rank 0
unlinks it once all have (the mappings outlive the name), so a crash later leaves nothing in
``/dev/shm``. Only a crash inside ``create``, between its two barriers, can leave the file, and
the next ``create`` of that name replaces it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch

from tokenmill.kernels import cpu as cpu_kernels

DEFAULT_TIMEOUT = 60.0  # seconds a call waits for a missing rank before it raises


def shm_dir() -> str:
    """Where the file goes: the memory file system where there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmAllReduce:
    """One rank's end of the shared-memory all-reduce (see the module's docstring)."""

    def __init__(self, native: object):
        self._native: object | None = native

    @classmethod
    def create(cls, name: str, rank: int, world: int, max_bytes: int,
               barrier: Callable[[], None],
               timeout: float = DEFAULT_TIMEOUT) -> ShmAllReduce | None:
        """Join the all-reduce ``name`` (unique among the groups running on this host) as
        ``rank`` of ``world``; every rank calls it, ``barrier`` being the group's (gloo)
        barrier. ``max_bytes``: each rank's slot, what one round carries (larger tensors take
        several). None where the CPU kernels are not built; raises where the file cannot be
        made or opened (after both barriers, so that no rank is left waiting in one)."""
        ops = cpu_kernels.load()
        if ops is None or not hasattr(ops, "ShmAllReduce"):
            return None
        if "/" in name or not name:
            raise ValueError(f"ShmAllReduce: a plain file name, not {name!r}")
        path = os.path.join(shm_dir(), f"tokenmill-allreduce-{name}")
        size = ops.ShmAllReduce.bytes_needed(world, max_bytes)
        native, error = None, None
        if rank == 0:
            native, error = _attempt(lambda: ops.ShmAllReduce(
                _make_file(path, size), rank, world, timeout))
        barrier()
        if rank != 0:
            native, error = _attempt(lambda: ops.ShmAllReduce(
                _open_file(path, size), rank, world, timeout))
        barrier()
        if rank == 0:
            _unlink(path)
        if error is not None:
            raise RuntimeError(f"ShmAllReduce: rank {rank} could not map {path}: "
                               f"{error}") from error
        return cls(native)

    @property
    def native(self) -> object:
        """The kernels' object, for the fused step (``CpuStep(model, all_reduce=...)``)."""
        if self._native is None:
            raise RuntimeError("ShmAllReduce: closed")
        return self._native

    @property
    def world(self) -> int:
        return self.native.world

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (float32 or bf16, on the CPU) summed over the ranks in place; returns ``t``."""
        if t.is_contiguous():
            return self.native.all_reduce_(t)
        t.copy_(self.native.all_reduce_(t.contiguous()))
        return t

    def abort(self) -> None:
        """Make the other ranks' waiting (and next) calls raise at once: for a rank that
        fails elsewhere and will not arrive."""
        self.native.abort()

    def close(self) -> None:
        """Let go of this rank's end; the mapping goes with the last reference (a fused step
        built over ``native`` keeps it)."""
        self._native = None


def _attempt(make: Callable[[], object]) -> tuple[object | None, Exception | None]:
    try:
        return make(), None
    except (OSError, RuntimeError) as exc:
        return None, exc


def _make_file(path: str, size: int) -> torch.Tensor:
    """A new zeroed file of ``size`` bytes at ``path``, mapped; its pages reserved now, so that
    a full ``/dev/shm`` is an error here rather than a SIGBUS at the first write."""
    _unlink(path)  # left by a crash inside an earlier create of this name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):  # Linux; elsewhere the pages come on first write
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        _unlink(path)
        raise
    os.close(fd)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _open_file(path: str, size: int) -> torch.Tensor:
    """Rank 0's file, mapped (an error if there is none: ``from_file`` would create one)."""
    if os.path.getsize(path) != size:  # raises FileNotFoundError where rank 0 made none
        raise OSError(f"{path} is {os.path.getsize(path)} bytes, not {size}")
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
