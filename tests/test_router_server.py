"""``tokenmill router`` end to end: real ``tokenmill serve`` workers (one thread each) and the
fake foreign server of ``benchmarks/peers/fake_openai.py`` behind a real router process, driven
with the official ``openai`` client and plain httpx.

What is checked is behaviour: answers equal to the worker's own, streams relayed as they come,
errors passed through unchanged, the router's own errors in OpenAI's shape, and failover (a
worker killed under load loses no request that had not started, a started stream ends with an
error event, nothing hangs, a worker that comes back is re-admitted). Timeouts are generous and
outputs short: the machine may be a loaded 2-core one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_server_support import MODEL, free_port

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

from fake_openai import start_fake  # noqa: E402

KEY = "sk-router-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORKER = "x-tokenmill-worker"
# Short health intervals so ejection and re-admission happen within a test; a generous probe
# timeout so a busy worker on a loaded machine is not mistaken for a dead one.
# Workers publish KV events on free ports and say where in /server_info (exact cache_aware)
KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0",
                        "topic": "kv-events"})
FAST_HEALTH = ("--health-check-interval", "0.3", "--health-check-timeout", "10",
               "--eject-after-failures", "2", "--eject-cooldown", "0.5")


@dataclass
class Proc:
    """A ``tokenmill`` subprocess (worker or router) on a fixed port, restartable there."""

    args: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self, ready: str = "/health", timeout: float = 180.0) -> Proc:
        """Start and wait until ``ready`` answers (any status: a router with every worker
        down still answers /health)."""
        env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
        cmd = [sys.executable, "-m", "tokenmill.cli", *self.args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log_path.open("a"),
                                     stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{cmd} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                httpx.get(self.url + ready, timeout=2)
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        pytest.fail(f"{cmd} did not answer in {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)


def tokenmill_worker(tmp: Path, name: str) -> Proc:
    args = ["serve", MODEL, "--num-threads", "1", "--dtype", "float32", "--kv-cache-memory",
            "512blocks", "--max-model-len", "2048", "--kv-events-config", KV_EVENTS]
    return Proc(args, free_port(), tmp / f"{name}.log").start()


def start_router(tmp: Path, workers: list[str], *flags: str) -> Proc:
    args = ["router", *[a for url in workers for a in ("--worker", url)], *FAST_HEALTH, *flags]
    return Proc(args, free_port(), tmp / f"router-{free_port()}.log").start()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router")


@pytest.fixture(scope="module")
def workers(tmp) -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        for name in ("a", "b"):
            started.append(tokenmill_worker(tmp, name))
        yield started
    finally:
        for w in started:
            w.stop()


@pytest.fixture(scope="module")
def router(tmp, workers) -> Iterator[Proc]:
    r = start_router(tmp, [w.url for w in workers], "--policy", "round_robin", "--api-key", KEY)
    yield r
    r.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def direct(worker: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def workers_state(router: Proc) -> dict[str, dict]:
    r = httpx.get(f"{router.url}/workers", headers=AUTH, timeout=10)
    return {w["url"]: w for w in r.json()["workers"]}


def wait_for(condition, timeout: float = 60.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def sse_data(lines: Iterator[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# ----- answers through the router are the worker's answers ---------------------------------------

def test_completion_and_chat_equal_the_workers_own(client, workers):
    prompt = "The capital of France is"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    want = direct(workers[0]).completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                 temperature=0)
    assert got.choices[0].text == want.choices[0].text and got.usage == want.usage
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                          temperature=0)
    own = direct(workers[1]).chat.completions.create(model=MODEL, messages=messages,
                                                     max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == own.choices[0].message.content


def test_stream_concatenates_to_the_non_stream_text(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
        if c.choices]
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == whole.choices[0].message.content


def test_n_choices_stream_and_not(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, n=2,
                                    temperature=0.8, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1]
    indices = {choice.index for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, n=2, stream=True, seed=1)
        for choice in c.choices}
    assert indices == {0, 1}


def test_tools_and_structured_output_pass_through(client, workers):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    requests = [
        dict(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
             tools=tools, max_tokens=24),
        dict(messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
             response_format={"type": "json_schema",
                              "json_schema": {"name": "answer", "schema": schema}},
             max_tokens=24),
    ]
    for req in requests:
        got = client.chat.completions.create(model=MODEL, temperature=0, **req)
        want = direct(workers[0]).chat.completions.create(model=MODEL, temperature=0, **req)
        strip = lambda m: m.model_dump(exclude={"tool_calls": {"__all__": {"id"}}})  # noqa: E731
        assert strip(got.choices[0].message) == strip(want.choices[0].message)
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(got.choices[0].message.content)["ok"], bool)


def test_worker_errors_pass_through_unchanged(router, workers):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": -3}
    via = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    own = httpx.post(f"{workers[0].url}/v1/completions", json=body, timeout=60)
    assert via.status_code == own.status_code == 400
    assert via.json() == own.json()


def test_tokenize_and_detokenize_forwarded(router, workers):
    body = {"model": MODEL, "prompt": "Hello router"}
    via = httpx.post(f"{router.url}/tokenize", json=body, headers=AUTH, timeout=60).json()
    assert via == httpx.post(f"{workers[1].url}/tokenize", json=body, timeout=60).json()
    back = httpx.post(f"{router.url}/detokenize", json={"model": MODEL, "tokens": via["tokens"]},
                      headers=AUTH, timeout=60)
    assert back.json()["prompt"] == "Hello router"


# ----- the router's own answers -----------------------------------------------------------------

def _assert_openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


def test_api_keys_checked_at_the_router(router):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        _assert_openai_error(httpx.post(f"{router.url}/v1/completions", json=body,
                                        headers=headers, timeout=30), 401, "invalid_api_key")
        _assert_openai_error(httpx.get(f"{router.url}/workers", headers=headers, timeout=30),
                             401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{router.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{router.url}/health", timeout=30).status_code == 200
    assert "tokenmill_router_requests_total" in httpx.get(f"{router.url}/metrics",
                                                          timeout=30).text


def test_unknown_model_and_malformed_json(client, router):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert e.value.code == "model_not_found"
    r = httpx.post(f"{router.url}/v1/completions", content=b'{"prompt": "hi",', headers={
        **AUTH, "content-type": "application/json"}, timeout=30)
    _assert_openai_error(r, 400, "invalid_json")


def test_models_aggregated_and_workers_listed(client, router, workers):
    assert [m.id for m in client.models.list().data] == [MODEL]  # two workers, one model
    assert client.models.retrieve(MODEL).id == MODEL
    state = workers_state(router)
    assert set(state) == {w.url for w in workers}
    assert all(s["healthy"] and s["models"] == [MODEL] and s["routed"] > 0
               for s in state.values())


def test_policies_route_end_to_end(tmp, workers):
    """Every policy serves chat and streams; the prefix-following ones send one prompt to one
    worker every time."""
    messages = [{"role": "system", "content": "You are terse. " * 20},
                {"role": "user", "content": "Hi"}]
    for policy in ("least_load", "cache_aware", "prefix_hash"):
        r = start_router(tmp, [w.url for w in workers], "--policy", policy)
        try:
            seen = set()
            for _ in range(3):
                resp = httpx.post(f"{r.url}/v1/chat/completions", timeout=120, json={
                    "model": MODEL, "messages": messages, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
                seen.add(resp.headers[WORKER])
            if policy != "least_load":
                assert len(seen) == 1, policy
        finally:
            r.stop(signal.SIGTERM)


def test_exact_cache_aware_follows_the_workers_kv_events(tmp, workers):
    """cache_aware subscribes to each worker's KV events (found in /server_info), tokenizes
    prompts through a worker, and sends a prompt whose blocks a worker holds to that worker."""
    r = start_router(tmp, [w.url for w in workers], "--policy", "cache_aware")
    try:
        prompt = "Here is a long shared document. " * 12
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

        def route() -> str:
            resp = httpx.post(f"{r.url}/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            return resp.headers[WORKER]

        first = route()  # its blocks reach the router as events, a moment later
        wait_for(lambda: route() and _metric(r, "tokenmill_router_exact_hit_tokens") > 0,
                 what="an exact cache hit from the workers' KV events")
        assert {route() for _ in range(3)} == {first}
    finally:
        r.stop(signal.SIGTERM)


def test_a_client_that_leaves_mid_stream_frees_its_worker(tmp):
    with start_fake(model="m", token_delay_s=0.2) as fake:
        r = start_router(tmp, [fake.url])
        try:
            body = {"model": "m", "prompt": "a", "max_tokens": 200, "stream": True}
            with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=60) as s:
                lines = s.iter_lines()  # kept: a dropped iterator closes the connection
                next(lines)
                assert workers_state(r)[fake.url]["in_flight"] == 1
            wait_for(lambda: workers_state(r)[fake.url]["in_flight"] == 0
                     and fake.state.in_flight == 0, what="the relay to let go")
        finally:
            r.stop(signal.SIGTERM)


# ----- a foreign (non-tokenmill) worker ---------------------------------------------------------

def test_router_in_front_of_a_foreign_server_and_tokenmill(tmp, workers):
    """Two models on two kinds of server: each request goes to the one that serves its model,
    and /v1/models lists both."""
    with start_fake(model="fake-model", token_delay_s=0.25) as fake:
        r = start_router(tmp, [workers[0].url, fake.url], "--policy", "cache_aware")
        try:
            c = openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=120)
            assert sorted(m.id for m in c.models.list().data) == sorted([MODEL, "fake-model"])
            whole = c.completions.create(model="fake-model", prompt="a b", max_tokens=5)
            arrivals, pieces = [], []
            for chunk in c.completions.create(model="fake-model", prompt="a b", max_tokens=5,
                                              stream=True):
                arrivals.append(time.monotonic())
                pieces.append(chunk.choices[0].text if chunk.choices else "")
            assert "".join(pieces) == whole.choices[0].text
            # 0.25 s between the fake's tokens: a relay that buffered would deliver them at once
            assert arrivals[-1] - arrivals[0] > 0.5
            mine = c.completions.create(model=MODEL, prompt="a b", max_tokens=2)
            assert mine.model == MODEL and fake.state.requests == 2
        finally:
            r.stop(signal.SIGTERM)


def _stream_events(url: str, body: dict, headers: dict | None = None) -> tuple[str, list[str]]:
    """(the worker that served it, the SSE data lines) of one streamed request."""
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        return r.headers.get(WORKER, ""), sse_data(r.iter_lines())


def _assert_ended_with_error(events: list[str]) -> None:
    assert events[-1] == "[DONE]", events
    assert json.loads(events[-2])["error"]["code"] == "upstream_disconnected", events


def test_a_stream_that_breaks_ends_with_an_error_event(tmp):
    """Bytes reached the client, so nothing can be retried: the client learns the answer is
    incomplete (never a silent truncation); a plain answer that breaks becomes a 502."""
    with start_fake(model="m", fail_mode="drop_mid_stream") as fake:
        r = start_router(tmp, [fake.url], "--policy", "round_robin")
        try:
            body = {"model": "m", "prompt": "a b c", "max_tokens": 20}
            _, events = _stream_events(f"{r.url}/v1/completions", body)
            assert len(events) >= 3 and json.loads(events[0])["choices"]
            _assert_ended_with_error(events)
            c = openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=60)
            with pytest.raises(openai.APIError):  # the client raises on the error event
                for _ in c.completions.create(model="m", prompt="a", max_tokens=20,
                                              stream=True):
                    pass
            plain = httpx.post(f"{r.url}/v1/completions", json=body, timeout=60)
            _assert_openai_error(plain, 502, "upstream_disconnected")
        finally:
            r.stop(signal.SIGTERM)


def test_queue_full_and_server_errors_spill_to_another_worker(tmp):
    """A 503 (queue full) or 500 before any byte is retried on the other worker; 500s eject
    the failing worker, 503s do not; a worker's own 4xx is its answer, not retried."""
    with start_fake(model="m", fail_mode="503") as bad, start_fake(model="m") as good:
        r = start_router(tmp, [bad.url, good.url], "--policy", "round_robin",
                         "--eject-cooldown", "600")
        try:
            c = openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=60)
            for _ in range(4):
                assert c.completions.create(model="m", prompt="x", max_tokens=2).choices
            assert bad.state.failed >= 1 and not workers_state(r)[bad.url]["ejected"]
            bad.configure(fail_mode="500")
            for _ in range(4):
                assert c.completions.create(model="m", prompt="x", max_tokens=2).choices
            assert workers_state(r)[bad.url]["ejected"]
            assert _metric(r, "tokenmill_router_retries_total") >= 2
            assert _metric(r, "tokenmill_router_ejections_total", bad.url) == 1
            routed = workers_state(r)[good.url]["routed"]
            with pytest.raises(openai.BadRequestError):  # the fake's 400 for max_tokens
                c.completions.create(model="m", prompt="x", max_tokens=5000)
            assert workers_state(r)[good.url]["routed"] == routed + 1
        finally:
            r.stop(signal.SIGTERM)


