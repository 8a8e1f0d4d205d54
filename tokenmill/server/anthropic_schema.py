"""What the Messages API routes answer, as pydantic models for the OpenAPI document
(``openapi.py`` lists them): the message, its content blocks, token counts, stream events and
Anthropic's error body. The answers themselves are made by ``anthropic_format.py``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AnthropicTextBlock(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicThinkingBlock(BaseModel):
    """The model's reasoning (with ``--reasoning-parser``); never signed here."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class AnthropicToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


AnthropicContentBlock = Annotated[
    AnthropicTextBlock | AnthropicThinkingBlock | AnthropicToolUseBlock,
    Field(discriminator="type")]


class AnthropicUsage(BaseModel):
    input_tokens: int = Field(ge=0, description="prompt tokens not read from the prefix cache")
    cache_creation_input_tokens: int = Field(ge=0)
    cache_read_input_tokens: int = Field(ge=0, description="prompt tokens from the prefix "
                                                          "cache")
    output_tokens: int = Field(ge=0)


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(BaseModel):
    input_tokens: int = Field(ge=0)


class AnthropicStreamEvent(BaseModel):
    """One ``data`` of a stream (``event:`` holds its type); the fields beside ``type`` are
    Anthropic's for that type. A stream the engine fails ends with an ``error`` event."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message_start", "ping", "content_block_start", "content_block_delta",
                  "content_block_stop", "message_delta", "message_stop", "error"]


class AnthropicError(BaseModel):
    type: str = Field(description="invalid_request_error, not_found_error, api_error, "
                                  "overloaded_error, ...")
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error shape, for the /v1/messages routes' refusals (the API key and body
    size checks, made before routing, answer in OpenAI's)."""

    type: Literal["error"]
    error: AnthropicError


ANTHROPIC_MODELS: tuple[type[BaseModel], ...] = (
    AnthropicMessage, AnthropicTokenCount, AnthropicStreamEvent, AnthropicErrorBody)
