"""Prefill/decode disaggregation (``tokenmill router --pd``): vLLM's ``kv_transfer_params``
protocol, spoken over the plain router's data path (``proxy.py``: its HTTP client, retries,
relay and metrics).

A completion (``/v1/completions``, ``/v1/chat/completions``) is sent twice::

    client --body--> router
      1. a prefill worker (``--policy``; cache_aware follows the prompt): the body with
         max_tokens=1, n=1, no stream, kv_transfer_params={"do_remote_decode": true, ...}
         <- 200 whose kv_transfer_params say where its blocks of the prompt wait to be pulled
      2. a decode worker (``--decode-policy``): the client's own body plus those params; it
         pulls the blocks (an external cache hit) and computes only what they do not cover
         <- its answer, streamed or whole, relayed as any other (usage: the decode worker's)

The prefill step is retried on another prefill worker when one cannot be reached or answers
5xx, as the plain data path retries. When no prefill worker helps -- every try failed, the
answer carried no kv_transfer_params, or the worker refused the hand-off itself (a 4xx naming
``kv_transfer_params``: not started as a producer) -- the decode worker gets the plain request
and computes the prompt itself, counted in ``tokenmill_router_pd_fallbacks_total``: slower,
never wrong. Any other 4xx of a prefill worker is the client's mistake, and is its answer.
Other routes, a batch of prompts (several engine requests, no single hand-off), and prompts
shorter than ``--pd-min-prompt-tokens`` (a short prefill costs less than a hand-over, and would
queue behind long ones on a prefill worker) go to the decode workers whole.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import RouteKey
from tokenmill.router.proxy import Proxy, RelayResponse, parse_body, route_key

log = logging.getLogger("tokenmill.router")

PD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
PREFILL_HEADER = "x-tokenmill-prefill-worker"  # which prefill worker handed over (or failed)
# What a producer is asked for: keep the prompt's blocks for a consumer to pull, and say where.
PREFILL_HANDOFF: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}
# The client's fields a one-token prefill must not carry: they ask for more than one token
# (min_tokens past 1, best_of choices) or for a stream.
_NOT_PREFILLED = frozenset({"stream_options", "min_tokens", "best_of"})


def prefill_body(payload: dict[str, Any]) -> dict[str, Any]:
    """The prefill worker's request: the client's, cut to one token of one choice, whole."""
    body = {k: v for k, v in payload.items() if k not in _NOT_PREFILLED}
    body.update(max_tokens=1, stream=False, n=1, kv_transfer_params=dict(PREFILL_HANDOFF))
    if "max_completion_tokens" in payload:
        body["max_completion_tokens"] = 1
    return body


def decode_body(payload: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The decode worker's request: the client's, with the prefill worker's hand-off."""
    return {**payload, "kv_transfer_params": params}


def disaggregable(payload: dict[str, Any] | None) -> bool:
    """A JSON body of one prompt (a batch is several engine requests: no single hand-off)."""
    if payload is None:
        return False
    prompt = payload.get("prompt")
    return not (isinstance(prompt, list) and len(prompt) > 1
                and isinstance(prompt[0], (str, list)))


@dataclass
class Handoff:
    """What the prefill step came to: the decode worker's ``params``, or an ``answer`` for the
    client (a prefill worker's 4xx), or the ``fallback`` reason the decode worker computes the
    prompt itself. ``worker``: the prefill worker that answered last."""

    params: dict[str, Any] | None = None
    answer: Response | None = None
    fallback: str | None = None
    worker: str | None = None


async def read_handoff(response: Response, url: str) -> Handoff | None:
    """A prefill worker's answer as a hand-off; None: it failed, try another worker."""
    if isinstance(response, RelayResponse):  # a stream, though none was asked for
        await response.lease.release()
        return Handoff(fallback="bad_prefill_answer", worker=url)
    if response.status_code >= 500:  # its body broke off (the proxy's 502)
        return None
    try:
        answer = json.loads(response.body)
    except ValueError:
        answer = None
    if response.status_code >= 400:
        error = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(error, dict) and error.get("param") == "kv_transfer_params":
            return Handoff(fallback="prefill_refused", worker=url)
        return Handoff(answer=response, worker=url)
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if isinstance(params, dict):
        return Handoff(params=params, worker=url)
    return Handoff(fallback="no_kv_transfer_params", worker=url)


