"""The router's ``GET /dashboard``: the servers' own page, one row per worker.

The page, script and style are tokenmill's server's (``tokenmill/server/static/``, read as
package data: the router imports nothing of the server). ``GET /dashboard/data`` asks every
worker for its ``/dashboard/data`` at once and answers them beside what the router knows of
each (health, requests in flight, routed); a worker that does not answer (down, or not a
tokenmill server: vLLM has no such page) gets the router's figures and an error note.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.router.workers import Worker, WorkerPool

_ASSETS = {"dashboard.js": "text/javascript; charset=utf-8",
           "dashboard.css": "text/css; charset=utf-8"}
# the same confinement as the servers' page: nothing but this router
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def _asset(name: str) -> bytes:
    return resources.files("tokenmill").joinpath("server", "static", name).read_bytes()


def add_dashboard_routes(app: FastAPI, router: Any, key_check: Any) -> None:
    """``/dashboard`` and its assets (public: no figures in them) and ``/dashboard/data``
    (behind ``key_check``). ``router``: the app's ``Router`` (its pool, policy, config and,
    while running, the health monitor's HTTP client)."""
    page = _asset("dashboard.html")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    @app.get("/dashboard/data", dependencies=[key_check], include_in_schema=False)
    async def dashboard_data(request: Request) -> Response:
        assert router.monitor is not None, "the app is not running"
        auth = router.cfg.worker_api_key
        header = f"Bearer {auth}" if auth else request.headers.get("authorization")
        workers = await poll_workers(router.pool, router.monitor.client, header,
                                     router.cfg.health_check_timeout_s)
        return JSONResponse({"kind": "router", "time": time.time(),
                             "policy": router.policy.name, "workers": workers},
                            headers={"Cache-Control": "no-store"})

    for name, media_type in _ASSETS.items():
        _add_asset(app, name, _asset(name), media_type)


def _add_asset(app: FastAPI, name: str, body: bytes, media_type: str) -> None:
    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)

    app.add_api_route(f"/dashboard/{name}", serve, methods=["GET"], include_in_schema=False)


async def poll_workers(pool: WorkerPool, client: httpx.AsyncClient, authorization: str | None,
                       timeout_s: float) -> list[dict[str, Any]]:
    """Every worker's state as the router keeps it, with its ``data`` (its own
    ``/dashboard/data``, or None and an ``error``)."""
    headers = {"authorization": authorization} if authorization else {}

    async def one(w: Worker) -> dict[str, Any]:
        data, error = None, None
        try:
            r = await client.get(f"{w.url}/dashboard/data", headers=headers, timeout=timeout_s)
            if r.status_code == 200:
                data = r.json()
            else:
                error = f"its /dashboard/data answered {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            error = f"no dashboard data: {type(e).__name__}"
        return {**w.state(), "data": data, "error": error}

    return list(await asyncio.gather(*(one(w) for w in pool.all())))
