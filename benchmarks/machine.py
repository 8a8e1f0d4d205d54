"""The machine a benchmark ran on, recorded next to every figure (CPUs differ day to day)."""

from __future__ import annotations

from tokenmill.platform import choose_dtype, cpu_description

__all__ = ["machine"]


def machine() -> dict[str, object]:
    """The CPU, its instruction sets and the dtype ``--dtype auto`` picks on it (with why)."""
    dtype, why = choose_dtype("cpu")
    return {**cpu_description(), "auto_dtype": dtype, "auto_dtype_reason": why}
