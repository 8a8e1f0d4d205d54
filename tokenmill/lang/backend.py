"""The HTTP side of ``tokenmill.lang``: one ``Endpoint`` per OpenAI-compatible server.

Every call a program makes goes through here as a plain ``/v1/completions`` or
``/v1/chat/completions`` request, so a program runs against tokenmill, vLLM, SGLang or any
other OpenAI-compatible server. What only some servers do (prompt logprobs, structured output,
continuing an open assistant turn) is probed once and used where it answered; elsewhere the
caller takes a weaker path (see ``interpreter.py``) instead of failing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

# A fork's branches share their parent's text; committing it first puts it in the server's
# prefix cache, so the branches find it there instead of each computing it. Shorter than this
# (one KV block of the usual size) nothing would be cached, so nothing is sent.
MIN_COMMIT_CHARS = 64


class EndpointError(RuntimeError):
    """A request the server refused or could not answer; ``status`` is the HTTP status (0 when
    no answer came) and ``body`` the server's error object where it sent one."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.body = body


@dataclass(frozen=True)
class Scored:
    """One continuation's log-likelihood after a context: the sum over its tokens and their
    count (a token that straddles the boundary counts with the continuation)."""

    logprob: float
    num_tokens: int

    @property
    def mean(self) -> float:
        return self.logprob / max(1, self.num_tokens)


