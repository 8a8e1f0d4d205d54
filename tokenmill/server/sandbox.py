"""Walls around a child process that runs code a client sent (a chat template).

That code already runs in jinja2's sandbox; these bounds are for the day an escape from it is
found (jinja2 has had several). The child applies every bound its platform allows before it takes
any work, and tells the parent which held (the server logs them):

    fds           every inherited descriptor but its pipe closed; 0-2 are /dev/null
    workdir       its working directory is a private temporary directory
    netns         a new user and network namespace: no interface but a loopback that is down
    no_new_privs  PR_SET_NO_NEW_PRIVS: nothing it runs gains privileges (the next two need it)
    landlock      files: read only Python's libraries and the packages loaded, write only its
                  directory, execute nothing; no TCP bind or connect (Landlock ABI 4), no
                  signals or abstract sockets outside itself (ABI 6); it cannot trace the server
    seccomp       no new socket (socket, socketpair, io_uring_setup fail) and no new process or
                  thread (clone, clone3, fork, vfork fail)
    rlimits       address space, CPU seconds per call, file size, open files, no core file, no
                  new process (RLIMIT_NPROC: not for root)

netns, no_new_privs, landlock and seccomp are Linux's (Landlock needs 5.13, seccomp x86-64 or
arm64); elsewhere the child has the rest. The parent reads replies as size-bounded JSON (it never
unpickles what the child sends) and kills a child whose call overruns its time.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import multiprocessing
import os
import platform
import resource
import shutil
import signal
import struct
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("tokenmill.server")

START_TIMEOUT = 60.0  # seconds a new child may take to start (Python, imports, the bounds)


class SandboxError(Exception):
    """A call failed in the child (the message says how), or the child ended."""


class SandboxTimeout(SandboxError):
    """A call did not finish within its time; the child was killed."""


@dataclass(frozen=True)
class Bounds:
    timeout: float  # wall-clock seconds per call (the parent kills); CPU seconds too (the child)
    memory_bytes: int = 1 << 30  # address space
    file_bytes: int = 1 << 20  # largest file it may write (only in its directory)
    open_files: int = 32


class Sandbox:
    """``call(request)`` runs ``handler(request)`` in a bounded child process, one call at a time
    (callers queue). Requests and replies are JSON; ``handler`` is a module-level function that
    returns a JSON value (an exception reaches the caller as its type name only). A child that
    overruns or dies is killed, and the next call starts a new one."""

    def __init__(self, handler: Callable[[Any], Any], bounds: Bounds, reply_bytes: int):
        self.bounds = bounds
        self.held: dict[str, Any] = {}  # what the newest child reported
        self._handler = handler
        self._reply_bytes = reply_bytes
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._workdir: str | None = None
        self._cleaner_end = None  # closing it (or this process dying) clears the workdir

    def call(self, request: Any) -> Any:
        data = json.dumps(request).encode()  # ASCII: lone surrogates travel too
        with self._lock:
            conn = self._child()
            try:
                conn.send_bytes(data)
                if not conn.poll(self.bounds.timeout):
                    self._stop("its time bound")
                    raise SandboxTimeout(f"did not finish within {self.bounds.timeout:g} s")
                reply = _parse_reply(conn.recv_bytes(self._reply_bytes))
            except (EOFError, OSError, ValueError):  # it died, or sent too much or garbage
                self._stop("it ended or sent no proper reply")
                raise SandboxError("its sandboxed process ended (out of memory?)") from None
        if "error" in reply:
            raise SandboxError(reply["error"])
        return reply["value"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _child(self):
        if self._proc is not None and self._proc.is_alive():
            return self._conn
        self._stop()
        self._workdir = tempfile.mkdtemp(prefix="tokenmill-sandbox-")
        ctx = multiprocessing.get_context("spawn")  # not fork: the parent runs threads
        self._conn, child = ctx.Pipe()
        watch, self._cleaner_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_main, name="tokenmill-sandbox", daemon=True,
                                 args=(child, watch, self._handler, self.bounds, self._workdir))
        self._proc.start()
        child.close()
        watch.close()
        try:
            hello = json.loads(self._conn.recv_bytes(4096)) \
                if self._conn.poll(START_TIMEOUT) else None
        except (EOFError, OSError, ValueError):
            hello = None
        if not isinstance(hello, dict) or not isinstance(hello.get("held"), dict):
            self._stop()
            raise SandboxError("its sandboxed process did not start")
        self._report(hello["held"])
        return self._conn

    def _report(self, held: dict[str, Any]) -> None:
        if held != self.held:
            on = [k if v is True else f"{k} (ABI {v})" for k, v in held.items() if v]
            logger.info("sandboxed process: bounds %s; not available here: %s", ", ".join(on),
                        ", ".join(k for k, v in held.items() if not v) or "none")
        self.held = held

    def _stop(self, why: str | None = None) -> None:
        if self._proc is not None:
            if why is not None:
                logger.info("sandboxed process stopped: %s", why)
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self._cleaner_end is not None:
            self._cleaner_end.close()  # the child's cleaner finds the folder gone, and exits
        self._proc = self._conn = self._workdir = self._cleaner_end = None


def _parse_reply(data: bytes) -> dict[str, Any]:
    reply = json.loads(data)
    if not isinstance(reply, dict) or not (set(reply) == {"value"} or (
            set(reply) == {"error"} and isinstance(reply["error"], str))):
        raise ValueError("malformed reply")
    return reply


# ----- the child -------------------------------------------------------------------------------

def _child_main(conn, watch, handler: Callable[[Any], Any], bounds: Bounds,
                workdir: str) -> None:
    _leave_a_cleaner(watch, workdir)
    held = harden(conn.fileno(), workdir, bounds)
    conn.send_bytes(json.dumps({"held": held}).encode())
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        _cpu_budget(bounds.timeout)
        try:
            reply = {"value": handler(request)}
        except BaseException as e:  # noqa: BLE001 - whatever it was, the parent reports it
            reply = {"error": f"{type(e).__name__} in its sandboxed process"}
        conn.send_bytes(json.dumps(reply).encode())


def _leave_a_cleaner(watch, workdir: str) -> None:
    """Fork, before any bound, a process that removes ``workdir`` once the server's end of
    ``watch`` closes: at the sandbox's stop, or when the server dies without cleaning up
    (SIGKILL). The child cannot remove it itself: its Landlock rules allow writes beneath
    ``workdir`` only, and removing it writes its parent folder."""
    if not hasattr(os, "fork"):
        watch.close()
        return
    if os.fork() == 0:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the server's own clean-up
            keep = watch.fileno()
            os.closerange(0, keep)  # the child's pipe too: its death must reach the server
            os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
            while True:
                watch.recv_bytes()  # nothing is ever sent: returns at EOF, by raising
        except BaseException:  # noqa: BLE001 - EOF, or anything: clean up and go
            shutil.rmtree(workdir, ignore_errors=True)
        finally:
            os._exit(0)
    watch.close()


def harden(keep_fd: int, workdir: str, bounds: Bounds) -> dict[str, Any]:
    """Apply every bound this platform allows; returns which held (landlock: its ABI)."""
    time.localtime()  # glibc reads the time zone file now; later it could not open it
    held: dict[str, Any] = {"fds": _close_inherited(keep_fd), "workdir": _enter(workdir)}
    if sys.platform.startswith("linux"):
        held["netns"] = _unshare_network()
        held["no_new_privs"] = _no_new_privs()
        held["landlock"] = _landlock(_library_dirs(), workdir) if held["no_new_privs"] else 0
        held["seccomp"] = held["no_new_privs"] and _seccomp()
    held["rlimits"] = _rlimits(bounds)
    return held


def _close_inherited(keep_fd: int) -> bool:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    os.closerange(3, keep_fd)  # close_range(2) where the kernel has it
    os.closerange(keep_fd + 1, os.sysconf("SC_OPEN_MAX"))
    return True


def _enter(workdir: str) -> bool:
    os.chdir(workdir)
    return True


def _rlimits(bounds: Bounds) -> bool:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails instead of killing
    limits = [(resource.RLIMIT_AS, bounds.memory_bytes), (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_FSIZE, bounds.file_bytes),
              (resource.RLIMIT_NOFILE, bounds.open_files)]
    if hasattr(resource, "RLIMIT_NPROC"):
        limits.append((resource.RLIMIT_NPROC, 0))
    for which, value in limits:
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))
    return True


def _cpu_budget(seconds: float) -> None:
    """Let the next call use ``seconds`` of CPU (SIGXCPU ends the child beyond that), a bound
    behind the parent's wall-clock one."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


