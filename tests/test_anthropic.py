"""Anthropic's Messages API (``/v1/messages``, ``count_tokens``): the formatter on synthetic
outputs (thinking, tool use, every chunking), then a real ``tokenmill serve`` through the
official ``anthropic`` SDK and raw HTTP checked against the SDK's own types.

The server runs in float32, where reusing a cached prefix never changes a greedy token, so a
streamed and a non-streamed request must agree exactly."""

from __future__ import annotations

import asyncio
import itertools
import json

import anthropic
import httpx
import pytest
from pydantic import TypeAdapter

from tests.test_server_support import MODEL, server_fixtures
from tokenmill.request import CompletionOutput, FinishReason, RequestOutput
from tokenmill.server.anthropic_format import MessagesFormatter, thinking_signature
from tokenmill.server.reasoning import ReasoningSetup, get_reasoning_parser
from tokenmill.server.tools.parsers import get_tool_parser

ASK = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments of its own: an extra body
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"]}}
EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)


# ----- the formatter on synthetic outputs ---------------------------------------------------------

def _output(text: str, finish: FinishReason | None = FinishReason.STOP,
            stop: str | None = None) -> RequestOutput:
    c = CompletionOutput(index=0, text=text, token_ids=list(range(len(text))),
                         finish_reason=finish, stop_reason=stop)
    return RequestOutput("r", [1, 2, 3], [c], finished=finish is not None, num_cached_tokens=1)


def _formatter(reasoning: bool = True, tools: bool = False, include: bool = True,
               limit: int | None = None) -> MessagesFormatter:
    setup = None
    if reasoning:
        parser = get_reasoning_parser("qwen3")
        setup = ReasoningSetup(parser, parser.start_mode(), include)
    ids = iter(f"call_{i}" for i in range(100))
    return MessagesFormatter("msg_1", "m", str,
                             get_tool_parser("hermes", lambda: next(ids)) if tools else None,
                             limit, setup)


def _events(fmt: MessagesFormatter, text: str, pieces: list[str], **final) -> list[dict]:
    async def outputs():
        for end in itertools.accumulate(map(len, pieces)):
            done = end == len(text)
            yield 0, _output(text[:end], FinishReason.STOP if done else None,
                             final.get("stop") if done else None)

    async def run():
        return [e async for e in fmt.events(outputs())]
    return asyncio.run(run())


def _chunkings(text: str):
    """Every split of ``text`` into one, two and three pieces (two cuts at most)."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i in range(1, len(text), 7):
        for j in range(i + 1, len(text), 5):
            yield [text[:i], text[i:j], text[j:]]


def _assembled(events: list[dict]) -> dict:
    """A stream put together by the SDK's own accumulator (each event checked as its type)."""
    from anthropic.lib.streaming._messages import accumulate_event

    snapshot, bufs = None, {}
    for event in events:
        if event["type"] == "ping":  # a keep-alive, outside the SDK's event types
            continue
        snapshot = accumulate_event(event=EVENT.validate_python(event), current_snapshot=snapshot,
                                    json_bufs=bufs)
    return snapshot.model_dump(exclude_none=True)


THOUGHT_AND_CALL = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_thinking_text_and_tool_use_blocks_whole():
    body = _formatter(tools=True).response([_output(THOUGHT_AND_CALL)])
    assert body["content"] == [
        {"type": "thinking", "thinking": "The user wants weather.",
         "signature": thinking_signature("The user wants weather.")},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Paris"}}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("tool_use", None)
    assert body["usage"] == {"input_tokens": 2, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 1, "output_tokens": len(THOUGHT_AND_CALL)}
    anthropic.types.Message.model_validate(body)


def test_every_chunking_streams_to_the_whole_answer():
    whole = _formatter(tools=True).response([_output(THOUGHT_AND_CALL)])
    for pieces in _chunkings(THOUGHT_AND_CALL):
        events = _events(_formatter(tools=True), THOUGHT_AND_CALL, pieces)
        types = [e["type"] for e in events]
        assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta",
                                                                        "message_stop"]
        got = _assembled(events)
        assert got["content"] == whole["content"], pieces
        assert got["stop_reason"] == "tool_use"
        # thinking, text, tool_use: each opened and closed once, in order
        starts = [e["content_block"]["type"] for e in events if e["type"] ==
                  "content_block_start"]
        assert starts == ["thinking", "text", "tool_use"]
        assert types.count("content_block_stop") == 3


def test_thinking_left_out_when_turned_off_and_plain_text_without_parsers():
    body = _formatter(include=False).response([_output("<think>\nhmm\n</think>\n\nHello!")])
    assert body["content"] == [{"type": "text", "text": "Hello!"}]
    body = _formatter(reasoning=False).response([_output("<think>x</think>Hi", stop="STOP")])
    assert body["content"] == [{"type": "text", "text": "<think>x</think>Hi"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "STOP")
    cut = _formatter().response([_output("<think>\nstill going", FinishReason.LENGTH)])
    assert cut["content"] == [{"type": "thinking", "thinking": "still going",
                               "signature": thinking_signature("still going")}]
    assert cut["stop_reason"] == "max_tokens"


def test_calls_past_the_limit_are_dropped():
    two = THOUGHT_AND_CALL + THOUGHT_AND_CALL.split("Let me check.\n")[1]
    body = _formatter(tools=True, limit=1).response([_output(two)])
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]