def _metric(router: Proc, name: str, worker: str | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{router.url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and (worker is None or s.labels.get("worker") == worker))


def test_all_workers_down_is_a_503_with_retry_after(tmp):
    fakes = [start_fake(model="m"), start_fake(model="m")]
    r = start_router(tmp, [f.url for f in fakes], "--retry-after", "7")
    try:
        for f in fakes:
            f.close()
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        for _ in range(3):  # before ejection (every try fails) and after (no candidate)
            resp = httpx.post(f"{r.url}/v1/completions", json=body, timeout=60)
            _assert_openai_error(resp, 503, "no_worker_available")
            assert resp.headers["retry-after"] == "7"
        wait_for(lambda: httpx.get(f"{r.url}/health", timeout=30).status_code == 503,
                 what="the router's /health to turn 503")
    finally:
        r.stop(signal.SIGTERM)


# ----- a tokenmill worker killed under load -------------------------------------------------------

def _load(router: Proc, i: int, stream: bool,
          first_event: threading.Event | None = None) -> tuple[str, list[str] | dict]:
    """One request of the batch: a stream long enough to be cut, or a plain completion."""
    body = {"model": MODEL, "prompt": f"Story number {i}:", "temperature": 0,
            "max_tokens": 96 if stream else 16, "ignore_eos": True}
    url = f"{router.url}/v1/completions"
    if not stream:
        r = httpx.post(url, json=body, headers=AUTH, timeout=180)
        return r.headers.get(WORKER, ""), {"status": r.status_code, **r.json()}
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH,
                      timeout=180) as r:
        worker, events = r.headers.get(WORKER, ""), []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if first_event is not None:
                    first_event.set()
        return worker, events


