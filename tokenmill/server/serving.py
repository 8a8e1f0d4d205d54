"""``/v1/completions``, ``/v1/chat/completions`` and ``/tokenize``: each body in the pipeline's
terms (prompts, output limit, constraint, tools), then ``RequestPipeline`` and a formatter."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenmill.params import ConstraintError, StructuredOutputs, ThinkingBudget
from tokenmill.server.formatters import ChatFormatter, CompletionFormatter
from tokenmill.server.pipeline import Prompt, RequestPipeline, given_id, message_dict
from tokenmill.server.prompt_scores import check_prompt_scoring
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest, SamplingFields,
                                       TokenizeRequest, field_error, honour_strict, invalid)
from tokenmill.server.reasoning import Mode, ReasoningParser, ReasoningSetup
from tokenmill.server.sampling import OutputLimit
from tokenmill.server.tools.choice import ToolSetup
from tokenmill.server.tools.prompt import ToolsError, check_tools
from tokenmill.structured.spec import from_request

# Stands in for the final message's text while the template renders it, so the prompt can be
# cut right after that text (continue_final_message); no client writes it.
_CONTINUE_MARK = "\ue000tokenmill-continue\ue000"
# Prompt tokens read for where thinking stands at its end (an open or an empty tag pair).
_PROMPT_TAIL_TOKENS = 16
_CONTINUED_TAIL_TOKENS = 8192
# Template variables the request's own fields set (chat_template_kwargs may not).
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt",
                                          "tools", "renderer", "max_chars"})


class OpenAIServing:
    """The Completions and Chat Completions endpoints (and ``/tokenize``) on a pipeline;
    with a ``reasoning`` parser chat answers split off the model's thinking."""

    def __init__(self, pipeline: RequestPipeline, reasoning: ReasoningParser | None = None):
        self.pipeline = pipeline
        self.tokenizer = pipeline.tokenizer
        self.reasoning = reasoning

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        p = self.pipeline
        model = p.resolve_model(req.model)
        check_best_of(req)
        items = completion_items(req.prompt)
        score_only = check_prompt_scoring(req, p.rules.limits.max_logprobs)
        limit = OutputLimit(1 if score_only else req.max_tokens)  # one token, dropped
        p.check_fields(req, len(items), limit, req.logprobs, "logprobs")
        if req.suffix is not None:
            items = [self._infill(item, req.suffix) for item in items]
        prompts = [await p.tokenize(item, "prompt", req.add_special_tokens) for item in items]
        job = await p.prepare(req, prompts, limit, req.logprobs, request_constraint(req), model)
        fmt = CompletionFormatter(f"cmpl-{_response_id(req, raw)}", model.name, p.token_text,
                                  req.stream_options, req.n, len(prompts), req.logprobs,
                                  self._echoes(prompts) if req.echo else None, score_only,
                                  req.prompt_logprobs is not None)
        return await p.run(job, fmt, req.stream, raw)

    def _infill(self, prompt: str | list[int], suffix: str) -> str:
        """A fill-in-the-middle prompt (prefix, suffix, then the middle to generate) in the
        model's own FIM tokens; a model without them cannot take ``suffix``."""
        tokens = self.tokenizer.fim_tokens
        if tokens is None:
            raise invalid("suffix", "suffix: this model's tokenizer has no fill-in-the-middle "
                          "tokens, so it cannot complete between a prompt and a suffix")
        if not isinstance(prompt, str):
            raise invalid("suffix", "suffix needs a text prompt")
        prefix_token, suffix_token, middle_token = tokens
        return f"{prefix_token}{prompt}{suffix_token}{suffix}{middle_token}"

    def _echoes(self, prompts: list[Prompt]) -> list[str]:
        return [p.text if p.text is not None else self.tokenizer.decode(p.ids) for p in prompts]

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        p = self.pipeline
        model = p.resolve_model(req.model)
        check_best_of(req)
        limit = OutputLimit.of_chat(req)
        p.check_fields(req, 1, limit, req.top_logprobs, "top_logprobs")
        check_prompt_scoring(req, p.rules.limits.max_logprobs)
        tools, structured = self._chat_tools(req)
        await p.check_tool_schemas(tools.offered)
        kwargs = template_kwargs(req.chat_template_kwargs, req.chat_template)
        prompt = await self._render(req, kwargs, tools.template_tools())
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        reasoning = self.reasoning_setup(prompt.ids, req.include_reasoning,
                                         req.thinking_token_budget, req.continue_final_message)
        job = await p.prepare(req, [prompt], limit, logprobs, structured, model, tools.active)
        if req.thinking_token_budget is not None:
            job.params = dataclasses.replace(job.params, thinking_budget=self.thinking_budget(
                req.thinking_token_budget, reasoning))
        fmt = ChatFormatter(f"chatcmpl-{_response_id(req, raw)}", model.name, p.token_text,
                            req.stream_options, req.n, logprobs,
                            p.tool_parser.for_tools(tools.choosable) if tools.active else None,
                            tools.limit, reasoning)
        return await p.run(job, fmt, req.stream, raw)

    async def _render(self, req: ChatCompletionRequest | TokenizeRequest, kwargs: dict[str, Any],
                      tools: list[dict[str, Any]] | None) -> Prompt:
        """The chat prompt: a new turn for the model (add_generation_prompt), or with
        ``continue_final_message`` the conversation cut right after the last message's text,
        which the model then goes on writing."""
        p = self.pipeline
        if not req.continue_final_message:
            return await p.render_chat(req.messages, req.add_generation_prompt, kwargs, tools)
        if req.add_generation_prompt:
            raise invalid("continue_final_message", "continue_final_message: set "
                          "add_generation_prompt to false (the final message is continued, "
                          "no new turn is started)")
        if not req.messages:
            raise invalid("messages", "continue_final_message: there is no final message to "
                          "continue (messages is empty)")
        final = req.messages[-1]
        text = message_dict(final, len(req.messages) - 1)["content"]
        marked = [*req.messages[:-1], final.model_copy(update={"content": _CONTINUE_MARK})]
        rendered = await p.render_chat(marked, False, kwargs, tools)
        # The rendered ids decode back to the template's text, the mark included.
        whole = self.tokenizer.decode(rendered.ids, skip_special_tokens=False)
        cut = whole.rfind(_CONTINUE_MARK)
        if cut == -1:
            raise invalid("continue_final_message", "continue_final_message: the chat "
                          "template does not write the final message's text, so there is "
                          "nothing to continue")
        ids = await p.off_loop(self.tokenizer.encode, whole[:cut] + text, False)
        return await p.tokenize(ids, "messages")

    def reasoning_setup(self, prompt_ids: list[int], include: bool = True,
                        budget: int | None = None, continued: bool = False
                        ) -> ReasoningSetup | None:
        """How a chat answer's thinking is split off, from where its prompt leaves it (a
        continued message's opening tag may be far back: all of it is read)."""
        if self.reasoning is None:
            for name, asked in (("include_reasoning", not include),
                                ("thinking_token_budget", budget is not None)):
                if asked:
                    raise invalid(name, f"{name}: this server knows no reasoning tags (start "
                                  f"it with --reasoning-parser)", "unsupported_parameter")
            return None
        tail = prompt_ids[-(_CONTINUED_TAIL_TOKENS if continued else _PROMPT_TAIL_TOKENS):]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return ReasoningSetup(self.reasoning, self.reasoning.start_mode(text, continued),
                              include)

    def thinking_budget(self, tokens: int, reasoning: ReasoningSetup) -> ThinkingBudget:
        return thinking_budget(self.tokenizer, tokens, reasoning)

    def _chat_tools(self, req: ChatCompletionRequest
                    ) -> tuple[ToolSetup, StructuredOutputs | None]:
        """The request's tools and its one output constraint (its own, else the tools')."""
        offered = checked_tools(req.tools)
        try:
            tools = ToolSetup.from_chat(offered, req.tool_choice, req.parallel_tool_calls)
            return tools, tools.constraint(request_constraint(req), self.pipeline.tool_parser)
        except (ToolsError, ConstraintError) as e:
            raise field_error(e) from None

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """``POST /tokenize``: the ids of a prompt, or of messages as the chat endpoint renders
        them with the same tools and template."""
        p = self.pipeline
        p.resolve_model(req.model)  # the adapters share the base model's tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise invalid("prompt", "give exactly one of prompt and messages", None)
        ids = await (self._chat_ids(req) if req.messages is not None else self._text_ids(req))
        out: dict[str, Any] = {"tokens": ids, "count": len(ids),
                               "max_model_len": p.max_model_len}
        if req.return_token_strs:
            out["token_strs"] = await p.off_loop(self.tokenizer.convert_ids_to_tokens, ids)
        return out

    async def _chat_ids(self, req: TokenizeRequest) -> list[int]:
        if req.add_special_tokens:
            raise invalid("add_special_tokens", "add_special_tokens: a chat prompt's special "
                          "tokens come from its template")
        kwargs = template_kwargs(req.chat_template_kwargs, req.chat_template)
        prompt = await self._render(req, kwargs, checked_tools(req.tools))
        return prompt.ids

    async def _text_ids(self, req: TokenizeRequest) -> list[int]:
        for name in ("tools", "chat_template", "chat_template_kwargs", "continue_final_message"):
            if getattr(req, name) not in (None, False):
                raise invalid(name, f"{name}: only with messages")
        self.pipeline.check_prompt_chars(len(req.prompt), "prompt")
        return await self.pipeline.off_loop(self.tokenizer.encode, req.prompt,
                                            req.add_special_tokens is not False)