class Endpoint:
    """A server at ``base_url`` (``http://host:port``, with or without ``/v1``). ``model`` is
    the served model's name (the first of ``/v1/models`` when not given); ``transport`` is
    httpx's (tests). The client is thread-safe: a program's forks and ``run_batch`` share it."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, max_connections: int = 256,
                 transport: httpx.BaseTransport | None = None) -> None:
        root = base_url.rstrip("/")
        self.base_url = root[:-3] if root.endswith("/v1") else root
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                  limits=limits, transport=transport)
        self._model = model
        self._probes: dict[str, bool] = {}
        self._lock = threading.Lock()

    # ----- the model and what the server can do ---------------------------------------------

    @property
    def model(self) -> str:
        if self._model is None:
            data = self._request("GET", "/v1/models")["data"]
            if not data:
                raise EndpointError(0, f"{self.base_url} serves no model")
            self._model = data[0]["id"]
        return self._model

    def supports(self, feature: str) -> bool:
        """Whether the server does ``feature`` (``"prompt_logprobs"``): asked once, then
        remembered. ``set_supports`` overrides it (tests, or a server known in advance)."""
        with self._lock:
            if feature not in self._probes:
                self._probes[feature] = _PROBES[feature](self)
            return self._probes[feature]

    def set_supports(self, feature: str, value: bool) -> None:
        with self._lock:
            self._probes[feature] = value

    def close(self) -> None:
        self._http.close()

    # ----- calls ----------------------------------------------------------------------------

    def complete(self, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
        """``/v1/completions`` for one prompt: the first choice's ``text`` and
        ``finish_reason`` (and the whole response under ``response``)."""
        body = {"model": self.model, "prompt": prompt, **params}
        response = self._request("POST", "/v1/completions", body)
        return _first_choice(response, text_of=lambda c: c.get("text") or "")

    def chat(self, messages: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
        """``/v1/chat/completions``: the first choice's message ``text`` and ``finish_reason``."""
        body = {"model": self.model, "messages": messages, **params}
        response = self._request("POST", "/v1/chat/completions", body)
        return _first_choice(response,
                             text_of=lambda c: (c.get("message") or {}).get("content") or "")

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        """The text deltas of a streamed call (``path`` is ``/v1/completions`` or
        ``/v1/chat/completions``); ``body`` without ``model`` or ``stream``."""
        body = {"model": self.model, **body, "stream": True}
        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error_of(r)
                yield from _deltas(r.iter_lines())
        except httpx.HTTPError as e:
            raise EndpointError(0, f"{path}: {e}") from e

    def score(self, context: str, continuations: Sequence[str]) -> list[Scored]:
        """The log-likelihood of each continuation after ``context``, from the prompt logprobs
        of one ``echo`` request (every continuation a prompt of it; nothing is generated)."""
        body = {"model": self.model, "prompt": [context + c for c in continuations],
                "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
        choices = sorted(self._request("POST", "/v1/completions", body)["choices"],
                         key=lambda c: c["index"])
        if len(choices) != len(continuations):
            raise EndpointError(0, f"asked to score {len(continuations)} prompts, got "
                                   f"{len(choices)} choices")
        return [_continuation_logprob(c.get("logprobs") or {}, len(context)) for c in choices]

    def commit(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
               continue_turn: bool = False) -> None:
        """Computes ``prompt`` (or the chat ``messages``; ``continue_turn``: the last one is an
        open assistant turn) once, so that it sits in the server's prefix cache for the
        requests that follow. One token is generated: the cheapest request every
        OpenAI-compatible server accepts."""
        params: dict[str, Any] = {"max_tokens": 1, "temperature": 0}
        if continue_turn:
            params.update(continue_final_message=True, add_generation_prompt=False)
        if messages is not None:
            self.chat(messages, params)
        elif prompt is not None and len(prompt) >= MIN_COMMIT_CHARS:
            self.complete(prompt, params)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            r = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise EndpointError(0, f"{method} {self.base_url}{path}: {e}") from e
        if r.status_code >= 400:
            raise _error_of(r)
        return r.json()


def _first_choice(response: dict[str, Any], text_of: Callable[[dict], str]) -> dict[str, Any]:
    choice = response["choices"][0]
    return {"text": text_of(choice), "finish_reason": choice.get("finish_reason"),
            "response": response}


def _error_of(r: httpx.Response) -> EndpointError:
    """The server's own message: OpenAI's ``{"error": {"message"}}``, Anthropic's
    ``{"error": {"type", "message"}}`` and FastAPI's ``{"detail"}`` alike."""
    try:
        body = r.json()
    except ValueError:
        return EndpointError(r.status_code, r.text[:500] or r.reason_phrase)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return EndpointError(r.status_code, str(error["message"]), body)
    if isinstance(body, dict) and "detail" in body:
        return EndpointError(r.status_code, str(body["detail"]), body)
    return EndpointError(r.status_code, str(body)[:500], body)


def _deltas(lines: Iterator[str]) -> Iterator[str]:
    """Text pieces of an SSE stream of completion or chat chunks; an error event raises."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise EndpointError(0, str(chunk["error"].get("message", chunk["error"])), chunk)
        for choice in chunk.get("choices") or ():
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            if piece:
                yield piece


def _continuation_logprob(logprobs: dict[str, Any], boundary: int) -> Scored:
    """Sums the logprobs of the tokens that end past ``boundary`` (a character offset).
    ``text_offset`` says where each token starts; without it the token strings are summed."""
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    offsets = logprobs.get("text_offset") or _running_offsets(tokens)
    total, count = 0.0, 0
    for token, value, start in zip(tokens, values, offsets):
        if start + len(token) > boundary:
            if value is None:  # the first token of a prompt has no logprob
                raise EndpointError(0, "the server returned no logprob for a scored token")
            total += value
            count += 1
    return Scored(total, count)


def _running_offsets(tokens: Sequence[str]) -> list[int]:
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return offsets


def _probe_prompt_logprobs(endpoint: Endpoint) -> bool:
    """An ``echo`` request with ``max_tokens: 0``: a server that scores prompts answers with
    a number for the second prompt token; others refuse it or answer nulls."""
    body = {"model": endpoint.model, "prompt": "The sky is blue", "echo": True,
            "logprobs": 1, "max_tokens": 0}
    try:
        choice = endpoint._request("POST", "/v1/completions", body)["choices"][0]
    except (EndpointError, KeyError, IndexError, TypeError):
        return False
    values = (choice.get("logprobs") or {}).get("token_logprobs") or []
    return len(values) > 1 and all(isinstance(v, (int, float)) for v in values[1:])


_PROBES: dict[str, Callable[[Endpoint], bool]] = {"prompt_logprobs": _probe_prompt_logprobs}
