"""Server limits, end to end: API keys, overload (503 + Retry-After) and graceful SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from tests.test_server_support import MODEL, metrics, start_server, stop_server

pytestmark = pytest.mark.slow

KEY = "sk-test-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the priority policy orders requests without a priority as first come, first served
    s = start_server(tmp_path_factory, "--api-key", KEY, "--max-queued-requests", "2",
                     "--max-num-seqs", "2", "--shutdown-timeout", "20",
                     "--scheduling-policy", "priority")
    yield s
    stop_server(s)


# Every route and whether it needs the key: all that reads model state or changes server state
# does; liveness, the version and the API's own description do not.
ROUTES = [
    ("GET", "/v1/models", True), ("GET", f"/v1/models/{MODEL}", True),
    ("POST", "/v1/completions", True), ("POST", "/v1/chat/completions", True),
    ("POST", "/v1/responses", True), ("POST", "/tokenize", True), ("POST", "/detokenize", True),
    ("POST", "/flush_cache", True), ("GET", "/metrics", True), ("GET", "/server_info", True),
    ("GET", "/no/such/route", True),
    ("GET", "/health", False), ("GET", "/version", False), ("GET", "/openapi.json", False),
]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}])
def test_missing_or_wrong_key_is_401_on_every_protected_route(server, headers):
    for method, path, protected in ROUTES:
        r = httpx.request(method, f"{server.url}{path}", headers=headers,
                          json={"model": MODEL, "prompt": "x", "tokens": [1]})
        if not protected:
            assert r.status_code == 200, (path, r.text)
            continue
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


BODIES = {
    "/v1/completions": {"prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    "/v1/responses": {"input": "x", "max_output_tokens": 1},
    "/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [1]},
}


def test_the_key_opens_every_protected_route(server):
    flushed_before = httpx.post(f"{server.url}/flush_cache").status_code
    assert flushed_before == 401  # state-changing: never without the key
    for i, (method, path, protected) in enumerate(ROUTES):
        if protected and path != "/no/such/route":
            # the scheme's case does not matter (RFC 9110), the key's does
            headers = AUTH if i % 2 else {"Authorization": f"bearer {KEY}"}
            r = httpx.request(method, f"{server.url}{path}", headers=headers,
                              json=BODIES.get(path))
            assert r.status_code == 200, (path, r.text)


def test_right_key_works(server):
    assert httpx.get(f"{server.url}/health").status_code == 200  # not under /v1
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    r = good.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens <= 2
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_priority_is_taken_under_the_priority_policy(server):
    """(Without it a priority is refused: tests/test_server_fields.py.)"""
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": -3})
    assert r.status_code == 200, r.text


def test_one_key_many_salts(server):
    """Holders of one API key who send their own cache_salt continue only their own stored
    responses."""
    def create(salt: str, **body) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60,
                          json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                "cache_salt": salt, **body})

    first = create("tenant-1").json()["id"]
    assert create("tenant-1", previous_response_id=first).status_code == 200
    assert create("tenant-2", previous_response_id=first).status_code == 404


def test_overload_gets_503_while_accepted_requests_complete(server):
    before = metrics(server.url, AUTH)
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 12, "ignore_eos": True}

    async def one(http):
        return await http.post("/v1/completions", json=body)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            return await asyncio.gather(*(one(http) for _ in range(16)))

    responses = asyncio.run(run())
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(rejected) == 16
    # 2 running slots + 2 queued get in at least
    assert len(ok) >= 4 and rejected, [r.status_code for r in responses]
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 12
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
    after = metrics(server.url, AUTH)
    key = ("tokenmill:admission_rejections_total", ())
    assert after[key] - before[key] == len(rejected)
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200  # the spike is over: served again


def test_sigterm_finishes_in_flight_request_then_exits_0(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        server.proc.send_signal(signal.SIGTERM)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"completion_tokens": 24' in events[-2]
    assert sum('"finish_reason": "length"' in e for e in events) == 1
    start = time.monotonic()
    assert server.proc.wait(30) == 0, server.log()
    assert time.monotonic() - start < 30
    assert "shutting down" in server.log()
