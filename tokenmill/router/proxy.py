"""Forwarding one request to a worker: choose, send, retry before the first byte, relay.

A request's body is read and parsed once (for the route key) and forwarded as the same bytes.
The policy chooses among the healthy candidates for its ``model``; a worker that cannot be
reached, times out, or answers 5xx before any byte reached the client is replaced by another
(up to ``max_retries``), so a queue-full 503 spills to the other workers. A worker's own 4xx
is its answer and passes through unchanged. Once bytes have reached the client nothing can be
retried: a stream that breaks then ends with an SSE error event and ``[DONE]``, so a client
never mistakes a truncated answer for a whole one.

The data path uses aiohttp's client, not httpx: on the 2-core test machine httpx cost 1.6 ms
of CPU per proxied request and aiohttp 0.15 ms (benchmarks/router.py overhead), and that cost
is the router's whole overhead. Health checks, a few requests a second, use httpx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.router.config import RouterConfig
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import Policy, RouteKey
from tokenmill.router.workers import Worker, WorkerPool

log = logging.getLogger("tokenmill.router")

# Per-connection headers (RFC 9110 7.6.1) never cross a proxy; content-length is recomputed and
# the upstream's server/date would duplicate ours.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "proxy-connection", "te", "trailer", "trailers", "transfer-encoding",
                         "upgrade", "host", "content-length"})
_NOT_RETURNED = _HOP_BY_HOP | {"server", "date", "content-encoding"}
WORKER_HEADER = "x-tokenmill-worker"
# What a worker's failure looks like on the client side: refused or lost connections, broken
# bodies (aiohttp.ClientPayloadError is a ClientError) and timeouts.
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def openai_error(status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    """An error the router itself answers, in the shape OpenAI clients parse."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# ----- the route key ----------------------------------------------------------------------------

def parse_body(body: bytes, content_type: str | None) -> dict[str, Any] | None:
    """The JSON object of a request, None for an empty or non-JSON (e.g. multipart) one.
    Raises ValueError for a body that claims to be JSON and is not."""
    if not body or (content_type and "json" not in content_type.lower()):
        return None
    payload = json.loads(body)
    return payload if isinstance(payload, dict) else None


def content_text(content: Any) -> str:
    """A message's content as text: a string, or its parts' texts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    return "".join(f"<|{m.get('role', '')}|>{content_text(m.get('content'))}\n"
                   for m in messages if isinstance(m, dict))


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p if isinstance(p, str) else json.dumps(p) for p in prompt)
    return ""


def responses_text(payload: dict[str, Any]) -> str:
    """The Responses API's instructions and input, rendered as chat messages."""
    system = payload.get("instructions")
    messages = [{"role": "system", "content": system}] if isinstance(system, str) else []
    items = payload.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return messages_text(messages + (items if isinstance(items, list) else []))


def prompt_ids(prompt: Any) -> list[int] | None:
    """A completion prompt given as token ids (one list, or the first of a batch)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


def route_key(payload: dict[str, Any] | None, path: str) -> RouteKey:
    """What the policy routes on: the model, and the prompt rendered canonically."""
    if payload is None:
        return RouteKey(model=None, text="")
    if "messages" in payload:
        text = messages_text(payload["messages"])
    elif path.endswith("/responses"):
        text = responses_text(payload)
    else:
        text = prompt_text(payload.get("prompt", payload.get("input")))
    salt = payload.get("cache_salt")
    model = payload.get("model")
    return RouteKey(model=model if isinstance(model, str) else None,
                    text=salt + text if isinstance(salt, str) else text,
                    token_ids=prompt_ids(payload.get("prompt")))


def tokenize_body(payload: dict[str, Any]) -> dict[str, Any] | None:
    """A worker's ``/tokenize`` request for the prompt of ``payload``, as the worker will render
    it (chat template, tools); None when there is no single text prompt to tokenize."""
    body: dict[str, Any] = {"model": payload.get("model")}
    if isinstance(payload.get("messages"), list):
        body["messages"] = payload["messages"]
        for name in ("tools", "chat_template", "chat_template_kwargs", "add_generation_prompt"):
            if payload.get(name) is not None:
                body[name] = payload[name]
        return body
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch: route on its first prompt
    if isinstance(prompt, str):
        return {**body, "prompt": prompt}
    return None


# ----- headers ----------------------------------------------------------------------------------

def upstream_headers(headers: Any, worker_api_key: str | None) -> dict[str, str]:
    """The client's headers as a worker gets them: per-connection ones dropped, compression
    refused (the relay must read SSE events), the worker's own key when one is set."""
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}
    out = {k: v for k, v in out.items() if k.lower() != "accept-encoding"}
    if worker_api_key:
        out = {k: v for k, v in out.items() if k.lower() != "authorization"}
        out["authorization"] = f"Bearer {worker_api_key}"
    out["accept-encoding"] = "identity"
    return out


