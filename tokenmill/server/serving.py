"""The generation endpoints: request -> engine streams -> OpenAI response or SSE chunks.

Everything a user can get wrong is checked before the first engine request is queued, so a bad
request never touches the engine; errors raise ``APIError`` (400-class) for the app to render.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.async_engine import (AsyncEngine, EngineOverloadedError,
                                           EngineUnavailableError, RequestFailedError,
                                           RequestStream)
from tokenmill.params import SamplingParams
from tokenmill.request import PromptError, RequestOutput
from tokenmill.server.limits import RequestLimits
from tokenmill.server.protocol import (APIError, ChatCompletionRequest, ChatMessage,
                                       CompletionRequest, FieldError, TokenizeRequest,
                                       _SamplingFields, check_request_id, honour_strict,
                                       printable)
from tokenmill.server.template_process import IsolatedRenderer
from tokenmill.structured.spec import ConstraintError, StructuredOutputs, from_request
from tokenmill.structured.tool_parsers import ToolCallParser, ToolCallStreamer, get_tool_parser
from tokenmill.structured.tool_prompt import (ToolsError, check_tools, prepare_tool_messages,
                                              template_handles_tools)
from tokenmill.structured.tools import check_tool_choice, tool_choice_constraint
from tokenmill.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from tokenmill.structured.backend import CompiledGrammar

_PARAM_FIELDS = set(SamplingParams.__dataclass_fields__)
# Template variables the request's own fields set (chat_template_kwargs may not).
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt",
                                          "tools", "renderer", "max_chars"})
_T = TypeVar("_T")
logger = logging.getLogger("tokenmill.server")


@dataclass
class _Prompt:
    text: str | None  # the caller's text (for echo); None for token-id prompts
    ids: list[int]


class OpenAIServing:
    """Shared state of the endpoints: the engine, its tokenizer, the served name, metrics."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics,
                 tool_call_parser: str = "hermes", limits: RequestLimits | None = None):
        self.engine = engine
        self.tool_parser = get_tool_parser(tool_call_parser)
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.info.max_model_len
        self.kv_cache_tokens = engine.info.kv_cache_tokens
        self.vocab_size = engine.info.vocab_size
        # Under any other policy a request's priority would order nothing: refused.
        self.priorities = engine.engine.scheduler.config.policy == "priority"
        self.limits = (limits or RequestLimits()).resolve(
            self.max_model_len, self.tokenizer.longest_token_chars, self.kv_cache_tokens)
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        # Tokenizing and template rendering run here, off the event loop (the tokenizer lets
        # go of the GIL for long texts), so /health answers while a huge prompt is encoded.
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tokenmill-tokenize")
        self._request_templates = IsolatedRenderer(self.limits.chat_template_timeout,
                                                   self.limits.max_prompt_chars) \
            if self.limits.trust_request_chat_template else None

    async def off_loop(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` in the tokenizer pool."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._request_templates is not None:
            self._request_templates.close()

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "not_found_error",
                           "model", "model_not_found")

    # ----- /v1/completions -------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        _check_best_of(req)
        items = _completion_items(req.prompt)
        self._check_request(req, len(items), req.max_tokens, "max_tokens", req.logprobs,
                            "logprobs")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo: cannot be combined with logprobs yet (the prompt "
                           "tokens' logprobs are not computed)", param="echo",
                           code="unsupported_parameter")
        if req.suffix is not None:
            items = [self._infill(p, req.suffix) for p in items]
        prompts = [await self.prompt(p, "prompt", req.add_special_tokens) for p in items]
        logprobs = req.logprobs
        params = self._params(req, req.max_tokens, logprobs, prompts, structured=_constraint(req))
        grammar = await self._compile(params)
        rid = f"cmpl-{_given_id(req, raw)}"
        streams = await self._add_all(rid, [p.ids for p in prompts], params, req.priority,
                                      req.cache_salt, grammar)
        out = _CompletionFormat(self, rid, req, prompts)
        if req.stream:
            return _sse(out.chunks(_merge(streams)), streams)
        finals = await _collect(streams, raw)
        return JSONResponse(out.response(finals))

    def _infill(self, prompt: str | list[int], suffix: str) -> str:
        """A fill-in-the-middle prompt (prefix, suffix, then the middle to generate) in the
        model's own FIM tokens; a model without them cannot take ``suffix``."""
        tokens = self.tokenizer.fim_tokens
        if tokens is None:
            raise APIError(400, "suffix: this model's tokenizer has no fill-in-the-middle "
                           "tokens, so it cannot complete between a prompt and a suffix",
                           param="suffix", code="invalid_value")
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs a text prompt", param="suffix",
                           code="invalid_value")
        prefix_token, suffix_token, middle_token = tokens
        return f"{prefix_token}{prompt}{suffix_token}{suffix}{middle_token}"

    async def prompt(self, prompt: str | list[int], param: str,
                     add_special_tokens: bool = True) -> _Prompt:
        """A text or token-id prompt, tokenized off the event loop once its length is known
        to fit."""
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            self.check_prompt_chars(len(text), param)
            ids = await self.off_loop(self.tokenizer.encode, text, add_special_tokens)
        else:
            ids = list(prompt)
        try:
            self.engine.check_prompt(ids, param)
        except PromptError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        return _Prompt(text, ids)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        limit = self.limits.max_prompt_chars
        if num_chars > limit:
            raise APIError(400, f"{param}: {num_chars} characters is more than this server "
                           f"takes ({limit}, --max-prompt-chars)", param=param,
                           code="context_length_exceeded")

    # ----- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        _check_best_of(req)
        max_tokens, max_param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        self._check_request(req, 1, max_tokens, max_param, req.top_logprobs, "top_logprobs")
        tools = _check_tools(req.tools)
        try:
            tool_mode = check_tool_choice(tools, req.tool_choice)
            structured = _constraint(req)
            if tool_mode in ("required", "named") and structured is not None:
                raise ConstraintError(f"a {tool_mode} tool choice cannot be combined with "
                                      f"another output constraint", structured.param)
            if structured is None:  # the tools' grammar, unless auto met a response_format
                structured = tool_choice_constraint(tools, req.tool_choice,
                                                    req.parallel_tool_calls, self.tool_parser)
        except ConstraintError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice", code="invalid_value") from None
        await self._check_tool_schemas(tools)
        kwargs = _template_kwargs(req.chat_template_kwargs, req.chat_template)
        prompt = await self.chat_prompt(req.messages, req.add_generation_prompt, kwargs,
                                        tools if tool_mode != "none" else None)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs",
                           code="invalid_value")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self._params(req, max_tokens, logprobs, [prompt], param, structured)
        grammar = await self._compile(params)
        rid = f"chatcmpl-{_given_id(req, raw)}"
        streams = await self._add_all(rid, [prompt.ids], params, req.priority, req.cache_salt,
                                      grammar)
        out = _ChatFormat(self, rid, req, self.tool_parser if tool_mode != "none" else None)
        if req.stream:
            return _sse(out.chunks(_merge(streams)), streams)
        finals = await _collect(streams, raw)
        return JSONResponse(out.response(finals[0]))

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """``POST /tokenize``: the ids of a prompt, or of messages as the chat endpoint renders
        them with the same tools and template."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if req.add_special_tokens:
                raise APIError(400, "add_special_tokens: a chat prompt's special tokens come "
                               "from its template", param="add_special_tokens",
                               code="invalid_value")
            kwargs = _template_kwargs(req.chat_template_kwargs, req.chat_template)
            ids = (await self.chat_prompt(req.messages, req.add_generation_prompt, kwargs,
                                          _check_tools(req.tools))).ids
        else:
            for name in ("tools", "chat_template", "chat_template_kwargs"):
                if getattr(req, name) is not None:
                    raise APIError(400, f"{name}: only with messages", param=name,
                                   code="invalid_value")
            self.check_prompt_chars(len(req.prompt), "prompt")
            ids = await self.off_loop(self.tokenizer.encode, req.prompt,
                                      req.add_special_tokens is not False)
        out: dict[str, Any] = {"tokens": ids, "count": len(ids),
                               "max_model_len": self.max_model_len}
        if req.return_token_strs:
            out["token_strs"] = await self.off_loop(self.tokenizer.convert_ids_to_tokens, ids)
        return out

    async def chat_prompt(self, messages: Sequence[ChatMessage],
                          add_generation_prompt: bool = True,
                          kwargs: dict[str, Any] | None = None,
                          tools: list[dict[str, Any]] | None = None) -> _Prompt:
        """Token ids of a conversation. A template that knows tools renders them (and calls in
        the history) itself; for one that does not, the tools go into the system prompt and
        calls and results become text in the model family's format.

        ``kwargs["chat_template"]`` may name one of the model's templates; a whole template
        sent by the client is refused unless the operator trusts them, and then is parsed and
        rendered only in a sandboxed process (``server/sandbox.py``), never in this one."""
        conversation = [_message_dict(m, i) for i, m in enumerate(messages)]
        self.check_prompt_chars(sum(len(m["content"]) + len(m.get("reasoning", ""))
                                    for m in conversation), "messages")
        kwargs = dict(kwargs or {})
        template = kwargs.get("chat_template")
        renderer = None
        if template is not None and template not in self.tokenizer.chat_templates:
            if self._request_templates is None:
                raise APIError(400, "chat_template: this server does not render chat templates "
                               "sent in requests (start it with --trust-request-chat-template "
                               "to allow them); name one of the model's templates: "
                               f"{sorted(self.tokenizer.chat_templates)}",
                               param="chat_template", code="invalid_value")
            renderer = self._request_templates.render
        try:
            if renderer is None:
                native = template_handles_tools(self.tokenizer.template_source(tools, template))
            else:  # parsing it folds constants (memory, time): only its sandbox parses it
                native = await self.off_loop(self._request_templates.handles_tools, template)
            conversation = prepare_tool_messages(conversation, tools, self.tool_parser, native)
            if native and tools:
                kwargs["tools"] = tools
            ids = await self.off_loop(self.tokenizer.encode_chat, conversation,
                                      add_generation_prompt, renderer=renderer,
                                      max_chars=self.limits.max_prompt_chars, **kwargs)
        except (ChatTemplateError, TypeError, ValueError) as e:
            param = "chat_template" if template is not None else "messages"
            raise APIError(400, f"the chat template failed: {printable(str(e))}", param=param,
                           code="invalid_value") from None
        return await self.prompt(ids, "messages")

    async def _check_tool_schemas(self, tools: list[dict[str, Any]] | None) -> None:
        """Every offered function's parameters must compile as a JSON schema (auto calls are
        parsed, not constrained, but a schema the grammar cannot take is refused either way)."""
        for i, tool in enumerate(tools or ()):
            parameters = tool["function"].get("parameters")
            if parameters is None:
                continue
            try:
                spec = StructuredOutputs(json=parameters,
                                         param=f"tools[{i}].function.parameters")
            except ConstraintError as e:
                raise APIError(400, str(e), param=e.param, code="invalid_value") from None
            await self._compile_spec(spec)

    async def _compile(self, params: SamplingParams) -> CompiledGrammar | None:
        """Compile the request's constraint off the event loop, before anything is queued:
        one that does not compile is a 400 naming its field. The grammar goes to the engine
        with the request (``_add_all``), so the engine's loop never compiles (a slow schema
        would stall every stream)."""
        if params.structured_outputs is None:
            return None
        return await self._compile_spec(params.structured_outputs)

    async def _compile_spec(self, spec: StructuredOutputs) -> CompiledGrammar:
        try:
            return await asyncio.to_thread(self.engine.compile_grammar, spec)
        except ConstraintError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        except Exception as e:  # e.g. a tokenizer the grammar backend cannot read
            logger.warning("structured output unavailable: %s: %s", type(e).__name__, e)
            raise APIError(400, f"{spec.param}: structured output is not available for this "
                           f"model ({type(e).__name__}: {e})", param=spec.param,
                           code="unsupported") from None

    # ----- shared -----------------------------------------------------------------------------

    def _check_request(self, req: _SamplingFields, num_prompts: int, max_tokens: int | None,
                       max_tokens_param: str, logprobs: int | None, logprobs_param: str) -> None:
        """The limits a request's fields must keep, before anything is tokenized."""
        self._check_options(req)
        lim = self.limits
        if req.n > lim.max_n:
            raise APIError(400, f"n: at most {lim.max_n} choices per request (--max-n), got "
                           f"{req.n}", param="n", code="invalid_value")
        param = max_tokens_param
        if isinstance(max_tokens, int) and max_tokens > 0 \
                and num_prompts * req.n * max_tokens > lim.max_request_tokens:
            raise APIError(400, f"{param}: {num_prompts} prompt(s) x n={req.n} x "
                           f"{max_tokens} tokens asks for more than the "
                           f"{lim.max_request_tokens} tokens one request may generate "
                           f"(--max-request-tokens)", param=param, code="invalid_value")
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop or any(len(x) > lim.max_stop_chars for x in stops):
            raise APIError(400, f"stop: at most {lim.max_stop} stop strings of at most "
                           f"{lim.max_stop_chars} characters (--max-stop, --max-stop-chars)",
                           param="stop", code="invalid_value")
        stop_ids = req.stop_token_ids or []
        if len(stop_ids) > 4 * lim.max_stop or any(not 0 <= i < self.vocab_size
                                                    for i in stop_ids):
            raise APIError(400, f"stop_token_ids: at most {4 * lim.max_stop} token ids in "
                           f"[0, {self.vocab_size})", param="stop_token_ids",
                           code="invalid_value")
        self._check_logit_bias(req.logit_bias)
        if logprobs is not None and logprobs > lim.max_logprobs:
            raise APIError(400, f"{logprobs_param}: at most {lim.max_logprobs} (--max-logprobs),"
                           f" got {logprobs}", param=logprobs_param, code="invalid_value")

    def _check_options(self, req: _SamplingFields) -> None:
        """Fields that would be ignored where they are sent are refused instead."""
        if req.priority != 0 and not self.priorities:
            raise APIError(400, f"priority: this server schedules first come, first served; "
                           f"start it with --scheduling-policy priority to order requests "
                           f"(got {req.priority})", param="priority", code="invalid_value")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only with stream=true", param="stream_options",
                           code="invalid_value")

    def _check_logit_bias(self, bias: dict[str, float] | None) -> None:
        if not bias:
            return
        if len(bias) > self.limits.max_logit_bias:
            raise APIError(400, f"logit_bias: at most {self.limits.max_logit_bias} entries "
                           f"(--max-logit-bias), got {len(bias)}", param="logit_bias",
                           code="invalid_value")
        for key in bias:
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"logit_bias: keys must be token ids in [0, "
                               f"{self.vocab_size}), got {printable(key)[:40]!r}",
                               param="logit_bias", code="invalid_value")

    def _params(self, req: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                prompts: list[_Prompt], max_tokens_param: str = "max_tokens",
                structured: StructuredOutputs | None = None) -> SamplingParams:
        longest = max(len(p.ids) for p in prompts)
        if max_tokens is None:  # until the context (or what the KV cache can hold) ends
            max_tokens = max(1, min(min(self.max_model_len, self.kv_cache_tokens) - longest,
                                    self.limits.max_request_tokens
                                    // (len(prompts) * max(1, req.n))))
        elif isinstance(max_tokens, int) and max_tokens >= 1 \
                and longest + max_tokens > self.max_model_len:
            raise APIError(400, f"{max_tokens_param}={max_tokens} plus the prompt's {longest} "
                           f"tokens exceeds the model's maximum context length of "
                           f"{self.max_model_len} tokens", param=max_tokens_param,
                           code="context_length_exceeded")
        try:
            return SamplingParams(**_sampling_kwargs(req, max_tokens, logprobs),
                                  structured_outputs=structured)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            if name == "max_tokens":
                name = max_tokens_param
            raise APIError(400, str(e), param=name if name in _PARAM_FIELDS | {max_tokens_param}
                           else None, code="invalid_value") from None

    async def _add_all(self, rid: str, prompts: list[list[int]], params: SamplingParams,
                       priority: int, cache_salt: str | None = None,
                       grammar: CompiledGrammar | None = None) -> list[RequestStream]:
        """Queue one engine request per prompt, with ``params``' constraint compiled already
        (``grammar``, from ``_compile``). Their ids extend ``rid`` (the response's id, which a
        client may choose and repeat) with a part of their own, so they never clash."""
        streams: list[RequestStream] = []
        own = uuid.uuid4().hex[:12]
        try:
            for i, ids in enumerate(prompts):
                request_id = f"{rid}-{own}" if len(prompts) == 1 else f"{rid}-{own}-{i}"
                streams.append(await self.engine.add_request(request_id, ids, params, priority,
                                                             cache_salt, grammar))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, EngineOverloadedError):
                self.metrics.rejections.labels(self.model_name).inc()
                raise APIError(503, str(e), "overloaded_error", None, "overloaded",
                               {"Retry-After": str(e.retry_after)}) from None
            if isinstance(e, EngineUnavailableError):
                raise engine_error(e) from None
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param="prompt", code="invalid_value") from None
            raise
        return streams


def _given_id(req: CompletionRequest | ChatCompletionRequest, raw: Request) -> str:
    """The id a client chose for its request, as vLLM takes it: the X-Request-Id header, then
    the ``request_id`` field; otherwise a fresh one."""
    given = request_id_header(raw)
    if given is None:
        given = req.request_id
    return uuid.uuid4().hex if given is None else given


def request_id_header(raw: Request) -> str | None:
    """The X-Request-Id header, checked as the ``request_id`` field is."""
    given = raw.headers.get("x-request-id")
    try:
        return None if given is None else check_request_id(given, "X-Request-Id")
    except FieldError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


def _completion_items(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    return items


def _check_best_of(req: CompletionRequest | ChatCompletionRequest) -> None:
    """``best_of`` samples that many and returns the ``n`` most likely; tokenmill returns
    every choice it samples, so only best_of == n means what it asks."""
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of: only best_of == n is supported (got best_of="
                       f"{req.best_of}, n={req.n}); ask for n choices instead",
                       param="best_of", code="invalid_value")


def engine_error(e: EngineUnavailableError | RequestFailedError) -> APIError:
    """The API error of an engine that stopped or of a request the engine failed."""
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), "server_error", None, "request_failed")
    return APIError(503, str(e), "server_error", None, "unavailable", {"Retry-After": "5"})


def _constraint(req: _SamplingFields) -> StructuredOutputs | None:
    try:
        return from_request(
            response_format=honour_strict(req.response_format),
            structured_outputs=req.structured_outputs,
            guided_json=req.guided_json, guided_regex=req.guided_regex,
            guided_choice=req.guided_choice, guided_grammar=req.guided_grammar,
            guided_whitespace_pattern=req.guided_whitespace_pattern)
    except ConstraintError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


def _template_kwargs(chat_template_kwargs: dict[str, Any] | None,
                     chat_template: str | None) -> dict[str, Any]:
    """The variables a request hands its chat template, and the template it names or sends."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(kwargs.keys() & _RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {reserved} are set by the request itself, "
                       f"not by template variables", param="chat_template_kwargs",
                       code="invalid_value")
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return kwargs


def _check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is not None:
        try:
            check_tools(tools)
        except ToolsError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    return tools


def _message_dict(m: ChatMessage, index: int) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{index}].content: only text parts are supported",
                               param="messages", code="invalid_value")
            texts.append(part["text"])
        content = "".join(texts)
    d: dict[str, Any] = {"role": m.role, "content": content or m.refusal or ""}
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        d["reasoning"] = d["reasoning_content"] = reasoning
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls is not None:
        d["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def _sampling_kwargs(req: _SamplingFields, max_tokens: int, logprobs: int | None) -> dict:
    kw: dict[str, Any] = {"n": req.n, "max_tokens": max_tokens, "logprobs": logprobs,
                          "seed": req.seed, "min_tokens": req.min_tokens,
                          "ignore_eos": req.ignore_eos,
                          "skip_special_tokens": req.skip_special_tokens,
                          "include_stop_str_in_output": req.include_stop_str_in_output,
                          "stop_token_ids": req.stop_token_ids or ()}
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        value = getattr(req, name)
        kw[name] = default if value is None else value
    kw["stop"] = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    # keys were checked to be token ids by _check_logit_bias
    kw["logit_bias"] = {int(key): value for key, value in (req.logit_bias or {}).items()}
    return kw


# ----- streams ----------------------------------------------------------------------------------

async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _collect(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """Final outputs of all streams; a client that disconnects aborts them at once (the
    engine logs one line per aborted request; nothing else is said)."""
    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        while True:
            await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in tasks if t.done() and t.exception()), None)
            if failed is not None:
                raise failed.exception()
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
            if await raw.is_disconnected():
                raise APIError(499, "the client disconnected", code="client_disconnected")
    except (EngineUnavailableError, RequestFailedError) as e:
        raise engine_error(e) from None
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()
        # Retrieve what the cancelled tasks ended with, so asyncio has nothing to report.
        await asyncio.gather(*tasks, return_exceptions=True)


class _AbortingStreamingResponse(StreamingResponse):
    """Aborts its requests however the response ends, even if the body was never iterated."""

    def __init__(self, content, streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()


def _sse(chunks: AsyncIterator[dict], streams: list[RequestStream]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except (EngineUnavailableError, RequestFailedError, APIError) as e:
            err = e if isinstance(e, APIError) else engine_error(e)
            yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"

    return _AbortingStreamingResponse(events(), streams)


# ----- response shapes -------------------------------------------------------------------------

def _usage(outputs: Iterable[RequestOutput]) -> dict[str, Any]:
    """OpenAI usage over a request's outputs; ``cached_tokens`` came from the prefix cache."""
    outputs = list(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}


class _ChoiceCursor:
    """What of one choice was already sent: text characters, logprob entries, finish."""

    def __init__(self, text_offset: int = 0):
        self.text = 0
        self.logprobs = 0
        self.offset = text_offset  # completions' text_offset of the next token
        self.done = False
        self.started = False
        self.tool_calls = False  # a tool call was streamed (chat with tools)


class _CompletionFormat:
    def __init__(self, serving: OpenAIServing, rid: str, req: CompletionRequest,
                 prompts: list[_Prompt]):
        self.s = serving
        self.rid = rid
        self.req = req
        self.prompts = prompts
        self.created = int(time.time())

    def _echo(self, i: int) -> str:
        p = self.prompts[i]
        return p.text if p.text is not None else self.s.tokenizer.decode(p.ids)

    def _logprobs(self, entries: list, cursor: _ChoiceCursor) -> dict:
        """The generated tokens' logprobs (echo is refused with logprobs until the prompt's
        are computed)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for e in entries:
            text = self.s.token_text(e.token_id)
            top = {self.s.token_text(t): lp for t, lp in e.top}
            top.setdefault(text, e.logprob)
            tokens.append(text)
            token_lps.append(e.logprob)
            tops.append(top)
            offsets.append(cursor.offset)
            cursor.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _choice_delta(self, index: int, prompt_index: int, c, cursor: _ChoiceCursor) -> dict | None:
        echo = self.req.echo and not cursor.started
        text = (self._echo(prompt_index) if echo else "") + c.text[cursor.text:]
        entries = (c.logprobs or [])[cursor.logprobs:]
        finish = c.finish_reason.value if c.finish_reason and not cursor.done else None
        if not (text or entries or finish or echo):
            return None
        lp = None
        if self.req.logprobs is not None:
            lp = self._logprobs(entries, cursor)
        cursor.started, cursor.text = True, len(c.text)
        cursor.logprobs += len(entries)
        cursor.done = cursor.done or finish is not None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish,
                "stop_reason": c.stop_reason if finish else None}

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        n = self.req.n
        cursors = [_ChoiceCursor() for _ in range(n * len(self.prompts))]
        finals: dict[int, RequestOutput] = {}
        include_usage, continuous = _usage_in_chunks(self.req)
        async for pi, out in outputs:
            finals[pi] = out
            choices = [d for c in out.outputs if (d := self._choice_delta(
                pi * n + c.index, pi, c, cursors[pi * n + c.index])) is not None]
            if choices:
                yield self._chunk(choices, include_usage, _usage([out]) if continuous else None)
        if include_usage:
            yield {**self._chunk([], False), "usage": _usage(finals.values())}

    def _chunk(self, choices: list[dict], include_usage: bool,
               usage: dict | None = None) -> dict:
        return _stream_chunk(self, "text_completion", choices, include_usage, usage)

    def response(self, finals: list[RequestOutput]) -> dict:
        n = self.req.n
        choices = []
        for pi, out in enumerate(finals):
            for c in out.outputs:
                choices.append(self._choice_delta(pi * n + c.index, pi, c, _ChoiceCursor()))
        return {"id": self.rid, "object": "text_completion", "created": self.created,
                "model": self.s.model_name, "choices": choices,
                "usage": _usage(finals)}


def _usage_in_chunks(req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streamed request: the second only with the
    first, as in vLLM."""
    options = req.stream_options
    include = bool(options and options.include_usage)
    return include, include and options.continuous_usage_stats


def _stream_chunk(fmt: _CompletionFormat | _ChatFormat, obj: str, choices: list[dict],
                  include_usage: bool, usage: dict | None = None) -> dict:
    """One SSE chunk. With include_usage every chunk but the last carries ``usage``: null, or
    with continuous_usage_stats the usage so far of the output it carries."""
    chunk = {"id": fmt.rid, "object": obj, "created": fmt.created, "model": fmt.s.model_name,
             "choices": choices}
    if include_usage:
        chunk["usage"] = usage
    return chunk


class _ChatFormat:
    """Chat responses and chunks; with a tool ``parser`` (tools offered, tool_choice not
    "none") the text is split into content and ``tool_calls``, whole or as it streams."""

    def __init__(self, serving: OpenAIServing, rid: str, req: ChatCompletionRequest,
                 parser: ToolCallParser | None = None):
        self.s = serving
        self.rid = rid
        self.req = req
        self.parser = parser
        self.created = int(time.time())

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.s.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, entries: list) -> dict | None:
        if not self.req.logprobs:
            return None
        content = []
        for e in entries:
            top = [self._entry(t, lp) for t, lp in e.top[:self.req.top_logprobs or 0]]
            content.append({**self._entry(e.token_id, e.logprob), "top_logprobs": top})
        return {"content": content}

    async def chunks(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict]:
        cursors = [_ChoiceCursor() for _ in range(self.req.n)]
        streamers = [self.parser.streamer() if self.parser else None for _ in range(self.req.n)]
        include_usage, continuous = _usage_in_chunks(self.req)
        final = None
        for i in range(self.req.n):  # the role first, like OpenAI, so clients see headers early
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}], include_usage)
        async for _, out in outputs:
            final = out
            pending = [self._deltas(c, cursors[c.index], streamers[c.index])
                       for c in out.outputs]
            # A choice may have several deltas (text, then a call): the k-th of each per chunk.
            usage = _usage([out]) if continuous else None
            for k in range(max(map(len, pending), default=0)):
                yield self._chunk([d[k] for d in pending if k < len(d)], include_usage, usage)
        if include_usage and final is not None:
            yield {**self._chunk([], False), "usage": _usage([final])}

    def _deltas(self, c, cursor: _ChoiceCursor, streamer: ToolCallStreamer | None) -> list[dict]:
        text = c.text[cursor.text:]
        entries = (c.logprobs or [])[cursor.logprobs:]
        finish = c.finish_reason.value if c.finish_reason and not cursor.done else None
        if not (text or entries or finish):
            return []
        cursor.text, cursor.logprobs = len(c.text), cursor.logprobs + len(entries)
        cursor.done = cursor.done or finish is not None
        if streamer is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = streamer.feed(text) if text else []
            if finish:
                deltas += streamer.finish()
            if not self.req.parallel_tool_calls:  # one call at most: later ones are dropped
                deltas = [d for d in deltas if d.get("tool_calls", [{}])[0].get("index", 0) == 0]
            cursor.tool_calls = cursor.tool_calls or any("tool_calls" in d for d in deltas)
        if finish == "stop" and cursor.tool_calls:
            finish = "tool_calls"
        out = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None}
               for d in deltas or [{}]]
        out[0]["logprobs"] = self._logprobs(entries)
        out[-1]["finish_reason"] = finish
        return out

    def _message(self, c) -> tuple[dict, str | None]:
        """The assistant message of a finished choice and its finish reason."""
        finish = c.finish_reason.value if c.finish_reason else None
        if self.parser is None:
            return {"role": "assistant", "content": c.text}, finish
        parsed = self.parser.parse(c.text)
        if not self.req.parallel_tool_calls:  # one call at most (auto is parsed, not bounded)
            del parsed.tool_calls[1:]
        message = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            if finish == "stop":
                finish = "tool_calls"
        return message, finish

    def _chunk(self, choices: list[dict], include_usage: bool,
               usage: dict | None = None) -> dict:
        return _stream_chunk(self, "chat.completion.chunk", choices, include_usage, usage)

    def response(self, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            message, finish = self._message(c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c.logprobs or []),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        return {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.s.model_name, "choices": choices,
                "usage": _usage([out])}
