"""The OpenAI Responses API: ``POST /v1/responses``.

A request's input items (after those of its ``previous_response_id``) become a chat
conversation (``responses_input.py``) that takes the same pipeline as the chat endpoint:
sampling checks, templates, output constraints, tool grammars and queueing; its answer is made
by ``ResponsesFormatter`` (``responses_format.py``).

Responses live in an in-memory LRU store (``STORE_SIZE``) for the server's lifetime, so
``previous_response_id`` can continue them; ``store: false`` keeps one out. The store is
divided by tenant: a response is found only with the API key and ``cache_salt`` it was made
with (to any other it does not exist), so a chosen or guessed id reaches no one else's chain.
Fields asking for what tokenmill cannot do are 400s (``responses_request.py``);
``max_tool_calls`` bounds the function calls kept (0: tools not offered); ``reasoning.effort``
is a thinking budget (``responses_request.EFFORT_BUDGETS``) for a server with a reasoning
parser, whose output then starts with a ``reasoning`` item.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.params import StructuredOutputs
from tokenmill.server.pipeline import RequestPipeline, given_id
from tokenmill.server.protocol import APIError, invalid, printable
from tokenmill.server.reasoning import ReasoningSetup
from tokenmill.server.responses_format import ResponseHead, ResponsesFormatter
from tokenmill.server.responses_input import (chat_messages, input_items, output_constraint,
                                              responses_tools, text_format)
from tokenmill.server.responses_request import (LOGPROBS, ResponsesRequest, bad,
                                                refuse_unsupported, thinking_tokens)
from tokenmill.server.sampling import OutputLimit
from tokenmill.server.serving import thinking_budget
from tokenmill.server.tools.choice import ToolSetup

logger = logging.getLogger("tokenmill.server")

STORE_SIZE = 1024  # responses kept for previous_response_id, least recently used dropped first
# ... and at most this many characters of items over all kept responses, each counted with its
# whole chain (chains share items, so this over-counts: memory stays below it).
STORE_CHARS = 1 << 26


@dataclass
class _OutputSetup:
    tools: ToolSetup
    tools_echo: list[dict[str, Any]]  # the tools as the response object lists them
    text_echo: dict[str, Any]  # the ``text`` field said back
    structured: StructuredOutputs | None
    logprobs: int | None  # top logprobs per token; None: not asked for


class OpenAIResponses:
    """``/v1/responses`` on the request pipeline, with the response store."""

    def __init__(self, pipeline: RequestPipeline | None, store_size: int = STORE_SIZE,
                 store_chars: int = STORE_CHARS,
                 reasoning: Callable[[list[int]], ReasoningSetup | None] | None = None):
        self.pipeline = pipeline
        # a prompt's ids -> how its answer's thinking is split off (None: no reasoning parser)
        self.reasoning = reasoning
        self.store_size = store_size
        self.store_chars = store_chars
        # (namespace, response id) -> (the input and output items of its whole chain in
        # order, their size)
        self._store: OrderedDict[tuple[str, str], tuple[list[dict[str, Any]], int]] = \
            OrderedDict()
        self._chars = 0

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        """Check everything, render the conversation, queue the engine request and answer;
        the response's id is the client's (``given_id``) where it chose one."""
        namespace, given = _namespace(raw, req.cache_salt), given_id(req, raw)
        p = self.pipeline
        model = p.resolve_model(req.model)
        refuse_unsupported(req)
        limit = OutputLimit(req.max_output_tokens, "max_output_tokens")
        p.check_fields(req, 1, limit, req.top_logprobs, "top_logprobs")
        items = input_items(req.input)
        previous = self._previous(namespace, req.previous_response_id)
        messages = chat_messages(previous, items, req.instructions)
        out = self._output(req)
        await p.check_tool_schemas(out.tools.offered, "tools[{}].parameters")
        prompt = await p.render_chat(messages, True, None, out.tools.template_tools(), "input")
        job = await p.prepare(req, [prompt], limit, out.logprobs, out.structured, model,
                              out.tools.active)
        reasoning = self._reasoning(req, prompt.ids)
        if reasoning is not None and (budget := thinking_tokens(req)) is not None:
            job.params = dataclasses.replace(
                job.params, thinking_budget=thinking_budget(p.tokenizer, budget, reasoning))
        # Reasoning items reach no prompt: they are not kept either.
        kept = [i for i in items if not (isinstance(i, dict) and i.get("type") == "reasoning")]
        head = ResponseHead(self._new_id(namespace, given), model.name, req, out.tools_echo,
                            out.text_echo, previous + kept, namespace)
        fmt = ResponsesFormatter(head, p.token_text,
                                 p.tool_parser.for_tools(out.tools.choosable) if out.tools.active
                                 else None, out.tools.limit,
                                 out.logprobs, self._keep, reasoning)
        return await p.run(job, fmt, req.stream, raw)

    def _reasoning(self, req: ResponsesRequest, prompt_ids: list[int]) -> ReasoningSetup | None:
        """How the answer's thinking is split off; an effort asked of a server that knows no
        thinking tags is a 400 ("none" asks for nothing)."""
        setup = self.reasoning(prompt_ids) if self.reasoning is not None else None
        if setup is None and thinking_tokens(req):
            raise invalid("reasoning", "reasoning.effort: this server knows no reasoning "
                          "tags (start it with --reasoning-parser)", "unsupported_parameter")
        return setup

    def _output(self, req: ResponsesRequest) -> _OutputSetup:
        """What the request asks of the output: tools, one constraint, logprobs."""
        tools, tools_echo = responses_tools(req)
        text_spec, text_echo = text_format(req.text)
        structured = output_constraint(req, text_spec, tools, self.pipeline.tool_parser)
        logprobs = (req.top_logprobs or 0) if LOGPROBS in (req.include or ()) else None
        if logprobs is not None and tools.active:
            raise bad("include", f"{LOGPROBS} cannot be combined with tools")
        return _OutputSetup(tools, tools_echo, text_echo, structured, logprobs)

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
            raise bad("request_id", f"a stored response already has the id {given!r}")
        return given

    def _keep(self, head: ResponseHead, body: dict[str, Any]) -> None:
        if head.req.store is False or body["status"] == "failed":
            return
        items = head.history + body["output"]
        size = len(json.dumps(items, ensure_ascii=False))
        if size > self.store_chars // 4:  # would push out most of the store: not kept
            logger.info("response %s not stored: its chain is %d characters", head.rid, size)
            return
        key = (head.namespace, head.rid)
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


def add_responses_routes(app: FastAPI, pipeline: RequestPipeline,
                         reasoning: Callable[[list[int]], ReasoningSetup | None] | None = None
                         ) -> None:
    """``POST /v1/responses`` (``reasoning``: the chat serving's ``reasoning_setup``)."""
    responses = OpenAIResponses(pipeline, reasoning=reasoning)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        return await responses.create(req, raw)
