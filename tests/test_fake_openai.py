"""benchmarks/peers/fake_openai.py, the foreign OpenAI server the router tests stand behind:
the official ``openai`` client must accept its answers, and each failure mode must look like the
failure it imitates."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

from fake_openai import start_fake  # noqa: E402

from tests.test_server_support import free_port  # noqa: E402


@pytest.fixture()
def fake():
    srv = start_fake(model="fake-a")
    yield srv
    srv.close()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_non_stream_n2_deterministic(fake):
    c = _client(fake)
    a = c.completions.create(model="fake-a", prompt="one two three", max_tokens=5, n=2)
    b = c.completions.create(model="fake-a", prompt="one two three", max_tokens=5, n=2)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.choices[0].text != a.choices[1].text and len(a.choices[0].text.split()) == 5
    assert a.usage.prompt_tokens == 3 and a.usage.completion_tokens == 10
    other = c.completions.create(model="fake-a", prompt="something else", max_tokens=5)
    assert other.choices[0].text != a.choices[0].text
    chat = c.chat.completions.create(model="fake-a", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].message.content.split()) == 4


def test_stream_chat_and_completion(fake):
    c = _client(fake)
    msgs = [{"role": "user", "content": "hi"}]
    pieces: dict[int, str] = {0: "", 1: ""}
    usage = None
    for chunk in c.chat.completions.create(model="fake-a", messages=msgs, max_tokens=3, n=2,
                                           stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            pieces[ch.index] += ch.delta.content or ""
    full = c.chat.completions.create(model="fake-a", messages=msgs, max_tokens=3, n=2)
    assert [pieces[0], pieces[1]] == [ch.message.content for ch in full.choices]
    assert usage.completion_tokens == 6
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="fake-a", prompt="p", max_tokens=4, stream=True) if ch.choices)
    assert len(text.split()) == 4


def test_models_health_stats_and_unknown_model(fake):
    assert [m.id for m in _client(fake).models.list()] == ["fake-a"]
    assert httpx.get(fake.url + "/health").status_code == 200
    assert httpx.post(fake.url + "/tokenize", json={"prompt": "x"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        _client(fake).completions.create(model="other", prompt="p", max_tokens=2)
    _client(fake).completions.create(model="fake-a", prompt="p", max_tokens=2)
    assert httpx.get(fake.url + "/stats").json()["requests"] == 1
    fake.configure(healthy=False)
    assert httpx.get(fake.url + "/health").status_code == 503


def test_failure_modes_and_healing():
    with start_fake(model="m", fail_mode="503", fail_after=1, fail_count=2) as srv:
        c = _client(srv)
        c.completions.create(model="m", prompt="p", max_tokens=2)  # the one before failing
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(model="m", prompt="p", max_tokens=2)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
        c.completions.create(model="m", prompt="p", max_tokens=2)  # healed after fail_count
        srv.configure(fail_mode="500")
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="m", prompt="p", max_tokens=2)
        assert e.value.status_code == 500
        httpx.post(srv.url + "/fake/config", json={"fail_mode": None}).raise_for_status()
        c.completions.create(model="m", prompt="p", max_tokens=2)


def test_drop_mid_stream_truncates():
    with start_fake(model="m", fail_mode="drop_mid_stream") as srv:
        got = []
        with pytest.raises(openai.APIConnectionError):
            for chunk in _client(srv).completions.create(model="m", prompt="p", max_tokens=50,
                                                         stream=True):
                got.append(chunk)
        assert 0 < len(got) < 50  # some chunks came before the connection died
        with pytest.raises(openai.APIConnectionError):
            _client(srv).completions.create(model="m", prompt="p", max_tokens=5)
        assert httpx.get(srv.url + "/stats").json()["in_flight"] == 0


def test_imports_neither_torch_nor_tokenmill():
    code = ("import sys; sys.path.insert(0, 'benchmarks/peers'); import fake_openai; "
            "print(sorted(m for m in ('torch', 'tokenmill') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_command_line():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks/peers/fake_openai.py"),
                             "--port", str(port), "--model", "cli-model"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "cli-model"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