def downstream_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _NOT_RETURNED}


# ----- relaying ---------------------------------------------------------------------------------

def sse_error_event(message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None,
                       "code": "upstream_disconnected"}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def event_boundary(buf: bytes) -> int:
    """Where the last complete SSE event in ``buf`` ends (0: none yet). Relaying whole events
    only lets a broken stream end cleanly with an error event instead of half an event."""
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := buf.rfind(sep)) >= 0]
    return max(ends, default=0)


@dataclass(eq=False)
class Lease:
    """One dispatch of a request to a worker: holds its in-flight count and the upstream
    response until the relay ends, however it ends."""

    worker: Worker
    started: float  # the router received the request (perf_counter)
    on_release: Callable[[Lease], None]
    response: aiohttp.ClientResponse | None = None
    status: int | None = None  # what the client got from this try, if anything
    broken: bool = False
    _released: bool = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.worker.in_flight -= 1
        if self.response is not None:
            self.response.release()  # back to the pool when read whole, else closed
        self.on_release(self)


class RelayResponse(StreamingResponse):
    """A streaming response that releases its lease even if it never starts (the client left
    before the first chunk): a generator's ``finally`` would not run then."""

    def __init__(self, content: AsyncIterator[bytes], lease: Lease, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.lease.release()


async def relay_events(lease: Lease, pool: WorkerPool, chunks: AsyncIterator[bytes],
                       first: bytes) -> AsyncIterator[bytes]:
    """The worker's stream as it arrives, a whole SSE event at a time; ``first``: what was
    read of it before the client was answered."""
    pending = b""
    try:
        async for chunk in _prepend(first, chunks):
            pending += chunk
            cut = event_boundary(pending)
            if cut:
                yield pending[:cut]
                pending = pending[cut:]
    except UPSTREAM_ERRORS as e:
        lease.broken = True
        pool.record_failure(lease.worker)
        log.warning("stream from %s broke: %r", lease.worker.url, e)
        yield sse_error_event(f"the worker serving this request failed mid-stream ({e!r}); "
                              "the output above is incomplete")
        return
    if pending:
        yield pending


async def _prepend(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in chunks:
        yield chunk


@dataclass
class _Failed:
    """A try that produced nothing for the client; ``answer``: the worker's own 5xx, kept in
    case no other worker does better."""

    answer: Response | None = None


class Proxy:
    """Routes and relays requests; one per app, sharing one HTTP client."""

    def __init__(self, cfg: RouterConfig, pool: WorkerPool, policy: Policy,
                 session: aiohttp.ClientSession, metrics: RouterMetrics,
                 ensure_model: Callable[[str | None], Awaitable[Response | None]]):
        self.cfg = cfg
        self.pool = pool
        self.policy = policy
        self.session = session
        self.metrics = metrics
        self.ensure_model = ensure_model
        self._tokenize_next = 0

    async def handle(self, request: Request) -> Response:
        started = time.perf_counter()
        body = await request.body()
        try:
            payload = parse_body(body, request.headers.get("content-type"))
        except ValueError as e:
            return self.answer(openai_error(400, f"the request body is not valid JSON: {e}",
                                            code="invalid_json"), started)
        key = route_key(payload, request.url.path)
        refused = await self.ensure_model(key.model)
        if refused is not None:
            return self.answer(refused, started)
        key.under_adapter(self.pool.adapter_for(key.model))
        if self.policy.needs_tokens and key.token_ids is None and payload is not None:
            await self.tokenize(key, payload, request)
        return await self.dispatch(request, body, key, started)

    async def dispatch(self, request: Request, body: bytes, key: RouteKey,
                       started: float) -> Response:
        """Try candidates until one answers; the router's own 503 when none can."""
        tried: set[str] = set()
        fallback: Response | None = None
        for attempt in range(self.cfg.max_retries + 1):
            candidates = [w for w in self.pool.candidates(key.model) if w.url not in tried]
            if not candidates:
                break
            worker = self.policy.choose(key, candidates)
            tried.add(worker.url)
            if attempt:
                self.metrics.retries.inc()
            outcome = await self.send(worker, request, body, key, started)
            if not isinstance(outcome, _Failed):
                return outcome
            fallback = outcome.answer or fallback
        return self.answer(fallback or self.unavailable(key.model), started)

    def unavailable(self, model: str | None) -> Response:
        what = f"model `{model}`" if model else "this request"
        return openai_error(503, f"no worker is available for {what}: every one is down, "
                            "ejected or full; try again shortly", type="overloaded_error",
                            code="no_worker_available",
                            headers={"Retry-After": str(self.cfg.retry_after_s)})

    async def send(self, worker: Worker, request: Request, body: bytes, key: RouteKey,
                   started: float) -> Response | _Failed:
        """One try on ``worker``: a response for the client, or ``_Failed`` to try another."""
        url = f"{worker.url}{request.url.path}"
        if request.url.query:
            url = f"{url}?{request.url.query}"
        headers = upstream_headers(request.headers, self.cfg.worker_api_key)
        lease = Lease(worker, started, self._released)
        worker.in_flight += 1
        worker.routed += 1
        self.metrics.routed.labels(worker.url).inc()
        handed_off = False
        try:
            sent = time.perf_counter()
            lease.response = await self.session.request(
                request.method, url, data=body, headers=headers, allow_redirects=False)
            self.metrics.ttfb.observe(time.perf_counter() - sent)
            if lease.response.status >= 500:
                return await self._worker_failed(lease)
            response = await self._respond(lease)
            handed_off = isinstance(response, RelayResponse)
            self.metrics.added.observe(sent - started)
            if not lease.broken:
                self.pool.record_success(worker)
            if lease.response.status < 400:
                self.policy.on_routed(key, worker)
            return response
        except UPSTREAM_ERRORS as e:
            log.warning("worker %s failed before answering: %r", worker.url, e)
            self.pool.record_failure(worker)
            return _Failed()
        finally:
            if not handed_off:
                await lease.release()

    async def _worker_failed(self, lease: Lease) -> _Failed:
        """A 5xx before any byte reached the client: keep it in case every worker fails.
        A 503 is a full queue, not a broken worker: it does not count toward ejection."""
        assert lease.response is not None
        status = lease.response.status
        if status != 503:
            self.pool.record_failure(lease.worker)
        try:
            content = await lease.response.read()
        except UPSTREAM_ERRORS:
            return _Failed()
        return _Failed(Response(content, status_code=status,
                                headers=downstream_headers(lease.response.headers)))

    async def _respond(self, lease: Lease) -> Response:
        """Relay a stream as it comes; read a plain body whole (a body that breaks mid-way
        becomes a 502, since its status line already said success)."""
        upstream = lease.response
        assert upstream is not None
        # which worker answered: for logs, debugging and tests; clients may ignore it
        headers = {**downstream_headers(upstream.headers), WORKER_HEADER: lease.worker.url}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            # Wait for the first bytes before answering: a worker that dies before sending
            # any can still be replaced (the TransportError goes up to ``send``'s retry).
            chunks = upstream.content.iter_any()
            first = await anext(chunks, b"")
            lease.status = upstream.status
            return RelayResponse(relay_events(lease, self.pool, chunks, first), lease,
                                 status_code=upstream.status, headers=headers)
        lease.status = upstream.status
        try:
            content = await upstream.read()
        except UPSTREAM_ERRORS as e:
            lease.broken = True
            self.pool.record_failure(lease.worker)
            lease.status = 502
            return openai_error(502, f"the worker's answer broke off ({e!r})",
                                type="server_error", code="upstream_disconnected")
        return Response(content, status_code=upstream.status, headers=headers)

    def _released(self, lease: Lease) -> None:
        if lease.status is not None:
            self.metrics.requests.labels(lease.worker.url, str(lease.status)).inc()
            self.metrics.latency.observe(time.perf_counter() - lease.started)

    def answer(self, response: Response, started: float) -> Response:
        """Account for a response the router gives without a worker's success behind it."""
        self.metrics.requests.labels("", str(response.status_code)).inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        return response

    async def tokenize(self, key: RouteKey, payload: dict[str, Any], request: Request) -> None:
        """Token ids for the policy, from a candidate's ``/tokenize`` (round robin); routing
        goes on from the text alone if that fails (e.g. a worker without the route)."""
        body = tokenize_body(payload)
        candidates = self.pool.candidates(key.model)
        if body is None or not candidates:
            return
        worker = candidates[self._tokenize_next % len(candidates)]
        self._tokenize_next += 1
        headers = upstream_headers({k: v for k, v in request.headers.items()
                                    if k.lower() == "authorization"}, self.cfg.worker_api_key)
        timeout = aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s)
        try:
            async with self.session.post(f"{worker.url}/tokenize", json=body, headers=headers,
                                         timeout=timeout) as r:
                tokens = (await r.json()).get("tokens") if r.status == 200 else None
        except (*UPSTREAM_ERRORS, ValueError, AttributeError):
            return
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            key.token_ids = tokens
