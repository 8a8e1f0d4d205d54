"""Chat templates sent in requests, rendered in a separate process.

A template is code. The model's own templates are the operator's choice and render in-process in
jinja2's sandbox; a template a client sends (only with ``--trust-request-chat-template``) could
loop for hours or build a gigabyte string without ever leaving the sandbox, and a thread cannot
be stopped. So those render in a child process with an address-space limit that is killed when a
render takes longer than its time bound, and started again for the next one.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.tokenizer.chat_template import ChatTemplateError, render_chat

logger = logging.getLogger("tokenmill.server")

MEMORY_BYTES = 1 << 30  # the child's address space; a template that needs more fails


def _serve(conn, memory_bytes: int) -> None:  # the child process
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    while True:
        try:
            args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, render_chat(*args, **kwargs)))
        except ChatTemplateError as e:
            conn.send((False, str(e)))
        except BaseException as e:  # noqa: BLE001 - whatever it was, the parent reports it
            conn.send((False, f"chat template failed: {type(e).__name__}"))


class IsolatedRenderer:
    """``render(...)`` has ``render_chat``'s signature; one render at a time (callers queue)."""

    def __init__(self, timeout: float, max_chars: int, memory_bytes: int = MEMORY_BYTES):
        self.timeout = timeout
        self.max_chars = max_chars
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def render(self, source: str, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool, tools: Sequence[Any] | None,
               variables: Mapping[str, Any], max_chars: int | None = None) -> str:
        kwargs = dict(add_generation_prompt=add_generation_prompt, tools=tools,
                      variables=dict(variables), max_chars=min(max_chars or self.max_chars,
                                                               self.max_chars))
        with self._lock:
            conn = self._child()
            try:
                conn.send(((source, list(messages)), kwargs))
                if not conn.poll(self.timeout):
                    self._kill()
                    raise ChatTemplateError(f"the chat template did not finish within "
                                            f"{self.timeout:g} s")
                ok, value = conn.recv()
            except (EOFError, OSError):  # the child died (its memory limit, a crash)
                self._kill()
                raise ChatTemplateError("the chat template failed: its renderer process "
                                        "ended (out of memory?)") from None
        if not ok:
            raise ChatTemplateError(value)
        return value

    def _child(self):
        if self._proc is None or not self._proc.is_alive():
            ctx = multiprocessing.get_context("spawn")  # not fork: the parent runs threads
            parent, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(child, self.memory_bytes),
                                     name="tokenmill-template", daemon=True)
            self._proc.start()
            child.close()
            self._conn = parent
        return self._conn

    def _kill(self) -> None:
        if self._proc is not None:
            logger.info("request chat template renderer stopped (time or memory bound)")
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.join(5)
            self._proc = self._conn = None
