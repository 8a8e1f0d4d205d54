"""The OpenAI-compatible server, end to end: a real ``tokenmill serve`` in a subprocess, talked
to with the official ``openai`` client and plain HTTP (httpx)."""

from __future__ import annotations

import asyncio
import json
from functools import partial

import httpx
import openai
import pytest

from tests.test_server_support import MODEL, metrics, server_fixtures, wait_idle

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


server, client = server_fixtures("--max-num-seqs", "64")


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=120)


def num_tokens(server, text: str) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["count"]


# ----- the happy paths ---------------------------------------------------------------------

def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_server_info_says_how_it_runs(server):
    """--dtype auto's choice and why (and --kv-cache-dtype auto's), the attention backend and
    the CPU, as start-up logs them."""
    from tokenmill.kernels import cpu
    from tokenmill.platform import choose_dtype, choose_kv_cache_dtype, cpu_description

    info = httpx.get(f"{server.url}/server_info").json()
    assert (info["dtype"], info["dtype_reason"]) == choose_dtype("cpu")
    assert (info["kv_cache_dtype"], info["kv_cache_dtype_reason"]) == \
        choose_kv_cache_dtype("cpu", "auto", info["dtype"])
    assert info["attention_backend"] == ("cpu" if cpu.is_built() else "torch")
    assert info["hardware"] == cpu_description()
    assert info["threads"] >= 1 and info["kv_cache_tokens"] > 0


