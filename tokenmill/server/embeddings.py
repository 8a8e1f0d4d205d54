"""Embedding and scoring endpoints: ``/v1/embeddings`` (OpenAI's shape), ``/v1/rerank`` with
its aliases ``/rerank`` and ``/v2/rerank`` (Cohere's and Jina's shape) and ``/score`` with
``/v1/score`` (vLLM's shape).

Each input of one HTTP call becomes one engine request (``AsyncEngine.encode``), all submitted
at once so the scheduler batches them under the same token budget as generation. What a model
serves is its engine's ``task``: an embedding model ("embed") answers all three (a pair's score
is the cosine of the two embeddings), a cross-encoder ("score") scores each (query, document)
pair in one forward and makes no embeddings, and a generation model answers none of them.
A refusal is a 400 in OpenAI's error shape naming the field; what the server can judge (fields,
counts, lengths) is refused before anything is queued, and what only the engine can (an
encoder's step budget) cancels the call's other requests.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from tokenmill.engine.async_engine import (AsyncEngine, EngineOverloadedError,
                                           EngineUnavailableError, RequestFailedError)
from tokenmill.params import PoolingParams
from tokenmill.request import PoolingOutput
from tokenmill.server.models import ModelChoice
from tokenmill.server.pipeline import RequestPipeline, request_id_header
from tokenmill.server.protocol import (APIError, FieldError, check_json_values,
                                       check_request_id, invalid, printable)
from tokenmill.server.streams import engine_error

if TYPE_CHECKING:  # torch: only where a pooling model runs in this process
    import torch

# Inputs one request may hold (OpenAI's bound for /v1/embeddings): each is an engine request.
MAX_INPUTS = 2048
_WRONG_TASK = "wrong_model_task"

# ----- request bodies ---------------------------------------------------------------------------


class _PoolingRequest(BaseModel):
    """Fields no API defines are ignored; those of vLLM's API that tokenmill does not implement
    (``refused``, with the values that ask for nothing) are a 400 naming them."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    refused: ClassVar[dict[str, tuple]] = {
        "truncate_prompt_tokens": (None,), "mm_processor_kwargs": (None,),
        "priority": (None, 0), "messages": (None,), "chat_template": (None,)}

    model: str | None = None
    user: str | None = None  # an end user's id for the operator (OpenAI): computes nothing
    request_id: str | None = None  # vLLM's: the response's id (X-Request-Id, where sent, wins)

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        check_json_values(data)
        if isinstance(data, dict):
            for name, harmless in cls.refused.items():
                if name in data and data[name] not in harmless:
                    raise FieldError(name, f"{name}: not supported by tokenmill (got "
                                     f"{printable(str(data[name])[:100])})")
        return data

    @field_validator("request_id")
    @classmethod
    def _plain_request_id(cls, value: str | None) -> str | None:
        return None if value is None else check_request_id(value, "request_id")


class EmbeddingRequest(_PoolingRequest):
    """``POST /v1/embeddings``: OpenAI's body plus vLLM's ``add_special_tokens``,
    ``normalize``, ``embed_dtype`` (float32 only) and ``endianness``."""

    refused: ClassVar[dict[str, tuple]] = {**_PoolingRequest.refused,
                                           "embed_dtype": (None, "float32")}

    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: the model's own (true for embedding models)
    endianness: Literal["native", "little", "big"] = "native"  # of base64's float32 bytes


class _ScoringRequest(_PoolingRequest):
    """What rerank and score share: vLLM's ``use_activation`` (and its older names
    ``activation`` and ``softmax``): a cross-encoder's logit through its sigmoid (the default)
    or as it is."""

    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    @property
    def activate(self) -> bool:
        given = (self.use_activation, self.activation, self.softmax)
        return next((v for v in given if v is not None), True)


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str


class RerankRequest(_ScoringRequest):
    """``POST /v1/rerank``: Cohere's and Jina's body. ``top_n`` None or 0: every document;
    ``return_documents`` (default true, as vLLM always does): each result carries its text."""

    refused: ClassVar[dict[str, tuple]] = {**_PoolingRequest.refused,
                                           "max_tokens_per_doc": (None,), "rank_fields": (None,)}

    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True