# ----- Linux: namespaces, no_new_privs, Landlock, seccomp ---------------------------------------

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _unshare_network() -> bool:
    """A network namespace of its own; a user namespace lets an unprivileged process make one."""
    libc = _libc()
    return any(libc.unshare(ctypes.c_int(flags)) == 0
               for flags in (_CLONE_NEWUSER | _CLONE_NEWNET, _CLONE_NEWNET))


def _prctl(option: int, *args: Any) -> int:
    args = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in args]
    return _libc().prctl(ctypes.c_int(option), *args, *[ctypes.c_ulong(0)] * (4 - len(args)))


def _no_new_privs() -> bool:
    return _prctl(_PR_SET_NO_NEW_PRIVS, 1) == 0


def _syscall(number: int, *args: Any) -> int:
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(number),
                        *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])


# Landlock (the syscall numbers are the same on every architecture but alpha).
_LANDLOCK_CREATE, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT = 444, 445, 446
_FS_BY_ABI = ((1, (1 << 13) - 1), (2, 1 << 13), (3, 1 << 14), (5, 1 << 15))  # (since ABI, rights)
_FS_EXECUTE, _FS_READ = 1 << 0, (1 << 2) | (1 << 3)  # execute; read file, read dir
_NET_TCP = 1 | 2  # bind, connect (ABI 4)
_SCOPES = 1 | 2  # abstract unix sockets, signals (ABI 6)


