"""What the machine offers, read at run time: the CPU and its instruction sets, the compute dtype
that suits it, and the threads the process may use. Development and serving machines differ
(an AVX2-only EPYC, an AVX512-BF16 EPYC, a Xeon with AMX), so nothing here is fixed in advance.
"""

from __future__ import annotations

import os
import platform

import torch

# Extensions that decide which matmul kernels and dtypes a CPU has.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16",
             "amx_fp16", "amx_int8")


def _proc_cpuinfo() -> tuple[str, set[str]]:
    """(model name, feature flags) from /proc/cpuinfo ("flags" on x86, "Features" on ARM)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("unknown", ""):
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def cpu_flags() -> set[str]:
    """The feature flags the kernel reports for this CPU (/proc/cpuinfo)."""
    return _proc_cpuinfo()[1]


def cpu_description() -> dict[str, object]:
    """``{"cpu": model name, "isa": [flags of ISA_FLAGS present]}``."""
    model, flags = _proc_cpuinfo()
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags]}


def cpu_features() -> set[str]:
    """Instruction sets as PyTorch's cpuinfo sees them (``avx512_bf16``, ``amx_bf16``, ...),
    falling back to /proc/cpuinfo's flags."""
    probe = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if probe is not None:
        try:
            return {k for k, v in probe().items() if v is True}
        except Exception:  # an older torch without the probe's full dict
            pass
    return cpu_flags()


def choose_dtype(device: str, requested: str | None = "auto") -> tuple[str, str]:
    """(dtype, why) for ``--dtype`` ``requested`` on ``device``. ``auto`` takes bfloat16 where
    the hardware multiplies it natively (AMX or AVX512-BF16 on a CPU; a GPU that supports it)
    and float32 otherwise on a CPU (float16 on an older GPU): emulated bf16 on a CPU without
    those units is several times slower than float32."""
    if requested not in (None, "auto"):
        return requested, "asked for"
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "the GPU supports bfloat16"
        return "float16", "the GPU lacks bfloat16"
    feats = cpu_features()
    native = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
              if flag in feats]
    if native:
        return "bfloat16", f"the CPU multiplies bfloat16 natively ({', '.join(native)})"
    return "float32", "the CPU has no native bfloat16 matrix instructions (AMX or AVX512-BF16)"


def choose_kv_cache_dtype(device: str, requested_dtype: str | None, dtype: str,
                          requested: str = "auto") -> tuple[str, str]:
    """(kv_cache_dtype, why) for ``--kv-cache-dtype`` ``requested`` once the compute dtype is
    ``dtype`` (``choose_dtype`` of ``requested_dtype``). ``auto`` is the compute dtype's cache,
    except where ``--dtype auto`` kept float32 on a CPU for want of native bfloat16: there K/V
    are stored in bfloat16. Storing costs a rounding, reading a widening in registers, and
    decode attention, which reads every cached K/V once per step and is bound by memory
    bandwidth, moves half the bytes (the same budget also holds twice the tokens). On the
    default model this changed no greedy token of test_kv_quant's prompts. ``--dtype float32``
    keeps a float32 cache."""
    if requested != "auto":
        return requested, "asked for"
    if dtype == "float32" and requested_dtype in (None, "auto") and not device.startswith("cuda"):
        return "bfloat16", ("float32 weights for want of native bfloat16: K/V stored in "
                            "bfloat16 halve decode attention's memory traffic")
    return "auto", f"the compute dtype ({dtype})"


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, so a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# glibc mallopt parameters (malloc.h) and the values set on a CPU: blocks up to 32 MiB (glibc's
# largest mmap threshold on 64-bit) come from the heap, and up to 256 MiB of freed heap top is
# kept rather than handed back to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 256 << 20


def configure_allocator() -> bool:
    """Keep the step's large temporaries in the heap (glibc only; False elsewhere or if refused).

    glibc serves blocks above its mmap threshold (128 KiB, raised by each large free up to
    32 MiB) with fresh mappings and unmaps them when freed, and trims freed heap top above
    twice that: a float32 prompt step's activations (a 2,048-token gate/up projection of the
    default model is 25 MB) then cost page faults and kernel zeroing every layer of every step,
    ~10% of a 2,048-token prefill in a profile on a 2-core Zen 3. Fixed thresholds keep them."""
    if os.name != "posix" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


def configure_threads(n: int | None = None) -> int:
    """Set the forward's intra-op threads: ``n``, or one per usable core (torch's default counts
    the whole machine's physical cores, which oversubscribes a process pinned to fewer)."""
    n = n or usable_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
