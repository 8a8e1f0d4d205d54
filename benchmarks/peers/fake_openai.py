"""A fake OpenAI-compatible server: no model, no torch, no tokenmill — a stand-in for "some
foreign server" (vLLM, SGLang, llama.cpp) in router tests and the router's overhead benchmark.

    python benchmarks/peers/fake_openai.py --port 8100 [--model fake] [--token-delay-s 0.01]
        [--fail-mode 503|500|drop_mid_stream] [--fail-after N] [--fail-count K]
        [--kv-role producer|consumer]

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming or not, ``n``
choices, ``usage``), ``/health``, plus ``GET /stats`` (requests seen, in flight) and ``POST
/fake/config`` (change the failure mode of a running server, so a test can break a worker and
heal it). ``/tokenize`` is deliberately absent: a router must not assume tokenmill's extras.

The text is a function of the prompt and the choice index (a hash seeds the words), so two
servers given the same request answer the same, and a test can tell choices apart. One "token"
is one word; ``usage`` counts words of the prompt and exactly ``max_tokens`` completion words.

``--kv-role`` plays one side of vLLM's prefill/decode protocol (``kv_transfer_params``) for
the router's PD mode: a ``producer`` answers a request asking ``do_remote_decode`` with the
params a decode instance would pull its blocks with; a ``consumer`` checks the params it is
given look like a producer's (400 naming ``kv_transfer_params`` if not, and for a request
asking it to produce) and counts the hand-offs. Without a role the field is ignored, as a
server without a KV connector may. Every generation body is kept (``state.received``, ``GET
/fake/received``) so a test can see what the router sent.

In a test: ``srv = start_fake(model="m", fail_mode="503"); ...; srv.close()``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

FAIL_MODES = (None, "503", "500", "drop_mid_stream")
KV_ROLES = (None, "producer", "consumer")
_KEPT_BODIES = 256  # generation bodies kept for tests, the oldest dropped first
_FAKE_BLOCK = 16  # "tokens" (words) per block in a producer's block ids
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
          "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
          "zulu").split()
_MAX_TOKENS_CAP = 4096


@dataclass
class FakeState:
    """What a running fake does and has done; mutable so a test can break and heal a worker."""

    model: str = "fake-model"
    token_delay_s: float = 0.0  # 0: as fast as the event loop goes (router overhead runs)
    fail_mode: str | None = None  # None | "503" | "500" | "drop_mid_stream"
    fail_after: int = 0  # generation requests served normally before failures start
    fail_count: int | None = None  # failures before it heals again (None: for ever)
    healthy: bool = True  # what /health answers, independent of fail_mode
    kv_role: str | None = None  # None | "producer" | "consumer"
    requests: int = 0
    in_flight: int = 0
    failed: int = 0
    failed_in_mode: int = 0  # failures since fail_mode was last set (counted against fail_count)
    handoffs: int = 0  # consumer: requests that came with a producer's kv_transfer_params
    received: list[dict] = field(default_factory=list, repr=False)  # generation bodies
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def configure(self, **opts: object) -> None:
        """Change options at run time. Setting ``fail_mode`` restarts the failure budget: unless
        ``fail_after`` comes with it, the very next request fails."""
        with self.lock:
            for key, value in opts.items():
                if key not in _OPTION_KEYS:
                    raise ValueError(f"unknown fake option {key!r}")
                setattr(self, key, value)
            if self.fail_mode not in FAIL_MODES:
                raise ValueError(f"fail_mode must be one of {FAIL_MODES}, not {self.fail_mode!r}")
            if self.kv_role not in KV_ROLES:
                raise ValueError(f"kv_role must be one of {KV_ROLES}, not {self.kv_role!r}")
            if "fail_mode" in opts:
                self.failed_in_mode = 0
                if "fail_after" not in opts:
                    self.fail_after = self.requests  # a mode set now fails the next request

    def admit(self) -> str | None:
        """Count one generation request; returns the failure it must show, if any."""
        with self.lock:
            self.requests += 1
            failing = self.fail_mode is not None and self.requests > self.fail_after
            if failing and (self.fail_count is None or self.failed_in_mode < self.fail_count):
                self.failed += 1
                self.failed_in_mode += 1
                return self.fail_mode
            return None


    def keep(self, body: dict) -> None:
        with self.lock:
            self.received.append(body)
            del self.received[:-_KEPT_BODIES]


_OPTION_KEYS = ("model", "token_delay_s", "fail_mode", "fail_after", "fail_count", "healthy",
                "kv_role")


class _DropConnection(Exception):
    """Raised inside a started response: uvicorn then closes the socket mid-body."""


class _QuietDrops(logging.Filter):
    """Hide the traceback uvicorn logs for a drop we caused on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not _is_drop(exc)


