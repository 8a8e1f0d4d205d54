"""``tokenmill router --pd``: a real router process in front of the fake server of
``benchmarks/peers/fake_openai.py`` playing producers (prefill) and consumers (decode) of
vLLM's ``kv_transfer_params`` protocol.

Checked: the prefill worker's body is the client's cut to one token and carries the hand-off
request; the decode worker gets the client's own body plus the producer's params, and its
answer (streamed or whole) is what the client sees; every prefill and decode worker is used; a
prefill worker failing is retried on another, and when none helps (all down, no params, the
hand-off refused) the decode worker gets the plain request and the fallback is counted; a
prefill worker's own 4xx is the client's answer. The real-engine PD test is elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_router_server import FAST_HEALTH, Proc, sse_data, wait_for
from tests.test_server_support import free_port
from tokenmill.router.config import RouterConfig
from tokenmill.router.pd import PREFILL_HANDOFF, decode_body, disaggregable, prefill_body
from tokenmill.router.workers import WorkerPool

from fake_openai import start_fake  # noqa: E402  (tests.test_router_server put it on the path)

WORKER = "x-tokenmill-worker"
PREFILL = "x-tokenmill-prefill-worker"


def start_pd_router(tmp: Path, prefill: list[str], decode: list[str], *flags: str) -> Proc:
    args = ["router", "--pd", *[a for u in prefill for a in ("--prefill", u)],
            *[a for u in decode for a in ("--decode", u)], *FAST_HEALTH, *flags]
    port = free_port()
    return Proc(args, port, tmp / f"pd-router-{port}.log").start()


def metric(router: Proc, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{router.url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def own_answer(fake, path: str, body: dict) -> dict:
    """What a fake answers a request itself (a plain one: no hand-off)."""
    return httpx.post(f"{fake.url}{path}", json=body, timeout=30).json()


# ----- the bodies and the flags -------------------------------------------------------------------

def test_prefill_body_is_cut_to_one_token_and_asks_for_the_handoff():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "n": 3, "max_completion_tokens": 50,
            "min_tokens": 5, "best_of": 3, "temperature": 0.7, "kv_transfer_params": {"x": 1}}
    body = prefill_body(chat)
    assert body == {"model": "m", "messages": chat["messages"], "stream": False, "n": 1,
                    "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0.7,
                    "kv_transfer_params": PREFILL_HANDOFF}
    assert chat["n"] == 3 and "stream_options" in chat  # the client's body is untouched
    assert PREFILL_HANDOFF == {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}
    plain = prefill_body({"prompt": "a b", "max_tokens": 9})
    assert plain["max_tokens"] == 1 and "max_completion_tokens" not in plain
    handoff = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    assert decode_body(chat, handoff) == {**chat, "kv_transfer_params": handoff}


def test_only_single_prompts_are_disaggregated():
    assert disaggregable({"prompt": "a"}) and disaggregable({"prompt": [1, 2, 3]})
    assert disaggregable({"prompt": ["a"]}) and disaggregable({"prompt": [[1, 2]]})
    assert disaggregable({"messages": [{"role": "user", "content": "x"}]})
    assert not disaggregable({"prompt": ["a", "b"]}) and not disaggregable({"prompt": [[1], [2]]})
    assert not disaggregable(None)


def test_pd_flags_make_the_config():
    from tokenmill.cli import build_parser
    from tokenmill.router.cli import config_from_args

    def config(*argv: str) -> RouterConfig:
        return config_from_args(build_parser().parse_args(["router", *argv]))

    cfg = config("--pd", "--prefill", "http://p:1", "--prefill", "http://p:2", "--decode",
                 "http://d:1", "--policy", "round_robin", "--decode-policy", "prefix_hash")
    assert cfg.pd and cfg.prefill_workers == ("http://p:1", "http://p:2")
    assert cfg.decode_workers == ("http://d:1",) and cfg.workers == ()
    assert (cfg.policy, cfg.decode_policy) == ("round_robin", "prefix_hash")
    assert config("--pd", "--prefill", "p:1", "--decode", "d:1").decode_policy == "least_load"
    for bad in (["--pd"], ["--pd", "--prefill", "http://p:1"],
                ["--prefill", "http://p:1", "--decode", "http://d:1"],
                ["--pd", "--prefill", "http://a:1", "--decode", "http://a:1"],
                ["--pd", "--prefill", "http://p:1", "--decode", "http://d:1", "--worker",
                 "http://w:1"]):
        with pytest.raises(ValueError):
            config(*bad)


def test_pool_seen_by_role():
    pool = WorkerPool(RouterConfig())
    p = pool.add("http://p:1", role="prefill")
    d = pool.add("http://d:1", role="decode")
    prefill, decode = pool.only("prefill"), pool.only("decode")
    assert prefill.candidates(None) == [p] and decode.all() == [d]
    assert pool.all() == [p, d] and p.state()["role"] == "prefill"
    decode.record_failure(d, eject_now=True)  # one breaker, whichever view records it
    assert not d.healthy and decode.candidates(None) == [] and pool.candidates(None) == [p]
    pool.add("http://d:2", role="decode")
    assert [w.url for w in decode.all()] == ["http://d:1", "http://d:2"]


# ----- a PD router over fake producers and consumers ---------------------------------------------

@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router-pd")


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, list]]:
    started = {"prefill": [start_fake(model="m", kv_role="producer") for _ in range(2)],
               "decode": [start_fake(model="m", kv_role="consumer") for _ in range(2)]}
    yield started
    for f in started["prefill"] + started["decode"]:
        f.close()


@pytest.fixture(scope="module")
def router(tmp, fakes) -> Iterator[Proc]:
    r = start_pd_router(tmp, [f.url for f in fakes["prefill"]],
                        [f.url for f in fakes["decode"]], "--policy", "round_robin",
                        "--decode-policy", "round_robin")
    yield r
    r.stop()


def by_url(fakes: dict[str, list], url: str):
    return next(f for fs in fakes.values() for f in fs if f.url == url)


def test_completion_is_prefilled_then_decoded(router, fakes):
    body = {"model": "m", "prompt": "one two three four", "max_tokens": 7, "temperature": 0}
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    producer, consumer = by_url(fakes, r.headers[PREFILL]), by_url(fakes, r.headers[WORKER])
    assert producer in fakes["prefill"] and consumer in fakes["decode"]
    sent = producer.state.received[-1]
    assert sent == {**body, "max_tokens": 1, "stream": False, "n": 1,
                    "kv_transfer_params": PREFILL_HANDOFF}
    got = consumer.state.received[-1]
    params = got.pop("kv_transfer_params")
    assert got == body  # the client's own body, plus the hand-off
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == \
        f"fake-{producer.port}" and params["remote_block_ids"] == [1]
    answer = r.json()
    assert "kv_transfer_params" not in answer  # the decode worker's answer, as it gave it
    assert answer["usage"]["completion_tokens"] == 7
    assert answer["choices"] == own_answer(consumer, "/v1/completions", body)["choices"]


def test_chat_stream_is_relayed_from_the_decode_worker(router, fakes):
    body = {"model": "m", "messages": [{"role": "user", "content": "say some words"}],
            "max_completion_tokens": 5, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r.iter_lines())
        producer, consumer = by_url(fakes, r.headers[PREFILL]), by_url(fakes, r.headers[WORKER])
    sent = producer.state.received[-1]
    assert (sent["max_tokens"], sent["max_completion_tokens"], sent["n"], sent["stream"]) == \
        (1, 1, 1, False) and "stream_options" not in sent
    got = consumer.state.received[-1]
    assert got["stream"] is True and got["n"] == 2 and got["stream_options"] == \
        body["stream_options"] and got["kv_transfer_params"]["remote_host"] == "127.0.0.1"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 10  # the decode worker's usage
    text = {i: "".join(c["delta"].get("content", "") for ch in chunks for c in ch["choices"]
                       if c["index"] == i) for i in (0, 1)}
    mine = own_answer(consumer, "/v1/chat/completions", {**body, "stream": False})
    assert text == {c["index"]: c["message"]["content"] for c in mine["choices"]}


def test_every_prefill_and_decode_worker_is_used(router, fakes):
    before = {f.url: (f.state.requests, f.state.handoffs)
              for f in fakes["prefill"] + fakes["decode"]}
    pairs = set()
    for i in range(8):
        r = httpx.post(f"{router.url}/v1/completions",
                       json={"model": "m", "prompt": f"request {i}", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        pairs.add((r.headers[PREFILL], r.headers[WORKER]))
    for f in fakes["prefill"]:
        assert f.state.requests - before[f.url][0] == 4
    for f in fakes["decode"]:
        assert f.state.handoffs - before[f.url][1] == 4  # each came with a producer's params
    assert {p for p, _ in pairs} == {f.url for f in fakes["prefill"]}
    assert metric(router, "tokenmill_router_pd_fallbacks_total") == 0


def test_prefill_client_error_is_the_answer(router, fakes):
    before = sum(len(f.state.received) for f in fakes["decode"])
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 400 and "'prompt' is required" in r.json()["error"]["message"]
    assert r.headers[WORKER] in {f.url for f in fakes["prefill"]}
    assert sum(len(f.state.received) for f in fakes["decode"]) == before


def test_batches_and_other_routes_go_to_decode_workers(router, fakes):
    before = sum(f.state.requests for f in fakes["prefill"])
    r = httpx.post(f"{router.url}/v1/completions",
                   json={"model": "m", "prompt": ["a b", "c d"], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers[WORKER] in {f.url for f in fakes["decode"]} and PREFILL not in r.headers
    assert "kv_transfer_params" not in by_url(fakes, r.headers[WORKER]).state.received[-1]
    assert [m["id"] for m in httpx.get(f"{router.url}/v1/models").json()["data"]] == ["m"]
    assert sum(f.state.requests for f in fakes["prefill"]) == before


def test_workers_health_and_metrics_show_both_pools(router, fakes):
    listing = httpx.get(f"{router.url}/workers", timeout=10).json()
    roles = {w["url"]: w["role"] for w in listing["workers"]}
    assert roles == {**{f.url: "prefill" for f in fakes["prefill"]},
                     **{f.url: "decode" for f in fakes["decode"]}}
    assert (listing["policy"], listing["decode_policy"]) == ("round_robin", "round_robin")
    health = httpx.get(f"{router.url}/health", timeout=10).json()
    assert health["healthy_by_role"] == {"prefill": 2, "decode": 2}
    for role in ("prefill", "decode"):
        assert metric(router, "tokenmill_router_healthy_workers", role=role) == 2
    assert metric(router, "tokenmill_router_pd_prefill_seconds_count") > 0


def test_short_prompts_go_straight_to_a_decode_worker(tmp, fakes):
    r = start_pd_router(tmp, [f.url for f in fakes["prefill"]], [f.url for f in fakes["decode"]],
                        "--pd-min-prompt-tokens", "8")
    try:
        before = sum(f.state.requests for f in fakes["prefill"])
        short = {"model": "m", "prompt": "short one", "max_tokens": 2}  # 9 characters: 2 tokens
        got = httpx.post(f"{r.url}/v1/completions", json=short, timeout=30)
        assert got.status_code == 200 and PREFILL not in got.headers
        assert by_url(fakes, got.headers[WORKER]).state.received[-1] == short
        assert sum(f.state.requests for f in fakes["prefill"]) == before
        long = {"model": "m", "prompt": "a prompt of more than thirty-two characters",
                "max_tokens": 2}
        got = httpx.post(f"{r.url}/v1/completions", json=long, timeout=30)
        assert got.status_code == 200
        assert got.headers[PREFILL] in {f.url for f in fakes["prefill"]}
        assert metric(r, "tokenmill_router_pd_direct_total") == 1
    finally:
        r.stop()


# ----- failing prefill workers --------------------------------------------------------------------

def test_a_failing_prefill_worker_is_retried_then_the_decode_worker_prefills(tmp):
    bad = start_fake(model="m", kv_role="producer", fail_mode="503")  # full: never ejected
    good = start_fake(model="m", kv_role="producer")
    decode = start_fake(model="m", kv_role="consumer")
    r = start_pd_router(tmp, [bad.url, good.url], [decode.url], "--policy", "round_robin")
    try:
        for i in range(4):
            got = httpx.post(f"{r.url}/v1/completions",
                             json={"model": "m", "prompt": f"x {i}", "max_tokens": 3}, timeout=30)
            assert got.status_code == 200 and got.headers[PREFILL] == good.url
        assert decode.state.handoffs == 4 and bad.state.failed >= 1
        assert metric(r, "tokenmill_router_retries_total") == bad.state.failed
        good.close()  # dead: refused connections; the other still fails
        body = {"model": "m", "prompt": "y", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=30) as s:
            assert s.status_code == 200 and sse_data(s.iter_lines())[-1] == "[DONE]"
        assert "kv_transfer_params" not in decode.state.received[-1]  # it prefills itself
        assert decode.state.received[-1] == body and decode.state.handoffs == 4
        assert metric(r, "tokenmill_router_pd_fallbacks_total",
                      reason="prefill_unavailable") == 1
        bad.configure(healthy=False)  # no prefill worker left at all: still served
        wait_for(lambda: httpx.get(f"{r.url}/health").json()["healthy_by_role"]["prefill"] == 0,
                 what="both prefill workers' ejection")
        assert httpx.get(f"{r.url}/health").status_code == 200  # the decode worker serves
        got = httpx.post(f"{r.url}/v1/completions", json={"model": "m", "prompt": "z"},
                         timeout=30)
        assert got.status_code == 200 and PREFILL not in got.headers
        assert metric(r, "tokenmill_router_pd_fallbacks_total") == 2
    finally:
        r.stop()
        for f in (bad, decode):
            f.close()


def test_prefill_workers_without_a_handoff_fall_back(tmp):
    """A prefill worker that ignores kv_transfer_params (no KV connector) or refuses it (a
    consumer) hands nothing over: the decode worker computes the prompt; nothing fails."""
    plain = start_fake(model="m")
    consumer_as_prefill = start_fake(model="m", kv_role="consumer")
    decode = start_fake(model="m", kv_role="consumer")
    r = start_pd_router(tmp, [plain.url, consumer_as_prefill.url], [decode.url],
                        "--policy", "round_robin")
    try:
        for i in range(2):
            body = {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}],
                    "max_tokens": 4}
            got = httpx.post(f"{r.url}/v1/chat/completions", json=body, timeout=30)
            assert got.status_code == 200, got.text
            assert decode.state.received[-1] == body
        assert metric(r, "tokenmill_router_pd_fallbacks_total") == 2
        for reason in ("no_kv_transfer_params", "prefill_refused"):
            assert metric(r, "tokenmill_router_pd_fallbacks_total", reason=reason) == 1
        assert decode.state.handoffs == 0
    finally:
        r.stop()
        for f in (plain, consumer_as_prefill, decode):
            f.close()
