"""LoRA adapters over HTTP: a real ``tokenmill serve`` of a tiny random qwen3 with adapters made
here by ``peft``, talked to with the official ``openai`` client and plain httpx; and, in
process, what a server without ``--allow-runtime-lora`` answers."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

from tests.test_server_support import start_server, stop_server

BASE = "org/tiny"  # a slash, as in real names: /v1/models/{id} and "<base>:<adapter>" take it
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "w1 w2 w3 w4 w5"
GREEDY = dict(prompt=PROMPT, max_tokens=12, temperature=0)
MAX_MODEL_LEN = 256
LONG = 240  # tokens: streams long enough to load and unload adapters while they run
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", *MLP]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


# ----- the model and its adapters ---------------------------------------------------------------

def make_adapter(directory: Path, r: int, targets: list[str], seed: int, **config) -> str:
    """A PEFT LoRA adapter of rank ``r`` on the tiny qwen3 (``config`` overrides its shape),
    A and B both random so that it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.tiny_models import make_hf_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    get_peft_model(make_hf_model("qwen3", **config), lora).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import COMMON, make_hf_model, save_hf_model, write_word_tokenizer

    directory = save_hf_model(make_hf_model("qwen3", max_position_embeddings=MAX_MODEL_LEN),
                              tmp_path_factory.mktemp("tiny-qwen3"))
    write_word_tokenizer(directory, COMMON["vocab_size"])
    template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return directory


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_adapter(root / "sql", 8, ALL, seed=1),
        "chat": make_adapter(root / "chat", 4, ["q_proj", "v_proj"], seed=2),
        "extra": make_adapter(root / "extra", 16, MLP, seed=3),
        "rank-32": make_adapter(root / "rank-32", 32, ["o_proj"], seed=4),
        "wrong-shape": make_adapter(root / "wrong-shape", 4, MLP, seed=5, intermediate_size=48),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir, adapters):
    s = start_server(tmp_path_factory, "--max-model-len", str(MAX_MODEL_LEN),
                     "--kv-cache-memory", "512blocks",
                     "--served-model-name", BASE, "--api-key", KEY, "--max-lora-rank", "16",
                     "--max-loras", "2", "--allow-runtime-lora", "--lora-modules",
                     f"sql={adapters['sql']}", f"chat={adapters['chat']}",
                     model=str(model_dir), timeout=300)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def completion(client: openai.OpenAI, model: str, **kw) -> tuple[str, str]:
    """(text, the response's model) of a greedy completion."""
    r = client.completions.create(model=model, **{**GREEDY, **kw})
    return r.choices[0].text, r.model


def post(server, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


# ----- requests under adapters ------------------------------------------------------------------

@pytest.mark.slow
def test_an_adapter_changes_the_output_and_is_deterministic(client):
    base, name = completion(client, BASE)
    assert name == BASE
    for adapter in ("sql", "chat"):
        first, name = completion(client, adapter)
        assert name == adapter  # the model the client named, as vLLM answers
        assert first != base, adapter
        assert completion(client, adapter)[0] == first, adapter
    assert completion(client, "sql")[0] != completion(client, "chat")[0]
    assert completion(client, BASE)[0] == base  # the adapters' prefixes never served the base


@pytest.mark.slow
def test_base_colon_adapter_names_the_adapter(client):
    text, name = completion(client, f"{BASE}:sql")
    assert name == f"{BASE}:sql" and text == completion(client, "sql")[0]


@pytest.mark.slow
def test_chat_and_responses_run_under_the_adapter(client):
    messages = [{"role": "user", "content": PROMPT}]
    answers = {}
    for model in (BASE, "sql"):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                           temperature=0)
        assert r.model == model
        answers[model] = r.choices[0].message.content
        resp = client.responses.create(model=model, input=PROMPT, max_output_tokens=8,
                                       temperature=0)
        assert resp.model == model and resp.output_text
    assert answers[BASE] != answers["sql"]


