"""Attention backends behind one interface, chosen by name through a small registry."""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.attention.base import AttentionBackend, AttentionMetadata

_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = factory


def get_backend(name: str = "torch") -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def _torch_backend() -> AttentionBackend:
    from tokenmill.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend()


def _cpu_backend() -> AttentionBackend:
    from tokenmill.attention.cpu_paged import CpuPagedBackend
    from tokenmill.kernels import cpu

    ops = cpu.load()
    if ops is None:
        raise ValueError("attention backend 'cpu' needs tokenmill's compiled CPU kernels, which "
                         "could not be built here (see the log); use --attention-backend torch")
    return CpuPagedBackend(ops)


def _triton_backend() -> AttentionBackend:
    try:
        from tokenmill.attention.triton_paged import TritonPagedBackend
    except ImportError as e:
        raise ValueError(f"attention backend 'triton' needs the triton package ({e}); "
                         "use --attention-backend torch") from None
    return TritonPagedBackend()


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend(device: str) -> str:
    """``cpu`` (K/V read in place) on a CPU where the kernels build, ``triton`` on a GPU where
    triton is installed, else ``torch``."""
    if device.startswith("cpu"):
        from tokenmill.kernels import cpu

        if cpu.load() is not None:
            return "cpu"
    elif device.startswith("cuda") and has_triton():
        return "triton"
    return "torch"


register_backend("torch", _torch_backend)
register_backend("cpu", _cpu_backend)
register_backend("triton", _triton_backend)

__all__ = ["AttentionBackend", "AttentionMetadata", "default_backend", "get_backend",
           "has_triton", "register_backend"]
