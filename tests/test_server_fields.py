"""Nothing is accepted and ignored: every request field of the three generation endpoints
either does what it asks or is refused.

``all_rows()`` holds, per endpoint, a request for every field, with a value other than its
default, and what must come of it: what was generated changes (against the same request
without it: text, tool calls, choices, usage, an event stream instead of a body), or a 4xx
names the field, or a named observable shows it (the response id, the prefix cache, a field
the response says back). Fields with no observable are listed in ``NOTHING_ASKED`` with the
reason. ``test_every_field_has_a_row`` holds the table to every field the request models
declare and every field vLLM 0.32 defines, so a field added later without a row fails here.

One float32 server (where a cached prefix never changes a greedy token) with request chat
templates trusted (so ``chat_template`` and ``chat_template_kwargs`` can be seen to change a
prompt); all requests go at once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as default
from typing import Any

import httpx
import pytest

from tests.test_server_support import MODEL, server_fixtures

server, client = server_fixtures("--dtype", "float32", "--trust-request-chat-template")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses"}
ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": ""}
LIMIT = {"chat": "max_tokens", "completions": "max_tokens", "responses": "max_output_tokens"}
LOGPROBS = "message.output_text.logprobs"
RUN = uuid.uuid4().hex[:8]  # request ids and salts no earlier run on the server used
SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n")


def say(endpoint: str, text: str) -> dict:
    """A user's turn: completions get the prompt SmolLM2's template renders for it, so every
    endpoint sees the same tokens and gets the same answer."""
    if endpoint == "chat":
        return {"messages": [{"role": "user", "content": text}]}
    if endpoint == "responses":
        return {"input": text}
    return {"prompt": f"{SYSTEM}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"}


def base_request(endpoint: str) -> dict:
    """Greedy and short: "1. Red\\n2." with the default model."""
    return {**say(endpoint, "Name three colors."), LIMIT[endpoint]: 6, "temperature": 0}


# ----- what a row expects ------------------------------------------------------------------------

@dataclass
class Answer:
    status: int
    body: Any  # the JSON body, or the data events of a stream

    @property
    def param(self) -> str | None:
        error = self.body.get("error") if isinstance(self.body, dict) else None
        return error.get("param") if isinstance(error, dict) else None


# Differ between two runs of one request: ids, clocks, and what the prefix cache held.
VOLATILE = {"id", "created", "created_at", "completed_at", "item_id", "call_id",
            "cached_tokens"}


def normal(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: normal(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [normal(v) for v in value]
    return value


Check = Callable[["Row", Answer, Answer], "str | None"]  # (row, base, answer) -> failure


# What a response generated; the rest of a response object echoes the request, which a
# field that changed nothing would change as well.
GENERATED = ("output", "usage", "status", "incomplete_details", "error")


def generated(body: Any) -> Any:
    if isinstance(body, dict) and body.get("object") == "response":
        body = {k: body[k] for k in GENERATED}
    return normal(body)


def changes(row: Row, base: Answer, got: Answer) -> str | None:
    if got.status != 200:
        return f"answered {got.status}: {json.dumps(got.body)[:300]}"
    if generated(got.body) == generated(base.body):
        return "the answer is the same as without it"
    return None


def echoes(row: Row, base: Answer, got: Answer) -> str | None:
    """For fields whose whole effect is to be said back (metadata, a user's id)."""
    if got.status != 200 or got.body.get(row.field) != row.value \
            or base.body.get(row.field) == row.value:
        return f"expected {row.field} said back, got {got.status}: {json.dumps(got.body)[:300]}"
    return None


def refused(row: Row, base: Answer, got: Answer) -> str | None:
    param = got.param or ""
    if 400 <= got.status < 500 and (param == row.field
                                    or param.startswith((row.field + ".", row.field + "["))):
        return None
    return f"expected a 4xx naming {row.field}, got {got.status}: {json.dumps(got.body)[:300]}"


def has_id(expected: str) -> Check:
    def check(row: Row, base: Answer, got: Answer) -> str | None:
        if got.status == 200 and got.body.get("id") == expected:
            return None
        return f"expected the id {expected!r}, got {got.status}: {json.dumps(got.body)[:200]}"
    return check


def cached_tokens(answer: Answer) -> int:
    usage = answer.body["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return details["cached_tokens"]


def cache_apart(row: Row, base: Answer, got: Answer) -> str | None:
    """Run after the base (sequential rows): it found its prompt cached, the salted one not."""
    if got.status != 200:
        return f"answered {got.status}: {json.dumps(got.body)[:300]}"
    if not (cached_tokens(base) > 0 and cached_tokens(got) == 0):
        return f"cached tokens: {cached_tokens(base)} without, {cached_tokens(got)} with"
    return None


# ----- the table ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tokens:
    """A value resolved when the test runs: the token ids of ``text``."""

    text: str


@dataclass(frozen=True)
class StoredResponse:
    """A value resolved when the test runs: the id of a response stored a moment before."""


@dataclass(frozen=True)
class Row:
    endpoint: str
    field: str
    value: Any
    expect: Check = changes
    base: dict = default(default_factory=dict)  # beyond base_request(endpoint)
    sequential: bool = False  # run after everything else, right after its base

    def base_body(self) -> dict:
        return {"model": MODEL, **base_request(self.endpoint), **self.base}


OBJECT = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
# Closed (strict), the model writes {"color":"red"} and stops; open, it adds a key.
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "c", "schema": OBJECT}}
TEXT_SCHEMA = {"format": {"type": "json_schema", "name": "c", "schema": OBJECT}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"]}
WEATHER_CHAT = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY}
# Reads one variable besides the messages: chat_template_kwargs can set it.
TEMPLATE = ("{{ pre }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
FRENCH = "<|im_start|>system\nAnswer in French.<|im_end|>\n"
# Values of the fields tokenmill implements only where they ask for nothing (protocol.py).
SOMETHING = "asks-for-something"


def sampling_rows(endpoint: str) -> list[Row]:
    """The fields every generation endpoint takes (protocol.SamplingFields)."""
    e, limit = endpoint, LIMIT[endpoint]
    sampled = {"temperature": 1.5, "seed": 1}
    # "The dog is a dog.": a penalty of 1 on the second "dog" already changes it
    repeats = {**say(e, "Repeat the word dog ten times."), limit: 12}
    ends = {**say(e, "What color is the sky? One word."), limit: 24}  # ends before the limit
    long = say(e, "Name three colors. " * 8)  # a prompt of full KV blocks, to be cached
    return [
        Row(e, "model", "nope", refused),
        Row(e, "n", 2, changes if e != "responses" else refused),
        Row(e, "stream", True),
        Row(e, "stream_options", {"include_usage": True}, refused),  # not streamed
        Row(e, "stop", ["Red"]),
        Row(e, "seed", 2, base=sampled),
        Row(e, "temperature", 1.5, base={"seed": 1}),
        Row(e, "top_p", 0.01, base=sampled),
        Row(e, "top_k", 1, base=sampled),
        Row(e, "min_p", 0.99, base=sampled),
        Row(e, "presence_penalty", 2.0, base=repeats),
        Row(e, "frequency_penalty", 2.0, base=repeats),
        Row(e, "repetition_penalty", 2.0, base=repeats),
        Row(e, "logit_bias", {"1000": 100}),
        Row(e, "ignore_eos", True, base=ends),
        Row(e, "min_tokens", 24, base=ends),
        Row(e, "stop_token_ids", Tokens(".")),
        Row(e, "skip_special_tokens", False, base={**ends, "ignore_eos": True}),
        Row(e, "include_stop_str_in_output", True, base={"stop": ["Red"]}),
        Row(e, "priority", 1, refused),  # the server schedules first come, first served
        Row(e, "request_id", f"{e}-{RUN}", has_id(f"{ID_PREFIX[e]}{e}-{RUN}")),
        Row(e, "cache_salt", f"{e}-{RUN}", cache_apart, sequential=True, base=long),
        Row(e, "response_format", {"type": "json_object"},
            changes if e != "responses" else refused),
        Row(e, "structured_outputs", {"choice": ["yes", "no"]}),
        Row(e, "guided_json", OBJECT),
        Row(e, "guided_regex", "[0-9]{3}"),
        Row(e, "guided_choice", ["yes", "no"]),
        Row(e, "guided_grammar", 'start: "ok"'),
        Row(e, "guided_whitespace_pattern", "\n  ", base={"guided_json": OBJECT, limit: 12}),
    ]


def chat_rows() -> list[Row]:
    calls = {**say("chat", "Weather in Paris and London?"), "max_tokens": 60,
             "tools": [WEATHER_CHAT], "tool_choice": "required"}  # the model calls twice
    strict = {"json_schema": {**SCHEMA_FORMAT["json_schema"], "strict": True}}
    return [
        Row("chat", "messages", [{"role": "user", "content": "Name three animals."}]),
        Row("chat", "max_tokens", 2),
        Row("chat", "max_completion_tokens", 2),
        Row("chat", "logprobs", True),
        Row("chat", "top_logprobs", 3, base={"logprobs": True}),
        Row("chat", "add_generation_prompt", False),
        Row("chat", "chat_template", TEMPLATE),
        Row("chat", "chat_template_kwargs", {"pre": FRENCH}, base={"chat_template": TEMPLATE}),
        Row("chat", "best_of", 3, refused),  # only best_of == n
        # this server has no KV connector (--kv-role): the hand-over cannot happen
        Row("chat", "kv_transfer_params", {"do_remote_decode": True}, refused),
        Row("chat", "tools", [WEATHER_CHAT]),
        Row("chat", "tool_choice", "required", base={"tools": [WEATHER_CHAT]}),
        Row("chat", "parallel_tool_calls", False, base=calls),
        # this server has no --reasoning-parser: no reasoning to leave out or to cut short
        Row("chat", "include_reasoning", False, refused),
        Row("chat", "thinking_token_budget", 10, refused),
        Row("chat", "continue_final_message", True,
            base={"messages": [{"role": "user", "content": "Name three colors."},
                               {"role": "assistant", "content": "1. Red"}],
                  "add_generation_prompt": False}),
        Row("chat", "stream_options", {"include_usage": True}, base={"stream": True}),
        Row("chat", "response_format",
            {**SCHEMA_FORMAT, "json_schema": {**strict["json_schema"], "strict": False}},
            base={"response_format": {**SCHEMA_FORMAT, **strict}, "max_tokens": 12}),
    ]


def completion_rows() -> list[Row]:
    strict = {**SCHEMA_FORMAT, "json_schema": {**SCHEMA_FORMAT["json_schema"], "strict": True}}
    loose = {**SCHEMA_FORMAT, "json_schema": {**SCHEMA_FORMAT["json_schema"], "strict": False}}
    return [
        Row("completions", "prompt", "Once upon a time"),
        Row("completions", "max_tokens", 2),
        Row("completions", "logprobs", 2),
        Row("completions", "echo", True),
        # the prompt tokens' logprobs, then the generated ones' (test_prompt_logprobs.py)
        Row("completions", "echo", True, base={"logprobs": 1}),
        Row("completions", "prompt_logprobs", 1),
        Row("chat", "prompt_logprobs", 1),
        Row("completions", "suffix", " the end.", refused),  # SmolLM2 has no FIM tokens
        Row("completions", "best_of", 3, refused),
        Row("completions", "kv_transfer_params", {"do_remote_decode": True}, refused),
        Row("completions", "stream_options", {"include_usage": True}, base={"stream": True}),
        Row("completions", "response_format", loose,
            base={"response_format": strict, "max_tokens": 12}),
    ]


# Fields of the Responses API implemented only where they ask for nothing, with a value that
# asks for something (responses._UNSUPPORTED).
RESPONSES_REFUSED = {
    "background": True, "background_options": {"poll": True}, "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"}, "moderation": {"model": "x"},
    "context_management": [{"type": "compaction"}], "access_programs": ["p"],
    "image": {"detail": "high"}, "prompt_cache_options": {"mode": "explicit"},
    "truncation": "auto", "reasoning": {"effort": "high"}, "service_tier": "flex",
    "max_tokens": 5, "max_completion_tokens": 5, "messages": [{"role": "user", "content": "x"}],
    "logprobs": True, "chat_template_kwargs": {"pre": "x"}, "chat_template": TEMPLATE,
    "add_generation_prompt": False, "top_logprobs": 21,
}