class ScoreRequest(_ScoringRequest):
    """``POST /score``: vLLM's body. ``text_1`` one text (scored against each of ``text_2``)
    or as many as ``text_2`` (scored pairwise)."""

    text_1: str | list[str]
    text_2: str | list[str]


# ----- the endpoints ----------------------------------------------------------------------------

class PoolingServing:
    """The embedding, rerank and score endpoints on the request pipeline's engine."""

    def __init__(self, pipeline: RequestPipeline):
        self.pipeline = pipeline
        self.engine: AsyncEngine = pipeline.engine

    @property
    def task(self) -> str:
        """What the model serves: "generate", "embed" or "score"."""
        return self.engine.engine.task

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> JSONResponse:
        model = self._resolve(req.model, ("embed",), "embeddings")
        rid = self._response_id("embd", req, raw)
        items = embedding_items(req.input)
        params = PoolingParams(task="embed", normalize=req.normalize,
                               dimensions=self._dimensions(req.dimensions))
        prompts = [await self._tokenize(item, "input", req.add_special_tokens)
                   for item in items]
        outputs = await self._encode_all(rid, prompts, params, raw, "input")
        data = [{"object": "embedding", "index": i,
                 "embedding": format_vector(o.data, req.encoding_format, req.endianness)}
                for i, o in enumerate(outputs)]
        tokens = sum(o.num_prompt_tokens for o in outputs)
        return JSONResponse({"id": rid, "object": "list", "created": int(time.time()),
                             "model": model.name, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def rerank(self, req: RerankRequest, raw: Request) -> JSONResponse:
        model = self._resolve(req.model, ("score", "embed"), "reranking")
        rid = self._response_id("rerank", req, raw)
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        if req.top_n is not None and req.top_n < 0:
            raise invalid("top_n", f"top_n: must be >= 0 (0: every document), got {req.top_n}")
        scores, tokens = await self._score(rid, [req.query], docs, ("query", "documents"),
                                           req.activate, raw)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])  # stable: ties keep order
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})}
                   for i in order[:req.top_n or None]]
        return JSONResponse({"id": rid, "model": model.name, "usage": {"total_tokens": tokens},
                             "results": results})

    async def score(self, req: ScoreRequest, raw: Request) -> JSONResponse:
        model = self._resolve(req.model, ("score", "embed"), "scoring")
        rid = self._response_id("score", req, raw)
        texts_1 = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        texts_2 = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        scores, tokens = await self._score(rid, texts_1, texts_2, ("text_1", "text_2"),
                                           req.activate, raw)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse({"id": rid, "object": "list", "created": int(time.time()),
                             "model": model.name, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    # ----- checks -------------------------------------------------------------------------------

    def _resolve(self, name: str | None, tasks: tuple[str, ...], what: str) -> ModelChoice:
        """The base model, if its task is one of ``tasks`` (400 otherwise; an adapter too:
        adapters serve generation only)."""
        model = self.pipeline.resolve_model(name)
        if self.task not in tasks:
            raise invalid("model", f"model: {wrong_task(self.task, what)}", _WRONG_TASK)
        if model.lora is not None:
            raise invalid("model", f"model: `{printable(model.name)}` is a LoRA adapter; "
                          f"adapters serve text generation only", _WRONG_TASK)
        return model

    def _dimensions(self, dimensions: int | None) -> int | None:
        size = embedding_size(self.engine)
        if dimensions is not None and not 1 <= dimensions <= (size or dimensions):
            raise invalid("dimensions", f"dimensions: this model's embeddings have {size} "
                          f"dimensions; it can keep 1 to {size} of them, not {dimensions}")
        return dimensions

    def _response_id(self, prefix: str, req: _PoolingRequest, raw: Request) -> str:
        given = request_id_header(raw) or req.request_id
        return f"{prefix}-{given or uuid.uuid4().hex}"

    async def _tokenize(self, item: str | list[int], param: str,
                        add_special_tokens: bool = True) -> list[int]:
        return (await self.pipeline.tokenize(item, param, add_special_tokens)).ids

    # ----- scoring ------------------------------------------------------------------------------

    async def _score(self, rid: str, texts_1: list[str], texts_2: list[str],
                     params: tuple[str, str], activate: bool,
                     raw: Request) -> tuple[list[float], int]:
        """A score per pair (as ``score_pairs`` pairs the texts; ``params`` names their two
        fields) and the prompt tokens read for them."""
        pairs = score_pairs(texts_1, texts_2, params)
        if self.task == "score":
            return await self._cross_encode(rid, pairs, params[1], activate, raw)
        return await self._cosines(rid, texts_1, texts_2, params, raw)

    async def _cross_encode(self, rid: str, pairs: list[tuple[str, str]], param: str,
                            activate: bool, raw: Request) -> tuple[list[float], int]:
        """Each (query, document) pair in one forward of the cross-encoder."""
        for a, b in pairs:
            self.pipeline.check_prompt_chars(len(a) + len(b), param)
        outputs = await self._encode_all(rid, pairs, PoolingParams(task="score"), raw, param)
        scores = [relevance(o.data, activate) for o in outputs]
        return scores, sum(o.num_prompt_tokens for o in outputs)

    async def _cosines(self, rid: str, texts_1: list[str], texts_2: list[str],
                       params: tuple[str, str], raw: Request) -> tuple[list[float], int]:
        """Each pair's cosine similarity; every text is embedded once."""
        prompts = [await self._tokenize(t, params[0]) for t in texts_1] + \
            [await self._tokenize(t, params[1]) for t in texts_2]
        outputs = await self._encode_all(rid, prompts, PoolingParams(task="embed"), raw,
                                         params[1])
        import torch

        first = torch.stack([o.data for o in outputs[:len(texts_1)]])  # (len(texts_1), dim)
        second = torch.stack([o.data for o in outputs[len(texts_1):]])  # (len(texts_2), dim)
        if len(texts_1) != len(texts_2):  # one text against each of the others
            first = first.expand(len(texts_2), -1)
        cosines = torch.nn.functional.cosine_similarity(first.float(), second.float(), dim=-1)
        # rounding puts a text's cosine with itself a hair above 1
        return cosines.clamp(-1.0, 1.0).tolist(), sum(o.num_prompt_tokens for o in outputs)

    # ----- the engine ---------------------------------------------------------------------------

    async def _encode_all(self, rid: str, prompts: Sequence[list[int] | tuple[str, str]],
                          params: PoolingParams, raw: Request,
                          param: str) -> list[PoolingOutput]:
        """Every prompt's output, all submitted at once so they batch; a client that leaves,
        or one refusal or failure, cancels the rest. The engine's request ids extend ``rid``
        (which a client may choose and repeat) with a part of their own."""
        own = uuid.uuid4().hex[:12]
        tasks = [asyncio.ensure_future(self.engine.encode(f"{rid}-{own}-{i}", prompt, params))
                 for i, prompt in enumerate(prompts)]
        try:
            while True:
                await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
                failed = next((t for t in tasks if t.done() and t.exception()), None)
                if failed is not None:
                    raise self._refusal(failed.exception(), param)
                if all(t.done() for t in tasks):
                    return [t.result() for t in tasks]
                if await raw.is_disconnected():
                    raise APIError(499, "the client disconnected", code="client_disconnected")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _refusal(self, e: BaseException, param: str) -> BaseException:
        """What a failed ``encode`` is said as (anything unexpected as it is)."""
        if isinstance(e, EngineOverloadedError):
            self.pipeline.metrics.rejections.labels(self.pipeline.model_name).inc()
            return APIError(503, str(e), "overloaded_error", None, "overloaded",
                            {"Retry-After": str(e.retry_after)})
        if isinstance(e, (EngineUnavailableError, RequestFailedError)):
            return engine_error(e)
        if isinstance(e, ValueError):  # the engine calls a prompt "prompt": here it is ``param``
            named = getattr(e, "param", None)
            return invalid(param if named in (None, "prompt") else named, str(e),
                           getattr(e, "code", None) or "invalid_value")
        return e


# ----- pieces -----------------------------------------------------------------------------------

def embedding_size(engine: AsyncEngine) -> int | None:
    """How many dimensions the model's embeddings have (None: not known, a test's engine)."""
    config = engine.engine.model_config
    return None if config is None else config.hidden_size


def wrong_task(task: str, what: str) -> str:
    """Why a model serving ``task`` cannot do ``what``, and what it can do instead."""
    if task == "generate":
        return (f"this server runs its model for text generation, which serves no {what} "
                f"(an embedding model, or this one with `tokenmill serve --task embed`, does)")
    if task == "score":
        return (f"this server runs a cross-encoder (task score): it scores text pairs "
                f"(/v1/rerank, /score) and serves no {what}")
    return (f"this server runs an embedding model (task {task}): it serves /v1/embeddings, "
            f"/v1/rerank and /score, not {what}")


def check_count(n: int, param: str) -> None:
    if n == 0:
        raise invalid(param, f"{param}: must not be empty")
    if n > MAX_INPUTS:
        raise invalid(param, f"{param}: {n} inputs is more than one request may hold "
                      f"({MAX_INPUTS})")


def embedding_items(value: str | list[str] | list[int] | list[list[int]]
                    ) -> list[str | list[int]]:
    """The prompts of an embeddings ``input``: texts or token-id lists, none empty."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        items: list[str | list[int]] = [value]  # one text, or one prompt of token ids
    else:
        items = list(value)
    check_count(len(items), "input")
    for i, item in enumerate(items):
        if len(item) == 0:
            where = "input" if len(items) == 1 else f"input[{i}]"
            raise invalid("input", f"{where}: must not be empty")
    return items


def score_pairs(texts_1: list[str], texts_2: list[str],
                params: tuple[str, str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one first text with each second text, or two lists of one length
    pairwise."""
    check_count(len(texts_1), params[0])
    check_count(len(texts_2), params[1])
    if len(texts_1) == 1:
        return [(texts_1[0], t) for t in texts_2]
    if len(texts_1) != len(texts_2):
        raise invalid(params[1], f"{params[0]} holds {len(texts_1)} texts and {params[1]} "
                      f"{len(texts_2)}: give one {params[0]}, or as many as {params[1]}")
    return list(zip(texts_1, texts_2))


def relevance(logits: torch.Tensor, activate: bool) -> float:
    """A cross-encoder's score: its one logit, through the sigmoid when ``activate``."""
    if logits.numel() != 1:
        raise APIError(400, f"this model gives {logits.numel()} scores per pair; scoring "
                       f"needs one (a single-label cross-encoder)", param="model",
                       code=_WRONG_TASK)
    logit = logits.float().reshape(())
    return float(logit.sigmoid() if activate else logit)


def format_vector(vector: torch.Tensor, encoding_format: str, endianness: str) -> list[float] | str:
    """An embedding as JSON numbers, or as base64 of its float32 bytes (what OpenAI's client
    decodes: little-endian, unless the request asked otherwise)."""
    values = vector.detach().float().cpu().numpy()
    if encoding_format == "float":
        return values.tolist()
    order = sys.byteorder if endianness == "native" else endianness
    data = values.astype("<f4" if order == "little" else ">f4").tobytes()
    return base64.b64encode(data).decode("ascii")


def add_pooling_routes(app: FastAPI, pipeline: RequestPipeline) -> None:
    """``/v1/embeddings``, ``/v1/rerank`` (and ``/rerank``, ``/v2/rerank``), ``/v1/score``
    (and ``/score``). The aliases answer as their ``/v1`` route does and stay out of the
    OpenAPI document, which would only repeat it."""
    serving = PoolingServing(pipeline)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request):
        return await serving.embeddings(req, raw)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        @app.post(path, include_in_schema=path == "/v1/rerank")
        async def rerank(req: RerankRequest, raw: Request):
            return await serving.rerank(req, raw)

    for path in ("/v1/score", "/score"):
        @app.post(path, include_in_schema=path == "/v1/score")
        async def score(req: ScoreRequest, raw: Request):
            return await serving.score(req, raw)
