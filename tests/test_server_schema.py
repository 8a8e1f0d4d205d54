"""The OpenAPI document tells the truth: schemathesis sends generated requests (valid and not)
to a real ``tokenmill serve`` of a tiny random-weight model and checks that every answer is a
documented status, content type and body, and never a server error.

``TOKENMILL_SCHEMA_EXAMPLES`` sets the examples per operation (default 100; a longer run:
``TOKENMILL_SCHEMA_EXAMPLES=2000``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
import schemathesis
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_headers_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

from tests.test_server_support import start_server, stop_server
from tokenmill.server.openapi import ROUTES, STREAMING

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("TOKENMILL_SCHEMA_EXAMPLES", "100"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
EOS = "<eos>"
# Reads ``tools`` itself, so offered tools cost a few tokens instead of a system prompt.
CHAT_TEMPLATE = ("{% if tools %}<tools:{{ tools | length }}>{% endif %}"
                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
MAX_MODEL_LEN = 128


def write_tiny_model(directory: Path) -> Path:
    """A random qwen3 whose tokens are the 256 bytes (byte-level, no merges) and ``<eos>``:
    any text is a prompt, any grammar can be followed, and the server's grammar backend reads
    it as it reads a real byte-level tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from tests.tiny_models import make_hf_model, save_hf_model

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    save_hf_model(make_hf_model("qwen3", vocab_size=tok.get_vocab_size(),
                                max_position_embeddings=MAX_MODEL_LEN), directory)
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "chat_template": CHAT_TEMPLATE}))
    return directory


# ----- the document, without a server ----------------------------------------------------------

def test_document_lists_what_each_route_returns():
    from tests.test_engine_unit import make_engine
    from tokenmill.server.app import ServerSettings, create_app

    app = create_app(make_engine(), ServerSettings("fake"))
    doc = app.openapi()
    routes = {r.path_format for r in app.routes if isinstance(r, APIRoute)}
    assert routes <= set(ROUTES), f"routes missing from openapi.ROUTES: {routes - set(ROUTES)}"
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    refs = {m.group(1) for m in re.finditer(r'"#/components/schemas/(\w+)"', json.dumps(doc))}
    assert refs <= set(schemas), refs - set(schemas)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            where = f"{method.upper()} {path}"
            responses = op["responses"]
            assert set(map(int, responses)) == set(ROUTES[path]), where
            assert "422" not in responses, where  # validation errors are 400s
            if "requestBody" in op:
                assert "400" in responses, where
            for status, response in responses.items():
                content = response.get("content", {})
                if path == "/health" and status == "503":  # the same body as its 200
                    assert content == {"application/json": {
                        "schema": {"$ref": "#/components/schemas/HealthStatus"}}}, where
                elif status == "200":
                    assert content and all("schema" in c for c in content.values()), where
                else:  # /v1/messages answers Anthropic's errors, but the middleware's
                    body = "AnthropicErrorBody" if path.startswith("/v1/messages") and \
                        status not in ("401", "413") else "ErrorBody"
                    assert content == {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{body}"}}}, where
            if path in STREAMING:
                assert set(responses["200"]["content"]) == {"application/json",
                                                            "text/event-stream"}, where
            if "503" in responses and path != "/health":
                assert "Retry-After" in responses["503"]["headers"], where
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert doc is app.openapi()  # built once


# ----- the server, fuzzed -----------------------------------------------------------------------

SERVED_NAME = "org/tiny"  # a slash, as in real names: /v1/models/{model_id} must take it
SERVE_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256blocks",
               "--max-num-seqs", "8", "--served-model-name", SERVED_NAME)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    s = start_server(tmp_path_factory, *SERVE_FLAGS, model=str(tiny_model), timeout=300)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def api_schema(server):
    # Unsanitized reports: schemathesis hides values of keys that look secret, and "token"
    # matches max_tokens, stop_token_ids and /detokenize's tokens.
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


# Nothing is excluded: /flush_cache's 400 (requests running) is documented, and requests here
# run one at a time anyway.
# The pooling routes answer this generation model with a 400 before anything reaches the engine
# (tests/test_embeddings_server.py runs them on models that serve them): their bodies' checks
# get a fifth of the examples.
POOLING_ROUTES = r"^/v1/(embeddings|rerank|score)$"
FUZZ = dict(derandomize=True, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                   HealthCheck.data_too_large])


@schema.exclude(path_regex=POOLING_ROUTES).parametrize()
@settings(max_examples=EXAMPLES, **FUZZ)
def test_every_answer_is_documented(case, server):
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)


