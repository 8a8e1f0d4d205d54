"""Chat templates sent in requests, examined and rendered only in a sandboxed child process.

A template is code. The model's own templates are the operator's choice and render in-process in
jinja2's sandbox; a template a client sends (only with ``--trust-request-chat-template``) could
loop for hours or build a gigabyte string without ever leaving that sandbox, and jinja builds
constant strings while it merely parses (``'a'|center(1000000000)``). So the server never
parses one: the child (``server/sandbox.py``: memory, time, no network, no files) scans it for
the variables it reads, renders it, and is killed when either takes longer than its time bound.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from tokenmill.server.sandbox import Bounds, Sandbox, SandboxError, SandboxTimeout
from tokenmill.tokenizer.chat_template import (ChatTemplateError, compile_template, render_chat,
                                               scan_variables)

MEMORY_BYTES = 1 << 30  # the child's address space; a template that needs more fails
# Older jinja2 has known sandbox escapes (CVE-2024-56326, CVE-2025-27516).
MIN_JINJA2 = (3, 1, 6)


def check_jinja2(version: str = jinja2.__version__) -> None:
    """Refuse to render clients' templates on a jinja2 with a known way out of its sandbox."""
    release = tuple(int(n) for n in re.findall(r"\d+", version)[:3])
    if release < MIN_JINJA2:
        raise ChatTemplateError(f"--trust-request-chat-template needs jinja2 >= "
                                f"{'.'.join(map(str, MIN_JINJA2))} (older ones have known "
                                f"sandbox escapes); this is jinja2 {version}")


def _handle(request: dict[str, Any]) -> dict[str, Any]:  # runs in the child
    """``{"value": ...}``, or ``{"error": message}`` for a template that fails."""
    try:
        if request["op"] == "variables":
            return {"value": sorted(scan_variables(request["source"]))}
        options = {k: request[k] for k in ("add_generation_prompt", "tools", "variables",
                                           "max_chars")}
        template = compile_template(request["source"])  # not cached: one template per request
        return {"value": render_chat(template, request["messages"], **options)}
    except ChatTemplateError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - e.g. RecursionError parsing 10^5 nested brackets
        return {"error": f"chat template failed: {type(e).__name__}"}


class IsolatedRenderer:
    """``render(...)`` has ``render_chat``'s signature and ``variables(source)`` is
    ``scan_variables``, both done in the child; one call at a time (callers queue)."""

    def __init__(self, timeout: float, max_chars: int, memory_bytes: int = MEMORY_BYTES):
        check_jinja2()
        self.timeout = timeout
        self.max_chars = max_chars
        # A reply is at most max_chars characters, each at most 12 bytes of JSON (a surrogate
        # pair of \uXXXX escapes).
        self._sandbox = Sandbox(_handle, Bounds(timeout, memory_bytes), 12 * max_chars + 4096)

    @property
    def held(self) -> dict[str, Any]:
        """The bounds the newest child reported as applied (empty before the first call)."""
        return self._sandbox.held

    def variables(self, source: str) -> frozenset[str]:
        names = self._call({"op": "variables", "source": source})
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ChatTemplateError("the chat template failed: its renderer sent no names")
        return frozenset(names)

    def handles_tools(self, source: str) -> bool:
        """Whether the template reads ``tools`` (``tools.prompt.template_handles_tools``)."""
        return "tools" in self.variables(source)

    def render(self, source: str, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool, tools: Sequence[Any] | None,
               variables: Mapping[str, Any], max_chars: int | None = None) -> str:
        limit = min(max_chars or self.max_chars, self.max_chars)
        text = self._call({"op": "render", "source": source, "messages": list(messages),
                           "add_generation_prompt": add_generation_prompt,
                           "tools": list(tools) if tools is not None else None,
                           "variables": dict(variables), "max_chars": limit})
        if not isinstance(text, str) or len(text) > limit:
            raise ChatTemplateError("the chat template failed: its renderer sent no text")
        return text

    def _call(self, request: dict[str, Any]) -> Any:
        try:
            reply = self._sandbox.call(request)
        except SandboxTimeout:
            raise ChatTemplateError(f"the chat template did not finish within "
                                    f"{self.timeout:g} s") from None
        except SandboxError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        if not isinstance(reply, dict) or not isinstance(reply.get("error", ""), str):
            raise ChatTemplateError("the chat template failed: its renderer sent no result")
        if "error" in reply:
            raise ChatTemplateError(reply["error"])
        return reply.get("value")

    def close(self) -> None:
        self._sandbox.close()