@pytest.mark.slow
def test_models_list_the_adapters_with_their_parent(server, client, adapters):
    listed = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    cards = {card["id"]: card for card in listed}
    assert [m.id for m in client.models.list().data][:3] == list(cards)[:3] == [BASE, "sql",
                                                                               "chat"]
    assert cards[BASE]["parent"] is None
    for name in ("sql", "chat"):
        assert (cards[name]["root"], cards[name]["parent"]) == (adapters[name], BASE)
    assert client.models.retrieve("sql").id == "sql"
    for model_id, card in (("sql", cards["sql"]), (f"{BASE}:chat", cards["chat"]),
                           (BASE, cards[BASE])):
        assert httpx.get(f"{server.url}/v1/models/{model_id}", headers=AUTH).json() == card


@pytest.mark.slow
@pytest.mark.parametrize("model", ["nope", f"{BASE}:nope", "sql:chat", f"{BASE}:"])
def test_an_unknown_model_is_a_404_in_openais_shape(server, client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert e.value.body == {"message": f"The model `{model}` does not exist.",
                            "type": "not_found_error", "param": "model",
                            "code": "model_not_found"}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]}),
                       ("/v1/responses", {"input": "w1"}), ("/tokenize", {"prompt": "w1"})):
        r = post(server, path, {**body, "model": model})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", path
    assert httpx.get(f"{server.url}/v1/models/{model}", headers=AUTH).status_code == 404


# ----- loading and unloading at run time --------------------------------------------------------

@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def documented(api_schema, server, path: str, body: dict, status: int,
               headers: dict | None = AUTH) -> httpx.Response:
    """POST ``body`` to ``path``; the answer has ``status`` and is what the OpenAPI document
    says it is (status, content type, body)."""
    case = api_schema[path]["POST"].Case(body=body, media_type="application/json",
                                         headers=headers)
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code == status, response.text
    case.validate_response(response, checks=CHECKS)
    return response


lora_schema = schemathesis.pytest.from_fixture("api_schema").include(path_regex="lora_adapter")


@pytest.mark.slow
@lora_schema.parametrize()
@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_the_adapter_routes_answer_as_documented(case, server):
    """Generated bodies (valid and not), with the key: every answer is documented; none loads
    anything (no generated path holds an adapter)."""
    case.call_and_validate(base_url=server.url, headers=AUTH, checks=CHECKS, timeout=60)


@pytest.mark.slow
def test_load_and_unload_over_http(server, client, adapters, api_schema):
    load = {"lora_name": "extra", "lora_path": adapters["extra"]}
    unload = {"lora_name": "extra"}
    for path, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", unload)):
        documented(api_schema, server, path, body, 401, headers=None)
    r = documented(api_schema, server, "/v1/load_lora_adapter", load, 200)
    assert "extra" in r.text  # text/plain, as the document says
    assert "extra" in [m.id for m in client.models.list().data]
    text, name = completion(client, "extra")
    assert name == "extra" and text != completion(client, BASE)[0]
    again = documented(api_schema, server, "/v1/load_lora_adapter", load, 400)
    assert again.json()["error"]["code"] == "lora_already_loaded"
    documented(api_schema, server, "/v1/unload_lora_adapter", unload, 200)
    assert "extra" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        completion(client, "extra")
    gone = documented(api_schema, server, "/v1/unload_lora_adapter", unload, 404)
    assert gone.json()["error"]["param"] == "lora_name"
    # loaded again under the same name, it answers as before
    assert post(server, "/v1/load_lora_adapter", load).status_code == 200
    assert completion(client, "extra")[0] == text
    assert post(server, "/v1/unload_lora_adapter", unload).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("adapter, words", [
    ("rank-32", ["rank-32", "o_proj", "32", "max-lora-rank"]),
    ("wrong-shape", ["wrong-shape", "down_proj", "48", "96"]),
    ("missing", ["/nonexistent/adapter"])])
