"""The body of ``POST /v1/responses`` and the fields it refuses.

Every Responses field asking for something tokenmill cannot do (background runs, reasoning
summaries, built-in tools, stored prompts, ``truncation: "auto"``, ...) is refused with a 400
naming the field; Chat Completions fields sent here would be ignored, so they are refused too.

``reasoning.effort`` becomes a thinking budget (``EFFORT_BUDGETS``) on a server started with
``--reasoning-parser``: the model thinks at most that many tokens, then its closing tag is
forced (as ``thinking_token_budget`` does on chat). ``none`` closes the thinking at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

from tokenmill.server.protocol import APIError, SamplingFields, invalid

LOGPROBS = "message.output_text.logprobs"
# `include` entries that can be honoured: logprobs, and encrypted reasoning, which is vacuous
# (no output here is a reasoning item).
_INCLUDABLE = {LOGPROBS, "reasoning.encrypted_content"}


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``. The vLLM sampling extras of the other endpoints (``top_k``,
    ``seed``, ``stop``, ``structured_outputs``...) are accepted too."""

    implemented: ClassVar[frozenset[str]] = frozenset({"store", "service_tier"})

    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # Taken only with values that ask for nothing tokenmill lacks (see _UNSUPPORTED).
    max_tokens: Any = None
    max_completion_tokens: Any = None
    messages: Any = None
    logprobs: Any = None
    chat_template_kwargs: Any = None
    chat_template: Any = None
    add_generation_prompt: Any = None
    truncation: Any = None
    reasoning: Any = None
    service_tier: Any = None
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None
    context_management: Any = None
    access_programs: Any = None
    image: Any = None
    prompt_cache_options: Any = None


def _never(_: Any) -> bool:
    return False


def _empty(value: Any) -> bool:
    return value in ({}, [])


# reasoning.effort -> the most tokens the model may think (OpenAI's efforts, lowest first)
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384,
                  "xhigh": 32768}


def _plain_reasoning(value: Any) -> bool:
    """An effort (or none), and no summary: summaries are not written here."""
    return isinstance(value, dict) \
        and set(value) <= {"effort", "summary", "generate_summary", "mode"} \
        and value.get("effort") in (None, *EFFORT_BUDGETS) \
        and value.get("summary") is None and value.get("generate_summary") is None \
        and value.get("mode") in (None, "standard")


def thinking_tokens(req: ResponsesRequest) -> int | None:
    """The thinking budget ``reasoning.effort`` asks for; None: no effort given."""
    effort = (req.reasoning or {}).get("effort")
    return None if effort is None else EFFORT_BUDGETS[effort]


def _implicit_cache(value: Any) -> bool:
    """The prefix cache is implicit: every prompt's full blocks are cached, with no lifetime
    promised, so only the default mode (without prewarming or diagnostics) is honoured."""
    return isinstance(value, dict) and set(value) <= {"mode", "prewarm"} \
        and value.get("mode", "implicit") == "implicit" and not value.get("prewarm")


# field -> (accepts a non-null value?, why it is refused). Null is always accepted.
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "background": (lambda v: v is False, "background responses are not supported"),
    "background_options": (_empty, "background responses are not supported"),
    "conversation": (_never, ("conversations are not supported; chain responses with "
                              "previous_response_id")),
    "prompt": (_never, "stored prompt templates are not supported; send instructions and input"),
    "moderation": (_never, "moderation is not supported"),
    "context_management": (_empty, "context management (compaction) is not supported"),
    "access_programs": (_empty, "access programs are not supported"),
    "image": (lambda v: _empty(v) or v in ({"context_compression": "auto"},
                                           {"context_compression": "disabled"}),
              "image inputs are not supported"),
    "prompt_cache_options": (_implicit_cache, ("only the implicit prefix cache is supported "
                                               "(mode 'implicit', no prewarm, ttl or "
                                               "diagnostics)")),
    "truncation": (lambda v: v == "disabled", ("only 'disabled' is supported: an input longer "
                                               "than the context is a 400")),
    "reasoning": (_plain_reasoning, (f"reasoning summaries and modes are not supported; effort "
                                     f"takes {', '.join(EFFORT_BUDGETS)}")),
    "service_tier": (lambda v: v in ("auto", "default"),
                     "only 'auto' and 'default' are supported"),
    "response_format": (_never, "a Chat Completions field: the Responses API takes text.format"),
    "n": (lambda v: v == 1, "a response has one output"),
    "stream_options": (lambda v: not v.get("include_obfuscation"),
                       "stream obfuscation is not supported"),
    "max_tool_calls": (lambda v: v >= 0, "must be at least 0"),
    "prompt_cache_retention": (lambda v: v == "in_memory",
                               "the prefix cache promises no lifetime: only 'in_memory'"),
    # Chat Completions fields: here they would be ignored, so they are refused.
    "max_tokens": (_never, "a Chat Completions field: the Responses API takes max_output_tokens"),
    "max_completion_tokens": (_never, "a Chat Completions field: use max_output_tokens"),
    "messages": (_never, "a Chat Completions field: the Responses API takes input"),
    "logprobs": (_never, "a Chat Completions field: use include "
                         "['message.output_text.logprobs']"),
    "chat_template_kwargs": (_never, "not supported on /v1/responses"),
    "chat_template": (_never, "not supported on /v1/responses"),
    "add_generation_prompt": (_never, "not supported on /v1/responses"),
    "top_logprobs": (lambda v: 0 <= v <= 20, "must be between 0 and 20"),
}


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 for the first field asking for what tokenmill cannot do (and malformed metadata)."""
    for name, (accepts, why) in _UNSUPPORTED.items():
        value = getattr(req, name)
        if value is not None and not accepts(value):
            raise invalid(name, f"{name}: {why} (got {json.dumps(value)[:100]})",
                          "unsupported_parameter")
    for entry in req.include or ():
        if entry not in _INCLUDABLE:
            raise invalid("include", f"include: {entry!r} cannot be produced here; supported: "
                          f"{sorted(_INCLUDABLE)}", "unsupported_parameter")
    metadata = req.metadata or {}
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise bad("metadata", "at most 16 pairs, keys of at most 64 characters and values of "
                  "at most 512")


def bad(param: str, message: str) -> APIError:
    """A 400 whose message starts with the field it names."""
    return invalid(param, f"{param}: {message}")
