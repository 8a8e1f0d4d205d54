"""The router's workers: who they are, what they serve, whether to send them anything.

Each worker is an OpenAI-compatible server known by its base URL. A worker is a candidate for a
request while its circuit is closed: ``eject_after_failures`` consecutive failed health probes,
or as many consecutive failed requests (no connection, a 5xx, a broken stream), open it (the
worker is *ejected*). The two streaks are counted apart, so that a worker that answers its
probes but fails every request is still ejected. After ``eject_cooldown_s`` the health monitor
probes an ejected worker again and one good probe closes the circuit (half-open). Ejection
also forgets the worker's cache state (the policy's tree, the KV index), because a worker
that failed has often restarted with a cold cache.

The health monitor also learns what each worker serves (``GET /v1/models``, every round, so
adapters loaded or unloaded at run time show within one interval) and, for tokenmill workers
that publish KV-cache events (``GET /server_info``'s ``kv_events``), keeps a subscriber that
mirrors them into the router's ``KVIndex`` (a new one when the advertised endpoint changes, as
it does when a worker restarts on free ports).

A worker serves the ids of its model cards. A card with a ``parent`` is a LoRA adapter of that
base model (vLLM's shape, and tokenmill's): a request names it by its id or as
``<base>:<adapter>`` (``base`` the card's parent or the worker's own base model, both of which
tokenmill's server accepts), and runs under the adapter's name, which is how workers' KV events
and the router's cache keys tell adapters apart (``adapter_for``). The body goes to the worker
as the client sent it: a server that knows adapters only by their bare name (vLLM) answers
the ``<base>:<adapter>`` form with its own 404.

In PD mode (``pd.py``) every worker has a role, prefill or decode; each side's proxy sees the
pool through ``WorkerPool.only(role)``: one set of workers and breakers, two candidate lists.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from tokenmill.router.config import RouterConfig

if TYPE_CHECKING:
    from tokenmill.router.kv_index import KVEventSubscriber, KVIndex

log = logging.getLogger("tokenmill.router")


@dataclass(eq=False)
class Worker:
    """One worker as the router sees it; ``in_flight`` and ``url`` are what policies read."""

    url: str
    role: str = "regular"  # PD mode: "prefill" or "decode" (config.ROLES)
    static_models: frozenset[str] = frozenset()  # given by whoever added it (a launcher)
    models: frozenset[str] = frozenset()  # what it serves: static ones and its /v1/models
    cards: list[dict[str, Any]] = field(default_factory=list)  # its /v1/models entries
    bases: dict[str, str] = field(default_factory=dict)  # card id -> its parent, or itself
    # every name a request may give one of its adapters (the id, <base>:<id>) -> the id
    adapters: dict[str, str] = field(default_factory=dict)
    ejected: bool = False
    ejected_at: float = 0.0
    failures: int = 0  # consecutive failed requests
    probe_failures: int = 0  # consecutive failed health probes
    in_flight: int = 0
    routed: int = 0

    @property
    def healthy(self) -> bool:
        return not self.ejected

    def serves(self, model: str | None) -> bool:
        """A worker whose models are unknown (no /v1/models) is taken to serve any."""
        return model is None or not self.models or model in self.models or model in self.adapters

    def set_cards(self, cards: list[dict[str, Any]]) -> None:
        """What its ``/v1/models`` lists now: the models it serves, adapters included."""
        self.cards = [c for c in cards if isinstance(c, dict) and "id" in c]
        self.bases = {str(c["id"]): str(c.get("parent") or c["id"]) for c in self.cards}
        self.models = self.static_models | set(self.bases)
        self.adapters = adapter_names(self.bases)

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "models": sorted(self.models),
                "healthy": self.healthy,
                "ejected": self.ejected, "consecutive_failures": self.failures,
                "consecutive_probe_failures": self.probe_failures,
                "in_flight": self.in_flight, "routed": self.routed}


def adapter_names(bases: dict[str, str]) -> dict[str, str]:
    """The names a request may give each adapter of one worker -> the adapter's id; ``bases``:
    its cards' ids -> their parents (a base card is its own). ``<base>:<adapter>`` is accepted
    for the card's parent and for the worker's base models, as tokenmill's server accepts both
    (the parent differs when the adapter was registered with a ``base_model_name``)."""
    own = [card for card, base in bases.items() if card == base]
    out: dict[str, str] = {}
    for card, base in bases.items():
        if card != base:
            out.update({f"{b}:{card}": card for b in (base, *own)})
    out.update({card: card for card, base in bases.items() if card != base})  # ids win
    return out


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class WorkerPool:
    """The workers and their circuit breakers. Plain bookkeeping on the event loop's thread:
    no locks, no I/O (the health monitor and the proxy do the talking)."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.role: str | None = None  # a view of one role's workers (``only``); None: all
        self._workers: dict[str, Worker] = {}
        # called with a worker as it is ejected or removed: forget its cache state
        self.on_eject: list[Callable[[Worker], None]] = []
        self.on_remove: list[Callable[[Worker], None]] = []

    def add(self, url: str, models: Iterable[str] = (), role: str = "regular") -> Worker:
        """Admit a worker at once (whoever adds one at run time has seen it healthy); the
        health monitor corrects that within one interval if not."""
        url = normalise_url(url)
        w = self._workers.get(url)
        if w is None:
            w = self._workers[url] = Worker(url, role)
        w.static_models = frozenset(models)
        w.models = w.models | w.static_models
        return w

    def remove(self, url: str) -> None:
        w = self._workers.pop(normalise_url(url), None)
        if w is not None:
            for hook in self.on_remove:
                hook(w)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(normalise_url(url))

    def only(self, role: str) -> WorkerPool:
        """This pool seen through one role (PD mode: its prefill or its decode workers): the
        same workers, breakers and hooks, but ``all`` and ``candidates`` list that role's."""
        view = copy.copy(self)
        view.role = role
        return view

    def all(self) -> list[Worker]:
        return [w for w in self._workers.values() if self.role in (None, w.role)]

    def candidates(self, model: str | None) -> list[Worker]:
        return [w for w in self.all() if w.healthy and w.serves(model)]

    def knows(self, model: str) -> bool:
        """Whether any worker, healthy or not, serves ``model``: a 503 (come back later)
        rather than a 404 (no such model) when all of those are down."""
        return any(model in w.models or model in w.adapters for w in self._workers.values())

    def adapter_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request for ``model`` runs under (its id on the workers that
        serve it: the name their KV events carry); None: a base model."""
        if model is None:
            return None
        return next((w.adapters[model] for w in self._workers.values() if model in w.adapters),
                    None)

    def bases_of(self, model: str) -> set[str]:
        """The base models that the healthy workers listing a card ``model`` give it (its
        parent; a base model is its own): more than one and the name alone is ambiguous."""
        return {w.bases[model] for w in self.candidates(model) if model in w.bases}

    def any_healthy(self) -> bool:
        return any(w.healthy for w in self._workers.values())

    def record_success(self, w: Worker) -> None:
        w.failures = 0

    def record_failure(self, w: Worker, *, probe: bool = False, eject_now: bool = False) -> None:
        if probe:
            w.probe_failures += 1
        else:
            w.failures += 1
        streak = max(w.failures, w.probe_failures)
        if not w.ejected and (eject_now or streak >= self.cfg.eject_after_failures):
            w.ejected, w.ejected_at = True, time.monotonic()
            log.warning("worker %s ejected after %d consecutive failures", w.url, streak)
            for hook in self.on_eject:
                hook(w)

    def record_probe_success(self, w: Worker) -> None:
        """A good probe closes an open circuit (the half-open trial), with a clean slate."""
        if w.ejected:
            log.warning("worker %s re-admitted", w.url)
            w.ejected, w.failures = False, 0
        w.probe_failures = 0

    def probe_due(self, w: Worker, now: float) -> bool:
        """Healthy workers every round; ejected ones only once their cooldown has passed."""
        return not w.ejected or now - w.ejected_at >= self.cfg.eject_cooldown_s


class HealthMonitor:
    """Probes every worker each ``health_check_interval_s``: liveness (``/health``), what it
    serves (``/v1/models``) and where it publishes KV events."""

    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient,
                 kv: KVSubscriptions | None = None):
        self.pool = pool
        self.client = client
        self.kv = kv
        self._timeout = httpx.Timeout(pool.cfg.health_check_timeout_s)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.pool.cfg.health_check_interval_s)
            await self.probe_all()

    async def probe_all(self, first: bool = False) -> None:
        """``first``: the round before the router serves, where a worker that does not answer
        is ejected at once instead of being sent requests until it fails enough."""
        now = time.monotonic()
        due = [w for w in self.pool.all() if first or self.pool.probe_due(w, now)]
        await asyncio.gather(*(self.probe(w, first) for w in due))

    async def probe(self, w: Worker, first: bool = False) -> None:
        try:
            ok = await self._alive(w)
        except httpx.HTTPError:
            ok = False
        if not ok:
            self.pool.record_failure(w, probe=True, eject_now=first or w.ejected)
            if w.ejected:
                w.ejected_at = time.monotonic()  # half-open probe failed: a new cooldown
            return
        self.pool.record_probe_success(w)
        await self.learn_models(w)
        # every round: a worker restarted in between has new ports; a decode worker's cache
        # is not what PD mode routes on
        if self.kv is not None and w.role != "decode":
            await self.kv.discover(w, self.client, self._timeout)

    async def _alive(self, w: Worker) -> bool:
        """``/health`` answers 200; a server without that route is alive if it lists its
        models."""
        r = await self.client.get(f"{w.url}/health", timeout=self._timeout)
        if r.status_code == 404:
            r = await self.client.get(f"{w.url}/v1/models", timeout=self._timeout)
        return r.status_code == 200

    async def learn_models(self, w: Worker) -> None:
        """Read what ``w`` serves now (also right after adapters are loaded through the
        router, so they are routed at once)."""
        try:
            r = await self.client.get(f"{w.url}/v1/models", timeout=self._timeout)
            cards = r.json()["data"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            cards = None
        if isinstance(cards, list):  # else keep what it served before
            w.set_cards(cards)


class KVSubscriptions:
    """One ``KVEventSubscriber`` per worker that publishes KV events, feeding ``index``
    (exact cache-aware routing). Endpoints come from ``cfg.kv_event_endpoints`` or the
    worker's ``/server_info``."""

    def __init__(self, index: KVIndex, endpoints: dict[str, str]):
        self.index = index
        self.endpoints = {normalise_url(u): e for u, e in endpoints.items()}
        self._subs: dict[str, tuple[KVEventSubscriber, tuple[Any, ...]]] = {}

    async def discover(self, w: Worker, client: httpx.AsyncClient,
                       timeout: httpx.Timeout) -> None:
        info: dict[str, Any] | None = None
        if w.url in self.endpoints:
            info = {"endpoint": self.endpoints[w.url]}
        else:
            try:
                r = await client.get(f"{w.url}/server_info", timeout=timeout)
                info = r.json().get("kv_events") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                info = None  # not a tokenmill worker: the approximate tree serves it
        if isinstance(info, dict) and info.get("endpoint"):
            where = (str(info["endpoint"]), info.get("replay_endpoint"), info.get("topic") or "")
            if w.url not in self._subs or self._subs[w.url][1] != where:
                self.start(w.url, where)

    def start(self, url: str, where: tuple[Any, ...]) -> None:
        """Subscribe afresh (a new endpoint is a new publisher: what it held is gone)."""
        from tokenmill.router.kv_index import KVEventSubscriber

        self.forget(url)
        endpoint, replay, topic = where
        sub = KVEventSubscriber(self.index, url, endpoint, replay, topic=topic)
        sub.start()
        self._subs[url] = (sub, where)
        log.info("mirroring KV events of %s from %s", url, endpoint)

    def forget(self, url: str, wait_s: float = 0.0) -> None:
        """Stop mirroring ``url``. Called on the event loop (an ejection), so it does not
        wait for the subscriber's thread, which ends at its next poll."""
        sub = self._subs.pop(url, None)
        if sub is not None:
            sub[0].close(timeout=wait_s)
        self.index.forget_worker(url)

    def close(self) -> None:
        for url in list(self._subs):
            self.forget(url, wait_s=2.0)
