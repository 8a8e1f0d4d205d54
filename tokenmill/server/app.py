"""The FastAPI app (``create_app``) and ``run_server`` (uvicorn, graceful SIGTERM)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import logging
import signal
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.engine.async_engine import (AsyncEngine, EngineOverloadedError,
                                           EngineUnavailableError, RequestFailedError)
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.params import SamplingParams
from tokenmill.request import PromptError, check_vocabulary
from tokenmill.server.limits import RequestLimits
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.openapi import install_openapi
from tokenmill.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, FieldError, TokenizeRequest)
from tokenmill.server.responses import add_responses_routes
from tokenmill.server.serving import OpenAIServing

logger = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None
    shutdown_timeout: float = 30.0  # seconds running requests get to finish after SIGTERM
    tool_call_parser: str = "hermes"  # the model family's tool-call syntax (tool_parsers.py)
    limits: RequestLimits = field(default_factory=RequestLimits)
    public_metrics: bool = False  # /metrics without the API key (for a scraper without one)
    step_timeout: float = 60.0  # a step running longer turns /health into 503


# Routes anyone may call when an API key is set: liveness and what the server is, nothing about
# its state or its model's output.
_PUBLIC_PATHS = frozenset({"/health", "/version", "/openapi.json", "/docs", "/redoc",
                           "/docs/oauth2-redirect"})


def create_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """An app serving ``engine`` (an ``LLMEngine``); its loop starts with the app's lifespan."""
    metrics = ServerMetrics(settings.model_name)
    async_engine = AsyncEngine(engine, settings.max_queued_requests, listener=metrics)
    metrics.attach(async_engine)
    serving = OpenAIServing(async_engine, settings.model_name, metrics,
                            settings.tool_call_parser, settings.limits)
    watchdog = _Watchdog(async_engine, settings.step_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        watch = asyncio.create_task(watchdog.run())
        info = engine.info
        logger.info("tokenmill %s serving %s at http://%s:%d (KV cache %d tokens, %s: %s, "
                    "max_model_len %d, %s: %s, attention %s)", tokenmill.__version__,
                    settings.model_name, settings.host, settings.port, info.kv_cache_tokens,
                    info.kv_cache_dtype, info.kv_cache_dtype_reason, info.max_model_len,
                    info.dtype, info.dtype_reason, info.attention_backend)
        yield
        watch.cancel()
        await async_engine.shutdown(settings.shutdown_timeout)
        serving.close()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    app.state.engine = async_engine
    app.state.serving = serving
    _install_error_handlers(app)
    app.add_middleware(_BodyLimit, max_bytes=settings.limits.max_body_bytes)
    if settings.api_key:
        public = _PUBLIC_PATHS | ({"/metrics"} if settings.public_metrics else set())
        app.add_middleware(_BearerAuth, api_key=settings.api_key, public=public)
    _add_routes(app, serving, metrics, settings, watchdog)
    add_responses_routes(app, serving)
    install_openapi(app)
    return app


def _add_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics,
                settings: ServerSettings, watchdog: _Watchdog) -> None:
    engine = serving.engine

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    created = int(time.time())

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": created,
                "owned_by": "tokenmill", "root": settings.model_name,
                "max_model_len": serving.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        serving.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health(raw: Request, generate: bool = False):
        """200 ``{"status": "ok"}`` while the engine loop lives and no step has overrun
        ``--step-timeout``, else 503 ``{"status": "unhealthy", "reason": ...}``. With
        ``generate=true`` (which needs the API key when one is set: it runs the model) a
        one-token generation must come back too; a server too busy to run it now (its queue
        full, or other work ahead of it past the timeout while steps go on) answers 200
        ``{"status": "busy"}``: a liveness probe must not restart a server for being busy."""
        if generate and settings.api_key and not _key_matches(
                raw.headers.get("authorization", "").encode("latin-1"), settings.api_key):
            raise _auth_error()
        problem = watchdog.problem()
        if problem is None and generate:
            status, problem = await _probe(engine, settings.step_timeout)
            if status == "busy":
                return JSONResponse({"status": "busy", "reason": problem})
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/server_info")
    async def server_info():
        """How this engine runs: dtype and why, attention backend, the CPU it found, sizes."""
        stats = engine.snapshot.stats
        return {"version": tokenmill.__version__, **dataclasses.asdict(engine.info),
                "threads": torch.get_num_threads(),
                "kv_cache_blocks": {"total": stats.num_blocks, "free": stats.num_free_blocks,
                                    "prefix_cached": stats.num_cached_blocks}}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return await serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)

        def decode() -> str:  # a 32 MB body holds millions of ids: off the event loop
            check_vocabulary(req.tokens, serving.vocab_size, "tokens")
            return serving.tokenizer.decode(req.tokens)

        try:
            return {"prompt": await serving.off_loop(decode)}
        except PromptError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None

    @app.post("/flush_cache")
    async def flush_cache():
        if engine.num_active:
            raise APIError(400, "cannot flush the prefix cache while requests are running",
                           code="requests_running")
        try:
            blocks = await engine.flush_prefix_cache()
        except RuntimeError as e:  # a request arrived in between
            raise APIError(400, str(e), code="requests_running") from None
        return {"flushed_blocks": blocks}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ----- errors -----------------------------------------------------------------------------------

