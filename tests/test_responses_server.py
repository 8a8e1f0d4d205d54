"""The Responses API (``/v1/responses``) through a real ``tokenmill serve``: the official
``openai`` client, raw HTTP checked against the SDK's own types, and an ``openai-agents`` Agent.

The server runs in float32, where reusing a cached prefix never changes a greedy token, so a
streamed and a non-streamed request must agree exactly."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from tests.test_server_support import MODEL, server_fixtures

pytestmark = pytest.mark.slow

server, client = server_fixtures("--dtype", "float32")

ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]},
           "strict": True}
EVENT = TypeAdapter(ResponseStreamEvent)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=120)


def stream_events(server, body: dict) -> list:
    """Every SSE event of a streamed response, validated as the SDK's event types."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = EVENT.validate_python(json.loads(line[len("data: "):]))
                assert event.type == name
                events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def num_tokens(server, messages: list[dict]) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]


def test_streamed_and_not_give_the_same_response(server, client):
    body = {"input": ASK, "instructions": "Answer in a few words.", "temperature": 0,
            "max_output_tokens": 24, "metadata": {"run": "1"}}
    raw = post(server, body)
    assert raw.status_code == 200, raw.text
    full = Response.model_validate(raw.json())
    assert full.id.startswith("resp_") and full.status == "completed" and full.output_text
    assert full.metadata == {"run": "1"} and full.instructions == "Answer in a few words."
    [message] = full.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")

    events = stream_events(server, body)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == full.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        full.usage.input_tokens, full.usage.output_tokens)

    with client.responses.stream(model=MODEL, **body) as stream:
        helper = stream.get_final_response()
    assert helper.output_text == full.output_text


def test_usage_is_exact_and_previous_response_continues(server, client):
    first = client.responses.create(model=MODEL, input="Name three colors.",
                                    instructions="Be brief.", temperature=0,
                                    max_output_tokens=16)
    assert first.usage.input_tokens == num_tokens(server, [
        {"role": "system", "content": "Be brief."}, *ASK])
    assert first.usage.output_tokens > 0 and first.usage.total_tokens == (
        first.usage.input_tokens + first.usage.output_tokens)
    assert first.usage.output_tokens_details.reasoning_tokens == 0

    # The stored input and output come first; the first response's instructions do not.
    second = client.responses.create(model=MODEL, input="And three animals?",
                                     previous_response_id=first.id, temperature=0,
                                     max_output_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == num_tokens(server, [
        *ASK, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And three animals?"}])

    unstored = client.responses.create(model=MODEL, input="Hi", store=False,
                                       max_output_tokens=2)
    for unknown in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=MODEL, input="Hi", previous_response_id=unknown)
        assert e.value.param == "previous_response_id"


def test_max_output_tokens_makes_it_incomplete(server, client):
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = stream_events(server, {"input": ASK, "max_output_tokens": 3, "temperature": 0})
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == r.output_text


def test_logprobs_of_the_output_text(server, client):
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text
    assert all(lp.logprob <= lp.top_logprobs[0].logprob + 1e-4 for lp in logprobs)


def test_forced_function_call_then_its_output(server, client):
    ask = "What is the weather in Paris?"
    kw = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
          "temperature": 0, "max_output_tokens": 60}
    r = client.responses.create(model=MODEL, input=ask, **kw)
    [call] = r.output
    assert (call.type, call.name, call.status, r.status) == (
        "function_call", "get_weather", "completed", "completed")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert call.call_id.startswith("call_") and r.tools[0].name == "get_weather"

    events = stream_events(server, {"input": ask, **kw})
    [streamed] = events[-1].response.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments and len(pieces) > 1  # sent as they were written

    # The result goes back as a function_call_output item, after the stored call.
    answer = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER], temperature=0,
        max_output_tokens=30, input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": "22 degrees and sunny"}])
    assert answer.output[0].type == "message" and answer.output_text
    # The same conversation sent whole (as stateless clients do) is the same prompt.
    whole = client.responses.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=30,
        input=[{"role": "user", "content": ask},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "22 degrees and sunny"}])
    assert whole.usage.input_tokens == answer.usage.input_tokens
    assert whole.output_text == answer.output_text


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1,
                                                         "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Pick a color and a count, as JSON.",
                                temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "pick",
                                                 "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    parsed = client.responses.parse(model=MODEL, input="Name a city.", text_format=City,
                                    temperature=0, max_output_tokens=40)
    assert isinstance(parsed.output_parsed, City)


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"reasoning": {"effort": None, "budget_tokens": 1000}}, "reasoning"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"extra_body": {"max_tokens": 5}}, "max_tokens"),  # Chat Completions fields: not ignored
    ({"extra_body": {"messages": [{"role": "user", "content": "x"}]}}, "messages"),
    ({"extra_body": {"chat_template": "{{ 1 }}"}}, "chat_template"),
    ({"extra_body": {"enable_response_messages": True}}, "enable_response_messages"),
    ({"extra_body": {"previous_input_messages": [{"role": "user", "content": "x"}]}},
     "previous_input_messages"),
])
def test_unsupported_fields_are_refused(client, body, param):
    body = {"input": "Hi", **body}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **body)
    assert e.value.param == param, e.value.message


