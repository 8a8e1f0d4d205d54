"""One path from a request body to engine requests, shared by completions, chat and responses.

An endpoint turns its body into prompts (texts, token ids, or a conversation for the chat
template, with its tools), an output constraint and an ``OutputLimit``; the pipeline does the
rest, each step refusing with an ``APIError`` that names the field as the endpoint spells it,
and all of them before anything is queued, so a bad request never touches the engine:

    resolve_model, check_fields the body alone: base model or LoRA adapter (``models.py``),
                                sampling (``sampling.SamplingRules``)
    tokenize, render_chat       off the event loop (a worker pool), then the engine's check
    check_tool_schemas          every offered function's parameters compile as a schema
    prepare                     ``SamplingParams``; the constraint compiled off the loop
    run                         one engine request per prompt, answered by the endpoint's
                                ``OutputFormatter``, streamed or whole
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import (AsyncEngine, EngineOverloadedError,
                                           EngineUnavailableError, RequestStream)
from tokenmill.errors import LoRAError
from tokenmill.params import ConstraintError, StructuredOutputs
from tokenmill.request import PromptError
from tokenmill.server.formatters import OutputFormatter
from tokenmill.server.limits import RequestLimits
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.models import ModelChoice, ServedModels, model_not_found
from tokenmill.server.protocol import (APIError, ChatMessage, FieldError, SamplingFields,
                                       check_request_id, field_error, invalid, printable)
from tokenmill.server.sampling import OutputLimit, SamplingRules
from tokenmill.server.streams import collect, engine_error
from tokenmill.server.template_process import IsolatedRenderer
from tokenmill.server.tools.parsers import get_tool_parser
from tokenmill.server.tools.prompt import prepare_tool_messages, template_handles_tools
from tokenmill.tokenizer import ChatTemplateError

if TYPE_CHECKING:
    from tokenmill.params import SamplingParams
    from tokenmill.structured.backend import CompiledGrammar

_T = TypeVar("_T")
logger = logging.getLogger("tokenmill.server")


@dataclass
class Prompt:
    """One prompt's token ids, with the caller's text (for echo; None for token ids) and the
    request field it came from (what a refusal of it names)."""

    text: str | None
    ids: list[int]
    param: str = "prompt"


@dataclass
class EngineJob:
    """What one HTTP request asks of the engine: a request per prompt, sharing the rest."""

    prompts: list[Prompt]
    params: SamplingParams
    grammar: CompiledGrammar | None  # params' constraint, compiled already
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # for the engine's KV connector
    model: ModelChoice | None = None  # the adapter to run under (None: the base model)


class RequestPipeline:
    """The endpoints' shared state (the engine, its tokenizer, the served name, the limits,
    the tool-call syntax) and the steps from a body to engine streams."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 tool_call_parser: str = "hermes", limits: RequestLimits | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.tool_parser = get_tool_parser(tool_call_parser)
        info = engine.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.models = ServedModels(engine, model_name, info.max_model_len)
        self.limits = (limits or RequestLimits()).resolve(
            info.max_model_len, self.tokenizer.longest_token_chars, info.kv_cache_tokens)
        # Under any other policy a request's priority would order nothing: refused.
        priorities = engine.engine.scheduler.config.policy == "priority"
        self.rules = SamplingRules(self.limits, info.vocab_size, info.max_model_len,
                                   info.kv_cache_tokens, priorities)
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

    # ----- the body alone -----------------------------------------------------------------------

    def resolve_model(self, model: str | None) -> ModelChoice:
        """The base model or the LoRA adapter a body's ``model`` names (404 for any other)."""
        return self.models.resolve(model)

    def check_fields(self, req: SamplingFields, num_prompts: int, limit: OutputLimit,
                     logprobs: int | None, logprobs_param: str) -> None:
        """The limits a request's fields must keep, before anything is tokenized."""
        self.rules.check(req, num_prompts, limit, logprobs, logprobs_param)
        check_kv_transfer(req, num_prompts)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        limit = self.limits.max_prompt_chars
        if num_chars > limit:
            raise invalid(param, f"{param}: {num_chars} characters is more than this server "
                          f"takes ({limit}, --max-prompt-chars)", "context_length_exceeded")

    # ----- prompts ------------------------------------------------------------------------------

    async def tokenize(self, prompt: str | list[int], param: str,
                       add_special_tokens: bool = True) -> Prompt:
        """A text or token-id prompt, tokenized off the event loop once its length is known
        to fit, and checked as the engine will."""
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            self.check_prompt_chars(len(text), param)
            ids = await self.off_loop(self.tokenizer.encode, text, add_special_tokens)
        else:
            ids = list(prompt)
        try:
            self.engine.check_prompt(ids, param)
        except PromptError as e:
            raise field_error(e) from None
        return Prompt(text, ids, param)

    async def render_chat(self, messages: Sequence[ChatMessage],
                          add_generation_prompt: bool = True,
                          kwargs: dict[str, Any] | None = None,
                          tools: list[dict[str, Any]] | None = None,
                          param: str = "messages") -> Prompt:
        """Token ids of a conversation (``param`` is the field it came from). A template that
        knows tools renders them (and calls in the history) itself; for one that does not, the
        tools go into the system prompt and calls and results become text in the model
        family's format.

        ``kwargs["chat_template"]`` may name one of the model's templates; a whole template
        sent by the client is refused unless the operator trusts them, and then is parsed and
        rendered only in a sandboxed process (``server/sandbox.py``), never in this one."""
        conversation = [message_dict(m, i, param) for i, m in enumerate(messages)]
        self.check_prompt_chars(sum(len(m["content"]) + len(m.get("reasoning", ""))
                                    for m in conversation), param)
        kwargs = dict(kwargs or {})
        template = kwargs.get("chat_template")
        renderer = self._request_renderer(template)
        try:
            native = await self._template_handles_tools(template, renderer, tools)
            conversation = prepare_tool_messages(conversation, tools, self.tool_parser, native)
            if native and tools:
                kwargs["tools"] = tools
            ids = await self.off_loop(self.tokenizer.encode_chat, conversation,
                                      add_generation_prompt, renderer=renderer,
                                      max_chars=self.limits.max_prompt_chars, **kwargs)
        except (ChatTemplateError, TypeError, ValueError) as e:
            at = "chat_template" if template is not None else param
            raise invalid(at, f"the chat template failed: {printable(str(e))}") from None
        return await self.tokenize(ids, param)

    def _request_renderer(self, template: str | None) -> Callable[..., str] | None:
        """The sandbox's renderer for a template the request sent, None for the model's."""
        if template is None or template in self.tokenizer.chat_templates:
            return None
        if self._request_templates is None:
            raise invalid("chat_template", "chat_template: this server does not render chat "
                          "templates sent in requests (start it with "
                          "--trust-request-chat-template to allow them); name one of the "
                          f"model's templates: {sorted(self.tokenizer.chat_templates)}")
        return self._request_templates.render

    async def _template_handles_tools(self, template: str | None,
                                      renderer: Callable[..., str] | None,
                                      tools: list[dict[str, Any]] | None) -> bool:
        if renderer is None:
            return template_handles_tools(self.tokenizer.template_source(tools, template))
        # parsing it folds constants (memory, time): only its sandbox parses it
        return await self.off_loop(self._request_templates.handles_tools, template)

    # ----- constraints and the engine request ---------------------------------------------------

    async def check_tool_schemas(self, tools: list[dict[str, Any]] | None,
                                 where: str = "tools[{}].function.parameters") -> None:
        """Every offered function's parameters must compile as a JSON schema (auto calls are
        parsed, not constrained, but a schema the grammar cannot take is refused either way);
        ``where`` spells the field of tool i."""
        for i, tool in enumerate(tools or ()):
            parameters = tool["function"].get("parameters")
            if parameters is None:
                continue
            try:
                spec = StructuredOutputs(json=parameters, param=where.format(i))
            except ConstraintError as e:
                raise field_error(e) from None
            await self.compile(spec)

    async def compile(self, spec: StructuredOutputs | None) -> CompiledGrammar | None:
        """Compile a constraint off the event loop, before anything is queued: one that does
        not compile is a 400 naming its field. The grammar goes to the engine with the request,
        so the engine's loop never compiles (a slow schema would stall every stream)."""
        if spec is None:
            return None
        try:
            return await asyncio.to_thread(self.engine.compile_grammar, spec)
        except ConstraintError as e:
            raise field_error(e) from None
        except Exception as e:  # e.g. a tokenizer the grammar backend cannot read
            logger.warning("structured output unavailable: %s: %s", type(e).__name__, e)
            raise invalid(spec.param, f"{spec.param}: structured output is not available for "
                          f"this model ({type(e).__name__}: {e})", "unsupported") from None

    async def prepare(self, req: SamplingFields, prompts: list[Prompt], limit: OutputLimit,
                      logprobs: int | None, structured: StructuredOutputs | None = None,
                      model: ModelChoice | None = None, tools: bool = False) -> EngineJob:
        """The engine's parameters for these prompts, with the constraint compiled; they run
        under ``model``'s adapter, if it has one. A model served for embeddings or scores
        generates nothing: that is the client's error, a 400. ``tools``: tool calls are parsed
        from the output, whose special-token markers (Mistral's ``[TOOL_CALLS]``) the text
        then keeps where the parser reads them."""
        task = getattr(self.engine.engine, "task", "generate")
        if task != "generate":
            raise invalid("model", f"model: this server runs its model for the {task} task "
                          "(an embedding model or cross-encoder); it serves /v1/embeddings, "
                          "/v1/rerank and /score, not text generation", "wrong_model_task")
        params = self.rules.params(req, [len(p.ids) for p in prompts], limit, logprobs,
                                   structured)
        if tools and self.tool_parser.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        grammar = await self.compile(params.structured_outputs)
        return EngineJob(prompts, params, grammar, req.priority, req.cache_salt,
                         req.kv_transfer_params, model)

    async def run(self, job: EngineJob, fmt: OutputFormatter, stream: bool,
                  raw: Request) -> Response:
        """Queue the job under the formatter's response id and answer: a stream of events, or
        one body once every prompt's request finished."""
        streams = await self.submit(fmt.rid, job)
        if stream:
            return fmt.streaming_response(streams)
        return JSONResponse(fmt.response(await collect(streams, raw)))

    async def submit(self, rid: str, job: EngineJob) -> list[RequestStream]:
        """One engine request per prompt. Their ids extend ``rid`` (the response's id, which a
        client may choose and repeat) with a part of their own, so they never clash."""
        streams: list[RequestStream] = []
        own = uuid.uuid4().hex[:12]
        prompts = job.prompts
        lora = job.model.lora if job.model else None
        try:
            for i, prompt in enumerate(prompts):
                request_id = f"{rid}-{own}" if len(prompts) == 1 else f"{rid}-{own}-{i}"
                streams.append(await self.engine.add_request(
                    request_id, prompt.ids, job.params, job.priority, job.cache_salt,
                    job.grammar, kv_transfer_params=job.kv_transfer_params, lora_request=lora))
        except BaseException as e:
            for s in streams:
                s.abort()
            raise self._refusal(e, prompts[0].param, job.model) from None
        return streams

    def _refusal(self, e: BaseException, prompt_param: str,
                 model: ModelChoice | None) -> BaseException:
        """What a failed ``add_request`` is said as (anything unexpected as it is)."""
        if isinstance(e, LoRAError) and model is not None and model.lora is not None:
            return model_not_found(model.name)  # unloaded since the request resolved it
        if isinstance(e, EngineOverloadedError):
            self.metrics.rejections.labels(self.model_name).inc()
            return APIError(503, str(e), "overloaded_error", None, "overloaded",
                            {"Retry-After": str(e.retry_after)})
        if isinstance(e, EngineUnavailableError):
            return engine_error(e)
        if isinstance(e, ValueError):  # the engine names the hand-off in its message
            kv = str(e).startswith("kv_transfer_params:")
            return invalid("kv_transfer_params" if kv else prompt_param, str(e))
        return e


