"""``GET /dashboard``: a page in the server itself that shows it work, live.

The page and its script and style (``server/static/``, package data: no CDN, no build step)
hold no data and are public; the page polls ``GET /dashboard/data`` (``dashboard_data.py``),
which needs the API key when one is set. A browser cannot put a bearer token on a page it
navigates to, so the page asks for the key (or reads it from the URL's ``#key=`` fragment,
which never reaches a server or its logs) and sends it on each poll. A content security
policy confines the page to this server.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.dashboard_data import DashboardView
from tokenmill.server.metrics import ServerMetrics

_ASSETS = {"dashboard.js": "text/javascript; charset=utf-8",
           "dashboard.css": "text/css; charset=utf-8"}
# Routes anyone may fetch when an API key is set: code and style, never figures.
DASHBOARD_PUBLIC_PATHS = frozenset({"/dashboard", *(f"/dashboard/{n}" for n in _ASSETS)})
# Everything the page loads or calls comes from this server; nothing runs inline.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def asset(name: str) -> bytes:
    """A file of the page (``dashboard.html``, ``.js``, ``.css``), as shipped."""
    return resources.files("tokenmill.server").joinpath("static", name).read_bytes()


def add_dashboard_routes(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics,
                         model_name: str, show_prompts: bool = False) -> None:
    """``/dashboard``, its two assets, and ``/dashboard/data``."""
    view = DashboardView(engine, metrics, model_name, show_prompts)
    page = asset("dashboard.html")
    files = {name: asset(name) for name in _ASSETS}

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    @app.get("/dashboard/data")
    async def dashboard_data() -> Response:
        return JSONResponse(view.data(), headers={"Cache-Control": "no-store"})

    for name, media_type in _ASSETS.items():
        _add_asset(app, name, files[name], media_type)


def _add_asset(app: FastAPI, name: str, body: bytes, media_type: str) -> None:
    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)

    app.add_api_route(f"/dashboard/{name}", serve, methods=["GET"], include_in_schema=False)
