"""``kv_transfer_params`` (vLLM's prefill/decode hand-off) at the HTTP layer of a server with
no KV connector: every use of it is a 400 naming the field, in OpenAI's error shape, whether
the server refuses it (shape, size, several prompts, n or stream with do_remote_decode, the
Responses API) or the engine does (no connector); null asks for nothing. A producer's answer
carrying the params is checked with real producer/consumer servers in test_kv_pd_real.py."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from tests.test_server_support import MODEL, server_fixtures
from tokenmill.server.formatters import with_kv_transfer
from tokenmill.server.protocol import KV_TRANSFER_PARAMS_MAX_CHARS

server, client = server_fixtures()

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}
DECODE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
          "remote_request_id": "cmpl-1", "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
          "remote_port": 5600, "tp_size": 1}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def refused(r: httpx.Response, *words: str) -> str:
    """The message of a 400 naming kv_transfer_params; each of ``words`` is in it."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params" and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error
    return error["message"]


def test_without_a_kv_connector_the_engine_refuses_it(server):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        for params in (PREFILL, DECODE, {}):
            message = refused(post(server, path, {**body, "kv_transfer_params": params}),
                              "no KV connector")
            assert message.startswith("kv_transfer_params: ")
    # streamed: refused before the stream starts, as any other refusal
    r = post(server, "/v1/chat/completions", {**CHAT, "stream": True, "kv_transfer_params": DECODE})
    refused(r, "no KV connector")


def test_null_asks_for_nothing(server):
    r = post(server, "/v1/completions", {**COMPLETION, "kv_transfer_params": None})
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in r.json()  # no hand-off: the answer keeps its shape
    r = post(server, "/v1/chat/completions", {**CHAT, "kv_transfer_params": None})
    assert r.status_code == 200 and "kv_transfer_params" not in r.json()


def test_malformed_values_are_refused(server):
    for value in ("producer", [PREFILL], 1, True):
        refused(post(server, "/v1/completions", {**COMPLETION, "kv_transfer_params": value}))
    big = {**DECODE, "remote_block_ids": list(range(KV_TRANSFER_PARAMS_MAX_CHARS // 4))}
    refused(post(server, "/v1/chat/completions", {**CHAT, "kv_transfer_params": big}),
            "characters")
    # checked whole, as every field is: no lone surrogate (valid JSON, not text)
    raw = b'{"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"a": "\\ud800"}}'
    r = httpx.post(f"{server.url}/v1/completions", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    refused(r, "surrogate")


def test_what_one_hand_off_cannot_name_is_refused(server):
    several = {**COMPLETION, "prompt": ["Once", "Twice"], "kv_transfer_params": DECODE}
    refused(post(server, "/v1/completions", several), "single prompt")
    ids = {**COMPLETION, "prompt": [[1, 2, 3], [4, 5]], "kv_transfer_params": DECODE}
    refused(post(server, "/v1/completions", ids), "single prompt")
    refused(post(server, "/v1/chat/completions", {**CHAT, "n": 2, "kv_transfer_params": PREFILL}),
            "n=1")
    refused(post(server, "/v1/completions",
                 {**COMPLETION, "stream": True, "kv_transfer_params": PREFILL}), "stream=false")


def test_the_responses_api_refuses_it(server):
    r = post(server, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                                        "kv_transfer_params": DECODE})
    refused(r, "not supported")
    r = post(server, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                                        "kv_transfer_params": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("outputs, expected", [
    ([SimpleNamespace(kv_transfer_params=None)], None),
    ([SimpleNamespace(kv_transfer_params=DECODE)], DECODE),
])
def test_the_answer_carries_the_connectors_params(outputs, expected):
    body = with_kv_transfer({"id": "x", "choices": []}, outputs)
    assert body.get("kv_transfer_params", None) == expected
    assert ("kv_transfer_params" in body) == (expected is not None)