def test_a_killed_worker_loses_no_unstarted_request_and_comes_back(router, workers):
    victim, survivor = workers
    jobs = []
    with ThreadPoolExecutor(12) as pool:
        for i in range(4):  # one after another: round robin puts two on each worker
            first = threading.Event()
            jobs.append((True, pool.submit(_load, router, i, True, first)))
            assert first.wait(120), "a stream did not start"
        jobs += [(False, pool.submit(_load, router, i, False)) for i in range(4, 12)]
        wait_for(lambda: workers_state(router)[victim.url]["in_flight"] >= 4, 60,
                 "plain requests to reach the victim beside its streams")
        victim.stop()  # SIGKILL: connections drop mid-answer
        results = [(s, f.result(timeout=240)) for s, f in jobs]
    for stream, (worker, out) in results:
        if not stream:  # a plain answer had sent nothing yet: retried on the survivor
            assert out["status"] == 200 and len(out["choices"]) == 1, out
        elif worker == victim.url and "error" in out[-2]:
            _assert_ended_with_error(out)
        else:
            assert out[-1] == "[DONE]" and json.loads(out[-2])["choices"][0]["finish_reason"]
    assert any(s and w == victim.url and "error" in out[-2] for s, (w, out) in results)
    after = [_load(router, 100 + i, False) for i in range(3)]
    assert all(w == survivor.url and out["status"] == 200 for w, out in after)
    victim.start()  # same port: the router re-admits it after its cooldown
    wait_for(lambda: workers_state(router)[victim.url]["healthy"], 120, "re-admission")
    served = {_load(router, 200 + i, False)[0] for i in range(4)}
    assert served == {victim.url, survivor.url}