def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        return _error_response(_validation_api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), kind,
                                        headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):  # a bug: still answer in OpenAI's shape
        logger.exception("internal error")
        return _error_response(APIError(500, f"internal error: {type(e).__name__}",
                                        "server_error"))


def _validation_api_error(e: RequestValidationError) -> APIError:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}", param=None,
                        code="invalid_json")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # our own checks name the field themselves
        return APIError(400, str(cause), param=cause.param, code="invalid_value")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Union types report the branch tried ("prompt.str"); the field is the first element.
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    msg = first.get("msg", "invalid value")
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        msg = "the body must be a JSON object"
    return APIError(400, f"{where}: {msg}", param=param, code="invalid_value")


class _BearerAuth:
    """Pure ASGI middleware: every route but the ``public`` ones needs ``Authorization: Bearer
    <key>`` (compared in constant time)."""

    def __init__(self, app, api_key: str, public: frozenset[str]):
        self.app = app
        self.expected = api_key.encode()
        self.public = public

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not _key_matches(given, self.expected):
                await _error_response(_auth_error())(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _key_matches(authorization: bytes, api_key: bytes | str) -> bool:
    """Whether an Authorization header is ``Bearer <api_key>`` (the key compared in constant
    time; the scheme's case does not matter, RFC 9110)."""
    expected = api_key.encode() if isinstance(api_key, str) else api_key
    scheme, _, key = authorization.partition(b" ")
    return hmac.compare_digest(key.strip(), expected) and scheme.lower() == b"bearer"


def _auth_error() -> APIError:
    return APIError(401, "Incorrect or missing API key: send Authorization: Bearer <key>",
                    "authentication_error", None, "invalid_api_key")


class _BodyLimit:
    """Pure ASGI middleware: a body over ``max_bytes`` is answered 413 as soon as its declared
    length says so, without reading it; a body without a length (chunked) is read up to the
    limit first."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:  # the HTTP server delivers no more than it declares
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks, size, message = [], 0, {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        err = APIError(413, f"the request body is larger than this server takes "
                       f"({self.max_bytes} bytes, --max-request-bytes)", param=None,
                       code="request_too_large")
        await _error_response(err)(scope, receive, send)


class _Watchdog:
    """Watches the engine loop: a step running longer than ``step_timeout`` s (a hung kernel,
    a stuck lock) makes /health answer 503 until it ends; a loop that died is logged once."""

    def __init__(self, engine: AsyncEngine, step_timeout: float):
        self.engine = engine
        self.step_timeout = step_timeout
        self.healthy = True  # as of the last check (for the log lines)

    def problem(self) -> str | None:
        """Why /health answers 503 now (read at each call), or None."""
        if not self.engine.is_alive:
            why = self.engine.error or "the server is shutting down"
            return f"the engine has stopped: {why}"
        running = self.engine.step_seconds
        if running > self.step_timeout:
            return f"an engine step has run for {running:.1f}s (--step-timeout " \
                   f"{self.step_timeout:g}s)"
        return None

    async def run(self) -> None:
        reported_dead = False
        while True:
            await asyncio.sleep(min(1.0, self.step_timeout / 4))
            running = self.engine.step_seconds
            stalled = running > self.step_timeout
            if stalled and self.healthy:
                logger.error("watchdog: an engine step has run for %.0fs (--step-timeout "
                             "%.0fs); /health answers 503 until it ends", running,
                             self.step_timeout)
            elif not stalled and not self.healthy:
                logger.warning("watchdog: the engine step ended; healthy again")
            self.healthy = not stalled
            if not self.engine.is_alive and not reported_dead:
                logger.error("watchdog: the engine loop is not running; /health answers 503")
                reported_dead = True


async def _probe(engine: AsyncEngine, timeout: float) -> tuple[str, str | None]:
    """A one-token generation through the whole engine (``/health?generate=true``): ``("ok",
    None)`` once it came back, ``("busy", why)`` when the server is too busy to run it now
    (steps go on), else ``("unhealthy", why)``. A probe that failed with a step it shared
    with a failing request runs once more: that request is gone by then."""
    why = None
    for _ in range(2):
        status, why = await _probe_once(engine, timeout)
        if status != "failed":
            return status, why
    return "unhealthy", why


async def _probe_once(engine: AsyncEngine, timeout: float) -> tuple[str, str | None]:
    token = engine.tokenizer.bos_token_id
    steps = engine.snapshot.stats.num_steps
    try:
        stream = await engine.add_request(f"health-{uuid.uuid4().hex}",
                                          [token if token is not None else 0],
                                          SamplingParams(max_tokens=1, temperature=0.0))
    except EngineOverloadedError:
        return "busy", "the request queue is full"
    except EngineUnavailableError as e:
        return "unhealthy", str(e)
    try:
        async with asyncio.timeout(timeout):
            async for out in stream:
                if out.finished:
                    return "ok", None
    except TimeoutError:
        if engine.snapshot.stats.num_steps > steps:  # working, just not on the probe yet
            return "busy", f"the probe's generation waited over {timeout:g}s behind others"
        return "unhealthy", f"no engine step completed in {timeout:g}s"
    except RequestFailedError as e:
        return "failed", f"the probe's generation failed: {e}"
    except EngineUnavailableError as e:
        return "unhealthy", str(e)
    finally:
        stream.abort()
    return "unhealthy", "the probe's generation ended without a result"


# ----- running ----------------------------------------------------------------------------------

def run_server(engine, settings: ServerSettings, log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM; running requests get ``shutdown_timeout`` s; returns 0."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(engine, settings)
    # The engine drains first (stop taking requests, let running ones finish, then end the
    # rest with an error each client is told); uvicorn's own wait for connections only needs
    # to cover the last bytes of those responses.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout) + 5,
                            access_log=False)
    server = _DrainingServer(config, app.state.engine, settings.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it is done; a no-op handler makes a
    # graceful SIGTERM exit with status 0 instead of dying of the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    # What exists now (model, tokenizer, app) lives as long as the server: kept out of the
    # collector's view, a full collection no longer walks it (~100 ms with the GIL held, which
    # stalls the step loop and every stream meanwhile) and runs in well under a millisecond.
    gc.collect()
    gc.freeze()
    server.run()
    return 0 if server.started else 1


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains the engine while connections stay open."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_seconds: float):
        super().__init__(config)
        self.engine = engine
        self.drain_seconds = drain_seconds

    async def shutdown(self, sockets=None) -> None:
        logger.info("shutting down: finishing running requests (up to %.0fs)",
                    self.drain_seconds)
        await self.engine.drain(self.drain_seconds)
        await super().shutdown(sockets)
