"""What the machine offers, read at run time: the CPU and its instruction sets, the compute dtype
that suits it, and the threads the process may use. Development and serving machines differ
(an AVX2-only EPYC, an AVX512-BF16 EPYC, a Xeon with AMX), so nothing here is fixed in advance.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

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


def choose_dtype(device: str, requested: str | None = "auto",
                 machine: Machine | None = None) -> tuple[str, str]:
    """(dtype, why) for ``--dtype`` ``requested`` on ``device`` (or the described ``machine``).
    ``auto`` takes bfloat16 where the hardware multiplies it natively (AMX or AVX512-BF16 on a
    CPU; a GPU that supports it) and float32 otherwise on a CPU (float16 on an older GPU):
    emulated bf16 on a CPU without those units is several times slower than float32."""
    if requested not in (None, "auto"):
        return requested, "asked for"
    if device.startswith("cuda"):
        if machine.gpu_bf16 if machine is not None else torch.cuda.is_bf16_supported():
            return "bfloat16", "the GPU supports bfloat16"
        return "float16", "the GPU lacks bfloat16"
    feats = machine.features if machine is not None else cpu_features()
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


def host_memory_available() -> int:
    """MemAvailable of the host (4 GiB where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


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


@dataclass(frozen=True)
class Machine:
    """What a load-time plan is made for: the device and, on a CPU, its model, instruction sets
    and cores, and whether tokenmill's C++ kernels are built. ``detect`` reads this machine; a
    test describes another (``Machine.described("avx2")``) and plans for it without it."""

    device: str = "cpu"  # "cpu" or "cuda[:n]"
    cpu_model: str = "unknown"
    features: frozenset[str] = field(default_factory=frozenset)  # cpu_features() names
    cores: int = 1
    kernels_built: bool = False  # the C++ CPU kernels compiled and loaded (kernels/cpu.py)
    gpu_name: str = ""
    gpu_capability: tuple[int, int] | None = None  # CUDA compute capability
    gpu_bf16: bool = False
    memory_bytes: int = 0  # free memory where the KV cache will live (host: MemAvailable)

    @property
    def on_gpu(self) -> bool:
        return self.device.split(":")[0] == "cuda"

    def has(self, *flags: str) -> bool:
        return all(f in self.features for f in flags)

    @property
    def kernel_caps(self) -> KernelCaps:
        """What the C++ kernels compiled with ``-march=native`` on this CPU offer (the macros
        their sources test); nothing without a build or on a GPU."""
        if self.on_gpu or not self.kernels_built:
            return KernelCaps()
        avx512, avx2 = self.has("avx512f"), self.has("avx2")
        return KernelCaps(attention=avx512 or avx2, bf16_gemm=self.has("avx512_bf16"),
                          f32_gemm=avx512 or avx2, a8_gemm=avx2,
                          int8_dot=self.has("avx512_vnni"), amx=self.has("amx_bf16"))

    @classmethod
    def detect(cls, device: str = "cpu", kernels_built: bool = False) -> Machine:
        """This machine. ``kernels_built``: whether the C++ CPU kernels loaded (the caller
        knows: ``kernels/cpu.py`` sits above this module)."""
        if device.split(":")[0] == "cuda":
            cap = torch.cuda.get_device_capability(device)
            return cls(device=device, gpu_name=torch.cuda.get_device_name(device),
                       gpu_capability=cap, gpu_bf16=torch.cuda.is_bf16_supported(),
                       cores=usable_cores(), cpu_model=_proc_cpuinfo()[0],
                       memory_bytes=torch.cuda.mem_get_info(device)[0])
        return cls(device=device, cpu_model=_proc_cpuinfo()[0],
                   features=frozenset(cpu_features() | cpu_flags()), cores=usable_cores(),
                   kernels_built=kernels_built, memory_bytes=host_memory_available())

    @classmethod
    def described(cls, kind: str, cores: int = 2) -> Machine:
        """A machine of a known class, for plans made without it: ``avx2`` (an AVX2-only EPYC),
        ``avx512-bf16`` (AVX512 with native bf16 dot products, no AMX), ``amx`` (a Xeon with
        AMX), ``cuda`` (an H100), ``bare`` (no compiler: the PyTorch paths)."""
        isa = {"bare": {"avx2"}, "avx2": {"avx2"},
               "avx512-bf16": {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"},
               "amx": {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
                       "amx_int8"}}
        if kind == "cuda":
            return cls(device="cuda", gpu_name="NVIDIA H100", gpu_capability=(9, 0),
                       gpu_bf16=True, cores=cores, memory_bytes=80 << 30)
        if kind not in isa:
            raise ValueError(f"unknown machine class {kind!r}; use one of "
                             f"{', '.join([*isa, 'cuda'])}")
        return cls(device="cpu", cpu_model=f"described: {kind}", features=frozenset(isa[kind]),
                   cores=cores, kernels_built=kind != "bare", memory_bytes=16 << 30)

    def describe(self) -> dict[str, object]:
        if self.on_gpu:
            return {"gpu": self.gpu_name, "capability": self.gpu_capability}
        return {"cpu": self.cpu_model, "isa": [f for f in ISA_FLAGS if f in self.features],
                "cores": self.cores, "cpu_kernels": self.kernels_built}


@dataclass(frozen=True)
class KernelCaps:
    """The C++ CPU kernels' families present in a build (all False: none built)."""

    attention: bool = False  # paged attention, store_kv, norms, RoPE (AVX2 or AVX512)
    bf16_gemm: bool = False  # packed bf16 GEMM and few-row bf16 linear (AVX512-BF16)
    f32_gemm: bool = False  # packed float32 GEMM, 4/8-bit weights widened in it
    a8_gemm: bool = False  # 4/8-bit weights times int8 rows of x (AVX2 vpmaddubsw)
    int8_dot: bool = False  # W8A8 / W4A8 on AVX512-VNNI
    amx: bool = False  # oneDNN multiplies bf16 on AMX tiles (the packed GEMM does not)