# ----- the pieces, without servers --------------------------------------------------------------

def test_route_key_renders_prompts_canonically():
    from tokenmill.router.proxy import route_key

    chat = {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                                                         "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": []}]}
    key = route_key(chat, "/v1/chat/completions")
    assert (key.model, key.text) == ("m", "<|system|>Be brief.\n<|user|>Hi there\n<|assistant|>\n")
    assert route_key({**chat, "cache_salt": "s1"}, "/v1/chat/completions").text.startswith("s1<|")
    assert route_key({"prompt": ["a", "b"]}, "/v1/completions").text == "a\nb"
    ids = route_key({"prompt": [1, 2, 3]}, "/v1/completions")
    assert ids.token_ids == [1, 2, 3] and ids.model is None
    responses = route_key({"instructions": "Sys", "input": "Q"}, "/v1/responses")
    assert responses.text == "<|system|>Sys\n<|user|>Q\n"
    assert route_key(None, "/v1/models").text == ""


def test_headers_to_and_from_workers():
    import httpx as hx

    from tokenmill.router.proxy import downstream_headers, event_boundary, upstream_headers

    client = {"Authorization": "Bearer client", "Connection": "keep-alive", "Host": "router",
              "Content-Type": "application/json", "Accept-Encoding": "gzip", "X-Trace": "1"}
    assert upstream_headers(client, None) == {
        "Authorization": "Bearer client", "Content-Type": "application/json", "X-Trace": "1",
        "accept-encoding": "identity"}
    assert upstream_headers(client, "wk")["authorization"] == "Bearer wk"
    assert "Authorization" not in upstream_headers(client, "wk")
    back = downstream_headers(hx.Headers({"content-type": "text/event-stream",
                                          "transfer-encoding": "chunked", "retry-after": "2"}))
    assert back == {"content-type": "text/event-stream", "retry-after": "2"}
    assert event_boundary(b"data: a\n\ndata: b") == len(b"data: a\n\n")
    assert event_boundary(b"data: a\r\n\r\n") == 11 and event_boundary(b"data: a") == 0


