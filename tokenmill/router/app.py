"""The router's HTTP app: one OpenAI-compatible endpoint in front of the worker pool.

Routes: every ``/v1/*`` path and ``/tokenize``, ``/detokenize`` are forwarded (``proxy.py``;
in PD mode ``pd.py``, over the prefill and decode workers), but loading or unloading a LoRA
adapter goes to every worker (``adapters.py``);
``/v1/models`` lists what the healthy workers (and the model launcher) serve, their LoRA
adapters included (with their ``parent``); ``/health``,
``/metrics`` and ``/workers`` describe the router itself; ``/dashboard`` shows each worker's
figures (``dashboard.py``). The pool is ``app.state.pool``, so a
launcher can add and remove workers while the router runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.router.adapters import LORA_ADMIN_PATHS, broadcast
from tokenmill.router.config import RouterConfig
from tokenmill.router.dashboard import add_dashboard_routes
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import Policy, make_policy
from tokenmill.router.pd import PDProxy
from tokenmill.router.proxy import Proxy, openai_error
from tokenmill.router.workers import HealthMonitor, KVSubscriptions, Worker, WorkerPool

if TYPE_CHECKING:
    from tokenmill.router.kv_index import KVIndex
    from tokenmill.router.models import ModelLauncher

log = logging.getLogger("tokenmill.router")

_FORWARDED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class Refused(Exception):
    """A request the router answers itself before routing (a bad key)."""

    def __init__(self, response: Response):
        super().__init__(response.status_code)
        self.response = response


class Router:
    """What the app holds: the pool, the policy and its KV index, the launcher; the proxy and
    its HTTP client exist while the app runs (they need its event loop)."""

    def __init__(self, cfg: RouterConfig, launcher: ModelLauncher | None):
        self.cfg = cfg
        self.launcher = launcher
        self.pool = WorkerPool(cfg)
        for role, urls in (("regular", cfg.workers), ("prefill", cfg.prefill_workers),
                           ("decode", cfg.decode_workers)):
            for url in urls:
                self.pool.add(url, role=role)
        self.kv_index = _kv_index(cfg)
        # PD mode: ``policy`` chooses the prefill worker, ``decode_policy`` the decode one
        self.policy: Policy = make_policy(cfg, self.kv_index)
        self.decode_policy: Policy | None = (
            make_policy(dataclasses.replace(cfg, policy=cfg.decode_policy)) if cfg.pd else None)
        self.metrics = RouterMetrics(
            lambda: {w.url: (w.in_flight, w.healthy, w.role) for w in self.pool.all()},
            self.policy.stats)
        self.kv = (KVSubscriptions(self.kv_index, dict(cfg.kv_event_endpoints))
                   if self.kv_index is not None else None)
        self._forget_on_leave()
        self.proxy: Proxy | PDProxy | None = None
        self.session: aiohttp.ClientSession | None = None
        self.monitor: HealthMonitor | None = None

    def _forget_on_leave(self) -> None:
        """A worker ejected (often restarted, with a cold cache) or removed leaves no stale
        cache state behind in the policy or the KV index."""
        def forget(w: Worker) -> None:
            self.policy.forget_worker(w.url)
            if self.decode_policy is not None:
                self.decode_policy.forget_worker(w.url)
            if self.kv is not None:
                self.kv.forget(w.url)

        self.pool.on_eject.append(lambda w: self.metrics.ejections.labels(w.url).inc())
        self.pool.on_eject.append(forget)
        self.pool.on_remove.append(forget)

    async def ensure_model(self, model: str | None) -> Response | None:
        """None when ``model`` can be routed (starting it first if the launcher knows it);
        else the error to answer."""
        launcher = self.launcher
        known = launcher is not None and model is not None and launcher.known(model)
        if model is None:
            return None
        if not known and self.pool.candidates(model):
            return self._ambiguous(model)
        if launcher is not None and known:
            if not self.pool.candidates(model):
                refused = await self._start(model)
                if refused is not None:
                    return refused
            launcher.touch(model)
            return None
        if self.pool.knows(model):
            return None  # served, but by workers that are down: the proxy's 503
        return openai_error(404, f"The model `{model}` does not exist.", param="model",
                            code="model_not_found")

    def _ambiguous(self, model: str) -> Response | None:
        """A 400 when the healthy workers give ``model`` different base models (an adapter
        name used under two bases, or a base model's name also an adapter's): the request
        would run under whichever its worker happens to have."""
        bases = self.pool.bases_of(model)
        if len(bases) <= 1:
            return None
        return openai_error(400, f"The model `{model}` is ambiguous: the workers serve it on "
                            f"{', '.join(sorted(bases))}; name the adapter as "
                            f"`<base>:{model}`.", param="model", code="model_ambiguous")

    async def _start(self, model: str) -> Response | None:
        from tokenmill.router.models import ModelUnavailable

        assert self.launcher is not None
        try:
            await self.launcher.ensure(model, self.pool)
        except ModelUnavailable as e:
            return openai_error(getattr(e, "status", 503), str(e), type="overloaded_error",
                                code="model_unavailable",
                                headers={"Retry-After": str(getattr(e, "retry_after", 1))})
        return None

    def model_cards(self) -> list[dict[str, Any]]:
        """The healthy workers' model cards and the launcher's, one per id and parent (the
        replicas of a model list it and its adapters alike; an adapter name under two base
        models is two adapters)."""
        cards: dict[tuple[str, str | None], dict[str, Any]] = {}
        for w in self.pool.all():
            if w.healthy:
                for card in w.cards:
                    cards.setdefault(_card_key(card), card)
        for card in self.launcher.cards() if self.launcher is not None else []:
            cards.setdefault(_card_key(card), card)
        return list(cards.values())

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The HTTP client, a first health round (so the router starts knowing who is up),
        the health loop; on the way out everything closed in reverse."""
        cfg = self.cfg
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client, \
                _upstream_session(cfg) as session:
            self.proxy, self.session = self._proxy(session), session
            self.monitor = monitor = HealthMonitor(self.pool, client, self.kv)
            await monitor.probe_all(first=True)
            task = asyncio.create_task(monitor.run())
            try:
                if self.launcher is not None and hasattr(self.launcher, "preload"):
                    await self.launcher.preload(self.pool)
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await self._close()

    def _proxy(self, session: aiohttp.ClientSession) -> Proxy | PDProxy:
        """The data path: one proxy over the pool, or in PD mode one over each role."""
        def proxy(pool: WorkerPool, policy: Policy) -> Proxy:
            return Proxy(self.cfg, pool, policy, session, self.metrics, self.ensure_model)

        if self.decode_policy is None:
            return proxy(self.pool, self.policy)
        return PDProxy(proxy(self.pool.only("prefill"), self.policy),
                       proxy(self.pool.only("decode"), self.decode_policy), self.metrics)

    def healthy_counts(self) -> dict[str, int]:
        """Admitted workers per role."""
        counts: dict[str, int] = {}
        for w in self.pool.all():
            counts[w.role] = counts.get(w.role, 0) + w.healthy
        return counts

    async def _close(self) -> None:
        if self.kv is not None:
            self.kv.close()
        if self.launcher is not None:
            await self.launcher.shutdown()


