"""A server under hostile or unlucky use, end to end: request chat templates (trusted), huge
bodies, disconnecting clients, SIGTERM mid-stream. Each case gets its status and an OpenAI-style
body, and a normal request succeeds right after."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.test_server_support import MODEL, start_server, stop_server

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--trust-request-chat-template",
                     "--chat-template-timeout", "2", "--shutdown-timeout", "1")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, timeout=timeout,
                      headers={"content-type": "application/json"})


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    return err


def assert_serving(client) -> None:
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_trusted_request_template_renders(server, client):
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n" \
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    mine = post(server, "/v1/chat/completions", {"messages": CHAT, "chat_template": template,
                                                 "max_tokens": 4, "temperature": 0})
    assert mine.status_code == 200, mine.text
    # SmolLM2's own template adds a default system prompt: another prompt, other tokens
    default = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                             temperature=0)
    assert mine.json()["usage"]["prompt_tokens"] < default.usage.prompt_tokens


@pytest.mark.parametrize("template,words", [
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "did not finish within 2 s"),
    ("{{ 'x' * 10000000000 }}", "repeats a sequence"),
    ("{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}", "more than"),
    ("{% if %}", "does not compile"),
])
def test_hostile_request_template_fails_that_request_alone(server, client, template, words):
    start = time.monotonic()
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "chat_template": template})
    err = assert_error(r, 400, "chat_template")
    assert words in err["message"]
    assert time.monotonic() - start < 10
    assert_serving(client)


def test_huge_bodies_are_refused_without_stalling_the_server(server, client):
    huge = json.dumps({"prompt": "a" * (50 << 20), "ignored_field": 1}).encode()
    for path in ("/tokenize", "/v1/completions"):
        err = assert_error(post(server, path, huge), 413, None)
        assert err["code"] == "request_too_large"
    # The largest body the server reads: parsed, then its prompt refused before tokenizing.
    maximal = json.dumps({"prompt": "hello world " * 2_700_000}).encode()
    assert len(maximal) < 32 << 20
    result: dict = {}

    def send() -> None:
        result["r"] = post(server, "/v1/completions", maximal)

    thread = threading.Thread(target=send)
    thread.start()
    latencies = []
    while thread.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.01)
    thread.join()
    err = assert_error(result["r"], 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert latencies and max(latencies) < 1.0, latencies
    assert_serving(client)


def test_disconnects_are_quiet(server):
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=0.6) as http:
            for extra in ({}, {"n": 2}):
                with pytest.raises(httpx.ReadTimeout):
                    await http.post("/v1/completions", json={**body, **extra})
            async with http.stream("POST", "/v1/completions",
                                   json={**body, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break
        await asyncio.sleep(1.0)

    before = server.log()
    asyncio.run(run())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.log().count(" aborted: ") < \
            before.count(" aborted: ") + 3:
        time.sleep(0.1)
    new = server.log()[len(before):]
    assert new.count(" aborted: ") == 3, new
    assert not re.search(r"ERROR|Traceback|never retrieved|Exception", new), new


def test_sigterm_ends_cut_streams_with_an_error_event_and_done(server):
    """Last: the server goes away. Its 1 s drain cannot finish 400-token streams."""
    body = {"model": MODEL, "prompt": "Tell", "max_tokens": 2000, "ignore_eos": True}

    async def stream(http) -> list[str]:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            return [line async for line in r.aiter_lines() if line]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            tasks = [asyncio.create_task(stream(http)) for _ in range(4)]
            plain = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(1.5)
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks), await plain

    streams, plain = asyncio.run(run())
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "unavailable"
        assert len(lines) > 3  # tokens came before the cut
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "unavailable"
    assert server.proc.wait(30) == 0
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
