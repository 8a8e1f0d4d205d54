"""The router and LoRA adapters: which workers serve an adapter (by its name or as
``<base>:<adapter>``), ``/v1/models`` with adapters and their parents, cache keys kept apart per
adapter (the exact KV index by adapter name, the approximate tree and ``prefix_hash`` by the
route text), and adapters loaded through the router on every worker.

Unit tests on the pool and the policies, then an in-process router (uvicorn in a thread) in
front of small fake workers that list adapter cards as tokenmill's server does. No model.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tokenmill.kv_events import BlockStored, KVEventBatch, decode_batch, encode_batch
from tokenmill.router.adapters import WorkerAnswer, combine
from tokenmill.router.app import build_app
from tokenmill.router.config import RouterConfig
from tokenmill.router.kv_index import KVIndex
from tokenmill.router.policies import CacheAware, PrefixHash, RouteKey, stable_hash
from tokenmill.router.workers import WorkerPool

BASE = "base-model"
W0, W1, W2 = "http://w0", "http://w1", "http://w2"


def card(name: str, parent: str | None = None, root: str | None = None) -> dict[str, Any]:
    """A ``/v1/models`` entry in tokenmill's (and vLLM's) shape."""
    return {"id": name, "object": "model", "owned_by": "tokenmill",
            "root": root or (f"/adapters/{name}" if parent else name), "parent": parent}


def pool_of(*cards_per_worker: list[dict[str, Any]]) -> WorkerPool:
    pool = WorkerPool(RouterConfig())
    for i, cards in enumerate(cards_per_worker):
        pool.add(f"http://w{i}").set_cards(cards)
    return pool


def urls(workers: list) -> list[str]:
    return [w.url for w in workers]


# ----- which workers serve an adapter ---------------------------------------------------------

def test_an_adapter_is_served_by_its_name_or_as_base_colon_adapter() -> None:
    pool = pool_of([card(BASE), card("sql", BASE), card("chat", BASE)],
                   [card(BASE), card("sql", BASE)],
                   [card(BASE)],
                   [card("other"), card("sql", "other")])
    assert urls(pool.candidates(BASE)) == [W0, W1, W2]
    assert urls(pool.candidates(f"{BASE}:sql")) == [W0, W1]
    assert urls(pool.candidates("other:sql")) == ["http://w3"]
    assert urls(pool.candidates(f"{BASE}:chat")) == [W0] == urls(pool.candidates("chat"))
    assert pool.candidates("other:chat") == [] and pool.candidates(f"{BASE}:nope") == []
    assert not pool.knows(f"{BASE}:nope") and pool.knows(f"{BASE}:sql")
    # every name of an adapter runs under the adapter's own (the workers' KV-event name)
    assert pool.adapter_for("sql") == pool.adapter_for(f"{BASE}:sql") == "sql"
    assert pool.adapter_for(BASE) is None and pool.adapter_for(None) is None
    # "sql" alone is an adapter of two base models here: ambiguous
    assert pool.bases_of("sql") == {BASE, "other"} and pool.bases_of(f"{BASE}:sql") == set()


def test_an_adapter_registered_with_a_base_model_name_answers_to_both_bases() -> None:
    """tokenmill's server accepts ``<served name>:<adapter>`` and ``<its parent>:<adapter>``."""
    pool = pool_of([card("served"), card("sql", "org/Base-1B")])
    assert urls(pool.candidates("served:sql")) == urls(pool.candidates("org/Base-1B:sql")) \
        == [W0]
    assert pool.adapter_for("org/Base-1B:sql") == "sql"


def test_a_worker_forgets_an_unloaded_adapter_at_its_next_listing() -> None:
    pool = pool_of([card(BASE), card("sql", BASE)])
    w = pool.get(W0)
    assert w is not None and w.serves("sql")
    w.set_cards([card(BASE)])
    assert not w.serves("sql") and not w.serves(f"{BASE}:sql") and w.serves(BASE)


# ----- the cache keys -------------------------------------------------------------------------

@dataclass
class FakeWorker:
    url: str
    in_flight: int = 0


BS = 4
PROMPT = list(range(100, 116))  # four blocks


