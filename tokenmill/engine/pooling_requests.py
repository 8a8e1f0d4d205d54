"""Pooling requests on the engine: what the model serves, its pooling defaults, and a request
for an embedding (or a cross-encoder's score) built from a prompt.

The task: ``--task`` (``rerank`` is ``score``), else a sentence-transformers directory's
modules make the model an embedding model, else its config says (BERT: ``embed``, a BERT
sequence classifier: ``score``, decoders: ``generate``). A decoder engine takes generate and
embed requests whatever its task (the server answers the kind it does not serve with a 400, by
``LLMEngine.task``), so both share its continuous batching; an encoder takes pooling requests
only. A pooling request is a ``Request`` with ``pooling_params`` (resolved against the model's
defaults) and ``max_tokens`` 1, which bounds what the scheduler reserves: the prompt's KV.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.params import ParamError, PoolingParams, SamplingParams
from tokenmill.request import (PoolingOutput, PromptError, Request, RequestOutput,
                               check_whole_prompt)

if TYPE_CHECKING:
    from tokenmill.engine.plan import ExecutionPlan
    from tokenmill.model.pooling import ModelPooling
    from tokenmill.tokenizer import Tokenizer

# text, token ids, or a (text, text) pair for a cross-encoder
PoolingPrompt = str | Sequence[int] | tuple[str, str]
TASKS = ("generate", "embed", "score")
TASK_ALIASES = {"rerank": "score"}


@dataclass(frozen=True)
class PoolingSetup:
    """What the engine's model serves (``task``), its pooling ``defaults``, its shape, and
    what bounds a pooling request: an encoder reads a prompt whole within the step's budget;
    pooling runs in one process (its vectors do not travel from parallel ranks yet)."""

    task: str = "generate"
    defaults: PoolingParams = field(default_factory=lambda: PoolingParams("embed", "last", True))
    config: ModelConfig | None = None  # None: an engine assembled by hand (tests)
    max_batched_tokens: int = 2048
    distributed: bool = False
    max_prompt_tokens: int | None = None  # a sentence-transformers model's max_seq_length
    # the sizes ``dimensions`` may take: () any, None none (not a Matryoshka model)
    matryoshka: tuple[int, ...] | None = ()

    @classmethod
    def for_plan(cls, plan: ExecutionPlan, task_option: str | None) -> PoolingSetup:
        cfg = plan.model_config
        task = TASK_ALIASES.get(task_option, task_option)
        model = _model_pooling(plan.model, cfg, task)
        task = task or model.task
        if task not in TASKS:
            raise ValueError(f"unknown task {task_option!r}; use generate, embed or score")
        if task == "generate" and not cfg.causal:
            raise ValueError(f"{cfg.architecture} is an encoder: it serves embed or score, "
                             "not generate (--task)")
        if task == "score" and cfg.task != "score":
            raise ValueError("--task score needs a cross-encoder (a sequence classifier such as "
                             "BertForSequenceClassification); this model embeds (--task embed)")
        return cls(task, PoolingParams("embed", model.pooling, model.normalize), cfg,
                   plan.max_batched_tokens, plan.parallel.distributed, model.max_tokens,
                   model.matryoshka)

    @property
    def causal(self) -> bool:
        return self.config is None or self.config.causal

    def check_generate(self) -> None:
        """A generate request is refused by an encoder, which has no tokens to sample."""
        if not self.causal:
            raise ValueError(f"this model ({self.config.architecture}) is an encoder: it "
                             "embeds or scores text, it does not generate")

    def request(self, request_id: str, prompt: PoolingPrompt, params: PoolingParams | None,
                tokenizer: Tokenizer, check_prompt: Callable[[Sequence[int]], None],
                **fields: Any) -> tuple[Request, str | None]:
        """The scheduler's request for ``prompt`` (and its text, when text was given); a
        ``ValueError`` naming the field for what this model cannot do."""
        if fields.pop("lora_request", None) is not None:
            raise ValueError("LoRA adapters apply to generation; a pooling request runs on the "
                             "base model")
        pair = isinstance(prompt, tuple) and len(prompt) == 2 and \
            all(isinstance(p, str) for p in prompt)
        params = self.resolve(params, pair)
        types = None
        if pair:
            ids, types = tokenizer.encode_pair(*prompt)
        else:
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        check_prompt(ids)
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise PromptError(f"this model embeds at most {self.max_prompt_tokens} tokens (its "
                              f"max_seq_length); your prompt has {len(ids)} tokens",
                              code="context_length_exceeded")
        if not self.causal:
            check_whole_prompt(ids, self.max_batched_tokens)
        request = Request(request_id, ids, SamplingParams(max_tokens=1), pooling_params=params,
                          token_type_ids=types, bidirectional=not self.causal,
                          **{k: v for k, v in fields.items() if v is not None})
        return request, prompt if isinstance(prompt, str) else None

    def resolve(self, params: PoolingParams | None, pair: bool = False) -> PoolingParams:
        """``params`` (None: the model's task's) with the model's defaults filled in."""
        cross_encoder = self.config is not None and self.config.task == "score"
        if params is None:
            params = PoolingParams(task="score" if cross_encoder else "embed")
        if self.distributed:
            raise ValueError("embeddings and scores run in one process for now, not with "
                             "tensor / pipeline parallel ranks")
        if params.task == "score" and not cross_encoder:
            raise ParamError("task", "this model has no classifier to score pairs with: "
                             "compare the embeddings of the two texts instead")
        if pair and params.task != "score":
            raise ParamError("prompt", "a (text, text) pair is scored by a cross-encoder "
                             "(task score); embed each text on its own")
        if params.dimensions is not None:
            self._check_dimensions(params.dimensions)
        return params.resolved(self.defaults)

    def _check_dimensions(self, dimensions: int) -> None:
        """Truncation only where the model was trained for it (vLLM refuses it likewise)."""
        size = self.config.hidden_size if self.config is not None else None
        if size is not None and dimensions > size:
            raise ParamError("dimensions", f"dimensions {dimensions} exceeds the model's "
                             f"embedding size {size}")
        if self.matryoshka is None:
            raise ParamError("dimensions", "this model was not trained for Matryoshka "
                             "truncation (its config.json sets neither is_matryoshka nor "
                             "matryoshka_dimensions), so it keeps all its dimensions")
        if self.matryoshka and dimensions not in self.matryoshka:
            raise ParamError("dimensions", f"this model keeps {list(self.matryoshka)} "
                             f"dimensions, not {dimensions}")