def responses_rows() -> list[Row]:
    calls = {**say("responses", "Weather in Paris and London?"), "max_output_tokens": 60,
             "tools": [WEATHER], "tool_choice": "required"}  # the model calls twice
    text = {"format": {**TEXT_SCHEMA["format"], "strict": True}}
    return [
        Row("responses", "input", "Name three animals."),
        Row("responses", "instructions", "Answer in French."),
        Row("responses", "max_output_tokens", 2),
        Row("responses", "previous_response_id", StoredResponse()),
        Row("responses", "previous_response_id", "resp_none", refused),
        # said in the response (test_responses_server.py: a response not stored is not found)
        Row("responses", "store", False, echoes),
        Row("responses", "metadata", {"k": "v"}, echoes),  # kept with the response
        Row("responses", "tools", [WEATHER]),
        Row("responses", "tool_choice", "required", base={"tools": [WEATHER]}),
        Row("responses", "parallel_tool_calls", False, base=calls),
        Row("responses", "max_tool_calls", 1, base=calls),
        Row("responses", "max_tool_calls", 0, refused, base=calls),
        Row("responses", "text", {"format": {"type": "json_object"}}),
        Row("responses", "text", {"format": {**text["format"], "strict": False}},
            base={"text": text, "max_output_tokens": 12}),
        Row("responses", "include", [LOGPROBS]),
        Row("responses", "top_logprobs", 3, base={"include": [LOGPROBS]}),
        Row("responses", "stream_options", {"include_obfuscation": True}, refused,
            base={"stream": True}),
        # said back (one engine: the cache key routes nothing; the prefix cache is implicit)
        Row("responses", "prompt_cache_key", "k", echoes),
        Row("responses", "prompt_cache_retention", "in_memory", echoes),
        Row("responses", "prompt_cache_retention", "24h", refused),
        Row("responses", "safety_identifier", "s", echoes),
        Row("responses", "user", "u", echoes),
        *(Row("responses", name, value, refused) for name, value in RESPONSES_REFUSED.items()),
    ]


