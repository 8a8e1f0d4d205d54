"""tokenmill's C++ CPU kernels, compiled for the machine they run on. ``csrc/`` holds a header per
kernel family, each compiling alone, and ``cpu_ops.cpp``, the one translation unit that binds
them; ``ladder.py`` lists every kernel with the PyTorch code it replaces, its test and its
benchmark (``python -m tokenmill.kernels.ladder``).

They are built with ``torch.utils.cpp_extension`` and ``-march=native`` into a cache folder whose
name hashes every file in ``csrc/``, the torch installation, the compiler and the CPU's
instruction sets, so a build never runs on a CPU it was not made for (development machines
change from day to day), each environment on a machine keeps its own, and a restart loads it in
a fraction of a second. ``scripts/setup.sh`` builds them (``python3 -m tokenmill.kernels.cpu``);
a server that finds no build compiles once at start-up, and without a compiler every caller
falls back to the PyTorch reference path.

    TOKENMILL_CACHE_DIR   where builds live (default ~/.cache/tokenmill)
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import time
from contextlib import nullcontext
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from tokenmill.platform import cpu_flags
from tokenmill.util import progress

log = logging.getLogger("tokenmill.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_ops.cpp"  # the one translation unit; it includes the headers beside it
# -ffp-contract=off: a * b - c * d stays two roundings, as in PyTorch's unfused ops (the
# attention kernel's FMAs are explicit intrinsics)
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17")
# --exclude-libs: a compiler that links libstdc++ statically (a wrapper adding
# -static-libstdc++, as some images' CXX does) puts a private copy in the module. Exported,
# its symbols bind to the process's libstdc++.so (loaded by torch) while its internals stay
# local, and the two halves disagree: formatting a number in an error message crashed. Kept
# private, the copy is whole; a dynamic libstdc++ is not affected.
_LDFLAGS = ("-fopenmp", "-Wl,--exclude-libs,ALL")
# (tuples, handed to torch as new lists: cpp_extension.load appends to the lists it is given,
# and the build folder's name hashes these)


def build_dir() -> Path:
    root = Path(os.environ.get("TOKENMILL_CACHE_DIR", Path.home() / ".cache" / "tokenmill"))
    return root / "kernels" / f"cpu-{build_key(build_inputs())}"


def build_inputs() -> list[str]:
    """Everything a build depends on besides the sources' text: the build records the paths of
    the sources, the torch installation, Python's headers and the compiler it used, and torch
    rebuilds when any of them differs from the loading environment's. So two environments or
    checkouts on one machine (two virtual environments, CI's clone beside a development one)
    each get a folder of their own instead of rebuilding each other's, and waiting on each
    other's compile lock for minutes."""
    compiler = os.environ.get("CXX", "c++")
    return [str(SOURCE.resolve()), torch.__version__, str(Path(torch.__file__).resolve().parent),
            sys.version,
            sysconfig.get_paths()["include"], os.path.realpath(shutil.which(compiler) or compiler),
            *_FLAGS, *_LDFLAGS, *sorted(cpu_flags())]


def build_key(inputs: list[str]) -> str:
    """A hash of ``inputs`` and of every file in ``csrc/``, its path there and its bytes: the
    headers are compiled into the one translation unit, so editing, adding or renaming any of
    them is another build."""
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        data = path.read_bytes()  # after its path and length: no two trees hash alike
        digest.update(f"{path.relative_to(CSRC).as_posix()}\0{len(data)}\0".encode() + data)
    digest.update("\n".join(inputs).encode())
    return digest.hexdigest()[:16]


def is_built() -> bool:
    return any(build_dir().glob("tokenmill_cpu_ops*.so"))


@cache
def load() -> ModuleType | None:
    """The compiled kernels (built first if this machine has no build yet), or None when they
    cannot be had (no compiler, a build error); the reason is logged once."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: CPU kernels unavailable, using the PyTorch "
                    "reference attention")
        return None
    from torch.utils import cpp_extension

    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    fresh = not is_built()
    t0 = time.perf_counter()
    try:
        # torch's own build lock is a file that a build killed midway (a server stopped while
        # compiling) leaves behind, and every later load then waits on it forever. Builds take
        # an OS lock here instead, released when its holder dies; whoever holds it may remove
        # a lock file left over.
        # a first build takes minutes: a terminal shows it going (util.progress)
        building = progress("building the CPU kernels (once per machine)") if fresh \
            else nullcontext()
        with open(path / "tokenmill-build.lock", "w") as lock, building:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (path / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(name="tokenmill_cpu_ops", sources=[str(SOURCE)],
                                        extra_cflags=list(_FLAGS), extra_ldflags=list(_LDFLAGS),
                                        build_directory=str(path), verbose=False)
    except Exception as exc:  # a failed build must not stop the server: fall back
        log.warning("building the CPU kernels failed (%s): using the PyTorch reference "
                    "attention", str(exc).strip().splitlines()[-1] if str(exc) else exc)
        return None
    if fresh:
        log.info("built the CPU kernels in %.0f s (%s)", time.perf_counter() - t0, path)
    return module


if __name__ == "__main__":  # python3 -m tokenmill.kernels.cpu: build now (scripts/setup.sh)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if load() is not None else 1)
