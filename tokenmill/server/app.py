"""The FastAPI app (``create_app``) and ``run_server`` (uvicorn, graceful SIGTERM)."""

from __future__ import annotations

import dataclasses
import hmac
import logging
import signal
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.request import PromptError, check_vocabulary
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest)
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


def create_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """An app serving ``engine`` (an ``LLMEngine``); its loop starts with the app's lifespan."""
    metrics = ServerMetrics(settings.model_name)
    async_engine = AsyncEngine(engine, settings.max_queued_requests, listener=metrics)
    metrics.attach(async_engine)
    serving = OpenAIServing(async_engine, settings.model_name, metrics,
                            settings.tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        info = engine.info
        logger.info("tokenmill %s serving %s at http://%s:%d (KV cache %d tokens, "
                    "max_model_len %d, %s: %s, attention %s)", tokenmill.__version__,
                    settings.model_name, settings.host, settings.port, info.kv_cache_tokens,
                    info.max_model_len, info.dtype, info.dtype_reason, info.attention_backend)
        yield
        logger.info("shutting down: finishing running requests (up to %.0fs)",
                    settings.shutdown_timeout)
        await async_engine.shutdown(settings.shutdown_timeout)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    app.state.engine = async_engine
    app.state.serving = serving
    _install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(_BearerAuth, api_key=settings.api_key)
    _add_routes(app, serving, metrics, settings)
    return app


def _add_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics,
                settings: ServerSettings) -> None:
    engine = serving.engine

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tokenmill", "root": settings.model_name,
            "max_model_len": serving.max_model_len}]}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/server_info")
    async def server_info():
        """How this engine runs: dtype and why, attention backend, the CPU it found, sizes."""
        return {"version": tokenmill.__version__, **dataclasses.asdict(engine.info),
                "threads": torch.get_num_threads()}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = serving.chat_prompt(req.messages, req.add_generation_prompt).ids
        else:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        try:
            check_vocabulary(req.tokens, serving.vocab_size, "tokens")
        except PromptError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        return {"prompt": serving.tokenizer.decode(req.tokens)}

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
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Union types report the branch tried ("prompt.str"); the field is the first element.
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    msg = first.get("msg", "invalid value")
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        msg = "the body must be a JSON object"
    return APIError(400, f"{where}: {msg}", param=param, code="invalid_value")


class _BearerAuth:
    """Pure ASGI middleware: every ``/v1/*`` route needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "Incorrect or missing API key: send Authorization: Bearer "
                               "<key>", "authentication_error", None, "invalid_api_key")
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----- running ----------------------------------------------------------------------------------

def run_server(engine, settings: ServerSettings, log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM; running requests get ``shutdown_timeout`` s; returns 0."""
    import uvicorn

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(engine, settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout),
                            access_log=False)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it is done; a no-op handler makes a
    # graceful SIGTERM exit with status 0 instead of dying of the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 0 if server.started else 1

