"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``, so that
Claude-style clients (the ``anthropic`` SDK, agent tools) run against a local model.

A body becomes a chat conversation (``anthropic_request.py``) and takes the chat endpoint's
pipeline: sampling checks, the chat template with its tools, the tool choice's grammar,
queueing. Its answer is made by ``MessagesFormatter`` (``anthropic_format.py``). A final
assistant turn is a prefill: the answer continues it. Errors on these routes, the body's
validation included, come back in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from tokenmill.params import ConstraintError, StructuredOutputs
from tokenmill.server.anthropic_format import MessagesFormatter, anthropic_status, error_body
from tokenmill.server.anthropic_request import (CountTokensRequest, MessagesRequest, bad,
                                                chat_messages, chat_tool_choice, chat_tools,
                                                output_format, prefill, refuse_unsupported,
                                                thinking_enabled)
from tokenmill.server.pipeline import Prompt, RequestPipeline, given_id
from tokenmill.server.protocol import APIError, FieldError, field_error
from tokenmill.server.reasoning import ReasoningParser, ReasoningSetup
from tokenmill.server.sampling import OutputLimit
from tokenmill.server.serving import request_constraint, template_kwargs, thinking_budget
from tokenmill.server.tools.choice import ToolSetup
from tokenmill.server.tools.prompt import ToolsError, check_tools

logger = logging.getLogger("tokenmill.server")

# Prompt tokens read for where thinking stands at the prompt's end (an open or an empty pair).
_PROMPT_TAIL_TOKENS = 16


class AnthropicMessages:
    """The two Messages routes on the request pipeline."""

    def __init__(self, pipeline: RequestPipeline, reasoning: ReasoningParser | None = None):
        self.pipeline = pipeline
        self.reasoning = reasoning

    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        p = self.pipeline
        model = p.resolve_model(req.model)
        refuse_unsupported(req)
        limit = OutputLimit(req.max_tokens, "max_tokens")
        _renamed_stop(p.check_fields, req, 1, limit, None, "top_logprobs")
        tools, structured = self._tools(req)
        await p.check_tool_schemas(tools.offered, "tools[{}].input_schema")
        prompt = await self.render(req, tools)
        job = await p.prepare(req, [prompt], limit, None, structured, model, tools.active)
        reasoning = self._reasoning(req, prompt)
        budget = thinking_enabled(req.thinking)[1]
        if budget is not None and reasoning is not None:  # no parser: no thinking is shown
            job.params = dataclasses.replace(
                job.params, thinking_budget=thinking_budget(p.tokenizer, budget, reasoning))
        given = given_id(req, raw)
        rid = f"msg_{uuid.uuid4().hex[:24]}" if given is None else given
        fmt = MessagesFormatter(rid, model.name, p.token_text,
                                p.tool_parser.for_tools(tools.choosable) if tools.active else None,
                                tools.limit, reasoning)
        return await p.run(job, fmt, req.stream, raw)

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        """The prompt's tokens as ``create`` would render it, tools and thinking included."""
        self.pipeline.resolve_model(req.model)
        tools, _ = self._tools(req)
        prompt = await self.render(req, tools)
        return {"input_tokens": len(prompt.ids)}

    def _tools(self, req: MessagesRequest) -> tuple[ToolSetup, StructuredOutputs | None]:
        """The body's tools in chat terms, and the tool choice's output constraint."""
        offered = chat_tools(req.tools)
        choice, parallel = chat_tool_choice(req.tool_choice, offered is not None)
        try:
            if offered is not None:
                check_tools(offered)
            tools = ToolSetup.from_chat(offered, choice, parallel)
        except ToolsError as e:
            raise _tool_error(e) from None
        own = _own_constraint(req)
        try:
            return tools, tools.constraint(own, self.pipeline.tool_parser)
        except ConstraintError as e:
            raise field_error(e) from None

    async def render(self, req: MessagesRequest, tools: ToolSetup) -> Prompt:
        """The conversation's token ids; with a prefill, the template renders the turns before
        it (with the assistant's header) and the prefill's text follows."""
        p = self.pipeline
        messages = chat_messages(req)
        kwargs = template_kwargs(req.chat_template_kwargs, None)  # reserved names refused
        thinking, _ = thinking_enabled(req.thinking)
        if thinking is not None:
            kwargs.setdefault("enable_thinking", thinking)
        start = prefill(req)
        if start is None:
            return await p.render_chat(messages, True, kwargs, tools.template_tools())
        head = await p.render_chat(messages[:-1], True, kwargs, tools.template_tools())
        p.check_prompt_chars(len(start), "messages")
        tail = await p.off_loop(p.tokenizer.encode, start, False)
        return await p.tokenize(head.ids + tail, "messages")

    def _reasoning(self, req: MessagesRequest, prompt: Prompt) -> ReasoningSetup | None:
        """How the answer's thinking is split off (where the prompt's end leaves the model);
        None without a reasoning parser. Thinking the body turned off is not shown, whatever
        the model does."""
        if self.reasoning is None:
            return None
        tail = self.pipeline.tokenizer.decode(prompt.ids[-_PROMPT_TAIL_TOKENS:],
                                              skip_special_tokens=False)
        shown = thinking_enabled(req.thinking)[0] is not False
        return ReasoningSetup(self.reasoning, self.reasoning.start_mode(tail), shown)