def test_circuit_breaker_ejects_and_readmits():
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.workers import WorkerPool

    pool = WorkerPool(RouterConfig(eject_after_failures=2, eject_cooldown_s=60))
    ejected = []
    pool.on_eject.append(lambda w: ejected.append(w.url))
    a, b = pool.add("127.0.0.1:1", models=["m"]), pool.add("http://127.0.0.1:2/", models=["n"])
    assert (a.url, b.url) == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert pool.candidates("m") == [a] and pool.candidates(None) == [a, b]
    pool.record_failure(a)
    pool.record_success(a)  # consecutive failures only
    pool.record_failure(a)
    assert a.healthy and not ejected
    pool.record_failure(a)
    assert not a.healthy and ejected == [a.url] and pool.candidates("m") == []
    assert pool.knows("m") and not pool.knows("x")
    assert not pool.probe_due(a, a.ejected_at + 1) and pool.probe_due(a, a.ejected_at + 61)
    pool.record_probe_success(a)  # the half-open probe after the cooldown
    assert pool.candidates("m") == [a] and a.failures == 0
    pool.record_failure(b)
    pool.record_probe_success(b)  # answering probes does not excuse failing requests
    pool.record_failure(b)
    assert b.ejected
    c = pool.add("http://127.0.0.1:3")
    pool.record_failure(c, probe=True)
    pool.record_probe_success(c)
    pool.record_failure(c, probe=True)
    assert c.healthy and c.serves("anything")  # models unknown: it may serve any