def test_a_bad_adapter_is_refused_naming_the_mismatch(server, client, adapters, api_schema,
                                                      adapter, words):
    path = adapters.get(adapter, "/nonexistent/adapter")
    r = documented(api_schema, server, "/v1/load_lora_adapter",
                   {"lora_name": adapter, "lora_path": path}, 400)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "lora_path"
    assert error["message"] and all(w in error["message"] for w in words), error
    assert adapter not in [m.id for m in client.models.list().data]


@pytest.mark.slow
def test_the_base_models_name_cannot_be_taken(server, adapters):
    for name in (BASE, f"{BASE}:x"):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name,
                                                   "lora_path": adapters["extra"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", name


@pytest.mark.slow
def test_loading_and_unloading_do_not_disturb_running_requests(server, client, adapters):
    """Streams under an adapter unloaded midway (while another is loaded) finish every token,
    the same tokens as the same request alone."""
    post(server, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": adapters["extra"]})
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                 timeout=60)
    kw = dict(prompt=PROMPT, max_tokens=LONG, temperature=0)

    async def stream(model: str, started: asyncio.Event) -> tuple[str, str | None, float]:
        text, finish = "", None
        async for chunk in await aclient.completions.create(model=model, stream=True, **kw):
            started.set()
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish, time.monotonic()

    async def main():
        started = [asyncio.Event() for _ in range(3)]
        running = [asyncio.create_task(stream(m, e))
                   for m, e in zip(("extra", "extra", "sql"), started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        changes = [await asyncio.to_thread(post, server, path, body) for path, body in (
            ("/v1/unload_lora_adapter", {"lora_name": "extra"}),
            ("/v1/load_lora_adapter", {"lora_name": "chat2", "lora_path": adapters["chat"]}))]
        return changes, time.monotonic(), await asyncio.gather(*running)

    changes, changed, results = asyncio.run(main())
    assert [r.status_code for r in changes] == [200, 200]
    assert all(ended > changed for _, _, ended in results)  # they ran meanwhile
    assert [finish for _, finish, _ in results] == ["length"] * 3
    assert results[0][0] == results[1][0]
    assert results[2][0] == completion(client, "sql", max_tokens=LONG)[0]  # as if alone
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "chat2"}).status_code == 200


def lora_info(server) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "tokenmill:lora_requests_info"]


@pytest.mark.slow
def test_lora_requests_info_metric(server, client):
    """vLLM's gauge: the adapters of running requests in its labels, the time as its value."""
    stream = client.completions.create(model="sql", stream=True, prompt=PROMPT,
                                       max_tokens=LONG, temperature=0)
    next(iter(stream))  # the request runs: "sql" is a running adapter until it ends
    during = lora_info(server)
    for _ in stream:
        pass
    after = lora_info(server)
    assert len(during) == len(after) == 1  # only the labels of now
    assert during[0].labels == {"model_name": BASE, "max_lora": "2",
                                "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
    assert after[0].labels["running_lora_adapters"] == ""
    assert abs(after[0].value - time.time()) < 60


# ----- in process: what the flags decide -------------------------------------------------------

def _app(**settings):
    from tests.test_engine_unit import make_engine
    from tokenmill.server.app import ServerSettings, create_app

    return create_app(make_engine(), ServerSettings("fake", **settings))


def _post(app, path: str, body: dict) -> httpx.Response:
    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            return await c.post(path, json=body)

    return asyncio.run(call())


def test_without_allow_runtime_lora_the_routes_do_not_exist():
    app = _app()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = _post(app, path, {"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path
        assert path not in app.openapi()["paths"]


def test_with_allow_runtime_lora_the_routes_are_documented():
    from tokenmill.server.openapi import ROUTES

    app = _app(allow_runtime_lora=True)
    paths = app.openapi()["paths"]
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        responses = paths[path]["post"]["responses"]
        assert set(map(int, responses)) == set(ROUTES[path]), path
        assert "text/plain" in responses["200"]["content"], path
    # an engine without adapters: unloading any name is a 404 naming the field
    r = _post(app, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    r = _post(app, "/v1/load_lora_adapter", {"lora_name": ""})
    assert r.status_code == 400