def test_a_request_id_names_the_response(client):
    """vLLM's request_id is the response's id, which previous_response_id then finds; an id a
    stored response already has is refused rather than overwriting that chain."""
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                     extra_body={"request_id": "resp_mine"})
    assert first.id == "resp_mine"
    second = client.responses.create(model=MODEL, input="Again", max_output_tokens=2,
                                      previous_response_id="resp_mine")
    assert second.previous_response_id == "resp_mine" and second.id.startswith("resp_")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                extra_body={"request_id": "resp_mine"})
    assert e.value.param == "request_id"


def test_stored_responses_belong_to_the_key_and_salt_that_made_them(server):
    """A stored response is continued only with the API key (bearer token) and cache_salt it
    was made with; to anyone else it does not exist: the same 404 as an id never stored, and
    a request id chosen by one tenant is free to another."""
    run = uuid.uuid4().hex[:8]

    def create(key: str, salt: str | None = None, **body) -> httpx.Response:
        extra = {"cache_salt": salt} if salt is not None else {}
        return httpx.post(f"{server.url}/v1/responses", timeout=120,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": MODEL, "input": "My name is Ada.",
                                "max_output_tokens": 2, **extra, **body})

    def not_found(r: httpx.Response, rid: str) -> bool:
        error = r.json()["error"]
        return r.status_code == 404 and error == {**never["error"], "message": never[
            "error"]["message"].replace(never_id, rid)}

    never_id = f"resp_{run}"
    never = create("key-a", previous_response_id=never_id).json()
    first, salted = create("key-a").json(), create("key-a", "salt-1").json()
    assert first["id"] != salted["id"]
    assert all(re.fullmatch(r"resp_[0-9a-f]{32}", r["id"]) for r in (first, salted))
    assert create("key-a", previous_response_id=first["id"]).status_code == 200
    assert create("key-a", "salt-1", previous_response_id=salted["id"]).status_code == 200
    for key, salt, rid in (("key-b", None, first["id"]), ("key-a", "salt-1", first["id"]),
                           ("key-a", None, salted["id"]), ("key-a", "salt-2", salted["id"]),
                           ("key-b", "salt-1", salted["id"])):
        assert not_found(create(key, salt, previous_response_id=rid), rid), (key, salt)

    # The same chosen id in two namespaces: two responses, each continuing its own chain.
    chosen = f"chosen-{run}"
    a = create("key-a", request_id=chosen)
    b = create("key-b", request_id=chosen, input="I live in a big old house by the sea.")
    assert a.json()["id"] == b.json()["id"] == chosen
    assert create("key-a", request_id=chosen).json()["error"]["param"] == "request_id"
    grown = [create(key, previous_response_id=chosen).json()["usage"]["input_tokens"]
             for key in ("key-a", "key-b")]
    assert grown[0] < grown[1]  # key-b's chain holds the longer first input
    unkept = create("key-a", store=False).json()
    assert not_found(create("key-a", previous_response_id=unkept["id"]), unkept["id"])


