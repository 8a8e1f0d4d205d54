"""The OpenAPI document as the server really answers: response models and statuses per route.

FastAPI's generated document says every body-taking route answers 422 (the server renders
validation errors as OpenAI-style 400s, see ``app._install_error_handlers``) and leaves every
200 schema empty. ``install_openapi`` post-processes it from ``ROUTES``: each route lists the
statuses it returns, errors carry the ``{"error": {...}}`` body, each 200 its response model.
A schema-driven client (``tests/test_server_schema.py`` runs schemathesis) then meets no
undocumented status and can validate every body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from tokenmill.server.anthropic_schema import (ANTHROPIC_MODELS, AnthropicErrorBody,
    AnthropicMessage, AnthropicStreamEvent, AnthropicTokenCount)
from tokenmill.server.protocol import ErrorType

_REF = "#/components/schemas/{model}"


# ----- shared pieces ----------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0, description="prompt tokens that came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


StopReason = int | str | None  # the stop token id or stop string that ended a choice
# vLLM's: a producer's (--kv-role) answer to kv_transfer_params, absent from other answers
KVTransferParams = Annotated[dict[str, Any] | None, Field(
    None, description="present when the request's kv_transfer_params asked this server to "
                      "prefill for another: where the decode instance pulls the KV blocks from")]
FinishReason = Literal["stop", "length", "abort"]


# ----- /v1/completions --------------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    """Per generated token: its text, logprob and top alternatives (``echo`` with
    ``logprobs`` is refused until the prompt's own logprobs are computed)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kv_transfer_params: KVTransferParams


class CompletionChunkChoice(BaseModel):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason


class CompletionChunk(BaseModel):
    """One event of a streamed completion; with include_usage the last has no choices and
    the usage, the others ``usage: null`` (with continuous_usage_stats: the usage so far)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


# ----- /v1/chat/completions ---------------------------------------------------------------------

class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON object, encoded")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list,
                                       description="present when the model called tools")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"]
    stop_reason: StopReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: KVTransferParams


class FunctionCallDelta(TypedDict, total=False):
    name: str
    arguments: str


class ToolCallDelta(TypedDict, total=False):
    """A call's first delta has its id, type and name; later ones add to its arguments."""

    index: int
    id: str
    type: Literal["function"]
    function: FunctionCallDelta


class ChatDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str
    tool_calls: list[ToolCallDelta]


class ChatChunkChoice(BaseModel):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (the first carries the role)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ----- /v1/responses ----------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[dict[str, Any]]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as a JSON object, encoded")


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(ge=0)


class ResponseUsage(BaseModel):
    input_tokens: int = Field(ge=0)
    input_tokens_details: InputTokensDetails
    output_tokens: int = Field(ge=0)
    output_tokens_details: OutputTokensDetails
    total_tokens: int = Field(ge=0)


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The Responses API object. The fields that echo the request (instructions, tools, text,
    temperature...) are not spelled out."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[Annotated[OutputMessage | FunctionCallItem, Field(discriminator="type")]]
    usage: ResponseUsage | None
    error: ResponseError | None
    incomplete_details: dict[str, Any] | None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response (``response.created`` ... ``response.completed``);
    the event's other fields depend on its type."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(pattern=r"^response\.")
    sequence_number: int = Field(ge=0)


# ----- /v1/embeddings, /v1/rerank, /v1/score ----------------------------------------------------

class PoolingUsage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int = Field(ge=0)
    embedding: list[float] | str = Field(
        description="the vector; with encoding_format base64, its float32 bytes in base64")


class EmbeddingList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: PoolingUsage


class RerankedDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(ge=0, description="the document's place in the request")
    relevance_score: float
    document: RerankedDocument | None = Field(
        None, description="absent with return_documents: false")


class RerankUsage(BaseModel):
    total_tokens: int = Field(ge=0)


class RerankList(BaseModel):
    """Results by relevance, highest first (top_n of them, when given)."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class Score(BaseModel):
    index: int = Field(ge=0)
    object: Literal["score"]
    score: float


class ScoreList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: PoolingUsage


# ----- the other routes -------------------------------------------------------------------------

class ModelCard(BaseModel):
    """The base model (``parent`` null) or a LoRA adapter over it (``root``: its path)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = Field(None, description="a LoRA adapter's base model")
    max_model_len: int = Field(ge=1)


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(BaseModel):
    tokens: list[int]
    count: int = Field(ge=0)
    max_model_len: int = Field(ge=1)
    token_strs: list[str | None] | None = Field(
        None, description="each token's vocabulary string (with return_token_strs)")


class Detokenized(BaseModel):
    prompt: str


class FlushedCache(BaseModel):
    flushed_blocks: int = Field(ge=0)


class Version(BaseModel):
    version: str


class HealthStatus(BaseModel):
    """/health: ok; busy (generate=true could not run its generation for other work); or
    unhealthy, with why."""

    status: Literal["ok", "busy", "unhealthy"]
    reason: str | None = None


class ServerInfo(BaseModel):
    """How the engine runs (dtype and why, attention backend, CPU, sizes); fields may grow."""

    model_config = ConfigDict(extra="allow")

    version: str


class ErrorDetail(BaseModel):
    message: str
    type: ErrorType
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


MODELS: tuple[type[BaseModel], ...] = (
    Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk, ResponseObject,
    ResponseStreamEvent, ModelCard, ModelList, Tokenized, Detokenized, FlushedCache, Version,
    HealthStatus, ServerInfo, ErrorBody, EmbeddingList, RerankList, ScoreList, *ANTHROPIC_MODELS)


# ----- the table --------------------------------------------------------------------------------

@dataclass(frozen=True)
class MediaBody:
    """A body that is not a JSON model: its media type and JSON schema."""

    media_type: str
    schema: dict[str, Any]


Body = type[BaseModel] | MediaBody | None  # None: no body
Statuses = dict[int, tuple[str, Body]]

PROMETHEUS_TEXT = MediaBody("text/plain", {"type": "string"})
PLAIN_TEXT = MediaBody("text/plain", {"type": "string"})
HTML_PAGE = MediaBody("text/html", {"type": "string"})
JS_TEXT = MediaBody("text/javascript", {"type": "string"})
CSS_TEXT = MediaBody("text/css", {"type": "string"})
JSON_OBJECT = MediaBody("application/json", {"type": "object"})

_BAD = "invalid request (a malformed body, a value out of range, a prompt too long)"
_AUTH = "missing or wrong API key (only when the server runs with one)"
_NOT_FOUND = "unknown model (neither the served model nor a LoRA adapter it holds)"
_TOO_LARGE = "request body too large"
_UNAVAILABLE = "overloaded or shutting down; Retry-After says when to try again"
_FAILED = "the engine failed this request (a bug: the other requests and the server go on)"


def _generation(model: type[BaseModel], not_found: str = _NOT_FOUND) -> Statuses:
    return {200: ("the object, or a stream of chunks with stream: true", model),
            400: (_BAD, ErrorBody), 401: (_AUTH, ErrorBody), 404: (not_found, ErrorBody),
            413: (_TOO_LARGE, ErrorBody), 500: (_FAILED, ErrorBody),
            503: (_UNAVAILABLE, ErrorBody)}


def _pooling(model: type[BaseModel], *paths: str) -> dict[str, Statuses]:
    """Pooling routes: a ``/v1`` one and its aliases (the same answers, kept out of the
    document by ``server/embeddings.py``)."""
    statuses = {200: ("the result", model),
                400: (_BAD + ", or a model that does not serve this task", ErrorBody),
                401: (_AUTH, ErrorBody), 404: (_NOT_FOUND, ErrorBody),
                413: (_TOO_LARGE, ErrorBody), 500: (_FAILED, ErrorBody),
                503: (_UNAVAILABLE, ErrorBody)}
    return dict.fromkeys(paths, statuses)


def _anthropic(model: type[BaseModel], what: str) -> Statuses:
    """Anthropic-shaped errors, but for the middleware's 401 and 413 (OpenAI-shaped)."""
    return {200: (what, model), 400: (_BAD, AnthropicErrorBody), 401: (_AUTH, ErrorBody),
            404: (_NOT_FOUND, AnthropicErrorBody), 413: (_TOO_LARGE, ErrorBody),
            500: (_FAILED, AnthropicErrorBody), 503: (_UNAVAILABLE, AnthropicErrorBody),
            529: ("overloaded (Anthropic's overloaded_error); Retry-After says when to try "
                  "again", AnthropicErrorBody)}


ROUTES: dict[str, Statuses] = {
    "/v1/completions": _generation(Completion),
    "/v1/chat/completions": _generation(ChatCompletion),
    "/v1/responses": _generation(ResponseObject, "unknown model or previous response"),
    **_pooling(EmbeddingList, "/v1/embeddings"),
    **_pooling(RerankList, "/v1/rerank", "/rerank", "/v2/rerank"),
    **_pooling(ScoreList, "/v1/score", "/score"),
    "/v1/messages": _anthropic(AnthropicMessage, "the message, or a stream of events with "
                               "stream: true"),
    "/v1/messages/count_tokens": _anthropic(AnthropicTokenCount, "the prompt's tokens"),
    "/v1/models": {200: ("the served model, then its LoRA adapters", ModelList),
                   401: (_AUTH, ErrorBody)},
    "/v1/models/{model_id}": {200: ("the model", ModelCard), 401: (_AUTH, ErrorBody),
                              404: (_NOT_FOUND, ErrorBody)},
    "/tokenize": {200: ("token ids of the prompt or conversation", Tokenized),
                  400: (_BAD, ErrorBody), 401: (_AUTH, ErrorBody),
                  404: (_NOT_FOUND, ErrorBody), 413: (_TOO_LARGE, ErrorBody)},
    "/detokenize": {200: ("the text of the token ids", Detokenized), 400: (_BAD, ErrorBody),
                    401: (_AUTH, ErrorBody), 404: (_NOT_FOUND, ErrorBody),
                    413: (_TOO_LARGE, ErrorBody)},
    # only with --allow-runtime-lora (otherwise they do not exist)
    "/v1/load_lora_adapter": {
        200: ("the adapter is loaded: a one-line message", PLAIN_TEXT),
        400: ("invalid body, a name already loaded, or an adapter that does not fit the base "
              "model (the message names the mismatch)", ErrorBody),
        401: (_AUTH, ErrorBody), 413: (_TOO_LARGE, ErrorBody)},
    "/v1/unload_lora_adapter": {
        200: ("the adapter is unloaded (its running requests finish): a one-line message",
              PLAIN_TEXT),
        400: (_BAD, ErrorBody), 401: (_AUTH, ErrorBody),
        404: ("no adapter of that name is loaded", ErrorBody), 413: (_TOO_LARGE, ErrorBody)},
    "/flush_cache": {200: ("prefix-cache blocks freed", FlushedCache),
                     400: ("requests are running", ErrorBody), 401: (_AUTH, ErrorBody)},
    "/health": {200: ("the engine is alive: ok, or busy (generate=true: too busy to run the "
                      "probe's generation now)", HealthStatus),
                400: ("generate is not a boolean", ErrorBody),
                401: ("generate=true without the API key (only when the server runs with "
                      "one)", ErrorBody),
                503: ("the engine loop stopped or a step overran --step-timeout, or the "
                      "generate probe failed", HealthStatus)},
    "/version": {200: ("the tokenmill version", Version)},
    "/server_info": {200: ("how the engine runs", ServerInfo), 401: (_AUTH, ErrorBody)},
    "/metrics": {200: ("Prometheus text exposition", PROMETHEUS_TEXT),
                 401: (_AUTH, ErrorBody)},
    # the live dashboard (server/dashboard.py): a page and its assets, public; its figures
    "/dashboard": {200: ("the live dashboard page (it polls /dashboard/data)", HTML_PAGE)},
    "/dashboard/dashboard.js": {200: ("the dashboard's script", JS_TEXT)},
    "/dashboard/dashboard.css": {200: ("the dashboard's style", CSS_TEXT)},
    "/dashboard/data": {200: ("the dashboard's figures: gauges, rates, latency percentiles, "
                              "requests in flight, the plan", JSON_OBJECT),
                        401: (_AUTH, ErrorBody)},
}
# Routes that stream with ``stream: true``: the JSON model of their events' data, and whether
# the stream ends with ``data: [DONE]`` (the Responses API ends with its response.* event).
STREAMING: dict[str, tuple[type[BaseModel], bool]] = {
    "/v1/completions": (CompletionChunk, True),
    "/v1/chat/completions": (ChatCompletionChunk, True),
    "/v1/responses": (ResponseStreamEvent, False),
    "/v1/messages": (AnthropicStreamEvent, False)}


# ----- building the document --------------------------------------------------------------------

def install_openapi(app: FastAPI) -> None:
    """Serve ``ROUTES``' document at /openapi.json (built once, on first use)."""
    generate = app.openapi  # FastAPI's own
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not built:
            built.update(document(generate()))
        return built

    app.openapi = openapi  # type: ignore[method-assign]


def document(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's document with ``ROUTES``' statuses and bodies; routes missing from ``ROUTES``
    only lose the 422 they never return (validation errors are 400s)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(m, "serialization") for m in MODELS], ref_template=_REF)
    for name, model_schema in defs["$defs"].items():
        if components.get(name, model_schema) != model_schema:
            raise ValueError(f"two OpenAPI schemas are named {name!r}: rename one")
        components[name] = model_schema
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            operation["responses"] = _responses(path, operation.get("responses", {}))
    return schema


