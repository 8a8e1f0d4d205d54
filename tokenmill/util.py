"""Small helpers every layer may use (stdlib only)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceil division: how many ``b``-sized pieces hold ``a`` (blocks for tokens, words for bits)."""
    return -(-a // b)
