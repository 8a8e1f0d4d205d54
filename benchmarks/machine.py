"""The machine a benchmark ran on, recorded next to every figure (CPUs differ day to day)."""

from __future__ import annotations

import platform

# Extensions that decide which matmul kernels and dtypes a CPU has.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_description() -> dict[str, object]:
    """``{"cpu": model name, "isa": [flags of ISA_FLAGS present]}`` from /proc/cpuinfo."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags]}
