"""The FastAPI app (``create_app``) and ``run_server`` (uvicorn, graceful SIGTERM)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.info import format_plan
from tokenmill.engine.kv_publisher import advertised
from tokenmill.request import PromptError, check_vocabulary
from tokenmill.server.anthropic import add_anthropic_routes
from tokenmill.server.dashboard import DASHBOARD_PUBLIC_PATHS, add_dashboard_routes
from tokenmill.server.embeddings import add_pooling_routes
from tokenmill.server.health import Watchdog, probe
from tokenmill.server.limits import RequestLimits
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.middleware import (
    BearerAuth,
    BodyLimit,
    auth_error,
    error_response,
    key_matches,
)
from tokenmill.server.models import add_model_routes
from tokenmill.server.observe import ObservedPipeline, ObserveMiddleware, Observer
from tokenmill.server.observe_args import ObserveSettings, observe_settings
from tokenmill.server.openapi import install_openapi
from tokenmill.server.pipeline import RequestPipeline
from tokenmill.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeRequest,
    field_error,
)
from tokenmill.server.reasoning import get_reasoning_parser
from tokenmill.server.responses import add_responses_routes
from tokenmill.server.serving import OpenAIServing

if TYPE_CHECKING:
    from tokenmill.engine.core_client import EngineCoreClient
    from tokenmill.engine.llm_engine import LLMEngine

logger = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None
    shutdown_timeout: float = 30.0  # seconds running requests get to finish after SIGTERM
    tool_call_parser: str = "hermes"  # the model family's tool-call syntax (tools/parsers.py)
    # The model family's thinking tags (server/reasoning.py); None: answers are not split.
    reasoning_parser: str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    public_metrics: bool = False  # /metrics without the API key (for a scraper without one)
    step_timeout: float = 60.0  # a step running longer turns /health into 503
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (--allow-runtime-lora)
    allow_runtime_lora: bool = False
    # tracing, the request log and dumps (server/observe.py); all off by default
    observe: ObserveSettings = field(default_factory=ObserveSettings)
    metrics_prefix: str = "tokenmill"  # /metrics names are <prefix>:<name> (vllm: vLLM's own)
    dashboard_show_prompts: bool = False  # /dashboard lists the start of each prompt

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_name: str, limits: RequestLimits,
                  dashboard: dict) -> ServerSettings:
        """``tokenmill serve``'s settings from its flags (limits and dashboard ones parsed)."""
        return cls(
            model_name=model_name, host=args.host, port=args.port,
            api_key=args.api_key or os.environ.get("TOKENMILL_API_KEY") or None,
            max_queued_requests=args.max_queued_requests,
            shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
            limits=limits, reasoning_parser=args.reasoning_parser,
            public_metrics=args.public_metrics, step_timeout=args.step_timeout,
            allow_runtime_lora=args.allow_runtime_lora or os.environ.get(
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("true", "1"),
            observe=observe_settings(args), **dashboard)


# Seconds an idle keep-alive connection stays open (uvicorn's default is 5: see run_server)
KEEP_ALIVE_S = 30

# Routes anyone may call when an API key is set: liveness and what the server is, nothing about
# its state or its model's output.
_PUBLIC_PATHS = frozenset({"/health", "/version", "/openapi.json", "/docs", "/redoc",
                           "/docs/oauth2-redirect"})


def create_app(engine: LLMEngine | EngineCoreClient, settings: ServerSettings) -> FastAPI:
    """An app serving ``engine``: an ``LLMEngine``, or with ``--engine-process`` the client of
    one in its own process (``engine/core_client.py``); its loop starts with the app's
    lifespan."""
    metrics = ServerMetrics(settings.model_name, settings.metrics_prefix)
    async_engine = AsyncEngine(engine, settings.max_queued_requests, listener=metrics)
    metrics.attach(async_engine)
    observer = Observer.build(settings.observe, async_engine, settings.model_name)  # None: off
    pipeline = (ObservedPipeline if observer else RequestPipeline)(
        async_engine, settings.model_name, metrics, settings.tool_call_parser, settings.limits)
    watchdog = Watchdog(async_engine, settings.step_timeout)
    app = FastAPI(title="tokenmill", version=tokenmill.__version__,
                  lifespan=_lifespan(pipeline, watchdog, settings, observer))
    app.state.engine = async_engine
    app.state.pipeline = pipeline
    app.state.watchdog = watchdog
    _install_error_handlers(app)
    if observer is not None:  # innermost: sees requests past the key and the size limit
        app.add_middleware(ObserveMiddleware, observer=observer)
    app.add_middleware(BodyLimit, max_bytes=settings.limits.max_body_bytes)
    if settings.api_key:
        public = _PUBLIC_PATHS | DASHBOARD_PUBLIC_PATHS | (
            {"/metrics"} if settings.public_metrics else set())
        app.add_middleware(BearerAuth, api_key=settings.api_key, public=public)
    reasoning = get_reasoning_parser(settings.reasoning_parser) \
        if settings.reasoning_parser else None
    serving = OpenAIServing(pipeline, reasoning)
    _add_generation_routes(app, serving)
    add_responses_routes(app, pipeline, serving.reasoning_setup)
    add_anthropic_routes(app, pipeline, reasoning)
    add_pooling_routes(app, pipeline)
    add_model_routes(app, pipeline.models, settings.allow_runtime_lora)
    _add_health_routes(app, async_engine, settings, watchdog)
    _add_admin_routes(app, pipeline, metrics)
    add_dashboard_routes(app, async_engine, metrics, settings.model_name,
                         settings.dashboard_show_prompts)
    install_openapi(app)
    return app


def _lifespan(pipeline: RequestPipeline, watchdog: Watchdog, settings: ServerSettings,
              observer: Observer | None = None
              ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The engine loop and the watchdog run while the app does; at the end the engine drains
    (running requests get ``shutdown_timeout``) before the worker pool closes."""
    engine = pipeline.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watch = asyncio.create_task(watchdog.run())
        if observer is not None:
            observer.start(watchdog)
        _log_start(engine, settings)
        yield
        watch.cancel()
        if observer is not None:
            observer.stop_watching()  # a clean stop is no crash to dump
        await engine.shutdown(settings.shutdown_timeout)
        pipeline.close()
        if observer is not None:
            await observer.close()

    return lifespan


def _log_start(engine: AsyncEngine, settings: ServerSettings) -> None:
    info = engine.info
    logger.info("tokenmill %s serving %s at http://%s:%d (KV cache %d tokens, %s: %s, "
                "max_model_len %d, %s: %s, attention %s)", tokenmill.__version__,
                settings.model_name, settings.host, settings.port, info.kv_cache_tokens,
                info.kv_cache_dtype, info.kv_cache_dtype_reason, info.max_model_len,
                info.dtype, info.dtype_reason, info.attention_backend)
    if info.plan:  # built before logging was set up: its own log line went nowhere
        logger.info("%s", format_plan(info.plan))


# ----- routes -----------------------------------------------------------------------------------

def _add_generation_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Completions, chat, and the tokenizer's two directions."""
    pipeline = serving.pipeline

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return await serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        pipeline.resolve_model(req.model)

        def decode() -> str:  # a 32 MB body holds millions of ids: off the event loop
            check_vocabulary(req.tokens, pipeline.vocab_size, "tokens")
            return pipeline.tokenizer.decode(req.tokens)

        try:
            return {"prompt": await pipeline.off_loop(decode)}
        except PromptError as e:
            raise field_error(e) from None


def _add_health_routes(app: FastAPI, engine: AsyncEngine, settings: ServerSettings,
                       watchdog: Watchdog) -> None:
    @app.get("/health")
    async def health(raw: Request, generate: bool = False):
        """200 ``{"status": "ok"}`` while the engine loop lives and no step has overrun
        ``--step-timeout``, else 503 ``{"status": "unhealthy", "reason": ...}``. With
        ``generate=true`` (which needs the API key when one is set: it runs the model) a
        one-token generation must come back too; a server too busy to run it now (its queue
        full, or other work ahead of it past the timeout while steps go on) answers 200
        ``{"status": "busy"}``: a liveness probe must not restart a server for being busy."""
        if generate and settings.api_key and not key_matches(
                raw.headers.get("authorization", "").encode("latin-1"), settings.api_key):
            raise auth_error()
        problem = watchdog.problem()
        if problem is None and generate:
            status, problem = await probe(engine, settings.step_timeout)
            if status == "busy":
                return JSONResponse({"status": "busy", "reason": problem})
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}


def _threads(plan: dict | None) -> int:
    """The forward's threads: the plan's count, as the engine (perhaps in its own process)
    runs it; where the plan has none (a GPU's forward), torch's setting in this process if
    the engine runs here (0 behind an engine process: this process has no torch)."""
    count = ((plan or {}).get("threads") or {}).get("count")
    if count:
        return count
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 0


def _add_admin_routes(app: FastAPI, pipeline: RequestPipeline, metrics: ServerMetrics) -> None:
    """What the engine is and holds: its facts, its prefix cache, its metrics."""
    engine = pipeline.engine

    @app.get("/server_info")
    async def server_info(request: Request):
        """How this engine runs: every ``EngineInfo`` field (dtype and why, attention backend,
        the load-time plan, the CPU it found, sizes), the task it serves, threads and KV blocks
        now. KV-event endpoints bound on every interface are given with the host this request
        reached the server by, which a client can connect to."""
        stats = engine.snapshot.stats
        kv_events = advertised(engine.info.kv_events, request.url.hostname or "127.0.0.1")
        return {"version": tokenmill.__version__, **dataclasses.asdict(engine.info),
                "task": engine.engine.task,  # generate, embed or score: the routes it answers
                "kv_events": kv_events,
                "threads": _threads(engine.info.plan),
                "kv_cache_blocks": {"total": stats.num_blocks, "free": stats.num_free_blocks,
                                    "prefix_cached": stats.num_cached_blocks}}

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

def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        return error_response(_validation_api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), kind,
                                       headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):  # a bug: still answer in OpenAI's shape
        logger.exception("internal error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}",
                                       "server_error"))


