"""Prefill/decode disaggregation with real servers and the default model: a producer prefills,
a consumer pulls the KV and decodes, and the tokens are those of one server doing both; the
producer frees what nobody pulls. Then ``kv_transfer_params`` at the HTTP layer: a 400 naming
the field for what one hand-over cannot name (shape, size, several prompts, n or stream with
do_remote_decode, the Responses API); null asks for nothing. (A server without a connector
refuses the field: test_server_fields.py. Transfers cut or lost: test_kv_transfer_engine.py.)"""

from __future__ import annotations

import json
import signal
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.test_router_server import FAST_HEALTH, Proc
from tests.test_server_support import MODEL, free_port, metrics, start_server, stop_server
from tokenmill.server.formatters import with_kv_transfer
from tokenmill.server.protocol import KV_TRANSFER_PARAMS_MAX_CHARS

# loads the real model or starts servers / ranks: not in the fast loop
pytestmark = pytest.mark.slow

BS = 16
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The keeper has lived alone on the island for eleven years, keeps a logbook of every "
          "ship that passes, and talks to the gulls as if they were old friends. One stormy "
          "morning, wedged between two rocks below the lamp room, there is a green glass bottle "
          "sealed with red wax. Inside is a letter written in a careful, old-fashioned hand, "
          "addressed to the keeper by name, and dated forty years before he was born.")
# One thread each: the servers share two cores. Float32: the consumer computes the last
# prompt token in a batch of one where one server computes it with the whole prompt, and in
# bf16 that rounds differently (as a prefix-cache hit does, issue 47), so greedy text may part
# late in a long answer; the KV itself moves bit for bit in every dtype (test_kv_p2p.py).
FLAGS = ("--num-threads", "1", "--dtype", "float32")
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}
DECODE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
          "remote_request_id": "cmpl-1", "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
          "remote_port": 5600, "tp_size": 1}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def _server(tmp_path_factory, *flags: str):
    s = start_server(tmp_path_factory, *FLAGS, *flags)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    yield from _server(tmp_path_factory, "--kv-role", "producer", "--kv-transfer-timeout", "3")


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    # drafts verified on pulled KV: speculative decoding is lossless there too
    yield from _server(tmp_path_factory, "--kv-role", "consumer", "--kv-pull-timeout", "3",
                       "--speculative-method", "ngram")


def _complete(url: str, kv_params: dict | None = None, max_tokens: int = 24,
              prompt: str = PROMPT) -> dict:
    body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _prefill(url: str, prompt: str = PROMPT) -> dict:
    out = _complete(url, PREFILL, max_tokens=1, prompt=prompt)
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_port"] > 0 and params["remote_block_ids"]
    return params


def _counter(url: str, name: str) -> float:
    return metrics(url)[(f"tokenmill:{name}_total", ())]


def _gauge(url: str, name: str) -> float:
    return metrics(url)[(f"tokenmill:{name}", ())]


