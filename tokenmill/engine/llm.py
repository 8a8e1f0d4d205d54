"""The offline API: ``LLM(model).generate(prompts, params)`` and ``LLM(model).chat(messages)``;
LoRA adapters with ``LLM(model, enable_lora=True)``, ``add_lora`` and ``generate(...,
lora_request=)``; embeddings and scores with ``embed``, ``score`` and ``encode``."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.params import PoolingParams, SamplingParams
from tokenmill.request import EmbeddingOutput, LoRARequest, PoolingOutput, RequestOutput

Prompt = str | Sequence[int]
PoolingPrompt = str | Sequence[int] | tuple[str, str]  # a (text, text) pair: a cross-encoder's
Message = Mapping[str, Any]
# the adapter of every prompt, or one per prompt: a LoRARequest or a registered name; None: the
# base model
LoRAArg = LoRARequest | str | Sequence[LoRARequest | str | None] | None


class LLM:
    """Batch generation on one engine; all prompts of a call run together, continuously batched.

    Keyword options are ``EngineConfig.from_options``'s (defaults in ``tokenmill/config.py``):
    ``device``, ``dtype``, ``seed`` (sampling seed of requests without one), ``block_size``,
    ``num_blocks``, ``kv_cache_memory`` (bytes), ``watermark``, ``enable_prefix_caching``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``policy`` (``fcfs``,
    ``priority``, ``lpm``), ``enable_lora``, ``max_loras``, ``max_cpu_loras``,
    ``max_lora_rank``. Or pass a built ``engine`` (an ``LLMEngine``) instead.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, engine=None, **options: Any):
        from tokenmill.engine.llm_engine import LLMEngine

        if engine is not None and options:
            raise TypeError(f"give engine options or an engine, not both: {sorted(options)}")
        self.engine = engine or LLMEngine.from_config(EngineConfig.from_options(model, **options))
        # the ~190k objects loading leaves live for good: out of the collector's full passes,
        # which otherwise cost a step at 1,024 sequences ~8 ms on average
        gc.freeze()
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Load the PEFT adapter at ``path`` as ``name``; ``LoRAError`` for one that does not
        fit the model (the message says what)."""
        return self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None, lora_request: LoRAArg = None,
                 lora: LoRAArg = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in the order of the prompts.
        ``lora_request`` (or ``lora``, the same): the adapter of every prompt or one per prompt,
        a ``LoRARequest`` or an adapter's name; a ``LoRARequest`` not loaded yet is loaded
        from its ``lora_path`` first."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        loras = self._loras(lora_request, lora, len(prompts))
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                                        cache_salt=cache_salt, lora_request=loras[i])
            finished = self._run(len(prompts), use_tqdm)
        except BaseException:
            for rid in ids:  # leave the engine clean for the next call
                self.engine.abort_request(rid)
            raise
        return [finished[rid] for rid in ids]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Chat completions: each conversation rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [self.chat_prompt_ids(c, add_generation_prompt, **(chat_template_kwargs or {}))
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def chat_prompt_ids(self, conversation: Sequence[Message], add_generation_prompt: bool = True,
                        **kwargs: Any) -> list[int]:
        return self.tokenizer.encode_chat(conversation, add_generation_prompt, **kwargs)

    def encode(self, prompts: PoolingPrompt | Sequence[PoolingPrompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True) -> list[PoolingOutput]:
        """The pooled vector of every prompt, in order: an embedding, or for a (text, text)
        pair a cross-encoder's logits. A single pair is one prompt; give a list for several.
        ``pooling_params`` None: the model's task with its defaults."""
        return [out.pooled for out in self._pool(prompts, pooling_params, use_tqdm)]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """The embedding of every prompt (text or token ids), in order; unset fields of
        ``pooling_params`` take the model's pooling and normalisation."""
        outs = self._pool(prompts, pooling_params or PoolingParams(task="embed"), use_tqdm)
        return [EmbeddingOutput(o.request_id, o.pooled.data.tolist(), o.prompt_token_ids)
                for o in outs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[float]:
        """A relevance score per pair: one ``text_1`` against each ``text_2``, or two lists of
        one length pairwise. A cross-encoder's is the sigmoid of its logit; an embedding
        model's the cosine of the two texts' embeddings."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ValueError(f"score takes one text_1 or as many as text_2 ({len(seconds)}), "
                             f"got {len(firsts)}")
        if self.engine.task == "score":
            logits = self.encode(list(zip(firsts, seconds)), use_tqdm=use_tqdm)
            return [float(o.data[0].sigmoid()) for o in logits]
        vectors = [o.data for o in self.encode(
            [*firsts, *seconds], PoolingParams(task="embed", normalize=True), use_tqdm)]
        pairs = zip(vectors[:len(firsts)], vectors[len(firsts):])
        return [float((a * b).sum()) for a, b in pairs]

    def _pool(self, prompts: PoolingPrompt | Sequence[PoolingPrompt],
              params: PoolingParams | Sequence[PoolingParams] | None,
              use_tqdm: bool) -> list[RequestOutput]:
        if isinstance(prompts, tuple) and len(prompts) == 2 and \
                all(isinstance(p, str) for p in prompts):
            prompts = [prompts]
        prompts = _as_prompt_list(prompts)
        per = [params] * len(prompts) if not isinstance(params, Sequence) else list(params)
        if len(per) != len(prompts):
            raise ValueError(f"got {len(per)} pooling params for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, per):
                self.engine.add_request(rid, prompt, p or PoolingParams(task=self._pool_task))
            finished = self._run(len(prompts), use_tqdm)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [finished[rid] for rid in ids]

    @property
    def _pool_task(self) -> str:
        return "score" if self.engine.task == "score" else "embed"

    def _loras(self, lora_request: LoRAArg, lora: LoRAArg,
               n: int) -> list[LoRARequest | str | None]:
        """Each prompt's adapter; a ``LoRARequest`` whose name is not loaded is loaded (vLLM's
        offline habit: the request brings its adapter's path)."""
        if lora_request is not None and lora is not None:
            raise TypeError("give lora_request or lora (the same), not both")
        given = lora_request if lora_request is not None else lora
        if given is None or isinstance(given, LoRARequest | str):
            loras = [given] * n
        elif len(given) != n:
            raise ValueError(f"got {len(given)} LoRA adapters for {n} prompts")
        else:
            loras = list(given)
        loaded = {r.lora_name for r in self.engine.list_loras()}
        for item in dict.fromkeys(x for x in loras if isinstance(x, LoRARequest)):
            if item.lora_name not in loaded:
                self.add_lora(item.lora_name, item.lora_path)
                loaded.add(item.lora_name)
        return loras

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                failures = self.engine.take_failures()
                if failures:
                    request_id, why = next(iter(failures.items()))
                    raise RuntimeError(f"request {request_id} failed: {why}")
        return finished


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