def _validation_api_error(e: RequestValidationError) -> APIError:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}", param=None,
                        code="invalid_json")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # our own checks name the field themselves
        return field_error(cause)
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Union types report the branch tried ("prompt.str"); the field is the first element.
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    msg = first.get("msg", "invalid value")
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        msg = "the body must be a JSON object"
    return APIError(400, f"{where}: {msg}", param=param, code="invalid_value")


# ----- running ----------------------------------------------------------------------------------

def run_server(engine: LLMEngine | EngineCoreClient, settings: ServerSettings,
               log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM; running requests get ``shutdown_timeout`` s; returns 0 (1
    when the executor broke: a worker process died or hung)."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(engine, settings)
    # The engine drains first (stop taking requests, let running ones finish, then end the
    # rest with an error each client is told); uvicorn's own wait for connections only needs
    # to cover the last bytes of those responses.
    # Idle keep-alive connections are closed after KEEP_ALIVE_S, longer than the 5 s after which
    # httpx-based clients (the openai client) drop theirs: with both at 5 s, a client could
    # send on a connection the server had just closed ("Server disconnected without sending a
    # response"), the server's clock having started when it sent, the client's when it read.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout) + 5,
                            timeout_keep_alive=KEEP_ALIVE_S, access_log=False)
    server = _DrainingServer(config, app.state.engine, settings.shutdown_timeout)
    # a worker process gone: the server ends, non-zero, for its supervisor to restart it
    app.state.watchdog.on_broken = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it is done; a no-op handler makes a
    # graceful SIGTERM exit with status 0 instead of dying of the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    # What exists now (model, tokenizer, app) lives as long as the server: kept out of the
    # collector's view, a full collection no longer walks it (~100 ms with the GIL held, which
    # stalls the step loop and every stream meanwhile) and runs in well under a millisecond.
    gc.collect()
    gc.freeze()
    server.run()
    if app.state.watchdog.broken:
        return 1
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
