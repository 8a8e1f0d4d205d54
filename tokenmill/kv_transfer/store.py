"""Where offloaded KV blocks live: host memory (``HostStore``) and files (``DiskStore``).

A block is stored under its key (the chained block hash of ``cache/events.py``, unsigned 64
bits) with the token ids it holds, which every load checks: a block is only ever handed back
for the tokens it was computed from. The stores keep no capacity rule; the scheduler side
decides what to drop or move (``DropBlocks`` / ``MoveBlocks``) and learns what the disk holds
at start-up from ``DiskStore.scan``, which reads names and sizes only. No torch here.

Disk layout, one directory per fingerprint (``fingerprint.py``), so a server only ever reads
files made by a cache of its own layout::

    root/
      3f9a0c1d2e4b5a67/              fingerprint_digest(fingerprint)
        fingerprint.json             the fingerprint, indented JSON (for people)
        a1/                          the key's first two hex digits (256 subdirectories)
          a1b2c3d4e5f60718.kvb       the block whose key is 0xa1b2c3d4e5f60718
          .a1b2c3d4e5f60718.kvb.x.tmp    a write in progress (renamed over the .kvb when done)

A ``.kvb`` file, little-endian::

    +------+---------+-------+--------+-----+----+-----------------+-------------+---------+
    | TKVB | version | flags | digest | key | n  | tokens          | payload len | check   |
    | 4 B  | u16 = 1 | u16=0 | 8 B    | u64 | u32| n x int32       | u64         | 16 B    |
    +------+---------+-------+--------+-----+----+-----------------+-------------+---------+
    | payload: the block's bytes (BlockIO.gather's row)                                    |
    +--------------------------------------------------------------------------------------+
    check = blake2b (16 bytes) of everything before it, then the payload

Several servers may share a root: a file appears whole (temp file + ``os.replace``) or not at
all, a file that vanishes between a scan and a read is a miss, and a file failing any check
(truncated, a flipped byte, other tokens, another fingerprint) is a miss that is logged once,
removed and never raised. A load that succeeds touches the file's mtime, so the least recently
used order (``scan``'s) survives restarts.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from hashlib import blake2b
from pathlib import Path
from typing import Any

from tokenmill.kv_transfer.base import TierStats
from tokenmill.kv_transfer.fingerprint import fingerprint_digest

logger = logging.getLogger("tokenmill.kv_transfer")

Payload = bytes | bytearray | memoryview

_MAGIC = b"TKVB"
_VERSION = 1
_HEAD = struct.Struct("<4sHH8sQI")  # magic, version, flags, digest, key, token count
_TAIL = struct.Struct("<Q16s")  # payload length, checksum
_SUFFIX = ".kvb"
_STALE_TEMP_SECONDS = 3600.0  # a temp file this old is a crashed write, not one in progress
_MAX_KEY = (1 << 64) - 1
_WRITE_WARNING_SECONDS = 60.0


class BadBlock(Exception):
    """A stored block failed a check (the message says which)."""


class BlockStore(ABC):
    """One tier of offloaded blocks, keyed by chained block hash. Thread-safe: a saver and a
    loader thread may use it at once. Buffers returned by ``get`` must not be written to."""

    name: str

    def __init__(self) -> None:
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._warned: set[int] = set()

    @abstractmethod
    def put(self, key: int, tokens: Sequence[int], data: Payload) -> bool:
        """Store (or replace) the block; False when it could not be stored (logged)."""

    @abstractmethod
    def get(self, key: int, tokens: Sequence[int]) -> Payload | None:
        """The block's bytes, or None: absent, or failing a check (logged once per key,
        removed). Counted as a hit or a miss. Never raises."""

    @abstractmethod
    def delete(self, key: int) -> None:
        """Forget the block; an absent key is a no-op."""

    @abstractmethod
    def __contains__(self, key: int) -> bool: ...

    def close(self) -> None:
        """Release what the store holds in memory (files stay)."""

    def _hit(self, nbytes: int, started: float) -> None:
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_loaded += nbytes
            self.stats.load_seconds += time.perf_counter() - started

    def _miss(self, key: int, problem: str | None = None) -> None:
        """A miss; ``problem``: why a block that was there is refused (warned once per key)."""
        with self._lock:
            self.stats.misses += 1
            first = problem is not None and key not in self._warned
            if first:
                self._warned.add(key)
        if first:
            logger.warning("%s tier: block %016x is a miss: %s", self.name, key, problem)

    def _stored(self, added_blocks: int, added_bytes: int,
                saved_bytes: int | None = None) -> None:
        """Count a change of what the tier holds; ``saved_bytes``: a put of that payload."""
        with self._lock:
            self.stats.stored_blocks += added_blocks
            self.stats.stored_bytes += added_bytes
            if saved_bytes is not None:
                self.stats.blocks_saved += 1
                self.stats.bytes_saved += saved_bytes


class HostStore(BlockStore):
    """Blocks in host memory: a dict of key -> (tokens, bytes)."""

    name = "host"

    def __init__(self) -> None:
        super().__init__()
        self._blocks: dict[int, tuple[tuple[int, ...], bytearray]] = {}

    def put(self, key: int, tokens: Sequence[int], data: Payload) -> bool:
        # a copy: the caller's buffer may be a view of memory that is reused
        entry = (tuple(tokens), bytearray(memoryview(data).cast("B")))
        with self._lock:
            old = self._blocks.get(key)
            self._blocks[key] = entry
        old_bytes = len(old[1]) if old else 0
        self._stored(0 if old else 1, len(entry[1]) - old_bytes, saved_bytes=len(entry[1]))
        return True

    def get(self, key: int, tokens: Sequence[int]) -> memoryview | None:
        started = time.perf_counter()
        entry = self._blocks.get(key)
        if entry is None:
            self._miss(key)
            return None
        if entry[0] != tuple(tokens):
            self.delete(key)
            self._miss(key, "it holds other tokens (dropped)")
            return None
        # writable, so BlockIO.scatter wraps it without a copy; nobody writes to it
        self._hit(len(entry[1]), started)
        return memoryview(entry[1])

    def delete(self, key: int) -> None:
        self.take(key)

    def take(self, key: int, tokens: Sequence[int] | None = None) -> bytearray | None:
        """Remove a block and return its bytes (None: absent, or other ``tokens``): a move to
        the next tier, which is no hit."""
        with self._lock:
            old = self._blocks.pop(key, None)
        if old is None:
            return None
        self._stored(-1, -len(old[1]))
        return old[1] if tokens is None or old[0] == tuple(tokens) else None

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.stats.stored_blocks = self.stats.stored_bytes = 0


class DiskStore(BlockStore):
    """Blocks as files under ``root/<fingerprint digest>/`` (see the module docstring)."""

    name = "disk"

    def __init__(self, root: str, fingerprint: Mapping[str, Any]) -> None:
        super().__init__()
        self.digest = fingerprint_digest(fingerprint)
        self._last_write_warning = -float("inf")
        self.directory = Path(root) / self.digest
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_if_changed(self.directory / "fingerprint.json",
                          (json.dumps(fingerprint, indent=1, sort_keys=True) + "\n").encode())
        present = self.scan(root, fingerprint)
        self._stored(len(present), sum(size for _, size in present))

    def path(self, key: int) -> Path:
        """The file that holds (or would hold) block ``key``."""
        if not 0 <= key <= _MAX_KEY:
            raise ValueError(f"block key {key} is not an unsigned 64-bit hash")
        name = f"{key:016x}"
        return self.directory / name[:2] / (name + _SUFFIX)

    def put(self, key: int, tokens: Sequence[int], data: Payload) -> bool:
        payload = memoryview(data).cast("B")
        path = self.path(key)
        try:
            path.parent.mkdir(exist_ok=True)
            old = _size_or_none(path)
            _write_atomic(path, _encode(self.digest, key, tokens, payload))
        except OSError as e:
            self._write_failed(f"could not write block {key:016x} to {path}: {e}")
            return False
        size = _header_size(len(tokens)) + payload.nbytes
        self._stored(1 if old is None else 0, size - (old or 0), saved_bytes=payload.nbytes)
        return True

    def get(self, key: int, tokens: Sequence[int]) -> memoryview | None:
        started = time.perf_counter()
        path = self.path(key)
        try:
            raw = _read(path)
        except FileNotFoundError:
            self._miss(key)
            return None
        except OSError as e:  # unreadable now (permissions, I/O): left in place, maybe transient
            self._miss(key, f"{path}: {e}")
            return None
        try:
            payload = _decode(raw, self.digest, key, tokens)
        except BadBlock as e:
            self._drop_file(key, path, len(raw))
            self._miss(key, f"{path}: {e} (removed)")
            return None
        _touch(path)
        self._hit(payload.nbytes, started)
        return payload

    def _write_failed(self, message: str) -> None:
        """Warn, at most once a minute: a full disk fails every write, not just one."""
        now = time.monotonic()
        if now - self._last_write_warning >= _WRITE_WARNING_SECONDS:
            self._last_write_warning = now
            logger.warning("disk tier: %s", message)

    def delete(self, key: int) -> None:
        path = self.path(key)
        self._drop_file(key, path, _size_or_none(path))

    def __contains__(self, key: int) -> bool:
        return self.path(key).is_file()

    def _drop_file(self, key: int, path: Path, size: int | None) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return  # another server removed it first
        except OSError as e:
            logger.warning("disk tier: could not remove block %016x (%s): %s", key, path, e)
            return
        self._stored(-1, -(size or 0))

    @staticmethod
    def scan(root: str, fingerprint: Mapping[str, Any]) -> list[tuple[int, int]]:
        """(key, file bytes) of every block file of this fingerprint under ``root``, least
        recently used (oldest mtime) first. Reads directory entries and sizes, no payloads;
        removes temp files of writes that crashed (older than an hour)."""
        top = Path(root) / fingerprint_digest(fingerprint)
        found = [entry for sub in _subdirectories(top) for entry in _block_files(sub)]
        found.sort()
        return [(key, size) for _, key, size in found]


def _header_size(num_tokens: int) -> int:
    return _HEAD.size + 4 * num_tokens + _TAIL.size


def _token_bytes(tokens: Sequence[int]) -> bytes:
    words = array("i", tokens)  # int32: token ids are vocabulary indices
    if sys.byteorder == "big":
        words.byteswap()
    return words.tobytes()


def _encode(digest: str, key: int, tokens: Sequence[int], payload: memoryview) -> list[Payload]:
    """The file's parts: header, then payload (written one after the other, never joined)."""
    head = _HEAD.pack(_MAGIC, _VERSION, 0, bytes.fromhex(digest), key, len(tokens))
    head += _token_bytes(tokens)
    check = blake2b(head, digest_size=16)
    check.update(struct.pack("<Q", payload.nbytes))
    check.update(payload)
    return [head + _TAIL.pack(payload.nbytes, check.digest()), payload]