def stored(tokens: list[int], lora_id: int | None = None,
           lora_name: str | None = None) -> KVEventBatch:
    event = BlockStored(block_hashes=list(range(1, len(tokens) // BS + 1)),
                        parent_block_hash=None, token_ids=tokens, block_size=BS,
                        lora_id=lora_id, medium=None, lora_name=lora_name)
    # through the wire format, as a subscriber gets it
    return decode_batch(encode_batch(KVEventBatch(ts=time.time(), events=[event])))


def test_the_exact_index_matches_adapters_by_name_whatever_each_worker_numbers_them() -> None:
    index = KVIndex()
    index.apply(W0, stored(PROMPT, lora_id=1, lora_name="sql"))
    index.apply(W1, stored(PROMPT[:8], lora_id=7, lora_name="sql"))  # its own id for sql
    index.apply(W2, stored(PROMPT))  # the base model
    assert index.match(PROMPT, "sql") == {W0: 16, W1: 8, W2: 0}
    assert index.match(PROMPT) == {W0: 0, W1: 0, W2: 16}
    assert index.match(PROMPT, "chat") == {W0: 0, W1: 0, W2: 0}
    assert index.match(PROMPT, 1) == {W0: 0, W1: 0, W2: 0}  # named: never by its id


def test_nameless_events_are_filed_by_id_and_never_hit_a_named_request() -> None:
    """A vLLM release that sends only ``lora_id``: its adapter blocks serve neither the base
    model nor a request by name (the router cannot know that worker's numbering)."""
    index = KVIndex()
    index.apply(W0, stored(PROMPT, lora_id=3))
    assert index.match(PROMPT, "sql") == {W0: 0} and index.match(PROMPT) == {W0: 0}
    assert index.match(PROMPT, 3) == {W0: 16}


def test_exact_cache_aware_routes_adapter_and_base_requests_to_their_own_blocks() -> None:
    index = KVIndex()
    index.apply(W0, stored(PROMPT, lora_id=1, lora_name="sql"))
    index.apply(W1, stored(PROMPT))
    index.apply(W2, stored([9] * 16, lora_id=2, lora_name="sql"))
    policy, pool = CacheAware(RouterConfig(), index), [FakeWorker(u) for u in (W0, W1, W2)]

    def route(adapter: str | None) -> tuple[str, dict[str, int] | None]:
        key = RouteKey(model=adapter or BASE, text="", token_ids=PROMPT + [1])
        key.under_adapter(adapter)
        return policy.choose(key, pool).url, key.cached_tokens

    assert route("sql") == (W0, {W0: 16, W1: 0, W2: 0})  # not W1's base blocks
    assert route(None) == (W1, {W0: 0, W1: 16, W2: 0})  # not W0's adapter blocks


def test_the_approximate_tree_keeps_a_prompt_under_an_adapter_apart_from_the_base() -> None:
    policy, pool = CacheAware(RouterConfig()), [FakeWorker(W0), FakeWorker(W1)]
    doc = "A long shared system prompt about databases and their queries. " * 4

    def key(adapter: str | None, question: str) -> RouteKey:
        k = RouteKey(model=adapter or BASE, text=doc + question)
        k.under_adapter(adapter)
        return k

    policy.on_routed(key(None, "Q1"), pool[0])
    assert policy.choose(key(None, "Q2"), pool) is pool[0]
    assert policy.choose(key("sql", "Q2"), pool) is pool[1]  # W0 saw it only as the base's
    policy.on_routed(key("sql", "Q2"), pool[1])
    assert policy.choose(key("sql", "Q3"), pool) is pool[1]
    # nor another adapter's: not even the prefix naming the adapter matches whole
    matched = policy.tree.match(key("chat", "Q3").text)
    assert max(matched.values(), default=0) < len(key("chat", "").text)


def test_base_keys_are_unchanged_and_adapter_keys_differ() -> None:
    base = RouteKey(model=BASE, text="hello world")
    base.under_adapter(None)
    assert (base.text, base.adapter) == ("hello world", None)
    policy = PrefixHash(RouterConfig(policy="prefix_hash"))
    assert policy.key_hash(base) == stable_hash(f"{BASE}\0hello world".encode())
    hashes = {}
    for model, adapter in ((BASE, None), ("sql", "sql"), (f"{BASE}:sql", "sql"),
                           ("chat", "chat")):
        for ids in (None, [1, 2, 3]):
            k = RouteKey(model=model, text="hello world", token_ids=ids)
            k.under_adapter(adapter)
            hashes[model, ids is None] = policy.key_hash(k)
    for text in (True, False):
        # one adapter's requests hash alike however ``model`` named it; others differ
        assert hashes["sql", text] == hashes[f"{BASE}:sql", text]
        assert len({hashes[BASE, text], hashes["sql", text], hashes["chat", text]}) == 3


def test_a_load_through_the_router_succeeds_where_workers_already_had_it() -> None:
    ok = WorkerAnswer(W0, 200, b"Success", {})
    had = WorkerAnswer(W1, 400, b'{"error": {"code": "lora_already_loaded"}}', {})
    bad = WorkerAnswer(W2, 400, b'{"error": {"code": "invalid_request_error"}}', {})
    assert combine([had, ok]) is ok and combine([ok, had, bad]) is bad
    assert combine([had]) is had


# ----- a router in front of fake workers ------------------------------------------------------

@dataclass
class FakeLoRAWorker:
    """A worker listing a base model and adapters as tokenmill's server does; it answers a
    completion with its own name and the model it was asked for."""

    name: str
    base: str = BASE
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path
    seen: list[str] = field(default_factory=list)  # the ``model`` of each completion

    def cards(self) -> list[dict[str, Any]]:
        return [card(self.base), *(card(n, self.base, p) for n, p in self.adapters.items())]

    def app(self) -> FastAPI:
        app = FastAPI()
        app.get("/health")(lambda: {"status": "ok"})
        app.get("/v1/models")(lambda: {"object": "list", "data": self.cards()})
        app.post("/v1/completions")(self.complete)
        app.post("/v1/load_lora_adapter")(self.load)
        app.post("/v1/unload_lora_adapter")(self.unload)
        return app

    async def complete(self, request: Request) -> JSONResponse:
        model = (await request.json()).get("model")
        self.seen.append(model)
        return JSONResponse({"worker": self.name, "model": model})

    async def load(self, request: Request) -> Any:
        body = await request.json()
        if body["lora_name"] in self.adapters:
            return JSONResponse({"error": {"code": "lora_already_loaded", "message": "loaded"}},
                                status_code=400)
        self.adapters[body["lora_name"]] = body["lora_path"]
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' loaded.")

    async def unload(self, request: Request) -> Any:
        name = (await request.json())["lora_name"]
        if self.adapters.pop(name, None) is None:
            return JSONResponse({"error": {"code": "model_not_found"}}, status_code=404)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed.")


class Served:
    """An ASGI app on a free loopback port, in a thread with its own event loop."""

    def __init__(self, app: Any) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                     timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started, "the server to start")

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def fleet() -> Iterator[tuple[str, list[FakeLoRAWorker]]]:
    """A router (health every 0.2 s) over two replicas with adapter ``sql`` and a worker of
    another base model that has an adapter ``sql`` of its own."""
    workers = [FakeLoRAWorker("r0", adapters={"sql": "/a/sql"}),
               FakeLoRAWorker("r1", adapters={"sql": "/a/sql"}),
               FakeLoRAWorker("other", base="other-model", adapters={"sql": "/b/sql"})]
    servers = [Served(w.app()) for w in workers]
    cfg = RouterConfig(workers=tuple(s.url for s in servers), policy="round_robin",
                       health_check_interval_s=0.2)
    router = Served(build_app(cfg))
    try:
        yield router.url, workers
    finally:
        for s in (router, *servers):
            s.close()


def complete(router: str, model: str) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", json={"model": model, "prompt": "hi"},
                      timeout=30)