def _responses(path: str, generated: dict[str, Any]) -> dict[str, Any]:
    statuses = ROUTES.get(path)
    if statuses is None:
        out = {k: v for k, v in generated.items() if k != "422"}
        if "422" in generated:
            out["400"] = _response(_BAD, ErrorBody)
        return out
    out = {str(status): _response(desc, body) for status, (desc, body) in statuses.items()}
    if path in STREAMING:
        out["200"]["content"]["text/event-stream"] = {"schema": _sse_event(*STREAMING[path])}
    for code in ("503", "529"):
        if code in out and statuses[int(code)][1] in (ErrorBody, AnthropicErrorBody):
            out[code]["headers"] = {"Retry-After": {
                "description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
    return out


def _response(description: str, body: Body) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description}
    if isinstance(body, MediaBody):
        out["content"] = {body.media_type: {"schema": body.schema}}
    elif body is not None:
        out["content"] = {"application/json": {"schema": _ref(body)}}
    return out


def _sse_event(chunk: type[BaseModel], done: bool) -> dict[str, Any]:
    """The schema of one server-sent event, as OpenAPI 3.2's ``itemSchema`` (and schemathesis,
    for earlier versions) reads a text/event-stream schema: each ``data`` is a JSON chunk (an
    error body if generation failed midway) and, with ``done``, the last is ``[DONE]``."""
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": _ref(chunk)}
    if done:
        data["contentSchema"] = {"anyOf": [_ref(chunk), _ref(ErrorBody)]}
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    return {"type": "object", "required": ["data"],
            "properties": {"data": data, "event": {"type": "string"}},
            "description": "one server-sent event (stream: true)"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}