def test_router_flags_make_the_config():
    from tokenmill.cli import build_parser
    from tokenmill.router.cli import config_from_args

    args = build_parser().parse_args([
        "router", "--worker", "http://a:1", "--worker", "http://b:2", "--policy", "least_load",
        "--api-key", "k1", "--api-key", "k2", "--worker-api-key", "wk", "--max-retries", "5",
        "--eject-cooldown", "2.5", "--kv-event-endpoint", "http://a:1=tcp://a:5557",
        "--no-kv-events"])
    cfg = config_from_args(args)
    assert cfg.workers == ("http://a:1", "http://b:2") and cfg.policy == "least_load"
    assert cfg.api_keys == ("k1", "k2") and cfg.worker_api_key == "wk"
    assert (cfg.max_retries, cfg.eject_cooldown_s, cfg.kv_events) == (5, 2.5, False)
    assert cfg.kv_event_endpoints == (("http://a:1", "tcp://a:5557"),)
    assert cfg.health_check_interval_s == 5.0  # untouched: the dataclass default
    with pytest.raises(ValueError):
        config_from_args(build_parser().parse_args(["router"]))


def test_kv_subscriptions_follow_the_advertised_endpoint():
    """A worker restarted on free ports advertises new KV-event endpoints: the router drops
    what it mirrored and subscribes afresh; a worker that publishes nothing gets nothing."""
    import asyncio

    from tokenmill.router.kv_index import KVIndex
    from tokenmill.router.workers import KVSubscriptions, Worker

    advertised = {"http://w1": {"endpoint": "tcp://127.0.0.1:1", "topic": "kv"},
                  "http://w2": None}

    def server_info(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"kv_events": advertised[f"http://{request.url.host}"]})

    async def scenario() -> None:
        kv = KVSubscriptions(KVIndex(), {})
        async with httpx.AsyncClient(transport=httpx.MockTransport(server_info)) as client:
            for url in ("http://w1", "http://w2"):
                await kv.discover(Worker(url), client, httpx.Timeout(5))
            first = kv._subs["http://w1"][0]
            assert set(kv._subs) == {"http://w1"}
            await kv.discover(Worker("http://w1"), client, httpx.Timeout(5))
            assert kv._subs["http://w1"][0] is first  # unchanged: kept
            advertised["http://w1"] = {"endpoint": "tcp://127.0.0.1:2", "topic": "kv"}
            await kv.discover(Worker("http://w1"), client, httpx.Timeout(5))
            assert kv._subs["http://w1"][0] is not first
            assert kv._subs["http://w1"][0].endpoint == "tcp://127.0.0.1:2"
        kv.close()
        assert not kv._subs

    asyncio.run(scenario())


def test_sigterm_ends_the_router_with_status_0(tmp_path):
    """A graceful stop is not a crash: a supervisor must not see the router die of SIGTERM."""
    with start_fake(model="m") as fake:
        router = start_router(tmp_path, [fake.url])
        router.stop(signal.SIGTERM)
        assert router.proc is not None and router.proc.returncode == 0, router.log()