@schema.include(path_regex=POOLING_ROUTES).parametrize()
@settings(max_examples=max(10, EXAMPLES // 5), **FUZZ)
def test_every_pooling_answer_is_documented(case, server):
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)


# ----- chosen requests the generator seldom builds ----------------------------------------------

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
              "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
CHAT = [{"role": "user", "content": "hi"}]
COMPLETIONS, CHAT_COMPLETIONS, RESPONSES = ("/v1/completions", "/v1/chat/completions",
                                            "/v1/responses")
# (method, path, schemathesis Case arguments, the status)
CHOSEN = [
    ("POST", COMPLETIONS, {"body": {"prompt": "ab", "max_tokens": 5, "logprobs": 2}}, 200),
    # echo with logprobs: the prompt's own logprobs too (the first null)
    ("POST", COMPLETIONS, {"body": {"prompt": "ab", "max_tokens": 5, "logprobs": 2,
                                    "echo": True}}, 200),
    ("POST", COMPLETIONS, {"body": {"prompt": [[5, 6], [7]], "max_tokens": 4, "n": 2,
                                    "stop": ["a"]}}, 200),
    ("POST", COMPLETIONS, {"body": {"prompt": "ab", "max_tokens": 6, "stream": True,
                                    "logprobs": 1, "echo": True,
                                    "stream_options": {"include_usage": True}}}, 200),
    ("POST", COMPLETIONS, {"body": {"prompt": "ab", "max_tokens": 6, "stream": True,
                                    "logprobs": 1, "echo": False,
                                    "stream_options": {"include_usage": True}}}, 200),
    ("POST", COMPLETIONS, {"body": {"prompt": "ab", "max_tokens": 8,
                                    "guided_json": {"type": "object"}}}, 200),
    ("POST", COMPLETIONS, {"body": {"prompt": "ab", "model": "nope"}}, 404),
    ("POST", CHAT_COMPLETIONS, {"body": {"messages": CHAT, "max_tokens": 5, "logprobs": True,
                                         "top_logprobs": 2, "n": 2}}, 200),
    ("POST", CHAT_COMPLETIONS, {"body": {"messages": CHAT, "max_tokens": 6, "stream": True,
                                         "logprobs": True,
                                         "stream_options": {"include_usage": True}}}, 200),
    ("POST", CHAT_COMPLETIONS, {"body": {"messages": CHAT, "max_tokens": 96, "tools": [TOOL],
                                         "tool_choice": "required"}}, 200),
    ("POST", CHAT_COMPLETIONS, {"body": {"messages": CHAT, "max_tokens": 96, "tools": [TOOL],
                                         "tool_choice": "required", "stream": True}}, 200),
    ("POST", CHAT_COMPLETIONS, {"body": {"messages": CHAT, "max_tokens": 20, "response_format":
                                         {"type": "json_object"}}}, 200),
    ("POST", RESPONSES, {"body": {"input": "hi", "max_output_tokens": 5}}, 200),
    ("POST", RESPONSES, {"body": {"input": "hi", "max_output_tokens": 5, "stream": True}}, 200),
    ("POST", RESPONSES, {"body": {"input": "hi", "max_output_tokens": 96,
                                  "tools": [RESPONSES_TOOL], "tool_choice": "required"}}, 200),
    ("POST", RESPONSES, {"body": {"input": "hi", "max_output_tokens": 96, "stream": True,
                                  "tools": [RESPONSES_TOOL], "tool_choice": "required"}}, 200),
    ("POST", RESPONSES, {"body": {"input": "hi", "previous_response_id": "resp_none"}}, 404),
    ("POST", "/tokenize", {"body": {"messages": CHAT}}, 200),
    ("POST", "/detokenize", {"body": {"tokens": [1, 2, 95]}}, 200),
    # a generation model: embeddings and scores are refused, in the documented shape
    ("POST", "/v1/embeddings", {"body": {"input": ["ab", "c"], "dimensions": 4}}, 400),
    ("POST", "/v1/rerank", {"body": {"query": "a", "documents": [{"text": "b"}]}}, 400),
    ("GET", "/v1/models/{model_id}", {"path_parameters": {"model_id": SERVED_NAME}}, 200),
    ("GET", "/v1/models/{model_id}", {"path_parameters": {"model_id": "nope"}}, 404),
    ("GET", "/health", {"query": {"generate": True}}, 200),
]


@pytest.mark.parametrize("method, path, kwargs, status", CHOSEN,
                         ids=[f"{m} {p} {i}" for i, (m, p, _, _) in enumerate(CHOSEN)])
def test_chosen_answers_match_the_document(api_schema, server, method, path, kwargs, status):
    if "body" in kwargs:
        kwargs = {**kwargs, "media_type": "application/json"}
    case = api_schema[path][method].Case(**kwargs)
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code == status, response.text
    case.validate_response(response, checks=CHECKS)
    body = kwargs.get("body", {})
    if body.get("tool_choice") == "required" and not body.get("stream"):
        calls = (response.json()["choices"][0]["message"]["tool_calls"] if path != RESPONSES
                 else [i for i in response.json()["output"] if i["type"] == "function_call"])
        assert calls


def test_a_response_chain_matches_the_document(api_schema, server):
    operation = api_schema[RESPONSES]["POST"]
    previous = None
    for _ in range(2):
        case = operation.Case(body={"input": "hi", "max_output_tokens": 4,
                                    "previous_response_id": previous},
                              media_type="application/json")
        response = case.call(base_url=server.url, timeout=60)
        assert response.status_code == 200, response.text
        case.validate_response(response, checks=CHECKS)
        previous = response.json()["id"]


def test_statuses_without_the_api_key(tmp_path_factory, tiny_model):
    """With --api-key, a request without it gets 401 exactly where the document says so."""
    keyed = start_server(tmp_path_factory, *SERVE_FLAGS, "--api-key", "k",
                         model=str(tiny_model), timeout=300)
    try:
        doc = httpx.get(f"{keyed.url}/openapi.json", timeout=10).json()
        for path, item in doc["paths"].items():
            for method, op in item.items():
                url = keyed.url + path.replace("{model_id}", SERVED_NAME)
                # /health needs the key only to run the model (generate=true)
                r = httpx.request(method, url, json={} if "requestBody" in op else None,
                                  params={"generate": "true"} if path == "/health" else None,
                                  timeout=30)
                documented = "401" in op["responses"]
                assert (r.status_code == 401) == documented, (method, path, r.status_code)
    finally:
        stop_server(keyed)
