"""OpenAI request bodies as pydantic models and the error shape.

Fields no API defines are ignored (as vLLM does); an OpenAI or vLLM field tokenmill does not
implement is refused with a 400 naming it unless it carries a value that asks for nothing
(``_UNSUPPORTED``). Every request is checked whole before its fields are read: no string may
hold a lone UTF-16 surrogate (valid JSON, but not text) and no number may be infinite or NaN.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)


class FieldError(ValueError):
    """A request field is unusable; ``param`` names it (the app's 400 says which)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def check_json_values(value: Any) -> None:
    """Raise FieldError for the first string with a lone surrogate or non-finite float.

    Iterative (a deeply nested body cannot exhaust the stack); a path is only spelled out for
    the value that fails, and ints (token ids: millions in a big body) are skipped cheaply."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not _is_text(v):
                raise _bad_value(path, "invalid Unicode (a lone UTF-16 surrogate) in a string")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise _bad_value(path, f"numbers must be finite, got {v}")
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _plain(k):  # keys are text too
                    stack.append((k, (*path, k)))
                if not _plain(item):
                    stack.append((item, (*path, k)))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                if not _plain(item):
                    stack.append((item, (*path, i)))


def _plain(item: Any) -> bool:
    """Fine as it is, decided without a trip through the stack: text, an int, a list of ints
    (token ids: a big body holds millions)."""
    kind = item.__class__
    if kind is str:
        return item.isascii() or _is_text(item)
    return kind is int or item is None or kind is bool \
        or (kind is list and all(x.__class__ is int for x in item))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_value(path: tuple, why: str) -> FieldError:
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    where = printable(where)
    return FieldError(_top(where) or None, f"{where or 'body'}: {why}")


def printable(text: str) -> str:
    """``text`` with lone surrogates escaped, safe to put in a UTF-8 response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _top(where: str) -> str:
    return where.split(".", 1)[0].split("[", 1)[0]


# vLLM's prefill/decode hand-off is a few ids and the producer's block ids (one per block of
# the prompt): far below this, which only keeps a body from parking megabytes in the engine.
KV_TRANSFER_PARAMS_MAX_CHARS = 1 << 18


def check_kv_transfer_params(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` as it is, or FieldError: ``kv_transfer_params`` is a JSON object of at most
    ``KV_TRANSFER_PARAMS_MAX_CHARS`` characters (what it holds is the KV connector's to judge)."""
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        raise FieldError("kv_transfer_params", "kv_transfer_params: not a plain JSON object") \
            from None
    if size > KV_TRANSFER_PARAMS_MAX_CHARS:
        raise FieldError("kv_transfer_params", f"kv_transfer_params: {size} characters is more "
                         f"than this server takes ({KV_TRANSFER_PARAMS_MAX_CHARS})")
    return value


# A request id becomes part of response and engine ids and of log lines: short and plain.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_request_id(value: str, param: str) -> str:
    """``value`` as it is, or FieldError: a client's request id (``request_id``, the
    X-Request-Id header) is 1 to 128 characters of ``A-Z a-z 0-9 . _ : -``."""
    if not _REQUEST_ID.fullmatch(value):
        raise FieldError(param, f"{param}: 1 to 128 characters of A-Z, a-z, 0-9 and . _ : - "
                         f"(got {len(value)} characters)")
    return value


# JSON Schema keys whose values are schemas by name (not schemas themselves), and keys whose
# values are data; ``open_objects`` must not take either for an object schema.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def open_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which an object that lists its ``properties`` and says
    nothing about others allows others, as JSON Schema reads it. Output constraints close such
    objects (strict mode); ``"strict": false`` asks for this reading instead."""
    if isinstance(schema, list):
        return [open_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: open_objects(s) for name, s in value.items()}
        else:
            out[key] = value if key in _DATA_KEYS else open_objects(value)
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = True
    return out


def honour_strict(response_format: Any) -> Any:
    """``response_format`` with a ``json_schema`` whose ``strict`` is false opened
    (``open_objects``); otherwise as it is. A ``strict`` that is not a boolean is refused."""
    body = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if not isinstance(body, dict) or response_format.get("type") != "json_schema":
        return response_format
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, "response_format.json_schema.strict: must be a boolean",
                       param="response_format.json_schema.strict", code="invalid_value")
    if strict is not False or not isinstance(body.get("schema"), dict):
        return response_format
    return {**response_format, "json_schema": {**body, "schema": open_objects(body["schema"])}}


# Fields of OpenAI's or vLLM's API that tokenmill does not implement, with the values that ask
# for nothing (absent, null, the default). Any other value is a 400 naming the field.
_OFF = (None, False)
_UNSUPPORTED: dict[str, tuple] = {
    # OpenAI
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "functions": (None,), "function_call": (None, "none"), "web_search_options": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "store": _OFF,
    "service_tier": (None, "auto", "default"),
    # vLLM
    "use_beam_search": _OFF, "length_penalty": (None, 1, 1.0), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "return_tokens_as_token_ids": _OFF, "return_token_ids": _OFF, "documents": (None,),
    "mm_processor_kwargs": (None,), "continue_final_message": _OFF, "vllm_xargs": (None,),
    "kv_transfer_params": (None,), "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []), "add_special_tokens": (None, False),
    "echo": _OFF, "prompt_embeds": (None,), "watermarking": _OFF, "logprob_token_ids": (None, []),
    "thinking_token_budget": (None,), "include_reasoning": (None, True),
    "repetition_detection": (None,), "stream_interval": (None, 1), "media_io_kwargs": (None,),
    "return_prompt_text": _OFF, "return_token_offsets": _OFF, "ec_transfer_params": (None,),
    "enable_response_messages": _OFF, "previous_input_messages": (None, []),
}
# completions implement these (add_special_tokens defaults to true there)
_UNSUPPORTED_COMPLETIONS = {"add_special_tokens", "echo", "kv_transfer_params", "prompt_logprobs"}
# vLLM fields left alone because they ask for nothing here: ``session_id`` (a hint for routing
# related requests; one engine), ``truncation_side`` (only with truncate_prompt_tokens, refused
# above), ``mm_payload``, ``return_mm_kwargs`` and ``routed_experts_prompt_start`` (what the render
# endpoints and mixture-of-experts models return; tokenmill has neither).
IGNORED_VLLM_FIELDS = frozenset({"session_id", "truncation_side", "mm_payload",
                                 "return_mm_kwargs", "routed_experts_prompt_start"})


def _refuse_unimplemented(data: Any, names: Iterable[str]) -> Any:
    """``data`` as it is, or FieldError for the first of ``names`` it holds with a value that
    asks for something (see _UNSUPPORTED)."""
    if isinstance(data, dict):
        for name in names:
            if name in data and data[name] not in _UNSUPPORTED[name]:
                raise FieldError(name, f"{name}: not supported by tokenmill (got "
                                 f"{printable(str(data[name])[:100])})")
    return data


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _check_values(cls, data: Any) -> Any:
        check_json_values(data)
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carrying tokens also carries the usage so far
    continuous_usage_stats: bool = False


class SamplingFields(_Request):
    """The OpenAI sampling fields plus the extras users send to vLLM."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse_unimplemented(data, [name for name in _UNSUPPORTED
                                            if name not in cls.implemented])

    implemented: ClassVar[frozenset[str]] = frozenset()  # _UNSUPPORTED names this one has

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    user: str | None = None  # an end user's id for the operator (OpenAI); generates nothing
    # vLLM's: the response's id is made from it (the X-Request-Id header, where sent, wins)
    request_id: str | None = None
    cache_salt: str | None = None  # prefix-cache namespace (per tenant): no sharing across salts
    # Structured output (``structured/``): OpenAI's field, vLLM's object and its older fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's prefill/decode hand-off, for the engine's KV connector as it is; completions and
    # chat take it, the other endpoints refuse it (``implemented``)
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: the prompt tokens' logprobs with their top-N (completions and chat take it)
    prompt_logprobs: int | None = None

    def engine_prompt_logprobs(self) -> int | None:
        """The top-N the engine scores the prompt with (None: the prompt is not scored)."""
        return self.prompt_logprobs

    @field_validator("request_id")
    @classmethod
    def _plain_request_id(cls, value: str | None) -> str | None:
        return None if value is None else check_request_id(value, "request_id")

    @field_validator("kv_transfer_params")
    @classmethod
    def _bounded_kv_transfer_params(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_kv_transfer_params(value)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    implemented: ClassVar[frozenset[str]] = frozenset(_UNSUPPORTED_COMPLETIONS)

    def engine_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` puts the prompt tokens' logprobs in front of the
        generated ones (what lm-evaluation-harness sums), so the prompt is scored then too."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's reasoning, in the history: the template sees it under both names, as in
    # vLLM (Qwen3's reads reasoning_content); a template that does not read it drops it.
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None  # an assistant's refusal, in the history: its text, as content
    # What a history message may carry that no prompt here can hold: refused unless null.
    audio: Any = None
    function_call: Any = None

    @field_validator("audio", "function_call")
    @classmethod
    def _refuse_unless_null(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported in a message (an assistant's "
                             f"calls go in tool_calls; only text is read)")
        return None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # a whole template: only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    best_of: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a named function
    parallel_tool_calls: bool = True
    # With --reasoning-parser: whether the thinking is returned (vLLM's; false drops it).
    include_reasoning: bool = True
    # With --reasoning-parser: think at most this many tokens, then the closing tag is forced.
    thinking_token_budget: int | None = Field(default=None, ge=0)
    # The last message (an assistant's, usually) is left open and the model goes on writing
    # it, instead of starting a new turn (vLLM's; needs add_generation_prompt false).
    continue_final_message: bool = False

    implemented: ClassVar[frozenset[str]] = frozenset({"kv_transfer_params",
                                                       "include_reasoning", "prompt_logprobs",
                                                       "thinking_token_budget",
                                                       "continue_final_message"})


class TokenizeRequest(_Request):
    """``POST /tokenize``: a prompt, or messages rendered as the chat endpoint renders them
    (tools and template choice included)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse_unimplemented(data, ("media_io_kwargs", "mm_processor_kwargs"))

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # a prompt: default true; messages: not taken
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as in chat
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's body): serve the PEFT adapter at ``lora_path``
    under the name ``lora_name``."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; its ``lora_int_id`` is not needed: a
    name is unique)."""

    lora_name: str = Field(min_length=1, max_length=256)


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error",
                    "server_error", "overloaded_error"]


class APIError(Exception):
    """An error with its HTTP status, rendered as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """The 400 of a request field that cannot be used; ``param`` names it as the API spells it."""
    return APIError(400, message, param=param, code=code)


def field_error(e: ValueError) -> APIError:
    """The 400 of a lower layer's typed error: each (``FieldError``, ``PromptError``,
    ``ParamError``, ``ConstraintError``, ``ToolsError``) is a ValueError that names its field
    in ``param`` (and may bring its ``code``), read here, never from its text."""
    return invalid(getattr(e, "param", None), str(e), getattr(e, "code", None) or "invalid_value")