class PDProxy:
    """The router's data path in PD mode: ``prefill`` and ``decode`` are the plain proxies
    over the pool's prefill and decode workers, each with its own policy."""

    def __init__(self, prefill: Proxy, decode: Proxy, metrics: RouterMetrics):
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics

    async def handle(self, request: Request) -> Response:
        if request.method != "POST" or request.url.path not in PD_PATHS:
            return await self.decode.handle(request)
        started = time.perf_counter()
        body = await request.body()  # Starlette keeps it: decode.handle may read it again
        try:
            payload = parse_body(body, request.headers.get("content-type"))
        except ValueError:
            payload = None  # the decode path answers the 400
        if not disaggregable(payload):
            return await self.decode.handle(request)
        assert payload is not None
        key = route_key(payload, request.url.path)
        if self._short(key):
            self.metrics.pd_direct.inc()
            return await self.decode.handle(request)
        refused = await self.decode.ensure_model(key.model)
        if refused is not None:
            return self.decode.answer(refused, started)
        key.under_adapter(self.prefill.pool.adapter_for(key.model))
        if self.prefill.policy.needs_tokens and key.token_ids is None:
            await self.prefill.tokenize(key, payload, request)
        handoff = await self.prefill_step(request, payload, key, started)
        if handoff.answer is not None:
            return handoff.answer
        if handoff.params is not None:
            body = json.dumps(decode_body(payload, handoff.params)).encode()
        response = await self.decode.dispatch(request, body, key, started)
        if handoff.worker is not None:
            response.headers[PREFILL_HEADER] = handoff.worker
        return response

    def _short(self, key: RouteKey) -> bool:
        """A prompt under ``pd_min_prompt_tokens`` (counted, or 4 characters a token)."""
        limit = self.prefill.cfg.pd_min_prompt_tokens
        if not limit:
            return False
        n = len(key.token_ids) if key.token_ids is not None else len(key.text) // 4
        return n < limit

    async def prefill_step(self, request: Request, payload: dict[str, Any], key: RouteKey,
                           started: float) -> Handoff:
        body = json.dumps(prefill_body(payload)).encode()
        handoff = await self._try_prefill(request, body, key, started)
        self.metrics.pd_prefill.observe(time.perf_counter() - started)
        if handoff.fallback is not None:
            self.metrics.pd_fallbacks.labels(handoff.fallback).inc()
            # every prefill worker down is already logged as ejections; the rest is set-up
            level = logging.INFO if handoff.fallback == "prefill_unavailable" else logging.WARNING
            log.log(level, "PD: %s (prefill worker %s): the decode worker computes the prompt",
                    handoff.fallback, handoff.worker)
        return handoff

    async def _try_prefill(self, request: Request, body: bytes, key: RouteKey,
                           started: float) -> Handoff:
        """Prefill workers in the policy's order until one answers (``Proxy.dispatch``'s
        retries, but the router answers nothing itself: a failure is a fallback)."""
        tried: set[str] = set()
        for attempt in range(self.prefill.cfg.max_retries + 1):
            candidates = [w for w in self.prefill.pool.candidates(key.model)
                          if w.url not in tried]
            if not candidates:
                break
            worker = self.prefill.policy.choose(key, candidates)
            tried.add(worker.url)
            if attempt:
                self.metrics.retries.inc()
            outcome = await self.prefill.send(worker, request, body, key, started)
            if isinstance(outcome, Response):
                handoff = await read_handoff(outcome, worker.url)
                if handoff is not None:
                    return handoff
        return Handoff(fallback="prefill_unavailable")
