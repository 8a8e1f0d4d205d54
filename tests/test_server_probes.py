"""Failing steps and the health probes, end to end: a real ``tokenmill serve`` whose engine
steps fail or slow down where a test asks (the hidden, test-only ``--test-faults`` flag: rules
fire for requests whose X-Request-Id contains their mark).

A failed step's client gets a 500 error body, or an SSE error event and ``[DONE]``, and the
server goes on; ``/health`` turns 503 while a step overruns ``--step-timeout`` and once the
engine has stopped; ``/health?generate=true`` needs the API key and answers 200 "busy" when the
queue is full. The last test stops the engine: it must stay last.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from tests.test_server_support import MODEL, metrics, start_server, stop_server

pytestmark = pytest.mark.slow

KEY = "sk-probe-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
STEP_TIMEOUT = 2.0
SLOW_STEP = 4.0  # over STEP_TIMEOUT
FAULTS = ";".join([
    "forward:fail-:raise",  # the model step of a fail-* request raises
    f"forward:slow-:sleep={SLOW_STEP}",
    "forward:busy-:sleep=0.3",  # slow, within the step timeout
    "step:fatal-:raise",  # before any request is touched: no one to blame, step after step
])
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0.0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "A JSON object, please."}],
        "max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, sockets_home):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(sockets_home))  # where the server makes its sockets' folder
        s = start_server(tmp_path_factory, "--api-key", KEY, "--max-num-seqs", "1",
                         "--max-queued-requests", "1", "--step-timeout", str(STEP_TIMEOUT),
                         "--test-faults", FAULTS, timeout=300)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def sockets_home(tmp_path_factory):
    return tmp_path_factory.mktemp("sockets")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def health(server, generate: bool = False, headers: dict | None = None) -> httpx.Response:
    return httpx.get(f"{server.url}/health", params={"generate": "true"} if generate else None,
                     headers=headers, timeout=30)


def wait_health(server, status: int, timeout: float = 15.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = health(server)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def wait_idle(server, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(server.url, AUTH)
        if m[("tokenmill:num_requests_running", ())] + m[
                ("tokenmill:num_requests_waiting", ())] == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not become idle")


def complete(client, request_id: str, **extra) -> str:
    return client.completions.create(**{**BODY, **extra},
                                     extra_headers={"X-Request-Id": request_id}).choices[0].text


def test_a_failing_step_fails_its_request_with_an_error_and_the_server_goes_on(server, client):
    expected = complete(client, "before")
    with pytest.raises(openai.InternalServerError) as e:
        complete(client, "fail-plain")
    assert e.value.status_code == 500
    err = e.value.response.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "request_failed"
    assert "InjectedFault" in err["message"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**BODY, "stream": True},
                      headers={**AUTH, "X-Request-Id": "fail-streamed"}, timeout=60) as r:
        assert r.status_code == 200  # the stream had begun when the step failed
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 2, events
    assert json.loads(events[0])["error"]["code"] == "request_failed"
    # A constrained request: the grammar's masks were being filled when its step failed.
    json_mode = {"response_format": {"type": "json_object"}}
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(**CHAT, **json_mode,
                                       extra_headers={"X-Request-Id": "fail-json"})
    assert e.value.status_code == 500
    assert client.chat.completions.create(**CHAT, **json_mode).choices[0].message.content
    assert complete(client, "after") == expected  # token for token as before the failures
    assert health(server).json() == {"status": "ok"}


def test_health_generate_needs_the_key(server):
    assert health(server).json() == {"status": "ok"}  # liveness stays public
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = health(server, generate=True, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = health(server, generate=True, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_health_generate_answers_busy_when_the_queue_is_full(server):
    long = {**BODY, "max_tokens": 64, "ignore_eos": True, "stream": True}

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=long,
                                   headers={"X-Request-Id": "busy-running"}) as running:
                lines = running.aiter_lines()  # kept: a dropped one closes the stream
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # it runs (0.3 s a step), in the server's only seat
                queued = asyncio.create_task(http.post(
                    "/v1/completions", json={**BODY, "max_tokens": 2},
                    headers={"X-Request-Id": "busy-queued"}))
                await asyncio.to_thread(wait_waiting, server)
                probe = await http.get("/health", params={"generate": "true"})
                plain = await http.get("/health")
            # leaving the stream aborts the running request; the queued one then runs
            return probe, plain, await queued

    probe, plain, queued = asyncio.run(scenario())
    assert probe.status_code == 200 and probe.json()["status"] == "busy", probe.text
    assert "queue is full" in probe.json()["reason"]
    assert plain.status_code == 200 and plain.json() == {"status": "ok"}
    assert queued.status_code == 200 and queued.json()["usage"]["completion_tokens"] == 2
    wait_idle(server)


def wait_waiting(server, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while metrics(server.url, AUTH)[("tokenmill:num_requests_waiting", ())] < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.05)


def test_health_turns_503_while_a_step_overruns_the_step_timeout(server, client):
    assert wait_health(server, 200).status_code == 200
    done: dict[str, str] = {}
    slow = threading.Thread(target=lambda: done.update(text=complete(
        client, "slow-step", max_tokens=1)))
    slow.start()
    stalled = wait_health(server, 503)
    assert stalled.status_code == 503, "no 503 while the step overran --step-timeout"
    assert stalled.json()["status"] == "unhealthy"
    assert "--step-timeout" in stalled.json()["reason"]
    slow.join(60)
    assert "text" in done  # the slow request itself succeeded
    assert wait_health(server, 200).json() == {"status": "ok"}  # healthy once the step ended
    assert "an engine step has run for" in server.log()


def test_repeated_failures_with_no_request_to_blame_stop_the_engine(server, client,
                                                                     sockets_home):
    """Last: the engine stops for good. The engine core's sockets' folder goes with it, while
    the server still answers (killed later, it would never remove it)."""
    assert list(sockets_home.glob("tokenmill-core-*"))
    with pytest.raises(openai.InternalServerError) as e:
        complete(client, "fatal-1")
    assert e.value.status_code == 503
    r = health(server)
    assert r.status_code == 503 and r.json()["status"] == "unhealthy"
    assert "EngineDeadError" in r.json()["reason"] and "no request to blame" in r.json()["reason"]
    assert health(server, generate=True, headers=AUTH).status_code == 503
    with pytest.raises(openai.InternalServerError) as e:
        complete(client, "after-the-end")
    assert e.value.status_code == 503 and e.value.response.json()["error"]["code"] == "unavailable"
    assert "engine loop died" in server.log()
    assert server.proc.poll() is None and not list(sockets_home.glob("tokenmill-core-*"))