def _wait_gauge(url: str, name: str, value: float, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    while (got := _gauge(url, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


@pytest.fixture(scope="module")
def reference(producer) -> dict:
    """One server doing both: the aggregated answer."""
    return _complete(producer.url)


def _fresh(producer, tag: str) -> tuple[str, str]:
    """A prompt no server has cached yet, and its aggregated answer. Each test that counts
    what the consumer computes needs its own: the consumer's prefix cache keeps the others."""
    prompt = f"Story {tag}. {PROMPT}"
    return prompt, _complete(producer.url, prompt=prompt)["choices"][0]["text"]


def test_pd_matches_aggregated_and_the_consumer_computes_one_prompt_token(
        producer, consumer, reference):
    params = _prefill(producer.url)
    assert _gauge(producer.url, "kv_held_requests") == 1
    computed = _counter(consumer.url, "prompt_tokens_computed")
    external = _counter(consumer.url, "external_prefix_cache_hits")
    out = _complete(consumer.url, params)
    n_prompt = out["usage"]["prompt_tokens"]
    assert out["choices"][0]["text"] == reference["choices"][0]["text"]
    assert _counter(consumer.url, "prompt_tokens_computed") - computed == 1
    assert _counter(consumer.url, "external_prefix_cache_hits") - external == n_prompt - 1
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    # pulled and acknowledged: the producer's blocks are free again
    assert _wait_gauge(producer.url, "kv_held_requests", 0) == 0
    assert metrics(consumer.url)[("tokenmill:kv_tier_hits_total", (("tier", "p2p"),))] > 0


def test_pd_streams(producer, consumer, reference):
    params = _prefill(producer.url)
    client = openai.OpenAI(base_url=f"{consumer.url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT,
                                       max_tokens=24, temperature=0, stream=True,
                                       extra_body={"kv_transfer_params": params})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == reference["choices"][0]["text"]


def test_structured_output_on_pulled_kv(producer, consumer):
    prompt = f"Story json. {PROMPT} Reply with JSON."
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                               "year": {"type": "integer"}},
              "required": ["title", "year"], "additionalProperties": False}
    params = _prefill(producer.url, prompt)
    body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 64,
            "temperature": 0, "kv_transfer_params": params,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "story", "schema": schema}}}
    r = httpx.post(f"{consumer.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    value = json.loads(r.json()["choices"][0]["text"])
    assert set(value) == {"title", "year"} and isinstance(value["year"], int)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_unpulled_blocks_are_freed_after_the_timeout(producer):
    _prefill(producer.url)
    assert _gauge(producer.url, "kv_held_requests") >= 1
    assert _wait_gauge(producer.url, "kv_held_requests", 0, timeout=20) == 0


def test_a_request_without_a_connector_role_is_refused(consumer):
    r = httpx.post(f"{consumer.url}/v1/completions", timeout=30, json={
        "model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 1,
        "kv_transfer_params": PREFILL})
    assert r.status_code == 400 and "kv_transfer_params" in r.text


def test_router_pd_mode_end_to_end(producer, consumer, tmp_path):
    prompt, expected = _fresh(producer, "router")
    router = Proc(["router", "--pd", "--prefill", producer.url, "--decode", consumer.url,
                   *FAST_HEALTH], free_port(), tmp_path / "router.log").start()
    try:
        external = _counter(consumer.url, "external_prefix_cache_hits")
        out = _complete(router.url, prompt=prompt)
        assert out["choices"][0]["text"] == expected
        assert _counter(consumer.url, "external_prefix_cache_hits") > external
    finally:
        router.stop(signal.SIGTERM)


# ----- the field at the HTTP layer (a server without a connector: test_server_fields.py) -----

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


def test_null_asks_for_nothing(consumer):
    r = post(consumer, "/v1/completions", {**COMPLETION, "kv_transfer_params": None})
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in r.json()  # no hand-off: the answer keeps its shape
    r = post(consumer, "/v1/chat/completions", {**CHAT, "kv_transfer_params": None})
    assert r.status_code == 200 and "kv_transfer_params" not in r.json()


def test_malformed_values_are_refused(consumer):
    for value in ("producer", [PREFILL], 1, True):
        refused(post(consumer, "/v1/completions", {**COMPLETION, "kv_transfer_params": value}))
    big = {**DECODE, "remote_block_ids": list(range(KV_TRANSFER_PARAMS_MAX_CHARS // 4))}
    refused(post(consumer, "/v1/chat/completions", {**CHAT, "kv_transfer_params": big}),
            "characters")
    # checked whole, as every field is: no lone surrogate (valid JSON, not text)
    raw = b'{"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"a": "\\ud800"}}'
    r = httpx.post(f"{consumer.url}/v1/completions", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    refused(r, "surrogate")


def test_what_one_hand_off_cannot_name_is_refused(consumer):
    several = {**COMPLETION, "prompt": ["Once", "Twice"], "kv_transfer_params": DECODE}
    refused(post(consumer, "/v1/completions", several), "single prompt")
    ids = {**COMPLETION, "prompt": [[1, 2, 3], [4, 5]], "kv_transfer_params": DECODE}
    refused(post(consumer, "/v1/completions", ids), "single prompt")
    refused(post(consumer, "/v1/chat/completions", {**CHAT, "n": 2, "kv_transfer_params": PREFILL}),
            "n=1")
    refused(post(consumer, "/v1/completions",
                 {**COMPLETION, "stream": True, "kv_transfer_params": PREFILL}), "stream=false")


def test_the_responses_api_refuses_it(consumer):
    r = post(consumer, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                                        "kv_transfer_params": DECODE})
    refused(r, "not supported")
    r = post(consumer, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3,
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