def _card_key(card: dict[str, Any]) -> tuple[str, str | None]:
    parent = card.get("parent")
    return str(card["id"]), str(parent) if parent else None


def _upstream_session(cfg: RouterConfig) -> aiohttp.ClientSession:
    """The data path's client: no connection cap (the workers' own queues are the limit),
    bodies passed as they are (no decompression: the relay reads SSE events)."""
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s,
                                    sock_connect=cfg.connect_timeout_s)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 trust_env=False)


def _kv_index(cfg: RouterConfig) -> KVIndex | None:
    """Exact cache-aware routing needs the mirror of the workers' caches; other policies
    never read it, so no subscriber runs for them."""
    if not (cfg.kv_events and cfg.policy == "cache_aware"):
        return None
    from tokenmill.router.kv_index import KVIndex

    return KVIndex()


def build_app(cfg: RouterConfig, launcher: ModelLauncher | None = None) -> FastAPI:
    """The router app; it owns the pool (``app.state.pool``), the policy and the KV index."""
    router = Router(cfg, launcher)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with router.running():
            yield

    app = FastAPI(title="tokenmill router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = router
    app.state.pool = router.pool

    @app.exception_handler(Refused)
    async def refused(_: Request, e: Refused) -> Response:
        return e.response

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> Response:  # a bug: OpenAI's shape still
        log.exception("router error")
        return openai_error(500, f"the router failed: {e!r}", type="server_error",
                            code="router_error")

    key_check = Depends(_key_check(cfg.api_keys))
    _add_own_routes(app, router)
    add_dashboard_routes(app, router, key_check)
    _add_forwarded_routes(app, router, key_check)
    return app


def _key_check(keys: tuple[str, ...]) -> Callable[[Request], Awaitable[None]]:
    """A dependency that refuses a request without one of ``keys`` (none: no check)."""
    wanted = [f"Bearer {k}".encode() for k in keys]

    async def check(request: Request) -> None:
        if not wanted:
            return
        given = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not any(hmac.compare_digest(given, w) for w in wanted):
            raise Refused(openai_error(401, "Incorrect API key provided.",
                                       type="authentication_error", code="invalid_api_key"))

    return check


def _add_own_routes(app: FastAPI, router: Router) -> None:
    """What the router answers itself; /health and /metrics need no key (probes, scrapers)."""
    @app.get("/health")
    async def health() -> Response:
        counts = router.healthy_counts()
        healthy = sum(counts.values())
        # PD mode serves (slower) without prefill workers, never without decode ones
        ok = counts.get("decode", 0) > 0 if router.cfg.pd else healthy > 0
        ok = ok or bool(router.launcher and router.launcher.cards())
        body: dict[str, Any] = {"status": "ok" if ok else "unhealthy",
                                "healthy_workers": healthy}
        if router.cfg.pd:
            body["healthy_by_role"] = counts
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_forwarded_routes(app: FastAPI, router: Router, key_check: Any) -> None:
    @app.get("/workers", dependencies=[key_check])
    async def workers() -> dict[str, Any]:
        listing: dict[str, Any] = {"policy": router.policy.name,
                                   "workers": [w.state() for w in router.pool.all()]}
        if router.decode_policy is not None:  # PD mode: ``policy`` chooses prefill workers
            listing["decode_policy"] = router.decode_policy.name
        return listing

    @app.get("/v1/models", dependencies=[key_check])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": router.model_cards()}

    @app.get("/v1/models/{model_id:path}", dependencies=[key_check])
    async def model(model_id: str) -> Response:
        for card in router.model_cards():
            parent = card.get("parent")
            if model_id == card["id"] or (parent and model_id == f"{parent}:{card['id']}"):
                return JSONResponse(card)
        return openai_error(404, f"The model `{model_id}` does not exist.", param="model",
                            code="model_not_found")

    async def adapters(request: Request) -> Response:
        assert router.session is not None and router.monitor is not None, "not running"
        return await broadcast(request, [w for w in router.pool.all() if w.healthy],
                               router.session, router.cfg.worker_api_key,
                               router.monitor.learn_models)

    for path in LORA_ADMIN_PATHS:  # before the catch-all, which would send it to one worker
        app.add_api_route(path, adapters, methods=["POST"], dependencies=[key_check],
                          include_in_schema=False)

    async def forward(request: Request) -> Response:
        assert router.proxy is not None, "the app is not running"
        return await router.proxy.handle(request)

    for path in ("/v1/{path:path}", "/tokenize", "/detokenize"):
        app.add_api_route(path, forward, methods=_FORWARDED_METHODS, dependencies=[key_check],
                          include_in_schema=False)


def serve_router(cfg: RouterConfig, launcher: ModelLauncher | None = None) -> None:
    """Run the router until interrupted (blocking); the app's lifespan closes the HTTP
    client, the KV subscribers and the launcher's workers on the way out."""
    import uvicorn

    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.log_level != "debug":  # httpx logs every request at info: one line per token stream
        logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_app(cfg, launcher)
    # What exists now lives as long as the router: kept out of the collector's view, a full
    # collection (GIL held, every relay paused) walks only what requests create.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                access_log=cfg.log_level == "debug", timeout_graceful_shutdown=5)
