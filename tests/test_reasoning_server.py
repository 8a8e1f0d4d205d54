"""``--reasoning-parser`` through the real server and the official OpenAI client: reasoning
split off in chat (whole and streamed) and in responses, where the test template leaves the
model thinking or not (``chat_template_kwargs.enable_thinking``), ``thinking_token_budget``
forcing the closing tag, and the refusals."""

from __future__ import annotations

import httpx
import pytest

from tests.test_server_support import server_fixtures

server, client = server_fixtures("--dtype", "float32", "--reasoning-parser", "deepseek_r1",
                                 "--trust-request-chat-template")

# SmolLM2's chat format, with the thinking tags of Qwen3's: thinking opened for the model,
# or an empty pair when enable_thinking is false.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
QUESTION = "What is the capital of France?"
PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n"
MESSAGES = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"chat_template": TEMPLATE}}


def _raw(client, prompt: str, max_tokens: int = 24) -> str:
    """The model's own text for ``prompt``, no parser in the way."""
    return client.completions.create(model=None, prompt=prompt, temperature=0,
                                     max_tokens=max_tokens).choices[0].text


def _extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def test_thinking_opened_by_the_template_is_reasoning(client):
    raw = _raw(client, PROMPT)
    assert "</think>" not in raw  # the tiny model never closes: all of it is reasoning
    message = client.chat.completions.create(model=None, messages=MESSAGES,
                                             **GREEDY).choices[0].message
    assert _extra(message, "reasoning") == _extra(message, "reasoning_content") == raw.strip()
    assert message.content is None


def test_streamed_reasoning_adds_up_to_the_whole(client):
    choice = client.chat.completions.create(model=None, messages=MESSAGES, **GREEDY).choices[0]
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(model=None, messages=MESSAGES, stream=True,
                                                **GREEDY):
        delta = chunk.choices[0].delta
        assert not (_extra(delta, "reasoning") and delta.content)
        reasoning += _extra(delta, "reasoning") or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == _extra(choice.message, "reasoning")
    assert content == ""
    assert finish == choice.finish_reason


def test_enable_thinking_false_is_all_answer(client):
    body = {**GREEDY["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}
    message = client.chat.completions.create(
        model=None, messages=MESSAGES, temperature=0, max_tokens=24,
        extra_body=body).choices[0].message
    raw = _raw(client, PROMPT.replace("<think>\n", "<think>\n\n</think>\n\n"))
    assert message.content == raw
    assert _extra(message, "reasoning") is None


def test_thinking_token_budget_forces_the_closing_tag(client):
    for budget in (0, 4):
        answer = client.chat.completions.create(
            model=None, messages=MESSAGES, temperature=0, max_tokens=30,
            extra_body={**GREEDY["extra_body"], "thinking_token_budget": budget})
        message = answer.choices[0].message
        thought = _raw(client, PROMPT, max_tokens=budget) if budget else ""  # the same tokens
        assert _extra(message, "reasoning") == (thought.strip() or None)
        # the model never closes by itself: the forced tag made an answer
        assert message.content, budget


def test_without_a_prompt_tag_deepseek_r1_output_is_reasoning(server, client):
    """The default template opens no tag: deepseek_r1 models often leave it out, so the
    output is reasoning until a closing tag."""
    message = client.chat.completions.create(model=None, messages=MESSAGES, temperature=0,
                                             max_tokens=16).choices[0].message
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES},
                     timeout=30).json()["tokens"]
    raw = client.completions.create(model=None, prompt=ids, temperature=0,
                                    max_tokens=16).choices[0].text
    assert _extra(message, "reasoning") == raw.strip()
    assert message.content is None


def test_responses_reasoning_item(client):
    chat = client.chat.completions.create(model=None, messages=MESSAGES, temperature=0,
                                          max_tokens=16).choices[0].message
    response = client.responses.create(model="smollm2-135m-instruct", input=QUESTION,
                                       temperature=0, max_output_tokens=16)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == _extra(chat, "reasoning")
    events = list(client.responses.create(
        model="smollm2-135m-instruct", input=QUESTION, temperature=0, max_output_tokens=16,
        stream=True))
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index(
        "response.output_text.done")
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert deltas == done.text == response.output[0].content[0].text
    final = events[-1].response  # response.completed: the same items as the whole response
    assert [(i.type, i.content[0].text) for i in final.output] == \
        [(i.type, i.content[0].text) for i in response.output]


def test_responses_reasoning_effort_is_a_thinking_budget(server, client):
    """effort none closes the thinking at once, as thinking_token_budget 0 does on chat; a
    summary, or an effort OpenAI does not name, is a 400."""
    chat = client.chat.completions.create(
        model=None, messages=MESSAGES, temperature=0, max_tokens=16,
        extra_body={"thinking_token_budget": 0}).choices[0].message
    response = client.responses.create(model="smollm2-135m-instruct", input=QUESTION,
                                       temperature=0, max_output_tokens=16,
                                       reasoning={"effort": "none"})
    assert [i.type for i in response.output] == ["message"]
    assert response.output[0].content[0].text == chat.content
    assert response.reasoning.effort == "none"
    for reasoning in ({"effort": "high", "summary": "auto"}, {"effort": "extreme"}):
        r = httpx.post(f"{server.url}/v1/responses", timeout=30, json={
            "input": QUESTION, "max_output_tokens": 2, "reasoning": reasoning})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning", r.text


SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n")


def test_continue_final_message_goes_on_writing_it(server, client):
    """The model continues the assistant's text (an answer: no reasoning, even with
    deepseek_r1), exactly as a raw completion of the cut prompt does; a final message with
    an open thinking tag continues as reasoning."""
    for start, kind in (("The capital of France is", "content"),
                        ("<think>\nThe user asks about", "reasoning")):
        messages = [*MESSAGES, {"role": "assistant", "content": start}]
        message = client.chat.completions.create(
            model=None, messages=messages, temperature=0, max_tokens=12,
            extra_body={"continue_final_message": True, "add_generation_prompt": False}
        ).choices[0].message
        raw = _raw(client, f"{SYSTEM}<|im_start|>user\n{QUESTION}<|im_end|>\n"
                   f"<|im_start|>assistant\n{start}", 12)
        ids = httpx.post(f"{server.url}/tokenize", timeout=30, json={
            "messages": messages, "continue_final_message": True,
            "add_generation_prompt": False}).json()["tokens"]
        assert client.completions.create(model=None, prompt=ids, temperature=0, max_tokens=12
                                         ).choices[0].text == raw
        if kind == "content":
            assert (message.content, _extra(message, "reasoning")) == (raw, None)
        else:
            assert (message.content, _extra(message, "reasoning")) == (None, raw.strip())


def test_continue_final_message_without_messages_is_400(server):
    """Nothing to continue: a 400 naming messages, on /tokenize as on chat (found by the
    schema fuzz as a 500)."""
    body = {"messages": [], "continue_final_message": True, "add_generation_prompt": False}
    for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 2})):
        r = httpx.post(f"{server.url}{path}", json={**body, **extra}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "messages", (path, r.text)


@pytest.mark.parametrize("body, field", [
    ({"continue_final_message": True}, "continue_final_message"),  # and a generation prompt
    ({"continue_final_message": "yes please"}, "continue_final_message"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": "lots"}, "thinking_token_budget"),
    ({"include_reasoning": "maybe"}, "include_reasoning"),
])
def test_bad_reasoning_fields_are_400(server, body, field):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"messages": MESSAGES, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.text