def test_completion_usage_is_exact(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == num_tokens(server, PROMPT)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.choices[0].finish_reason == "length" and r.choices[0].text


def _streamed_completion(client, **kw):
    text, finishes, usage = "", [], None
    for chunk in client.completions.create(model=MODEL, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.finish_reason:
                finishes.append(c.finish_reason)
    return text, finishes, usage


def test_completion_stream_equals_non_stream(client):
    kw = dict(prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(model=MODEL, **kw)
    text, finishes, usage = _streamed_completion(client, **kw)
    assert text == full.choices[0].text
    assert finishes == [full.choices[0].finish_reason]
    # The second request may hit the prefix cache the first one filled: compare the counts.
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    text, finishes, usage = "", [], None
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert text == full.choices[0].message.content and text
    assert finishes == [full.choices[0].finish_reason]
    # The second run of the same prompt hits the prefix cache: only cached_tokens may differ.
    assert (usage.prompt_tokens_details.cached_tokens
            >= full.usage.prompt_tokens_details.cached_tokens)
    assert ({**usage.model_dump(), "prompt_tokens_details": None}
            == {**full.usage.model_dump(), "prompt_tokens_details": None})
    assert full.usage.completion_tokens <= 12


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats(client, endpoint):
    """vLLM's stream_options.continuous_usage_stats: each chunk with tokens carries the usage so
    far, its completion tokens counting up to the final usage; without include_usage, none."""
    kw = dict(model=MODEL, max_tokens=6, temperature=0, stream=True,
              extra_body={"ignore_eos": True})
    create = (partial(client.completions.create, prompt=PROMPT) if endpoint == "completions"
              else partial(client.chat.completions.create, messages=CHAT))
    chunks = list(create(stream_options={"include_usage": True, "continuous_usage_stats": True},
                         **kw))
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens == 6
    counted = [c.usage.completion_tokens for c in chunks[:-1] if c.usage is not None]
    texts = [c for c in chunks[:-1]
             if any((ch.text if endpoint == "completions" else ch.delta.content)
                    for ch in c.choices)]
    assert len(counted) >= len(texts) >= 1 and counted == sorted(counted)
    assert counted[0] >= 1 and counted[-1] == 6
    assert {c.usage.prompt_tokens for c in chunks if c.usage} == {final.usage.prompt_tokens}
    quiet = list(create(stream_options={"continuous_usage_stats": True}, **kw))
    assert all(c.usage is None for c in quiet)


def test_n_and_seed(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=3,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=3,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, seed=3,
                                           temperature=1.0).choices[0].message.content
            for _ in range(2)]
    assert chat[0] == chat[1]


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base.strip().split()[1] if len(base.split()) > 1 else base.strip()[-2:]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    text, finishes, _ = _streamed_completion(client, prompt=PROMPT, max_tokens=12, temperature=0,
                                             stop=stop, extra_body={"ignore_eos": True})
    assert text == r.choices[0].text and finishes == ["stop"]


def test_completion_logprobs_and_echo(server, client):
    """Logprobs of the generated tokens; echo puts the prompt before them, and with logprobs
    the prompt tokens' own logprobs before theirs."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and top[token] == value and 2 <= len(top) <= 3
        assert max(top.values()) == value  # greedy picks the most likely token
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + c.text and echoed.choices[0].logprobs is None
    # echo with logprobs: the prompt tokens' logprobs (null for the first) before the new ones
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=0,
                                       echo=True, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].logprobs
    assert scored.token_logprobs[0] is None and None not in scored.token_logprobs[1:]
    assert scored.tokens[-len(lp.tokens):] == lp.tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert bytes(e.bytes).decode() == e.token


def test_token_prompts_and_batches(server, client):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"],
                                      max_tokens=5, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text
    ids_batch = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=3,
                                          temperature=0)
    assert ids_batch.usage.prompt_tokens == len(ids) + 2
    text, finishes, usage = _streamed_completion(client, prompt=[PROMPT, PROMPT], max_tokens=4,
                                                 temperature=0, extra_body={"ignore_eos": True})
    assert finishes == ["length", "length"] and usage.completion_tokens == 8
    assert usage.prompt_tokens == 2 * len(ids)


# ----- bad input ---------------------------------------------------------------------------

LONG = "hello " * 2100
BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "stream": True, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 4000}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    # valid JSON that is not usable text or numbers
    ("/v1/completions", {"prompt": "\ud800"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "x\udfff"], "stream": True}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "\ud800"}, 400, "model"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400,
     "messages"),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "repetition_penalty": NaN}', 400,
     "repetition_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"maximum": 1e999}}}},
     400, "response_format"),
    # limits
    ("/v1/completions", {"prompt": "x", "n": 10000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 100, "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, 400,
     "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["x" * 1025]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/tokenize", {"prompt": "x" * 10 ** 6}, 400, "prompt"),
    # what tokenmill does not do is refused, not ignored
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 1/0 }}"}, 400,
     "chat_template"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {
        "chat_template": "{% for i in range(10**9) %}x{% endfor %}"}}, 400, "chat_template"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {
        "add_generation_prompt": 5}}, 400, "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 1, "n": 2}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": CHAT, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": ["audio"]}, 400, "modalities"),
    ("/v1/chat/completions", {"messages": CHAT, "store": True}, 400, "store"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
    ("/v1/completions", {"prompt": "x", "logprob_token_ids": [1, 2]}, 400,
     "logprob_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_interval": 4}, 400,
     "stream_interval"),
    ("/v1/chat/completions", {"messages": CHAT, "repetition_detection": {"max_pattern_size": 4}},
     400, "repetition_detection"),
    ("/v1/chat/completions", {"messages": CHAT, "include_reasoning": False}, 400,
     "include_reasoning"),
    ("/v1/completions", {"prompt": "x", "request_id": 7}, 400, "request_id"),
    ("/v1/completions", {"prompt": "x", "request_id": "x" * 129}, 400, "request_id"),
    ("/v1/chat/completions", {"messages": CHAT, "request_id": "a\nforged log line"}, 400,
     "request_id"),
    ("/v1/responses", {"input": "x", "request_id": ""}, 400, "request_id"),
    ("/v1/completions", {"prompt": "x", "priority": -5}, 400, "priority"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": ""}},
        *CHAT]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "audio": {"id": "a"}}]},
     400, "messages"),
    ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input(server, path, body, status, param):
    # json.dumps escapes lone surrogates (\ud800), which are valid JSON but not UTF-8 text
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}{path}", timeout=30, content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_completed_api_routes(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, best_of=2,
                                  temperature=0)
    assert len(r.choices) == 2  # best_of == n asks for nothing more than n
    assert httpx.get(f"{server.url}/health", params={"generate": "true"}).status_code == 200


def test_request_ids_chosen_by_the_client(server, client):
    """As vLLM: the response's id is made from the X-Request-Id header, else the request_id
    field; requests sharing a chosen id run side by side without clashing in the engine."""
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                          extra_body={"request_id": "job-7"})
    assert chat.id == "chatcmpl-job-7"
    r = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "from-header"},
                   json={"prompt": PROMPT, "max_tokens": 2, "request_id": "from-body"})
    assert r.json()["id"] == "cmpl-from-header"
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                       extra_body={"request_id": "s"})
    assert {c.id for c in chunks} == {"cmpl-s"}

    async def same_id_twice():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(aclient.completions.create(
                model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=6, temperature=0,
                extra_body={"request_id": "dup", "ignore_eos": True}) for _ in range(2)))

    first, second = asyncio.run(same_id_twice())
    assert first.id == second.id == "cmpl-dup"
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert all(c.finish_reason == "length" for c in first.choices + second.choices)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 1})])
def test_request_ids_are_short_and_plain(server, path, body):
    """A chosen request id becomes part of ids and log lines: 1 to 128 characters of
    [A-Za-z0-9._:-], in the X-Request-Id header as in the request_id field; else a 400."""
    url = f"{server.url}{path}"
    header_values = ["x" * 129, "two words", "a/b?c", ""]
    for given in [*header_values, "line\nbreak", "caf\u00e9"]:
        r = httpx.post(url, json={**body, "request_id": given})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
        if given in header_values:
            r = httpx.post(url, json=body, headers={"X-Request-Id": given})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "X-Request-Id"
    ok = "a" * 120 + "._:-AZ09"
    r = httpx.post(url, json=body, headers={"X-Request-Id": ok})
    assert r.status_code == 200 and r.json()["id"].endswith(ok), r.text


def test_tokenize_counts_what_the_chat_endpoint_runs(server, client):
    """/tokenize renders messages as the chat endpoint does, offered tools included, and
    return_token_strs gives each token's vocabulary string (vLLM's fields)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]

    def tokenize(**body) -> dict:
        r = httpx.post(f"{server.url}/tokenize", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    offered = tokenize(messages=CHAT, tools=tools)
    assert offered["count"] > tokenize(messages=CHAT)["count"]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, max_tokens=1)
    assert chat.usage.prompt_tokens == offered["count"]
    words = tokenize(prompt="Hello world", return_token_strs=True)
    assert len(words["token_strs"]) == words["count"] >= 2
    assert "".join(words["token_strs"]).replace("\u0120", " ") == "Hello world"
    assert "token_strs" not in tokenize(prompt="Hello world")


