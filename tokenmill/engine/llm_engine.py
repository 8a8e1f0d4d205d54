"""LLMEngine: the step loop. One step = schedule -> forward + sample -> update -> outputs.

The engine owns what needs text: detokenization, stop strings, logprobs bookkeeping. The
scheduler owns which tokens run and the KV blocks; the runner owns tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tokenmill.config import EngineConfig
from tokenmill.engine.output_state import RequestState
from tokenmill.params import SamplingParams
from tokenmill.request import FinishReason, Request, RequestOutput
from tokenmill.sched.output import SchedulerOutput, SeqUpdate

logger = logging.getLogger("tokenmill.engine")


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
    num_generated_tokens: int = 0
    forward_seconds: float = 0.0  # model forward + sampling
    step_seconds: float = 0.0  # whole step, scheduler and detokenization included
    iteration_tokens: list[int] = field(default_factory=list, repr=False)


class LLMEngine:
    """Synchronous engine: ``add_request`` any time, call ``step`` until nothing is left."""

    def __init__(self, config: EngineConfig):
        import torch

        from tokenmill.model.loader import load_model
        from tokenmill.runner.kv_cache import num_kv_blocks
        from tokenmill.runner.model_runner import ModelRunner
        from tokenmill.sched.scheduler import Scheduler
        from tokenmill.tokenizer import load_tokenizer

        dtype = config.dtype or ("bfloat16" if config.device.startswith("cuda") else "float32")
        torch.manual_seed(config.seed)
        self.config = config
        self.loaded = load_model(config.model, config.device, dtype)
        self.model_config = self.loaded.config
        self.tokenizer = load_tokenizer(config.model)
        cache = config.cache
        self.num_blocks = num_kv_blocks(self.model_config, cache.block_size, getattr(torch, dtype),
                                        config.device, cache.kv_cache_memory, cache.num_blocks)
        self.runner = ModelRunner(self.loaded, self.num_blocks, cache.block_size, config.device)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.model_config.eos_token_ids)
        max_len = min(config.scheduler.max_model_len or self.model_config.max_position_embeddings,
                      self.model_config.max_position_embeddings)
        self.scheduler_config = replace(config.scheduler, max_model_len=max_len)
        self.scheduler = Scheduler(self.scheduler_config, cache, num_blocks=self.num_blocks,
                                   eos_token_ids=self.eos_token_ids)
        self.max_model_len = max_len
        self.stats = EngineStats()
        self._requests: dict[str, RequestState] = {}

    @property
    def kv_cache_tokens(self) -> int:
        return (self.num_blocks - 1) * self.config.cache.block_size  # block 0 is padding

    # ----- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queue a request. Raises ValueError (nothing queued) for a bad prompt or one that can
        never fit the context or the KV cache. Requests with different ``cache_salt`` never
        share prefix-cache entries."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        request = Request(request_id, ids, params, priority=priority, cache_salt=cache_salt,
                          **({} if arrival_time is None else {"arrival_time": arrival_time}))
        sequences = self.scheduler.add_request(request)
        self._requests[request_id] = RequestState(request_id, text, ids, params, sequences,
                                                  self.tokenizer)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError("prompt is empty")
            return prompt, ids
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return None, ids

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; its KV blocks are freed at once."""
        state = self._requests.pop(request_id, None)
        return self.scheduler.abort_request(request_id) if state else False

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix; returns the blocks dropped. Refused (RuntimeError) while
        requests are unfinished, whose cached prefixes are in use."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot flush the prefix cache while requests are running")
        return self.scheduler.flush_prefix_cache()

    # ----- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that changed."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self.runner.forget(out.finished_ids)
        sampled, logprobs = self._run(out) if out.scheduled else ({}, {})
        updates = self.scheduler.update_from_output(out, sampled)
        outputs = self._process(updates, logprobs)
        self.stats.num_steps += 1
        self.stats.step_seconds += time.perf_counter() - start
        return outputs

    def _run(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, object]]:
        start = time.perf_counter()
        try:
            result = self.runner.execute(out.scheduled, self.eos_token_ids)
        except Exception:
            # Leave no sequence half-run: the step's requests are aborted, the engine lives on.
            logger.exception("model step failed; aborting the %d requests in it",
                             len(out.scheduled))
            for chunk in out.scheduled:
                self.scheduler.abort_request(chunk.request.group_id)
            self.scheduler.update_from_output(out, {})
            raise
        self.stats.forward_seconds += time.perf_counter() - start
        self._count_tokens(out)
        sampling = [c.request_id for c in out.scheduled if c.sample]
        return dict(zip(sampling, result.token_ids)), dict(zip(sampling, result.logprobs))

    def _count_tokens(self, out: SchedulerOutput) -> None:
        prompt = sum(min(c.num_tokens, max(0, c.request.num_prompt_tokens - c.start_pos))
                     for c in out.scheduled)
        self.stats.num_prompt_tokens_computed += prompt
        self.stats.iteration_tokens.append(out.num_batched_tokens)

    def _process(self, updates: list[SeqUpdate], logprobs: dict[str, object]) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        for update in updates:
            state = self._requests.get(update.request.group_id)
            if state is None:
                continue
            self.stats.num_generated_tokens += len(update.new_token_ids)
            stop = state.on_tokens(update.request, update.new_token_ids,
                                   logprobs.get(update.request.request_id))
            if stop is not None:
                self.scheduler.finish_request(update.request.request_id, FinishReason.STOP, stop)
            touched[state.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            output = state.output()
            output.num_cached_tokens = state.sequences[0].num_cached_tokens or 0
            if output.finished:
                del self._requests[request_id]
            outputs.append(output)
        return outputs
