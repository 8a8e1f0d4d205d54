"""The wire of the prefill->decode transfer (``p2p.py``): its messages, the host identity that
lets two processes use shared memory, and the shared-memory segments themselves.

Messages are msgpack arrays with a tag naming the struct, one zmq frame each; a ``Chunk`` sent
over TCP is followed by a second frame holding its bytes (``count`` blocks, gather's layout).
A ``Chunk`` sent through shared memory names instead a file under ``/dev/shm`` (the system's
temporary directory where there is none) that the sender wrote and the receiver reads and
unlinks. Segment names carry the sender's pid, so a later sender on the host can remove what a
dead one left behind.

This module imports neither torch nor zmq: it is plain data and files.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

logger = logging.getLogger("tokenmill.kv_transfer")

TRANSPORTS = ("auto", "tcp", "shm")
SEGMENT_PREFIX = "tokenmill-kv-"
# <prefix><pid>-<counter>-<random>: the only names a receiver opens (and unlinks), so a sender
# cannot make it touch any other file.
_SEGMENT_NAME = re.compile(rf"{SEGMENT_PREFIX}(?P<pid>\d+)-\d+-[0-9a-f]+")


class Pull(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Receiver -> sender, once per transfer: send ``block_ids`` of ``request_id``. ``xfer``
    (the receiver's random id) names the transfer in every later message both ways."""

    xfer: int
    request_id: str
    block_ids: list[int]
    fingerprint: dict[str, Any]
    block_nbytes: int
    host_id: str
    transport: str  # the receiver's setting: auto | tcp | shm


class Next(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Receiver -> sender: the chunk starting at index ``start`` of the pulled block ids
    (``tcp_only``: the receiver could not read a segment; bytes in frames from now on)."""

    xfer: int
    start: int
    tcp_only: bool = False


class Done(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Receiver -> sender: the transfer is over (``ok``: every block arrived); the sender
    releases the request's blocks either way, since this consumer will not ask again."""

    xfer: int
    ok: bool


class Chunk(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Sender -> receiver: blocks ``start .. start + count`` of the pulled ids; ``shm`` names
    the segment holding them, or is empty when they follow in the next frame."""

    xfer: int
    start: int
    count: int
    shm: str = ""


class Refused(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Sender -> receiver: the transfer cannot go on, and why (logged by the receiver)."""

    xfer: int
    reason: str


ToSender = Pull | Next | Done
ToReceiver = Chunk | Refused

_ENCODER = msgspec.msgpack.Encoder()
_TO_SENDER = msgspec.msgpack.Decoder(ToSender)
_TO_RECEIVER = msgspec.msgpack.Decoder(ToReceiver)
_PLAIN = msgspec.msgpack.Decoder()


def encode(message: ToSender | ToReceiver) -> bytes:
    return _ENCODER.encode(message)


def decode_to_sender(payload: bytes) -> ToSender:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything else."""
    return _TO_SENDER.decode(payload)


def decode_to_receiver(payload: bytes) -> ToReceiver:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything else."""
    return _TO_RECEIVER.decode(payload)


def as_sent(fingerprint: Any) -> dict[str, Any]:
    """The fingerprint as the other side decodes it (tuples become lists), so both sides
    compare like with like."""
    return _PLAIN.decode(_ENCODER.encode(fingerprint))


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"KV transfer: transport must be one of {', '.join(TRANSPORTS)}, "
                         f"not {transport!r}")


def endpoint(host: str, port: int | str) -> str:
    """The zmq TCP address of ``host:port`` (an IPv6 host in brackets)."""
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# ----- the host, and its shared memory ----------------------------------------------------------

def segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


def host_id() -> str:
    """Equal in two processes that can share segments: the host's name, its boot (a
    container sees the host's boot id) and the device of the segment directory (two
    containers with their own /dev/shm differ there)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        device = os.stat(segment_dir()).st_dev
    except OSError:
        device = -1
    return f"{socket.gethostname()}/{boot}/{device}"


def new_segment_name(counter: int) -> str:
    return f"{SEGMENT_PREFIX}{os.getpid()}-{counter}-{secrets.token_hex(4)}"


def write_segment(path: str, nbytes: int, fill: Callable[[memoryview], object]) -> None:
    """A new file of ``nbytes`` (only its owner may read it) that ``fill`` writes in place,
    through a mapping of it (the sender gathers the blocks straight into it: no copy between);
    nothing is left on failure."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mapped:
            view = memoryview(mapped)
            try:
                fill(view)
            finally:
                view.release()
    except BaseException:
        unlink_quietly(path)
        raise
    finally:
        os.close(fd)


def read_segment(name: str, nbytes: int) -> mmap.mmap:
    """Segment ``name`` mapped (writable, so the cache is filled from it without a copy), and
    unlinked whatever happens once it is opened; the caller closes the mapping. Raises
    ``FileNotFoundError`` (absent), ``ValueError`` (a name that is not a segment's, or a size
    other than ``nbytes``) or another ``OSError``."""
    if _SEGMENT_NAME.fullmatch(name) is None:
        raise ValueError(f"{name!r} is not a KV segment's name")
    path = os.path.join(segment_dir(), name)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"segment {name} holds {size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        unlink_quietly(path)
        os.close(fd)


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sweep_dead_segments(directory: str, min_age: float = 600.0) -> int:
    """Remove segments whose sender is gone (its pid runs no more) and that are older than
    ``min_age`` s (a pid of another pid namespace looks gone too: the age spares its live
    transfers, which last seconds). Returns how many were removed."""
    removed, now = 0, time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        m = _SEGMENT_NAME.fullmatch(entry.name)
        if m is None or _pid_alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime >= min_age:
                os.unlink(entry.path)
                removed += 1
    if removed:
        logger.info("KV transfer: removed %d stale shared-memory segments of exited "
                    "senders from %s", removed, directory)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True