def test_history_messages_as_an_openai_client_sends_them_back(server):
    """A message the openai client dumps back into the history carries refusal, audio and
    function_call (null) and maybe reasoning: accepted, a refusal read as the message's text,
    the reasoning handed to the template under vLLM's two names."""
    from tokenmill.server.protocol import ChatMessage
    from tokenmill.server.pipeline import message_dict

    def count(message: dict) -> int:
        r = httpx.post(f"{server.url}/tokenize", json={"messages": [*CHAT, message]})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    plain = {"role": "assistant", "content": "I cannot."}
    assert count({**plain, "content": None, "refusal": "I cannot.", "audio": None,
                  "function_call": None, "annotations": []}) == count(plain)
    assert count({**plain, "reasoning": "Think first."}) == count(plain)  # SmolLM2's ignores it
    assert message_dict(ChatMessage(**plain, reasoning_content="Think."), 0) == {
        **plain, "reasoning": "Think.", "reasoning_content": "Think."}


def test_server_keeps_serving_after_bad_input(server, client):
    for path, body, _, _ in BAD_REQUESTS[:5]:
        httpx.post(f"{server.url}{path}", json=body if not isinstance(body, bytes) else None)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "Traceback" not in server.log()


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


# ----- concurrency, disconnects, metrics ---------------------------------------------------

def test_48_concurrent_streams(server, aclient_factory):
    async def one(aclient, i):
        text, finishes, usage = "", [], None
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finishes += [c.finish_reason] if c.finish_reason else []
        return text, finishes, usage

    async def run():
        aclient = aclient_factory()
        results = await asyncio.gather(*(one(aclient, i) for i in range(48)))
        await aclient.close()
        return results

    results = asyncio.run(run())
    assert len(results) == 48
    for text, finishes, usage in results:
        assert text and finishes == ["length"] and usage.completion_tokens == 8
    assert wait_idle(server.url)[("tokenmill:num_requests_running", ())] == 0