def unimplemented_rows(endpoint: str, model) -> list[Row]:
    """OpenAI and vLLM fields an endpoint takes only where they ask for nothing
    (protocol._UNSUPPORTED): anything else is refused."""
    from tokenmill.server.protocol import _UNSUPPORTED

    return [Row(endpoint, name, SOMETHING, refused) for name in _UNSUPPORTED
            if name not in model.implemented]


def request_models() -> dict[str, type]:
    from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
    from tokenmill.server.responses_request import ResponsesRequest

    return {"chat": ChatCompletionRequest, "completions": CompletionRequest,
            "responses": ResponsesRequest}


def all_rows() -> list[Row]:
    models = request_models()
    return [*chat_rows(), *completion_rows(), *responses_rows(),
            *(row for e, model in models.items()
              for row in [*sampling_rows(e), *unimplemented_rows(e, model)])]


# Fields that ask nothing of the server, so nothing can show them: why, per endpoint.
NOTHING_ASKED = {
    "chat": {"user": "an end user's id for the operator's abuse monitoring (OpenAI)"},
    "completions": {"user": "an end user's id for the operator's abuse monitoring (OpenAI)",
                    "add_special_tokens": "SmolLM2's tokenizer adds no special tokens to a "
                                          "prompt, so leaving them out changes nothing here"},
    "responses": {},
}