def _is_drop(exc: BaseException | None) -> bool:
    if isinstance(exc, _DropConnection):
        return True
    inner = getattr(exc, "exceptions", None)  # an ExceptionGroup from anyio's task group
    return bool(inner) and all(_is_drop(e) for e in inner)


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None,
           param: str | None = None) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _words(seed_text: str, index: int, count: int) -> list[str]:
    """``count`` words determined by the prompt and the choice index."""
    digest = hashlib.sha256(f"{index}\x00{seed_text}".encode()).digest()
    rng = random.Random(digest)
    return [" " + rng.choice(_WORDS) for _ in range(count)]


def _chat_text(messages: list[dict]) -> str:
    parts = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep their text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}: {content}\n")
    return "".join(parts)


@dataclass
class _Job:
    """One parsed generation request."""

    chat: bool
    prompt: str
    n: int
    max_tokens: int
    stream: bool
    include_usage: bool
    rid: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.split())

    def usage(self) -> dict[str, int]:
        done = self.n * self.max_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}


def _parse(body: dict, chat: bool, serial: int) -> _Job:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        prompt = _chat_text(messages)
    else:
        raw = body.get("prompt")
        if raw is None:
            raise ValueError("'prompt' is required")
        prompt = "\n".join(map(str, raw)) if isinstance(raw, list) else str(raw)
    max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    n = int(body.get("n") or 1)
    if not 1 <= max_tokens <= _MAX_TOKENS_CAP or not 1 <= n <= 16:
        raise ValueError("max_tokens must be 1..4096 and n 1..16")
    opts = body.get("stream_options") or {}
    return _Job(chat, prompt, n, max_tokens, bool(body.get("stream")),
                bool(opts.get("include_usage")), f"{'chatcmpl' if chat else 'cmpl'}-fake-{serial}")


def _envelope(job: _Job, model: str, choices: list[dict]) -> dict:
    kind = ("chat.completion" if job.chat else "text_completion")
    if job.stream and job.chat:
        kind = "chat.completion.chunk"
    return {"id": job.rid, "object": kind, "created": job.created, "model": model,
            "choices": choices}


def _full_choice(job: _Job, index: int) -> dict:
    text = "".join(_words(job.prompt, index, job.max_tokens))
    if job.chat:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": "length"}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": "length"}


def _delta_choice(job: _Job, index: int, piece: str | None, finish: str | None) -> dict:
    if job.chat:
        delta = {} if piece is None else {"content": piece}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"index": index, "text": piece or "", "logprobs": None, "finish_reason": finish}


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _events(job: _Job, model: str) -> Iterator[dict | str]:
    """Every SSE payload of a streamed answer in order: one chunk per token step with a
    piece for each choice, a finishing chunk, the usage chunk when asked, then [DONE]."""
    words = [_words(job.prompt, i, job.max_tokens) for i in range(job.n)]
    if job.chat:
        yield _envelope(job, model, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}
                                     for i in range(job.n)])
    for step in range(job.max_tokens):
        yield _envelope(job, model, [_delta_choice(job, i, words[i][step], None)
                                     for i in range(job.n)])
    yield _envelope(job, model, [_delta_choice(job, i, None, "length") for i in range(job.n)])
    if job.include_usage:
        yield {**_envelope(job, model, []), "usage": job.usage()}
    yield "[DONE]"


async def _stream(job: _Job, state: FakeState, drop: bool) -> AsyncIterator[bytes]:
    """The SSE body; with ``drop`` it stops after a few chunks and kills the connection."""
    try:
        for k, event in enumerate(_events(job, state.model)):
            if drop and k >= 3:
                raise _DropConnection()
            if state.token_delay_s and k:
                await asyncio.sleep(state.token_delay_s)
            yield _sse(event)
    finally:
        state.in_flight -= 1


async def _dropped_json(job: _Job, state: FakeState) -> AsyncIterator[bytes]:
    """Half of a non-streamed answer, then a dropped connection."""
    try:
        body = json.dumps(_envelope(job, state.model, [_full_choice(job, 0)])).encode()
        yield body[: len(body) // 2]
        raise _DropConnection()
    finally:
        state.in_flight -= 1


_HANDOFF_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
                 "remote_port")


def _kv_refusal(body: dict, state: FakeState) -> str | None:
    """Why this fake cannot take the request's ``kv_transfer_params`` (None: it can)."""
    params = body.get("kv_transfer_params")
    if params is None or state.kv_role is None:
        return None
    if not isinstance(params, dict):
        return "kv_transfer_params: must be an object"
    if params.get("do_remote_decode"):
        if state.kv_role == "consumer":
            return "kv_transfer_params: a consumer does not prefill for another instance"
        return None
    if params.get("do_remote_prefill") and state.kv_role == "consumer":
        missing = [k for k in _HANDOFF_KEYS if params.get(k) is None]
        if missing or not isinstance(params["remote_block_ids"], list):
            return f"kv_transfer_params: not a producer's hand-off (missing {missing})"
        with state.lock:
            state.handoffs += 1
    return None