def test_requests_go_to_the_workers_serving_the_adapter_of_that_base(fleet) -> None:
    router, workers = fleet
    # round robin: both replicas take their turns
    assert [complete(router, f"{BASE}:sql").json()["worker"] for _ in range(4)] == \
        ["r0", "r1"] * 2
    assert {complete(router, "other-model:sql").json()["worker"] for _ in range(3)} == {"other"}
    r = complete(router, "sql")  # an adapter of two base models: the router will not guess
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_ambiguous"
    r = complete(router, f"{BASE}:nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_models_lists_adapters_with_their_parent_once_per_base(fleet) -> None:
    router, _ = fleet
    listed = httpx.get(f"{router}/v1/models", timeout=30).json()["data"]
    assert sorted((c["id"], c["parent"] or "", c["root"]) for c in listed) == [
        (BASE, "", BASE), ("other-model", "", "other-model"),
        ("sql", BASE, "/a/sql"), ("sql", "other-model", "/b/sql")]
    one = httpx.get(f"{router}/v1/models/{BASE}:sql", timeout=30).json()
    assert (one["id"], one["parent"]) == ("sql", BASE)


def test_a_load_through_the_router_reaches_every_worker_and_routes_at_once(fleet) -> None:
    router, workers = fleet
    body = {"lora_name": "chat", "lora_path": "/a/chat"}
    r = httpx.post(f"{router}/v1/load_lora_adapter", json=body, timeout=30)
    assert r.status_code == 200 and r.text.startswith("Success")
    assert all("chat" in w.adapters for w in workers)
    # no wait for a health round: the router read every worker's models after the load
    assert complete(router, f"{BASE}:chat").status_code == 200
    workers[1].adapters.pop("chat")  # a replica restarted without it ...
    wait_for(lambda: "chat" not in _served(router, "r1"), "the health round")
    r = httpx.post(f"{router}/v1/load_lora_adapter", json=body, timeout=30)
    assert r.status_code == 200 and "chat" in workers[1].adapters  # ... gets it again
    r = httpx.post(f"{router}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=30)
    assert r.status_code == 200 and not any("chat" in w.adapters for w in workers)
    assert complete(router, "chat").status_code == 404


def test_an_adapter_loaded_on_a_worker_directly_is_routed_after_the_next_health_round(
        fleet) -> None:
    router, workers = fleet
    assert complete(router, "tables").status_code == 404
    workers[0].adapters["tables"] = "/a/tables"
    wait_for(lambda: complete(router, "tables").status_code == 200, "the health round")
    assert {complete(router, f"{BASE}:tables").json()["worker"] for _ in range(4)} == {"r0"}


def _served(router: str, worker: str) -> set[str]:
    """The models the router believes ``worker`` (a fake's name) serves, by its answers."""
    state = httpx.get(f"{router}/workers", timeout=30).json()["workers"]
    index = {"r0": 0, "r1": 1, "other": 2}[worker]
    return set(state[index]["models"])