# vLLM 0.32's request fields per endpoint: each must have a row too (or be one that asks for
# nothing here: protocol.IGNORED_VLLM_FIELDS).
_VLLM_SHARED = {
    "model", "frequency_penalty", "logit_bias", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "prompt_logprobs", "logprob_token_ids", "allowed_token_ids", "bad_words",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id",
    "session_id", "return_tokens_as_token_ids", "return_token_ids",
    "routed_experts_prompt_start", "return_token_offsets", "mm_payload", "return_mm_kwargs",
    "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "stream_interval"}
VLLM_FIELDS = {
    "chat": _VLLM_SHARED | {
        "messages", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens", "tools",
        "tool_choice", "reasoning_effort", "include_reasoning", "parallel_tool_calls", "echo",
        "add_generation_prompt", "continue_final_message", "documents", "chat_template",
        "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs",
        "return_prompt_text"},
    "completions": _VLLM_SHARED | {"prompt", "echo", "logprobs", "max_tokens", "suffix",
                                   "prompt_embeds"},
    "responses": {
        "background", "include", "input", "instructions", "max_output_tokens",
        "max_tool_calls", "metadata", "model", "logit_bias", "parallel_tool_calls",
        "previous_response_id", "prompt", "reasoning", "include_reasoning", "service_tier",
        "store", "stream", "temperature", "text", "tool_choice", "tools", "top_logprobs",
        "top_p", "top_k", "min_p", "truncation", "user", "skip_special_tokens",
        "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
        "prompt_cache_key", "watermarking", "request_id", "session_id", "media_io_kwargs",
        "mm_processor_kwargs", "priority", "mm_payload", "return_mm_kwargs", "cache_salt",
        "enable_response_messages", "previous_input_messages", "structured_outputs",
        "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "vllm_xargs",
        "kv_transfer_params", "ec_transfer_params", "chat_template_kwargs"},
}


def test_every_field_has_a_row():
    """Every field a request model declares and every vLLM field has a row (or asks for
    nothing, with the reason above); no row names a field no request takes."""
    from tokenmill.server.protocol import _UNSUPPORTED, IGNORED_VLLM_FIELDS

    rows = all_rows()
    for endpoint, model in request_models().items():
        covered = {r.field for r in rows if r.endpoint == endpoint}
        needed = (set(model.model_fields) | VLLM_FIELDS[endpoint]) - IGNORED_VLLM_FIELDS \
            - NOTHING_ASKED[endpoint].keys()
        assert not needed - covered, (endpoint, sorted(needed - covered))
        assert covered <= set(model.model_fields) | set(_UNSUPPORTED), endpoint
        assert NOTHING_ASKED[endpoint].keys() <= set(model.model_fields), endpoint


def test_strict_false_opens_only_schemas():
    """``open_objects`` opens every object schema that says nothing about other keys, and
    leaves alone what is data (enum, const) and what already says (additionalProperties)."""
    from tokenmill.server.protocol import open_objects

    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "closed": {"type": "object", "properties": {}, "additionalProperties": False},
        "kind": {"enum": [{"properties": {}}]}},
        "$defs": {"item": {"type": "object", "properties": {"b": {}}}}}
    opened = open_objects(schema)
    assert opened["additionalProperties"] is True
    inner = opened["properties"]
    assert inner["properties"]["additionalProperties"] is True
    assert "additionalProperties" not in inner["properties"]["properties"]  # names, not a schema
    assert inner["closed"]["additionalProperties"] is False
    assert inner["kind"] == {"enum": [{"properties": {}}]}
    assert opened["$defs"]["item"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # a copy


# ----- running it --------------------------------------------------------------------------------

async def send(http: httpx.AsyncClient, endpoint: str, body: dict) -> Answer:
    r = await http.post(PATHS[endpoint], json=body)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return Answer(r.status_code, [json.loads(line[len("data: "):])
                                      for line in r.text.splitlines()
                                      if line.startswith("data: ") and line != "data: [DONE]"])
    return Answer(r.status_code, r.json())


async def resolve(http: httpx.AsyncClient, value: Any) -> Any:
    if isinstance(value, Tokens):
        r = await http.post("/tokenize", json={"prompt": value.text})
        return r.json()["tokens"]
    if isinstance(value, StoredResponse):
        stored = await send(http, "responses", {"model": MODEL, "input": "My name is Ada.",
                                                "max_output_tokens": 2})
        assert stored.status == 200, stored.body
        return stored.body["id"]
    return value


async def run_rows(url: str, rows: list[Row]) -> list[str]:
    """Every row's request and every base request at once; then the sequential rows one by
    one, each right after its base. Returns what failed."""
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as http:
        values = [await resolve(http, r.value) for r in rows]

        def ask(i: int):
            return send(http, rows[i].endpoint, {**rows[i].base_body(), rows[i].field: values[i]})

        def ask_base(row: Row):
            return send(http, row.endpoint, row.base_body())

        keys = [json.dumps([r.endpoint, r.base_body()], sort_keys=True) for r in rows]
        distinct = dict(zip(keys, rows))
        at_once = [i for i, r in enumerate(rows) if not r.sequential]
        answers = await asyncio.gather(*map(ask_base, distinct.values()), *map(ask, at_once))
        base_of = dict(zip(distinct, answers))
        bases = [base_of[k] for k in keys]
        got: list[Answer | None] = [None] * len(rows)
        for i, answer in zip(at_once, answers[len(distinct):]):
            got[i] = answer
        for i in (i for i, r in enumerate(rows) if r.sequential):
            bases[i] = await ask_base(rows[i])
            got[i] = await ask(i)
    failures = []
    for r, value, base, answer in zip(rows, values, bases, got):
        why = r.expect(r, base, answer) if base.status == 200 else \
            f"the request without it answered {base.status}: {json.dumps(base.body)[:300]}"
        if why is not None:
            failures.append(f"{r.endpoint} {r.field}={json.dumps(value)[:80]}: {why}")
    return failures


@pytest.mark.slow
def test_every_field_changes_the_answer_or_is_refused(server):
    failures = asyncio.run(run_rows(server.url, all_rows()))
    assert not failures, "\n".join(failures)