def _response_id(req: SamplingFields, raw: Request) -> str:
    """The client's id for its request (``given_id``), else a fresh one."""
    given = given_id(req, raw)
    return uuid.uuid4().hex if given is None else given


def completion_items(prompt: Any) -> list[str | list[int]]:
    """A completions ``prompt`` as its prompts: one text or token-id list, or a batch."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise invalid("prompt", "prompt must not be empty")
    return items


def check_best_of(req: CompletionRequest | ChatCompletionRequest) -> None:
    """``best_of`` samples that many and returns the ``n`` most likely; tokenmill returns
    every choice it samples, so only best_of == n means what it asks."""
    if req.best_of is not None and req.best_of != req.n:
        raise invalid("best_of", f"best_of: only best_of == n is supported (got best_of="
                      f"{req.best_of}, n={req.n}); ask for n choices instead")


def request_constraint(req: CompletionRequest | ChatCompletionRequest
                       ) -> StructuredOutputs | None:
    """The output constraint a chat or completions body asks for itself, if any."""
    try:
        return from_request(
            response_format=honour_strict(req.response_format),
            structured_outputs=req.structured_outputs,
            guided_json=req.guided_json, guided_regex=req.guided_regex,
            guided_choice=req.guided_choice, guided_grammar=req.guided_grammar,
            guided_whitespace_pattern=req.guided_whitespace_pattern)
    except ConstraintError as e:
        raise field_error(e) from None


def template_kwargs(chat_template_kwargs: dict[str, Any] | None,
                    chat_template: str | None) -> dict[str, Any]:
    """The variables a request hands its chat template, and the template it names or sends."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(kwargs.keys() & _RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise invalid("chat_template_kwargs", f"chat_template_kwargs: {reserved} are set by "
                      f"the request itself, not by template variables")
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return kwargs


def checked_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Chat ``tools`` as given, once they are well-formed function tools."""
    if tools is not None:
        try:
            check_tools(tools)
        except ToolsError as e:
            raise field_error(e) from None
    return tools


def thinking_budget(tokenizer: Any, tokens: int, reasoning: ReasoningSetup) -> ThinkingBudget:
    """The engine's side of a thinking budget (``thinking_token_budget``, Anthropic's
    ``budget_tokens``): the tags as token ids, and whether the prompt left the model thinking
    already."""
    parser, start = reasoning.parser, reasoning.start
    return ThinkingBudget(tokens, tuple(tokenizer.encode(parser.start_tag, False)),
                          tuple(tokenizer.encode(parser.end_tag, False)),
                          starts_open=start.mode is Mode.REASONING or
                          (start.mode is Mode.UNDECIDED and start.default_reasoning))