def _library_dirs() -> set[str]:
    """What the child may read: Python's own libraries and every package already loaded (so a
    later import of one of their modules still works), not the server's working directory."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    for name, module in list(sys.modules.items()):
        top = getattr(module, "__path__", None) if "." not in name else None
        dirs.update(p for p in (top or ()) if isinstance(p, str))
    return {d for d in dirs if os.path.isdir(d)}


def _landlock(read_dirs: Iterable[str], write_dir: str) -> int:
    """Restrict files (and TCP, and scopes, where the ABI has them); returns the ABI, 0 if
    Landlock is not there."""
    abi = _syscall(_LANDLOCK_CREATE, 0, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    fs = sum(rights for since, rights in _FS_BY_ABI if abi >= since)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = struct.pack("<QQQ", fs, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    ruleset = _syscall(_LANDLOCK_CREATE, ctypes.create_string_buffer(attr[:size], size), size, 0)
    if ruleset < 0:
        return 0
    try:
        rules = [(d, _FS_READ) for d in read_dirs] + [(write_dir, fs & ~_FS_EXECUTE)]
        for path, access in rules:
            _allow_beneath(ruleset, path, access)
        return abi if _syscall(_LANDLOCK_RESTRICT, ruleset, 0) == 0 else 0
    finally:
        os.close(ruleset)


def _allow_beneath(ruleset: int, path: str, access: int) -> None:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        attr = struct.pack("<Qi", access, fd)  # landlock_path_beneath_attr, packed
        if _syscall(_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.create_string_buffer(attr, 12), 0):
            raise OSError(ctypes.get_errno(), f"landlock rule for {path}")
    finally:
        os.close(fd)


# seccomp: a classic BPF filter over (arch, syscall number).
# Refused: socket, socketpair, io_uring_setup (it makes sockets too), then clone, clone3, fork
# and vfork (RLIMIT_NPROC does not hold for root).
_SECCOMP_ARCH = {"x86_64": (0xC000003E, (41, 53, 425, 56, 435, 57, 58)),
                 "aarch64": (0xC00000B7, (198, 199, 425, 220, 435))}
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_X32_BIT = 0x40000000  # x32 system calls on x86-64: refused


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _filter(arch: int, denied: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) instructions: another ABI's call -> ENOSYS; a denied call -> EACCES."""
    n = len(denied)
    return [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _ERRNO | errno.ENOSYS),
            (_LD_ABS, 0, 0, 0), (_JGE, n + 1, 0, _X32_BIT),
            *[(_JEQ, n - i, 0, nr) for i, nr in enumerate(denied)],
            (_RET, 0, 0, _ALLOW), (_RET, 0, 0, _ERRNO | errno.EACCES)]


def _seccomp() -> bool:
    arch = _SECCOMP_ARCH.get(platform.machine())
    if arch is None:
        return False
    code = b"".join(struct.pack("<HBBI", *insn) for insn in _filter(*arch))
    program = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(program, ctypes.c_void_p))
    return _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog)) == 0