def serving_task(model: str, task_option: str | None) -> str:
    """The task ``model`` serves under ``--task task_option``, from its files' metadata alone
    (no weights, no device): what ``PoolingSetup.for_plan`` will find, before a load."""
    from tokenmill.model.config_reader import read_model_config

    task = TASK_ALIASES.get(task_option, task_option)
    if task:
        return task
    source, cfg = read_model_config(model)
    return _model_pooling(str(source.path), cfg, None).task


def _model_pooling(model: str, cfg: ModelConfig, task: str | None) -> ModelPooling:
    """The model's defaults; a sentence-transformers set-up tokenmill cannot pool is an error
    only where the model is to pool (not under ``--task generate``)."""
    from tokenmill.model.pooling import ModelPooling, model_pooling  # torch: only with a model

    try:
        return model_pooling(model, cfg)
    except ModelLoadError:
        if task != "generate":
            raise
        return ModelPooling("generate", "last", True, "unread: --task generate")


def attach_pooled(outputs: list[RequestOutput], pooled: Mapping[str, Any] | None) -> None:
    """Each finished pooling request's output gets its vector (``RequestOutput.pooled``)."""
    if not pooled:
        return
    for output in outputs:
        vector = pooled.get(output.request_id)
        if vector is not None:
            output.pooled = PoolingOutput(output.request_id, vector,
                                          len(output.prompt_token_ids))
