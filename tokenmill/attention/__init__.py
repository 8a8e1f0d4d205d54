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


register_backend("torch", _torch_backend)

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "register_backend"]
