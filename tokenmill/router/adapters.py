"""Loading and unloading LoRA adapters through the router: every worker gets the request.

Replicas behind one router serve the same adapters only if each of them loads them, so a
``POST /v1/load_lora_adapter`` or ``/v1/unload_lora_adapter`` sent to the router goes to every
healthy worker at once, not to the one a policy would pick. Once they have all answered, their
``/v1/models`` are read again: requests for a new adapter are routed to it at once (and an
unloaded one's to nobody) instead of after the next health round.

The answer is a worker's success when every worker succeeded or already had the adapter
loaded (tokenmill's ``lora_already_loaded``: a retry after a partial failure, or a replica that
restarted without it, loads it where it is missing and succeeds); otherwise the first failure
as the worker gave it (the router's 502 for a worker it could not reach), every worker's
outcome logged. A partial failure leaves the other workers as they now are; requests for the
adapter go only to the workers that list it. An ejected worker is not asked: one that comes
back with its old process still has the adapter, a restarted one does not list it, and is
sent none of its requests until it is loaded there too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
from fastapi import Request, Response

from tokenmill.router.proxy import (UPSTREAM_ERRORS, WORKER_HEADER, downstream_headers,
                                    openai_error, upstream_headers)
from tokenmill.router.workers import Worker

log = logging.getLogger("tokenmill.router")

LORA_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_ALREADY_LOADED = "lora_already_loaded"  # tokenmill's error code for a load of a loaded name


@dataclass
class WorkerAnswer:
    url: str
    status: int
    body: bytes
    headers: dict[str, str]

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def already_loaded(self) -> bool:
        try:
            error = json.loads(self.body).get("error")
        except (ValueError, AttributeError):
            return False
        return self.status == 400 and isinstance(error, dict) and \
            error.get("code") == _ALREADY_LOADED


async def broadcast(request: Request, workers: Sequence[Worker], session: aiohttp.ClientSession,
                    worker_api_key: str | None,
                    refresh: Callable[[Worker], Awaitable[None]]) -> Response:
    """Send the request to every one of ``workers`` (the healthy ones), refresh what each
    serves, and answer for all of them (see the module docstring)."""
    if not workers:
        return openai_error(503, "no worker is available to load or unload the adapter on",
                            type="overloaded_error", code="no_worker_available")
    body = await request.body()
    headers = upstream_headers(request.headers, worker_api_key)
    answers = await asyncio.gather(*(_send(session, w.url, request.url.path, body, headers)
                                     for w in workers))
    await asyncio.gather(*(refresh(w) for w in workers))
    chosen = combine(answers)
    if not all(a.ok for a in answers):
        log.warning("%s: %s", request.url.path,
                    ", ".join(f"{a.url} answered {a.status}" for a in answers))
    return Response(chosen.body, status_code=chosen.status,
                    headers={**chosen.headers, WORKER_HEADER: chosen.url})


def combine(answers: Sequence[WorkerAnswer]) -> WorkerAnswer:
    """The first failure that is not "already loaded"; else the first success; else (every
    worker had it already) the first answer."""
    failed = [a for a in answers if not a.ok and not a.already_loaded]
    return next(iter(failed or [a for a in answers if a.ok] or answers))


async def _send(session: aiohttp.ClientSession, url: str, path: str, body: bytes,
                headers: dict[str, str]) -> WorkerAnswer:
    try:
        async with session.post(f"{url}{path}", data=body, headers=headers) as r:
            return WorkerAnswer(url, r.status, await r.read(), downstream_headers(r.headers))
    except UPSTREAM_ERRORS as e:
        error = openai_error(502, f"the worker {url} could not be reached ({e!r})",
                             type="server_error", code="upstream_unreachable")
        return WorkerAnswer(url, 502, bytes(error.body), {"content-type": "application/json"})