# ----- the real server --------------------------------------------------------------------------

def _serve_takes(*flags: str) -> bool:
    from tokenmill.cli import build_parser

    _, unknown = build_parser().parse_known_args(["serve", MODEL, *flags])
    return not unknown


# With qwen3's tags SmolLM2 (which writes none) answers as before; a "<think>" prefill makes it
# think, which the thinking test reads.
REASONING = ("--reasoning-parser", "qwen3")
HAS_REASONING = _serve_takes(*REASONING)
# 2 running and 2 queued requests at most: more at once are tokenmill's overload (a 529 here)
server, _client = server_fixtures("--dtype", "float32", "--max-num-seqs", "2",
                                  "--max-queued-requests", "2",
                                  *(REASONING if HAS_REASONING else ()))


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                               timeout=120)


def post(server, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)


def stream_events(server, body: dict) -> list[dict]:
    """Every SSE event of a streamed message, each checked as the SDK's event type."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                if event["type"] != "ping":
                    EVENT.validate_python(event)
                assert event["type"] == name
                events.append(event)
    return events


def test_streamed_and_not_give_the_same_message(server, client):
    kw = dict(model=MODEL, max_tokens=24, system=[{"type": "text", "text": "Be brief."}],
              messages=ASK, extra_body=GREEDY, metadata={"user_id": "u1"})
    whole = client.messages.create(**kw)
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == MODEL
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**kw) as stream:
        types = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert [(b.type, b.text) for b in streamed.content] == [(b.type, b.text)
                                                            for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    usage = streamed.usage
    counted = client.messages.count_tokens(model=MODEL, system=kw["system"], messages=ASK)
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    assert usage.cache_read_input_tokens > 0  # the second request found the prompt cached


def test_count_tokens_is_the_chat_prompt(server, client):
    turns = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
             {"role": "user", "content": "And one more?"}]
    chat = [{"role": "system", "content": "Hi"}, *[
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
         else m["content"][0]["text"]} for m in turns]]
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": chat}).json()["count"]
    assert client.messages.count_tokens(model=MODEL, system="Hi",
                                        messages=turns).input_tokens == tokenized


def test_stop_sequences(server, client):
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = whole.content[0].text
    word = text.split()[2]  # some word of the greedy answer, after its start
    cut = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY,
                                 stop_sequences=["@@", word])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
    assert cut.content[0].text == text[:text.index(word)]


def test_prefill_continues_the_assistant_turn(server, client):
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    start = whole.content[0].text[:4]
    turns = [*ASK, {"role": "assistant", "content": start}]
    cont = client.messages.create(model=MODEL, max_tokens=8, messages=turns, extra_body=GREEDY)
    assert cont.content[0].text and not cont.content[0].text.startswith(start)
    alone = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    with_start = client.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": start,
                                                      "add_special_tokens": False}).json()
    assert with_start == alone + ids["count"]


@pytest.mark.skipif(not HAS_REASONING, reason="tokenmill serve has no --reasoning-parser")
def test_thinking_blocks_from_the_reasoning_parser(server, client):
    # a prefill that opens the tag: the model goes on thinking ("to know which color...")
    turns = [*ASK, {"role": "assistant", "content": "<think>\nThe user wants"}]
    kw = dict(model=MODEL, max_tokens=16, messages=turns, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    assert len(whole.content[0].signature) == 32  # a digest of the thinking: stable
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].thinking == whole.content[0].thinking
    assert streamed.content[0].signature == whole.content[0].signature
    hidden = client.messages.create(thinking={"type": "disabled"}, **kw)
    assert all(b.type != "thinking" for b in hidden.content)
    assert hidden.usage.output_tokens == whole.usage.output_tokens
    # budget_tokens: past it the closing tag is forced, and the answer follows the thinking
    capped = client.messages.create(thinking={"type": "enabled", "budget_tokens": 2}, **kw)
    assert capped.content[0].type == "thinking"
    assert len(capped.content[0].thinking) < len(whole.content[0].thinking)


def test_tool_use_and_tool_result_round_trip(server, client):
    kw = dict(model=MODEL, max_tokens=60, tools=[WEATHER], extra_body=GREEDY,
              messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    forced = client.messages.create(tool_choice={"type": "any",
                                                 "disable_parallel_tool_use": True}, **kw)
    [call] = [b for b in forced.content if b.type == "tool_use"]
    assert forced.stop_reason == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_") and set(call.input) == {"city"}
    with client.messages.stream(tool_choice={"type": "tool", "name": "get_weather"},
                                **kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", "get_weather", call.input)]
    history = [*kw["messages"], {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "Sunny"}]}]}]
    answer = client.messages.create(**{**kw, "messages": history, "max_tokens": 16},
                                    tool_choice={"type": "none"})
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text


def test_output_config_format_keeps_the_schema(server, client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=20, messages=ASK, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}})
    assert json.loads(m.content[0].text)["color"] in ("red", "blue")


def test_raw_bodies_match_the_documented_models(server):
    from tokenmill.server.anthropic_schema import AnthropicMessage, AnthropicTokenCount

    r = post(server, {"max_tokens": 4, "messages": ASK})
    assert r.status_code == 200
    AnthropicMessage.model_validate(r.json())
    anthropic.types.Message.model_validate(r.json())
    AnthropicTokenCount.model_validate(post(server, {"messages": ASK},
                                            "/v1/messages/count_tokens").json())


def test_raw_stream_events_in_order(server):
    events = stream_events(server, {"max_tokens": 6, "messages": ASK, **GREEDY})
    types = [e["type"] for e in events]
    assert types[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"]["output_tokens"] == 6


def _user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


BAD = [  # (body, status, error type, what the message names)
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 0, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "model": "claude-nope"}, 404, "not_found_error",
     "claude-nope"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "messages[0].role"),
    ({"max_tokens": 5, "messages": _user([{"type": "image", "source": {}}])}, 400,
     "invalid_request_error", "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": _user([{"type": "tool_result"}])}, 400,
     "invalid_request_error", "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 5, "messages": _user(7)}, 400, "invalid_request_error",
     "messages[0].content"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                    "name": "s"}]}, 400,
     "invalid_request_error", "tools[0].type"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "f"}]}, 400,
     "invalid_request_error", "tools[0].input_schema"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER, WEATHER]}, 400,
     "invalid_request_error", "tools[1].name"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "tool", "name": "x"},
      "tools": [WEATHER]}, 400, "invalid_request_error", "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "sometimes"}}, 400,
     "invalid_request_error", "tool_choice.type"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled",
                                                     "budget_tokens": 10}}, 400,
     "invalid_request_error", "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": ASK, "stop": ["x"]}, 400, "invalid_request_error",
     "stop_sequences"),
    ({"max_tokens": 5, "messages": ASK, "output_config": {"effort": "high"}}, 400,
     "invalid_request_error", "output_config.effort"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": ["x"] * 1000}, 400,
     "invalid_request_error", "stop_sequences"),
    ({"max_tokens": 5000, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "mcp_servers": [{"url": "x"}]}, 400,
     "invalid_request_error", "mcp_servers"),
    ({"max_tokens": 5, "messages": ASK, "system": [{"type": "image"}]}, 400,
     "invalid_request_error", "system[0]"),
    ({"max_tokens": 5, "messages": ASK, "output_config": {"format": {"type": "xml"}}}, 400,
     "invalid_request_error", "output_config.format.type"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{**WEATHER, "input_schema": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}]}, 400,
     "invalid_request_error", "tools[0].input_schema"),
    ({"max_tokens": 5, "messages": ASK, "temperature": "hot"}, 400, "invalid_request_error",
     "temperature"),
    ({"max_tokens": 5, "messages": _user([])}, 400, "invalid_request_error",
     "messages[0].content: user messages must have non-empty content"),
    ({"max_tokens": 5, "messages": ["hi"]}, 400, "invalid_request_error", "messages[0]:"),
    ({"max_tokens": 5, "messages": ASK, "system": 5}, 400, "invalid_request_error", "system:"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0]"),
]


@pytest.mark.parametrize("body,status,kind,names", BAD)
def test_bad_requests_get_anthropic_errors(server, body, status, kind, names):
    r = post(server, body)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    assert names in r.json()["error"]["message"], r.text


def test_overload_is_anthropics_529_with_retry_after(server):
    """More requests at once than run and queue: the rest get Anthropic's overloaded_error
    with status 529 (which the SDK retries after Retry-After); the others are served."""
    async def run():
        sdk = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0,
                                       timeout=120)

        async def one():
            try:
                return await sdk.messages.create(model=MODEL, max_tokens=12, messages=ASK,
                                                 extra_body={**GREEDY, "ignore_eos": True})
            except anthropic.APIStatusError as e:
                return e
        return await asyncio.gather(*(one() for _ in range(8)))

    results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, anthropic.APIStatusError)]
    assert refused and len(refused) <= 4, results
    for e in refused:
        assert isinstance(e, anthropic.OverloadedError) and e.status_code == 529
        assert e.body == {"type": "error", "error": {"type": "overloaded_error",
                                                     "message": e.body["error"]["message"]}}
        assert int(e.response.headers["retry-after"]) >= 1
    assert all(r.usage.output_tokens == 12 for r in results if r not in refused)


def test_malformed_json_and_the_sdk_errors(server, client):
    r = httpx.post(f"{server.url}/v1/messages", content=b"{nope", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=_user([{"type": "document"}]))