def _decode(raw: bytearray, digest: str, key: int, tokens: Sequence[int]) -> memoryview:
    """The payload of a block file's bytes, after every check; else ``BadBlock``."""
    if len(raw) < _HEAD.size:
        raise BadBlock(f"truncated ({len(raw)} bytes)")
    magic, version, _, file_digest, file_key, n = _HEAD.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION:
        raise BadBlock(f"not a version {_VERSION} block file")
    if file_digest.hex() != digest or file_key != key:
        raise BadBlock(f"it holds block {file_key:016x} of layout {file_digest.hex()}")
    start = _header_size(n)
    if len(raw) < start:
        raise BadBlock(f"truncated ({len(raw)} bytes)")
    length, check = _TAIL.unpack_from(raw, start - _TAIL.size)
    if len(raw) != start + length:
        raise BadBlock(f"{len(raw) - start} payload bytes, the header says {length}")
    view = memoryview(raw)
    hashed = blake2b(view[:start - 16], digest_size=16)  # all but the check itself
    hashed.update(view[start:])
    if hashed.digest() != check:
        raise BadBlock("checksum mismatch")
    if view[_HEAD.size:start - _TAIL.size] != _token_bytes(tokens):
        raise BadBlock("it holds other tokens")
    return view[start:]


def _read(path: Path) -> bytearray:
    """The whole file into a writable buffer (so BlockIO.scatter wraps it without a copy)."""
    with path.open("rb") as f:
        raw = bytearray(os.fstat(f.fileno()).st_size)
        got = f.readinto(raw)
    return raw if got == len(raw) else raw[:got]


