"""The OpenAI Responses API: ``POST /v1/responses``.

A request's input items (after those of its ``previous_response_id``) become a chat
conversation rendered by ``OpenAIServing.chat_prompt``; sampling checks, output constraints,
tool grammars and queueing are the chat endpoint's. One ``_OutputItems`` turns the model's text
into output items and the stream's events, so a streamed response ends in exactly the items a
non-streamed one returns.

Responses live in an in-memory LRU store (``STORE_SIZE``) for the server's lifetime, so
``previous_response_id`` can continue them; ``store: false`` keeps one out. The store is
divided by tenant: a response is found only with the API key and ``cache_salt`` it was made
with (to any other it does not exist), so a chosen or guessed id reaches no one else's chain.
Every Responses field asking for something tokenmill cannot do (background runs, reasoning
effort, built-in tools, stored prompts, ``truncation: "auto"``, ...) is refused with a 400
naming the field; ``max_tool_calls`` bounds the function calls kept (0: tools not offered).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.async_engine import (EngineUnavailableError, RequestFailedError,
                                           RequestStream)
from tokenmill.request import FinishReason, RequestOutput
from tokenmill.server.protocol import (APIError, ChatMessage, _SamplingFields, open_objects,
                                       printable)
from tokenmill.server.serving import (OpenAIServing, _AbortingStreamingResponse, _collect,
                                      _merge, engine_error, request_id_header)
from tokenmill.structured.spec import ConstraintError, StructuredOutputs, from_request
from tokenmill.structured.tool_parsers import ToolCallParser
from tokenmill.structured.tools import check_tool_choice, tool_choice_constraint

logger = logging.getLogger("tokenmill.server")

STORE_SIZE = 1024  # responses kept for previous_response_id, least recently used dropped first
# ... and at most this many characters of items over all kept responses, each counted with its
# whole chain (chains share items, so this over-counts: memory stays below it).
STORE_CHARS = 1 << 26
LOGPROBS = "message.output_text.logprobs"
# `include` entries that can be honoured: logprobs, and encrypted reasoning, which is vacuous
# (no output here is a reasoning item).
_INCLUDABLE = {LOGPROBS, "reasoning.encrypted_content"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
          "developer": "system"}  # open-model templates know no developer role
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


class ResponsesRequest(_SamplingFields):
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


def _no_reasoning(value: Any) -> bool:
    return isinstance(value, dict) \
        and set(value) <= {"effort", "summary", "generate_summary", "mode"} \
        and value.get("effort") in (None, "none") \
        and value.get("summary") is None and value.get("generate_summary") is None \
        and value.get("mode") in (None, "standard")


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
    "reasoning": (_no_reasoning, "reasoning (effort, summaries, modes) is not supported"),
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


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """400 for the first field asking for what tokenmill cannot do (and malformed metadata)."""
    for name, (accepts, why) in _UNSUPPORTED.items():
        value = getattr(req, name)
        if value is not None and not accepts(value):
            raise APIError(400, f"{name}: {why} (got {json.dumps(value)[:100]})", param=name,
                           code="unsupported_parameter")
    for entry in req.include or ():
        if entry not in _INCLUDABLE:
            raise APIError(400, f"include: {entry!r} cannot be produced here; supported: "
                           f"{sorted(_INCLUDABLE)}", param="include",
                           code="unsupported_parameter")
    metadata = req.metadata or {}
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise _bad("metadata", "at most 16 pairs, keys of at most 64 characters and values of "
                   "at most 512")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


# The chat fields the shared checks name, and the Responses fields they come from here.
_CHAT_NAMES = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens"}


@contextmanager
def _responses_names():
    """Errors of the shared code name chat fields; say the Responses ones."""
    try:
        yield
    except APIError as e:
        for old, new in _CHAT_NAMES.items():
            if e.param is not None and (e.param == old
                                        or e.param.startswith((old + "[", old + "."))):
                e.param = new
            if e.message.startswith(old):
                e.message = new + e.message[len(old):]
        raise


# ----- input items -> chat messages ---------------------------------------------------------------

def _input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


def _text_content(content: Any, param: str) -> str:
    """Content as one string: a string, or text parts (no images, files or audio)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise APIError(400, f"{param}[{j}]: only text parts are supported (input_text, "
                           f"output_text), got {kind!r}", param=param,
                           code="unsupported_parameter")
        if not isinstance(part.get(key), str):
            raise _bad(f"{param}[{j}].{key}", "a string is required")
        texts.append(part[key])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{where}.{key}", "a non-empty string is required")
    return value


