"""A handler for ``tokenmill.server.sandbox.Sandbox`` that tries, from inside the bounded child,
what the bounds forbid, and reports what happened (no tests here; stdlib only, since the child
imports this module)."""

from __future__ import annotations

import ctypes
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

PR_GET_NO_NEW_PRIVS = 39


def probe(request: dict[str, Any]) -> Any:
    """``request["op"]``: ``"probe"`` (every attempt below), ``"spin"`` (a call that never
    ends), ``"reply"`` (a reply of ``request["chars"]`` characters), ``"pid"``."""
    op = request["op"]
    if op == "spin":
        while True:
            time.sleep(0)
    if op == "reply":
        return "x" * request["chars"]
    if op == "pid":
        return os.getpid()
    return {name: _attempt(fn) for name, fn in _attempts(request).items()}


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": fn()}
    except BaseException as e:  # noqa: BLE001 - what failed, and how, is the result
        return {"error": type(e).__name__, "errno": getattr(e, "errno", None)}


def _attempts(request: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    return {
        "cwd": os.getcwd,
        "fds": _open_fds,
        "null_fds": lambda: [_is_null(fd) for fd in (0, 1, 2)],
        "no_new_privs": lambda: ctypes.CDLL(None).prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0),
        "net_namespace": lambda: os.readlink("/proc/self/ns/net"),
        "socket": lambda: socket.socket().close(),
        "connect": lambda: socket.create_connection(("127.0.0.1", request["port"]), 2).close(),
        "write_outside": lambda: _write(request["outside"], 10),
        "read_outside": lambda: open(request["secret"]).read(),
        "write_inside": lambda: _write("inside.txt", 1000),
        "write_too_large": lambda: _write("large.bin", request["too_large"]),
        "fork": _fork,
        "exec": lambda: os.execv("/bin/true", ["/bin/true"]),
        "allocate": lambda: len(bytearray(request["allocate"])),
        "lazy_import": lambda: __import__("email.mime.text").mime.text.__name__,
    }


def _open_fds() -> list[int]:
    out = []
    for fd in range(256):
        try:
            os.fstat(fd)
            out.append(fd)
        except OSError:
            pass
    return out


def _is_null(fd: int) -> bool:
    st = os.fstat(fd)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev


def _write(path: str, size: int) -> int:
    with open(path, "wb") as f:
        return f.write(b"x" * size)


def _fork() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
