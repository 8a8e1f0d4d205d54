"""The machine a benchmark ran on, recorded next to every figure (CPUs differ day to day)."""

from __future__ import annotations

from tokenmill.platform import choose_dtype, choose_kv_cache_dtype, cpu_description

__all__ = ["machine"]


def machine() -> dict[str, object]:
    """The CPU, its instruction sets and the dtypes ``--dtype auto`` and ``--kv-cache-dtype
    auto`` pick on it (with why)."""
    dtype, why = choose_dtype("cpu")
    kv, kv_why = choose_kv_cache_dtype("cpu", "auto", dtype)
    return {**cpu_description(), "auto_dtype": dtype, "auto_dtype_reason": why,
            "auto_kv_cache_dtype": kv, "auto_kv_cache_dtype_reason": kv_why}
