"""Read the key/value metadata at the head of a GGUF file, and nothing else.

``gguf.GGUFReader`` builds a numpy view per array element while it indexes the whole file, which
takes seconds for a 50k-token vocabulary. The metadata section is a simple length-prefixed
stream, so we walk it with ``struct`` over an mmap: string arrays cost one slice per element and
numeric arrays one ``numpy.frombuffer``. Tensor data is never touched.

Layout (GGUF v2/v3): magic ``GGUF``, version u32, tensor count u64, kv count u64, then per kv a
string key (u64 length + bytes), a u32 value type and the value. An array value is an element type
u32, a count u64 and the elements.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from tokenmill.errors import ModelLoadError

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}


class _Cursor:
    """A read position in the mapped file with the file's byte order."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf = buf
        self.order = order
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        raw = self.buf[self.pos:self.pos + size]  # slicing an mmap copies: no buffer stays exported
        if len(raw) != size:
            raise struct.error("string runs past the end of the file")
        self.pos += size
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALARS[vtype])

    def array(self) -> list[Any]:
        etype = GGUFValueType(self.scalar("I"))
        count = self.scalar("Q")
        if etype in _SCALARS:  # numeric: one vectorised read instead of a Python loop
            dtype = np.dtype(self.order + _SCALARS[etype])
            # One expression, so no array keeps the mmap exported (it could not be closed then).
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += dtype.itemsize * count
            return values
        return [self.value(etype) for _ in range(count)]


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value pairs of a GGUF file as plain Python values (arrays become lists)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(mm)
    except (OSError, ValueError, struct.error, ModelLoadError) as exc:
        raise ModelLoadError(f"cannot read GGUF metadata from {str(path)!r}: {exc}") from exc


def _parse(buf: mmap.mmap) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise ModelLoadError("not a GGUF file (bad magic)")
    cur = _Cursor(buf, _byte_order(buf))
    cur.pos = 8
    cur.scalar("Q")  # tensor count: not needed for metadata
    kv_count = cur.scalar("Q")
    out = {}
    for _ in range(kv_count):
        key = cur.string()
        out[key] = cur.value(GGUFValueType(cur.scalar("I")))
    return out


def _byte_order(buf: mmap.mmap) -> str:
    """GGUF has no endianness flag; like llama.cpp, infer it from a plausible version number."""
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # a small version read with the wrong byte order
        (version,) = struct.unpack_from(">I", buf, 4)
        order = ">"
    else:
        order = "<"
    if version not in (2, 3):
        raise ModelLoadError(f"unsupported GGUF version {version} (tokenmill reads v2 and v3)")
    return order