def _renamed_stop(check: Callable[..., None], *args: Any) -> None:
    """``check(*args)``, its refusals of ``stop`` said as ``stop_sequences``."""
    try:
        check(*args)
    except APIError as e:
        if e.param == "stop":
            e.param = "stop_sequences"
            e.message = "stop_sequences" + e.message.removeprefix("stop")
        raise


def _own_constraint(req: MessagesRequest) -> StructuredOutputs | None:
    """``output_config.format``, or one of vLLM's constraint extras (not both)."""
    try:
        extra = request_constraint(req)
        own = output_format(req.output_config)
    except ConstraintError as e:
        raise field_error(e) from None
    if extra is not None and own is not None:
        raise bad("output_config.format", f"give one output constraint (not also {extra.param})")
    return own or extra


def _tool_error(e: ToolsError) -> APIError:
    param = getattr(e, "param", None) or ""
    # the chat names of the converted tools, in this API's terms
    param = param.replace(".function.parameters", ".input_schema").replace(".function", "")
    message = str(e).replace(".function.parameters", ".input_schema").replace(".function", "")
    return APIError(400, message, param=param or None, code="invalid_value")


# ----- errors in Anthropic's shape ------------------------------------------------------------

def anthropic_error(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=anthropic_status(error),
                        headers=error.headers)


def validation_error(e: RequestValidationError) -> APIError:
    """A body pydantic refused, as the 400 naming its first bad field."""
    first = e.errors()[0] if e.errors() else {}
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return field_error(cause)
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}",
                        code="invalid_json")
    loc = _field_path(first.get("loc", ()))
    where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") \
        or "body"
    msg = first.get("msg", "invalid value")
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        msg = "the body must be a JSON object"
    return APIError(400, f"{where}: {msg}", param=str(loc[0]) if loc else None,
                    code="invalid_value")


def _field_path(loc: tuple) -> list[str | int]:
    """pydantic's error location as the field's path: up to the union branch it names
    (``system.str``, ``messages.0.dict[str,any]``), which is no field."""
    path: list[str | int] = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, str) and (part in _TYPE_NAMES or "[" in part):
            break
        path.append(part)
    return path


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class _AnthropicRoute(APIRoute):
    """A route whose every refusal, validation included, is Anthropic-shaped."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return anthropic_error(validation_error(e))
            except APIError as e:
                return anthropic_error(e)
            except HTTPException as e:  # FastAPI's own: a body that is not UTF-8 JSON
                return anthropic_error(APIError(e.status_code, str(e.detail)))
            except Exception:  # a bug: still answered in the client's shape
                logger.exception("internal error")
                return anthropic_error(APIError(500, "internal error", "server_error"))

        return route


def add_anthropic_routes(app: FastAPI, pipeline: RequestPipeline,
                         reasoning: ReasoningParser | None = None) -> None:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``; with a ``reasoning``
    parser answers carry ``thinking`` blocks."""
    messages = AnthropicMessages(pipeline, reasoning)
    router = APIRouter(route_class=_AnthropicRoute)

    @router.post("/v1/messages")
    async def create_message(req: MessagesRequest, raw: Request):
        return await messages.create(req, raw)

    @router.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: CountTokensRequest):
        return await messages.count_tokens(req)

    app.include_router(router)