def test_disconnects_free_everything(server):
    async def disconnect_streaming(http):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "stream": True,
                "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # leaving the block closes the connection mid-stream

    async def disconnect_waiting(http):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body, timeout=1.0)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            await asyncio.gather(*(disconnect_streaming(http) for _ in range(20)),
                                 *(disconnect_waiting(http) for _ in range(2)))

    asyncio.run(run())
    m = wait_idle(server.url, timeout=10)
    assert m[("tokenmill:num_requests_running", ())] == 0
    assert m[("tokenmill:num_requests_waiting", ())] == 0
    assert m[("tokenmill:kv_cache_usage_perc", ())] == 0
    # every block free again: never used, or cached and evictable
    assert m[("tokenmill:kv_cache_free_blocks", ())] == m[("tokenmill:kv_cache_blocks", ())]
    assert 0 < m[("tokenmill:prefix_cache_blocks", ())] <= m[("tokenmill:kv_cache_blocks", ())]
    assert m[("tokenmill:request_success_total", (("finished_reason", "abort"),))] >= 20


def test_metrics_counters_match_traffic(server, client):
    wait_idle(server.url)
    before = metrics(server.url)
    prompts, completions = 0, 0
    for max_tokens in (3, 5, 7):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True})
        prompts += r.usage.prompt_tokens
        completions += r.usage.completion_tokens
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2,
                                       extra_body={"ignore_eos": True})
    prompts += r.usage.prompt_tokens
    completions += r.usage.completion_tokens
    after = metrics(server.url)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("tokenmill:prompt_tokens_total") == prompts
    assert delta("tokenmill:generation_tokens_total") == completions
    assert delta("tokenmill:request_success_total", (("finished_reason", "length"),)) == 4
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert delta(f"tokenmill:{hist}_count") == 4, hist
    assert delta("tokenmill:request_generation_tokens_sum") == completions
    assert delta("tokenmill:inter_token_latency_seconds_count") > 0
    assert delta("tokenmill:iteration_tokens_total_count") > 0
    for name in ("num_preemptions_total", "admission_rejections_total"):
        assert (f"tokenmill:{name}", ()) in after
    assert json.loads(httpx.get(f"{server.url}/v1/models").text)["data"][0]["id"] == MODEL


# ----- prefix caching ---------------------------------------------------------------------

LONG = ("Prefix caching test. " * 30).strip()


def test_cached_tokens_in_usage_and_metrics(server, client):
    wait_idle(server.url)
    httpx.post(f"{server.url}/flush_cache").raise_for_status()
    before = metrics(server.url)
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 2, "ignore_eos": True}
    first = httpx.post(f"{server.url}/v1/completions", json=body).json()["usage"]
    second = client.completions.create(model=MODEL, prompt=LONG, max_tokens=2,
                                       extra_body={"ignore_eos": True}).usage
    n = first["prompt_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    salted = httpx.post(f"{server.url}/v1/completions",
                        json={**body, "cache_salt": "tenant-b"}).json()["usage"]
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0
    chat = [{"role": "user", "content": LONG}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
    r = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    stream = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens_details.cached_tokens
    after = metrics(server.url)

    def delta(name):
        return after.get((name, ()), 0) - before.get((name, ()), 0)

    hits = (second.prompt_tokens_details.cached_tokens
            + 2 * usage.prompt_tokens_details.cached_tokens)
    assert delta("tokenmill:prefix_cache_hits_total") == hits
    assert delta("tokenmill:prefix_cache_queries_total") == 3 * n + 3 * r.usage.prompt_tokens


def test_flush_cache_refused_while_running(server, client):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"model": MODEL, "prompt": LONG, "max_tokens": 300, "stream": True,
                    "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break
                refused = await http.post("/flush_cache")
            return refused

    refused = asyncio.run(run())
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    wait_idle(server.url)
    ok = httpx.post(f"{server.url}/flush_cache")
    assert ok.status_code == 200 and ok.json()["flushed_blocks"] >= 0
    usage = client.completions.create(model=MODEL, prompt=LONG, max_tokens=1).usage
    assert usage.prompt_tokens_details.cached_tokens == 0  # flushed