def _item_message(item: Any, where: str) -> dict[str, Any] | None:
    """One input item as a chat message dict (None for items that are not replayed)."""
    if not isinstance(item, dict):
        raise _bad(where, "an input item must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"{where}.role", f"must be one of {sorted(_ROLES)}, got {role!r}")
        return {"role": _ROLES[role],
                "content": _text_content(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        arguments = item.get("arguments")
        try:
            ok = isinstance(json.loads(arguments), dict)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise _bad(f"{where}.arguments", "must be a JSON object encoded as a string")
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": _string(item, "call_id", where),
                "content": _text_content(item.get("output"), f"{where}.output")}
    if kind == "reasoning":  # another model's private reasoning: templates drop it as well
        return None
    raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, "
                   f"function_call, function_call_output)", param=where,
                   code="unsupported_parameter")


def _chat_messages(history: list[dict[str, Any]], items: list[dict[str, Any]],
                   instructions: str | None) -> list[ChatMessage]:
    """Instructions first, then the stored history and the new items (validated, naming
    ``input[i]``); a function call joins the assistant message before it."""
    converted = [_item_message(item, "previous_response") for item in history]
    converted += [_item_message(item, f"input[{i}]") for i, item in enumerate(items)]
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for m in converted:
        if m is None:
            continue
        last = messages[-1] if messages else None
        if m.get("tool_calls") and last is not None and last["role"] == "assistant":
            last["tool_calls"] = (last.get("tool_calls") or []) + m["tool_calls"]
        else:
            messages.append(m)
    if not messages:
        raise _bad("input", "the conversation is empty: give input (or instructions)")
    return [ChatMessage(**m) for m in messages]


# ----- tools and output constraints ---------------------------------------------------------------

@dataclass
class _Tools:
    chat: list[dict[str, Any]] | None  # the offered functions in chat format
    echo: list[dict[str, Any]]  # as the response object lists them
    choosable: list[dict[str, Any]] | None  # chat tools the model may call (allowed_tools)
    choice: Any  # tool_choice in chat format
    mode: str  # none, auto, required or named (check_tool_choice)
    limit: int | None = None  # the most function calls (max_tool_calls, parallel_tool_calls)

    @property
    def parallel(self) -> bool:
        return self.limit is None or self.limit > 1


def _function_tool(tool: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Responses function tool as (chat tool, echo); other tool types are refused."""
    if not isinstance(tool, dict):
        raise _bad(where, "a tool must be an object")
    if tool.get("type") != "function":
        raise APIError(400, f"{where}.type: {tool.get('type')!r} tools are not supported, "
                       f"only 'function'", param=f"{where}.type", code="unsupported_parameter")
    name = _string(tool, "name", where)
    parameters, description = tool.get("parameters"), tool.get("description")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{where}.parameters", "must be a JSON schema object")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.description", "must be a string")
    if tool.get("strict") not in (None, True, False):
        raise _bad(f"{where}.strict", "must be a boolean")
    for key, ok in (("defer_loading", not tool.get("defer_loading")),
                    ("async", not tool.get("async")),
                    ("output_schema", tool.get("output_schema") is None),
                    ("allowed_callers", tool.get("allowed_callers") in (None, [], ["direct"]))):
        if not ok:
            raise APIError(400, f"{where}.{key} is not supported", param=f"{where}.{key}",
                           code="unsupported_parameter")
    function = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    echo = {"type": "function", "name": name, "description": description,
            "parameters": parameters, "strict": tool.get("strict")}
    return {"type": "function", "function": function}, echo


def _tools(req: ResponsesRequest) -> _Tools:
    pairs = [_function_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools or ())]
    names = [chat["function"]["name"] for chat, _ in pairs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _bad(f"tools[{i}].name", f"{name!r} is offered twice")
    chat = [c for c, _ in pairs] or None
    # "auto" without tools asks for nothing: no tool can be called either way.
    choice, allowed = _tool_choice(None if req.tool_choice == "auto" and not chat
                                   else req.tool_choice, names)
    choosable = chat if allowed is None else [c for c in chat or ()
                                              if c["function"]["name"] in allowed]
    try:
        mode = check_tool_choice(choosable or None, choice)
    except ValueError as e:
        raise _bad("tool_choice", str(e)) from None
    limit = _call_limit(req)
    if limit == 0 and mode in ("required", "named"):
        raise _bad("max_tool_calls", f"0 allows no call, but tool_choice asks for one ({mode})")
    if limit == 0:  # no call may be made: the tools are not offered
        mode = "none"
    return _Tools(chat, [e for _, e in pairs], choosable, choice, mode, limit)


def _call_limit(req: ResponsesRequest) -> int | None:
    """The most function calls a response may make: ``max_tool_calls``, and one without
    ``parallel_tool_calls``; None: any number. Calls past it are dropped."""
    limits = [req.max_tool_calls, 1 if req.parallel_tool_calls is False else None]
    return min((n for n in limits if n is not None), default=None)


def _tool_choice(value: Any, offered: list[str]) -> tuple[Any, set[str] | None]:
    """(the chat tool_choice, the names ``allowed_tools`` narrows the choice to, or None)."""
    if value is None or value in ("none", "auto", "required"):
        return value, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}, None
    if kind == "allowed_tools" and value.get("mode") in ("auto", "required") \
            and isinstance(value.get("tools"), list):
        allowed = set()
        for j, tool in enumerate(value["tools"]):
            if not isinstance(tool, dict) or tool.get("type") != "function" \
                    or tool.get("name") not in offered:
                raise _bad(f"tool_choice.tools[{j}]", "must name an offered function as "
                           "{'type': 'function', 'name': ...}")
            allowed.add(tool["name"])
        return value["mode"], allowed
    raise APIError(400, "tool_choice: must be 'none', 'auto', 'required', {'type': 'function', "
                   "'name': ...} or {'type': 'allowed_tools', 'mode': ..., 'tools': [...]} "
                   f"of function tools; got {json.dumps(value)}", param="tool_choice",
                   code="unsupported_parameter")


def _text_format(text: dict[str, Any] | None) -> tuple[StructuredOutputs | None, dict]:
    """``text.format`` as a constraint, and the ``text`` the response echoes."""
    text = text or {}
    if text.get("verbosity") not in (None, "medium"):
        raise APIError(400, "text.verbosity: only 'medium' is supported",
                       param="text.verbosity", code="unsupported_parameter")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        spec = None
    elif kind == "json_object":
        spec = StructuredOutputs(json_object=True, param="text.format")
    elif kind == "json_schema":
        fmt = {"type": kind, "name": _string(fmt, "name", "text.format"),
               "schema": fmt.get("schema"), "description": fmt.get("description"),
               "strict": fmt.get("strict")}
        if not isinstance(fmt["schema"], dict):
            raise _bad("text.format.schema", "a JSON schema object is required")
        if fmt["strict"] not in (None, True, False) \
                or not isinstance(fmt["description"], str | None):
            raise _bad("text.format", "strict must be a boolean and description a string")
        # strict false: the schema as JSON Schema reads it, objects open (protocol.py)
        schema = open_objects(fmt["schema"]) if fmt["strict"] is False else fmt["schema"]
        spec = StructuredOutputs(json=schema, param="text.format.schema")
    else:
        raise _bad("text.format.type", f"must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}")
    return spec, {"format": {"type": kind} if spec is None or kind == "json_object" else fmt,
                  "verbosity": "medium"}


def _constraint(req: ResponsesRequest, text_spec: StructuredOutputs | None, tools: _Tools,
                parser: ToolCallParser) -> StructuredOutputs | None:
    """One output constraint, as the chat endpoint picks it: ``text.format`` (or a vLLM
    extra), else the tool choice's grammar; a forced call cannot also be JSON text."""
    try:
        extra = from_request(
            structured_outputs=req.structured_outputs, guided_json=req.guided_json,
            guided_regex=req.guided_regex, guided_choice=req.guided_choice,
            guided_grammar=req.guided_grammar,
            guided_whitespace_pattern=req.guided_whitespace_pattern)
        if extra is not None and text_spec is not None:
            raise ConstraintError("give one output constraint (text.format or "
                                  f"{extra.param})", extra.param)
        spec = extra or text_spec
        if tools.mode in ("required", "named") and spec is not None:
            raise ConstraintError(f"a {tools.mode} tool choice cannot be combined with "
                                  f"another output constraint", spec.param)
        if spec is None and tools.mode != "none":
            spec = tool_choice_constraint(tools.choosable, tools.choice,
                                          tools.parallel, parser)
        return spec
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


# ----- output items and stream events -------------------------------------------------------------

def _text_part(text: str, logprobs: list[dict]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _event_logprob(lp: dict) -> dict:
    """An output_text logprob as the delta/done events carry it (no bytes)."""
    return {"token": lp["token"], "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                             for t in lp["top_logprobs"]]}


class _OutputItems:
    """A response's output items, built as the model's text arrives, and the stream events that
    build them on the client. Text goes to one message item (opened at its first text, closed
    at the end); with a tool ``parser`` each call becomes a function_call item when it is
    complete. A non-streamed response feeds the whole text once and gets the same items."""

    def __init__(self, parser: ToolCallParser | None, call_limit: int | None,
                 logprob: Callable[[Any], dict] | None = None):
        self.items: list[dict[str, Any]] = []
        self._streamer = parser.streamer() if parser is not None else None
        self._limit = call_limit  # the most function calls; later ones are dropped
        self._logprob = logprob  # an engine logprob entry -> an output_text logprob
        self._message: dict[str, Any] | None = None  # the open message item
        self._index = 0  # its output index
        self._texts: list[str] = []
        self._logprobs: list[dict] = []
        self._call: tuple[str, str] | None = None  # (call id, name) of a call being sent

    def feed(self, text: str, entries: Sequence[Any] = ()) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._streamer is None:
            if text or entries:
                self._add_text(text, entries, events)
        elif text:
            self._deltas(self._streamer.feed(text), events)
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._streamer is not None:
            self._deltas(self._streamer.finish(), events)
        if not self.items:  # nothing said: one empty message, as OpenAI answers
            self._open_message(events)
        if self._message is not None:
            self._close_message("completed" if status == "completed" else "incomplete", events)
        return events

    def _deltas(self, deltas: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        """Chat deltas of the tool streamer: content, or a call as (id + name, arguments)."""
        for delta in deltas:
            if "content" in delta:
                self._add_text(delta["content"], (), events)
                continue
            call = delta["tool_calls"][0]
            if self._limit is not None and call["index"] >= self._limit:
                continue
            if "id" in call:
                self._call = (call["id"], call["function"]["name"])
            else:
                self._add_call(*self._call, call["function"]["arguments"], events)

    def _open_message(self, events: list[dict[str, Any]]) -> None:
        self._message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                         "status": "in_progress", "role": "assistant", "content": []}
        self._index = len(self.items)
        self.items.append(self._message)
        where = {"item_id": self._message["id"], "output_index": self._index}
        events.append({"type": "response.output_item.added", "output_index": self._index,
                       "item": {**self._message, "content": []}})
        events.append({"type": "response.content_part.added", **where, "content_index": 0,
                       "part": _text_part("", [])})

    def _add_text(self, text: str, entries: Sequence[Any], events: list[dict[str, Any]]) -> None:
        if self._message is None:
            self._open_message(events)
        logprobs = [self._logprob(e) for e in entries] if self._logprob else []
        self._texts.append(text)
        self._logprobs += logprobs
        events.append({"type": "response.output_text.delta", "item_id": self._message["id"],
                       "output_index": self._index, "content_index": 0, "delta": text,
                       "logprobs": [_event_logprob(lp) for lp in logprobs]})

    def _close_message(self, status: str, events: list[dict[str, Any]]) -> None:
        text = "".join(self._texts)
        part = _text_part(text, self._logprobs)
        self._message.update(status=status, content=[part])
        where = {"item_id": self._message["id"], "output_index": self._index,
                 "content_index": 0}
        events.append({"type": "response.output_text.done", **where, "text": text,
                       "logprobs": [_event_logprob(lp) for lp in self._logprobs]})
        events.append({"type": "response.content_part.done", **where, "part": part})
        events.append({"type": "response.output_item.done", "output_index": self._index,
                       "item": self._message})
        self._message = None

    def _add_call(self, call_id: str, name: str, arguments: str,
                  events: list[dict[str, Any]]) -> None:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                "call_id": call_id, "name": name, "arguments": arguments}
        index = len(self.items)
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": {**item, "status": "in_progress", "arguments": ""}})
        events.append({"type": "response.function_call_arguments.delta", **where,
                       "delta": arguments})
        events.append({"type": "response.function_call_arguments.done", **where,
                       "name": name, "arguments": arguments})
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": item})


# ----- response objects ---------------------------------------------------------------------------

def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt, output = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"input_tokens": prompt,
            # cache_write_tokens counts explicit cache breakpoints, which tokenmill has none of.
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _outcome(out: RequestOutput) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a finished request."""
    reason = out.outputs[0].finish_reason
    if reason is FinishReason.STOP:
        return "completed", None, None
    if reason is FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}, None
    return "failed", None, {"code": "server_error", "message": "the request was aborted"}


@dataclass
class _Pending:
    """One response being made: what its object echoes, and what the store keeps of it."""

    rid: str
    model: str
    req: ResponsesRequest
    tools: _Tools
    text: dict[str, Any]
    history: list[dict[str, Any]]  # the previous responses' items and this input's
    namespace: str = ""  # whose store it is kept in (_namespace)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: dict | None = None,
             incomplete: dict | None = None, error: dict | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at,
            "status": status, "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": req.safety_identifier, "service_tier": "default",
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": self.text, "tool_choice": req.tool_choice or "auto",
            "tools": self.tools.echo, "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user}

    def finished(self, out: RequestOutput, items: _OutputItems) -> dict[str, Any]:
        status, incomplete, error = _outcome(out)
        return self.body(status, items.items, _usage(out), incomplete, error)


class OpenAIResponses:
    """``/v1/responses`` on top of the chat endpoint's machinery, with the response store."""

    def __init__(self, serving: OpenAIServing, store_size: int = STORE_SIZE,
                 store_chars: int = STORE_CHARS):
        self.s = serving
        self.store_size = store_size
        self.store_chars = store_chars
        # (namespace, response id) -> (the input and output items of its whole chain in
        # order, their size)
        self._store: OrderedDict[tuple[str, str], tuple[list[dict[str, Any]], int]] = \
            OrderedDict()
        self._chars = 0

    async def create(self, req: ResponsesRequest, raw: Request):
        namespace = _namespace(raw, req.cache_salt)
        given_id = request_id_header(raw) or req.request_id
        pending, output, streams = await self._start(req, namespace, given_id)
        if req.stream:
            return self._stream(pending, output, streams)
        final = (await _collect(streams, raw))[0]
        c = final.outputs[0]
        output.feed(c.text, c.logprobs or ())
        output.finish(_outcome(final)[0])
        body = pending.finished(final, output)
        self._keep(pending, body)
        return JSONResponse(body)

    async def _start(self, req: ResponsesRequest, namespace: str, given_id: str | None
                     ) -> tuple[_Pending, _OutputItems, list[RequestStream]]:
        """Check everything, render the conversation and queue the engine request; the
        response's id is ``given_id`` where a client chose one."""
        s = self.s
        s.check_model(req.model)
        _refuse_unsupported(req)
        with _responses_names():
            s._check_request(req, 1, req.max_output_tokens, "max_output_tokens",
                             req.top_logprobs, "top_logprobs")
        items = _input_items(req.input)
        previous = self._previous(namespace, req.previous_response_id)
        messages = _chat_messages(previous, items, req.instructions)
        tools = _tools(req)
        text_spec, text_echo = _text_format(req.text)
        structured = _constraint(req, text_spec, tools, s.tool_parser)
        logprobs = (req.top_logprobs or 0) if LOGPROBS in (req.include or ()) else None
        if logprobs is not None and tools.mode != "none":
            raise _bad("include", f"{LOGPROBS} cannot be combined with tools")
        await self._check_tool_schemas(tools)
        parser = s.tool_parser if tools.mode != "none" else None
        with _responses_names():
            prompt = await s.chat_prompt(messages, True, None, tools.chat if parser else None)
            params = s._params(req, req.max_output_tokens, logprobs, [prompt],
                               "max_output_tokens", structured)
            grammar = await s._compile(params)
            # Reasoning items reach no prompt: they are not kept either.
            kept = [i for i in items if not (isinstance(i, dict) and i.get("type") == "reasoning")]
            pending = _Pending(self._new_id(namespace, given_id), s.model_name, req, tools,
                               text_echo, previous + kept, namespace)
            streams = await s._add_all(pending.rid, [prompt.ids], params, req.priority,
                                       req.cache_salt, grammar)
        output = _OutputItems(parser, tools.limit,
                              self._logprob(logprobs) if logprobs is not None else None)
        return pending, output, streams

    async def _check_tool_schemas(self, tools: _Tools) -> None:
        try:
            await self.s._check_tool_schemas(tools.chat)
        except APIError as e:  # tools[i].function.parameters -> tools[i].parameters
            if e.param is not None:
                e.param = e.param.replace(".function.", ".")
                e.message = e.message.replace(".function.", ".")
            raise

    def _logprob(self, top: int) -> Callable[[Any], dict]:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.s.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return lambda e: {**entry(e.token_id, e.logprob),
                          "top_logprobs": [entry(t, lp) for t, lp in e.top[:top]]}

    # ----- streaming ------------------------------------------------------------------------------

    def _stream(self, pending: _Pending, output: _OutputItems,
                streams: list[RequestStream]) -> StreamingResponse:
        seq = itertools.count()

        def sse(event: dict[str, Any]) -> str:
            event["sequence_number"] = next(seq)
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            yield sse({"type": "response.created", "response": pending.body("in_progress", [])})
            yield sse({"type": "response.in_progress",
                       "response": pending.body("in_progress", [])})
            final, failure = None, "the request ended without output"
            sent = [0, 0]  # text characters and logprob entries already fed
            try:
                async for _, final in _merge(streams):
                    c = final.outputs[0]
                    entries = (c.logprobs or [])[sent[1]:]
                    for event in output.feed(c.text[sent[0]:], entries):
                        yield sse(event)
                    sent = [len(c.text), sent[1] + len(entries)]
            except (EngineUnavailableError, RequestFailedError, APIError) as e:
                final = None
                failure = (e if isinstance(e, APIError) else engine_error(e)).message
            if final is None:
                error = {"code": "server_error", "message": failure}
                yield sse({"type": "response.failed",
                           "response": pending.body("failed", output.items, error=error)})
                return
            status = _outcome(final)[0]
            for event in output.finish(status):
                yield sse(event)
            body = pending.finished(final, output)
            self._keep(pending, body)
            yield sse({"type": f"response.{status}", "response": body})

        return _AbortingStreamingResponse(events(), streams)

    # ----- the store ------------------------------------------------------------------------------

    def _previous(self, namespace: str, response_id: str | None) -> list[dict[str, Any]]:
        """The items of a stored response's chain; one kept in another namespace is not
        found, as one never kept."""
        if response_id is None:
            return []
        kept = self._store.get((namespace, response_id))
        if kept is None:
            raise APIError(404, f"Previous response with id '{printable(response_id)[:200]}' "
                           f"not found.", "not_found_error", "previous_response_id",
                           "previous_response_not_found")
        self._store.move_to_end((namespace, response_id))
        return kept[0]

    def _new_id(self, namespace: str, given: str | None) -> str:
        """The response's id: a client's request id (checked as protocol.check_request_id
        says) where it names no response stored in this namespace (a later
        ``previous_response_id`` must find one chain), else a random one."""
        if given is None:
            return f"resp_{uuid.uuid4().hex}"
        if (namespace, given) in self._store:
            raise _bad("request_id", f"a stored response already has the id {given!r}")
        return given

    def _keep(self, pending: _Pending, body: dict[str, Any]) -> None:
        if pending.req.store is False or body["status"] == "failed":
            return
        items = pending.history + body["output"]
        size = len(json.dumps(items, ensure_ascii=False))
        if size > self.store_chars // 4:  # would push out most of the store: not kept
            logger.info("response %s not stored: its chain is %d characters", pending.rid, size)
            return
        key = (pending.namespace, pending.rid)
        if key in self._store:  # two requests ran under one chosen id: the later stays
            self._chars -= self._store.pop(key)[1]
        self._store[key] = (items, size)
        self._chars += size
        while len(self._store) > self.store_size or self._chars > self.store_chars:
            _, (_, dropped) = self._store.popitem(last=False)
            self._chars -= dropped


def _namespace(raw: Request, cache_salt: str | None) -> str:
    """Whose stored responses a request may continue: those made with the same API key (the
    bearer token sent) and the same ``cache_salt``. Only a hash of the two is kept."""
    scheme, _, key = raw.headers.get("authorization", "").partition(" ")
    key = key.strip() if scheme.lower() == "bearer" else ""
    return hashlib.sha256(json.dumps([key, cache_salt]).encode()).hexdigest()


def add_responses_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """``POST /v1/responses``."""
    responses = OpenAIResponses(serving)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        return await responses.create(req, raw)