def test_fields_asking_for_nothing_are_accepted(client):
    # greedy: a sampled reply to "Hi" may end within the 2 tokens (seen once in CI) and complete
    r = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, temperature=0, background=False, store=True,
        reasoning={"effort": None}, truncation="disabled", service_tier="auto",
        include=["reasoning.encrypted_content"], prompt_cache_key="k", user="u",
        parallel_tool_calls=True, tool_choice="auto", text={"format": {"type": "text"}})
    assert r.status == "incomplete" and r.truncation == "disabled"


def test_openai_agents_runner(server):
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="x", max_retries=0))
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    plain = Agent(name="helper", instructions="Answer in one short sentence.", model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=24))
    # A forced call, then the tool's result is the answer (the run cannot loop on calls).
    weather = Agent(name="weather", instructions="Use the tools.", model=model,
                    tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                    model_settings=ModelSettings(temperature=0, tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=60))

    async def run():
        answer = await Runner.run(plain, "What is the capital of France?")
        streamed = Runner.run_streamed(plain, "What is the capital of France?")
        async for _ in streamed.stream_events():
            pass
        called = await Runner.run(weather, "What is the weather in Paris?")
        return answer, streamed, called

    answer, streamed, called = asyncio.run(run())
    assert isinstance(answer.final_output, str) and answer.final_output
    assert streamed.final_output == answer.final_output
    assert len(cities) == 1 and called.final_output == f"sunny in {cities[0]}"


def test_store_bounds():
    """The store keeps at most store_size responses and store_chars characters (each
    counted with its chain), dropping the least recently used; one whose chain alone is over
    a quarter of the characters is not kept. A response is found in its namespace only."""
    from types import SimpleNamespace

    from tokenmill.server.protocol import APIError
    from tokenmill.server.responses import OpenAIResponses

    def keep(store, rid: str, text: str, previous: str | None = None, ns: str = "t") -> None:
        history = store._previous(ns, previous) + [{"type": "message", "content": text}]
        store._keep(SimpleNamespace(req=SimpleNamespace(store=None), rid=rid, history=history,
                                    namespace=ns),
                    {"status": "completed", "output": [{"type": "message", "content": "ok"}]})

    def ids(store) -> list[str]:
        return [rid for _, rid in store._store]

    by_count = OpenAIResponses(pipeline=None, store_size=3)
    for rid in "abcd":
        keep(by_count, rid, "x")
    assert ids(by_count) == ["b", "c", "d"]
    by_count._previous("t", "b")  # used: now the most recent
    keep(by_count, "e", "y", "b")
    assert ids(by_count) == ["d", "b", "e"]
    assert [i["content"] for i in by_count._previous("t", "e")] == ["x", "ok", "y", "ok"]
    with pytest.raises(APIError) as e:  # another tenant's: as if it never existed
        by_count._previous("u", "e")
    assert e.value.status == 404
    keep(by_count, "e", "z", ns="u")  # the same id in another namespace: both kept
    assert [i["content"] for i in by_count._previous("u", "e")] == ["z", "ok"]
    assert [i["content"] for i in by_count._previous("t", "e")] == ["x", "ok", "y", "ok"]

    by_chars = OpenAIResponses(pipeline=None, store_chars=1000)
    for rid in "abcd":  # about 225 characters each
        keep(by_chars, rid, "x" * 150)
    assert ids(by_chars) == ["a", "b", "c", "d"]
    keep(by_chars, "e", "x" * 150)
    assert ids(by_chars) == ["b", "c", "d", "e"] and by_chars._chars <= 1000
    keep(by_chars, "f", "x" * 300)  # over a quarter alone: not kept, nothing dropped
    assert ids(by_chars) == ["b", "c", "d", "e"]
    with pytest.raises(APIError):
        by_chars._previous("t", "f")

    keep(by_chars, "c", "x" * 10)  # a chosen id kept twice: the later chain, counted once
    assert ids(by_chars) == ["b", "d", "e", "c"]
    assert by_chars._chars == sum(size for _, size in by_chars._store.values())