def check_kv_transfer(req: SamplingFields, num_prompts: int) -> None:
    """``kv_transfer_params`` names one engine request's KV blocks: one prompt; and a producer
    (``do_remote_decode``) hands over the blocks of one sequence, in a body the caller reads
    whole (the params come back in it), so one choice and no stream."""
    params = req.kv_transfer_params
    if params is None:
        return
    if num_prompts > 1:
        raise invalid("kv_transfer_params", f"kv_transfer_params: only with a single prompt "
                      f"(got {num_prompts})", "unsupported_parameter")
    if not params.get("do_remote_decode"):
        return
    if req.n > 1:
        raise invalid("kv_transfer_params", f"kv_transfer_params: do_remote_decode needs n=1 "
                      f"(got n={req.n})", "unsupported_parameter")
    if req.stream:
        raise invalid("kv_transfer_params", "kv_transfer_params: do_remote_decode needs "
                      "stream=false (the hand-off comes back in the response body)",
                      "unsupported_parameter")


def message_dict(m: ChatMessage, index: int, param: str = "messages") -> dict[str, Any]:
    """A chat message as its template reads it: text content, reasoning under both names."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(param, f"{param}[{index}].content: only text parts are "
                              f"supported")
            texts.append(part["text"])
        content = "".join(texts)
    d: dict[str, Any] = {"role": m.role, "content": content or m.refusal or ""}
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        d["reasoning"] = d["reasoning_content"] = reasoning
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    return d


def request_id_header(raw: Request) -> str | None:
    """The X-Request-Id header, checked as the ``request_id`` field is."""
    given = raw.headers.get("x-request-id")
    try:
        return None if given is None else check_request_id(given, "X-Request-Id")
    except FieldError as e:
        raise field_error(e) from None


def given_id(req: SamplingFields, raw: Request) -> str | None:
    """The id a client chose for its request, as vLLM takes it: the X-Request-Id header, then
    the ``request_id`` field; None where it chose none."""
    given = request_id_header(raw)
    return req.request_id if given is None else given