def _handoff(job: _Job, body: dict, state: FakeState, port: int) -> dict | None:
    """A producer's answer to ``do_remote_decode``: where a consumer pulls the blocks."""
    params = body.get("kv_transfer_params")
    if state.kv_role != "producer" or not isinstance(params, dict) \
            or not params.get("do_remote_decode"):
        return None
    blocks = -(-job.prompt_tokens // _FAKE_BLOCK)
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": f"fake-{port}", "remote_request_id": job.rid,
            "remote_block_ids": list(range(1, blocks + 1)), "remote_host": "127.0.0.1",
            "remote_port": port, "tp_size": 1}


async def _generate(request: Request, state: FakeState, chat: bool) -> Response:
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        job = _parse(body, chat, state.requests + 1)
    except (ValueError, TypeError) as e:
        return _error(400, str(e), "invalid_request_error")
    if body.get("model") not in (None, state.model):
        return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
    state.keep(body)
    refusal = _kv_refusal(body, state)
    if refusal is not None:
        return _error(400, refusal, "invalid_request_error", param="kv_transfer_params")
    failure = state.admit()
    if failure == "503":
        return _error(503, "the server is busy: queue full", "server_busy", {"Retry-After": "1"})
    if failure == "500":
        return _error(500, "the fake failed on purpose", "internal_error")
    state.in_flight += 1
    if job.stream:
        return StreamingResponse(_stream(job, state, failure == "drop_mid_stream"),
                                 media_type="text/event-stream")
    if failure == "drop_mid_stream":
        return StreamingResponse(_dropped_json(job, state), media_type="application/json")
    try:
        if state.token_delay_s:
            await asyncio.sleep(state.token_delay_s * job.max_tokens)
        choices = [_full_choice(job, i) for i in range(job.n)]
        answer = {**_envelope(job, state.model, choices), "usage": job.usage()}
        handoff = _handoff(job, body, state, request.url.port or 0)
        if handoff is not None:
            answer["kv_transfer_params"] = handoff
        return JSONResponse(answer)
    finally:
        state.in_flight -= 1


def build_app(state: FakeState) -> FastAPI:
    """The fake's routes over ``state`` (shared with the test that holds it)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": state.model, "object": "model", "created": 0, "owned_by": "fake"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, state, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(request, state, chat=True)

    @app.get("/stats")
    async def stats() -> dict:
        return {"requests": state.requests, "in_flight": state.in_flight, "failed": state.failed,
                "handoffs": state.handoffs}

    @app.get("/fake/received")
    async def received() -> list:
        with state.lock:
            return list(state.received)

    @app.post("/fake/config")
    async def configure(request: Request) -> Response:
        try:
            state.configure(**(await request.json()))
        except (ValueError, TypeError) as e:
            return _error(400, str(e), "invalid_request_error")
        return JSONResponse({"ok": True})

    return app


class FakeServer:
    """A fake running in a background thread (its own event loop); ``close()`` stops it."""

    def __init__(self, state: FakeState, sock: socket.socket, log_level: str = "warning"):
        self.state = state
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        config = uvicorn.Config(build_app(state), log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True, name=f"fake-openai-{self.port}")

    def start(self, timeout_s: float = 10.0) -> FakeServer:
        """Start and wait until it accepts requests (uvicorn reports ``started``)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fake OpenAI server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def configure(self, **opts: object) -> None:
        """Same as ``POST /fake/config``: e.g. ``configure(fail_mode="500")`` or heal with
        ``configure(fail_mode=None)``."""
        self.state.configure(**opts)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def start_fake(port: int = 0, host: str = "127.0.0.1", **opts: object) -> FakeServer:
    """Start a fake on ``port`` (0: a free one) with ``FakeState`` options (``model``,
    ``token_delay_s``, ``fail_mode``, ``fail_after``, ``fail_count``, ``healthy``,
    ``kv_role``)."""
    state = FakeState()
    state.configure(**opts)
    logging.getLogger("uvicorn.error").addFilter(_QUIET)
    return FakeServer(state, _bind(host, port)).start()


_QUIET = _QuietDrops()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--token-delay-s", type=float, default=0.0)
    p.add_argument("--fail-mode", choices=[m for m in FAIL_MODES if m], default=None)
    p.add_argument("--fail-after", type=int, default=0)
    p.add_argument("--fail-count", type=int, default=None)
    p.add_argument("--kv-role", choices=[r for r in KV_ROLES if r], default=None)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    state = FakeState(model=args.model, token_delay_s=args.token_delay_s, fail_mode=args.fail_mode,
                      fail_after=args.fail_after, fail_count=args.fail_count, kv_role=args.kv_role)
    logging.getLogger("uvicorn.error").addFilter(_QUIET)
    print(f"fake OpenAI server ({args.model}) on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)


if __name__ == "__main__":
    main()
