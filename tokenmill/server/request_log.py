"""The request log (``serve --request-log DIR``): one JSON line per generation request, written
by a thread of its own so the event loop never waits on a disk or on JSON.

A line (``tokenmill bench replay DIR`` reads them back)::

    {"time": 1718000000.123456,            arrival, Unix seconds
     "id": "cmpl-...", "path": "/v1/completions", "status": 200,
     "outcome": "ok" | "error" | "aborted" | "failed", "model": "...",
     "duration": 1.52, "ttft": 0.21,       seconds from arrival (the client's view, server side)
     "prompt_tokens": 12, "completion_tokens": 64, "cached_tokens": 0,
     "requests": [{"id", "prompt_tokens", "cached_tokens", "output_tokens": [per choice],
                   "finish_reasons": [...], "queue", "ttft", "e2e", "decode_steps"}],
     "body": {...}}                        the request body, prompts left out (below)

Without ``--request-log-prompts`` no text of the user's is written: ``prompt`` goes (each
prompt's token count is in ``requests``), each message keeps its role and the token count of
its content, ``input`` / ``instructions`` / ``system`` / ``suffix`` become token counts and
``tools`` their number; everything else (sampling settings, limits) stays.

``requests.jsonl`` turns into ``requests.jsonl.1`` (``.2`` ...) once the next line would take
it past ``max_bytes``; ``keep`` old files stay. Servers sharing a directory (the replicas of
``--data-parallel-size`` get the same flags) each write their own file: the first takes
``requests.jsonl``, the others ``requests-<pid>.jsonl`` (a lock file says who holds which).
The last ``window`` seconds of lines are kept in memory too, for a crash dump (``dumps.py``),
with or without a directory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("tokenmill.server")

LOG_NAME = "requests.jsonl"
# fields whose text is the user's: kept only with --request-log-prompts
_TEXT_FIELDS = ("input", "instructions", "system", "suffix")
_MAX_RING = 100_000  # lines kept in memory for dumps, however many arrive in the window
_STOP = object()


class RequestLog:
    """Takes finished requests (``put``) from the event loop; its thread sanitizes, encodes,
    writes and rotates. ``directory`` None: the ring for dumps only."""

    def __init__(self, directory: str | None, count_tokens: Callable[[str], int],
                 max_bytes: int = 100 * 2**20, keep: int = 5, prompts: bool = False,
                 window: float = 300.0):
        if max_bytes < 1 or keep < 0:
            raise ValueError("--request-log-max-bytes must be >= 1 and --request-log-keep "
                             ">= 0")
        self.directory = Path(directory) if directory else None
        self.count_tokens = count_tokens
        self.max_bytes = max_bytes
        self.keep = keep
        self.prompts = prompts
        self.window = window
        self._ring: deque[dict[str, Any]] = deque(maxlen=_MAX_RING)
        self._ring_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._file = None
        self._size = 0
        self._name = LOG_NAME
        self._lock = None  # held while this log writes requests.jsonl
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._name = self._claim_name()
            self._open()
        self._thread = threading.Thread(target=self._run, name="tokenmill-request-log",
                                        daemon=True)
        self._thread.start()

    @property
    def path(self) -> Path | None:
        return None if self.directory is None else self.directory / self._name

    def _claim_name(self) -> str:
        """``requests.jsonl`` unless another live server writes it (its lock is held, and
        released when that process ends): then a name of this process' own."""
        self._lock = open(self.directory / ".requests.lock", "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            self._lock = None
            return f"requests-{os.getpid()}.jsonl"
        return LOG_NAME

    def put(self, entry: dict[str, Any], body: bytes | None) -> None:
        """One finished request: its summary and the body's bytes (any thread)."""
        self._queue.put((entry, body))

    def recent(self) -> list[dict[str, Any]]:
        """The lines of the last ``window`` seconds, oldest first."""
        with self._ring_lock:
            self._prune(time.time())
            return list(self._ring)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the thread and close the file."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._lock is not None:
            self._lock.close()

    def flush(self, timeout: float = 5.0) -> None:
        """Return once every request put so far is written (for dumps and tests)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    # ----- the writer thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():  # a burst is written with one flush
                items.append(self._queue.get_nowait())
            if self._write_all(items):
                break
        if self._file is not None:
            self._file.close()

    def _write_all(self, items: list) -> bool:
        """Write a batch; True when it held the stop mark."""
        stop = False
        for item in items:
            if item is _STOP:
                stop = True
            elif isinstance(item, threading.Event):
                if self._file is not None:
                    self._file.flush()
                item.set()
            else:
                self._write_one(*item)
        if self._file is not None:
            self._file.flush()
        return stop

    def _write_one(self, entry: dict[str, Any], body: bytes | None) -> None:
        try:
            entry["body"] = self.body_view(body)
            line = json.dumps(entry, separators=(",", ":"), default=str) + "\n"
        except Exception:  # a log line is never worth a failed request or a dead thread
            logger.exception("request log: could not encode a request")
            return
        with self._ring_lock:
            self._ring.append(entry)
            self._prune(entry["time"])
        if self._file is not None:
            self._append(line.encode())

    def _prune(self, now: float) -> None:
        while self._ring and self._ring[0]["time"] < now - self.window:
            self._ring.popleft()

    def _append(self, data: bytes) -> None:
        try:
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._size += len(data)
        except OSError:
            logger.exception("request log: write to %s failed", self.path)

    def _open(self) -> None:
        self._file = open(self.path, "ab")
        self._size = self._file.tell()

    def _rotate(self) -> None:
        """requests.jsonl -> .1 -> .2 ...; the file past ``keep`` is deleted."""
        self._file.close()
        base = str(self.path)
        if self.keep == 0:
            os.remove(base)
        else:
            for i in range(self.keep - 1, 0, -1):
                if os.path.exists(f"{base}.{i}"):
                    os.replace(f"{base}.{i}", f"{base}.{i + 1}")
            os.replace(base, f"{base}.1")
        self._open()

    # ----- what of a body is written ------------------------------------------------------

    def body_view(self, body: bytes | None) -> Any:
        """The body as logged: whole with prompts, else with the user's text as counts."""
        if not body:
            return None
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return {"unparsed_bytes": len(body)}
        if self.prompts or not isinstance(parsed, dict):
            return parsed
        return self._without_text(parsed)

    def _without_text(self, body: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in body.items()
               if k not in ("prompt", "messages", "tools", "functions", *_TEXT_FIELDS)}
        if isinstance(body.get("messages"), list):
            out["messages"] = [self._message_view(m) for m in body["messages"]]
        for name in _TEXT_FIELDS:
            if name in body:
                out[name] = {"tokens": self.count_tokens(_text_of(body[name]))}
        for name in ("tools", "functions"):
            if isinstance(body.get(name), list):
                out[name] = {"count": len(body[name])}
        return out

    def _message_view(self, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict):
            return {}
        view = {"role": message.get("role"),
                "tokens": self.count_tokens(_text_of(message.get("content")))}
        if message.get("tool_calls"):
            view["tool_calls"] = len(message["tool_calls"])
        return view


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text of its parts / blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_of(part.get("text", part.get("content", "")))
                       if isinstance(part, dict) else _text_of(part) for part in content)
    return ""