def _write_atomic(path: Path, parts: Iterable[Payload]) -> None:
    """Write ``parts`` to ``path`` so that readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _write_if_changed(path: Path, content: bytes) -> None:
    """Write ``content`` unless the file holds it already (a read-only cache still opens)."""
    try:
        if path.read_bytes() == content:
            return
    except OSError:
        pass
    _write_atomic(path, [content])


def _unlink_quietly(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # removed meanwhile, or a read-only directory: only the LRU order suffers


def _subdirectories(top: Path) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(top) as entries:
            subs = [e for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    yield from subs


def _block_files(sub: os.DirEntry[str]) -> list[tuple[float, int, int]]:
    """(mtime, key, size) of the block files in one subdirectory."""
    found = []
    now = time.time()
    try:
        with os.scandir(sub.path) as entries:
            for entry in entries:
                item = _block_file(entry, sub.name, now)
                if item is not None:
                    found.append(item)
    except OSError:
        pass
    return found


def _block_file(entry: os.DirEntry[str], prefix: str,
                now: float) -> tuple[float, int, int] | None:
    name = entry.name
    try:
        if name.endswith(".tmp"):
            if now - entry.stat().st_mtime > _STALE_TEMP_SECONDS:
                _unlink_quietly(entry.path)
            return None
        if not name.endswith(_SUFFIX):
            return None
        stem = name.removesuffix(_SUFFIX)
        key = int(stem, 16)
        if stem != f"{key:016x}" or not stem.startswith(prefix):
            return None  # only the names put() gives, in the right subdirectory
        st = entry.stat()
    except (OSError, ValueError):  # gone meanwhile, or not a name of ours
        return None
    return st.st_mtime, key, st.st_size
