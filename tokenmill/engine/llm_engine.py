"""LLMEngine: the step loop. One step = propose -> schedule -> forward + sample -> update ->
outputs; with ``async_scheduling`` the outputs are built while the next step runs
(``engine/overlap.py``).

The engine is built from parts: a ``Scheduler`` (which tokens run, the KV blocks), an
``Executor`` (runs each ``SchedulerOutput`` on the model's workers; ``executor/``), a
``Tokenizer`` and, optionally, a draft proposer
(``speculative.SpeculativeDecoder``, or anything with ``propose``). ``LLMEngine.from_config`` builds
the real ones from an ``EngineConfig`` by its load-time plan (``engine/plan.py``,
``engine/build.py``); tests build it with a fake executor and no torch at all.
The engine owns what needs text: detokenization, stop strings, logprobs bookkeeping.
``AsyncEngine`` and the server use only the public surface below (add, abort, step, stats,
info, tokenizer, check_prompt, the LoRA adapters: ``engine/loras.py``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenmill.engine.info import EngineInfo, EngineStats, StepInfo
from tokenmill.engine.loras import LoRALike, LoRARegistry
from tokenmill.engine.output_state import RequestState, take_prompt_logprobs
from tokenmill.engine.overlap import InFlight, OverlappedSteps
from tokenmill.engine.pooling_requests import PoolingPrompt, PoolingSetup, attach_pooled
from tokenmill.engine.proposer import DraftProposer
from tokenmill.engine.step_state import (MAX_BLAMELESS_FAILURES, BlamelessFailures,  # noqa: F401
                                         EngineDeadError, StepState, touched_requests,
                                         undelivered_kv)
from tokenmill.errors import LoRALoadError
from tokenmill.executor.base import ExecutorError
from tokenmill.params import PoolingParams, SamplingParams
from tokenmill.request import (FinishReason, LoRARequest, Request, RequestOutput, RequestStatus,
                               check_prompt)
from tokenmill.sched.output import ModelOutput, ScheduledChunk, SchedulerOutput, SeqUpdate
from tokenmill.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig, LoRAConfig
    from tokenmill.engine.kv_publisher import KVEventPublisher
    from tokenmill.executor import Executor
    from tokenmill.structured.backend import CompiledGrammar
    from tokenmill.structured.manager import PendingMasks, StructuredOutputManager
    from tokenmill.structured.spec import StructuredOutputs
    from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill.engine")

# ``LLMEngine.fault_hook``: called at each stage of a step with the callers' ids of the requests
# in play (tests only: ``engine/faults.py``).
FaultHook = Callable[[str, Collection[str]], None]


class LLMEngine(OverlappedSteps):
    """Synchronous engine: ``add_request`` any time, call ``step`` until nothing is left.

    ``seed``: requests without a seed of their own sample with one derived from it and their
    arrival order, so the same requests in the same order give the same text however they are
    batched; None leaves them nondeterministic. ``lora``: the adapters' limits (None: the
    engine serves none); ``served_model_name``: the base model's name, which no adapter takes.
    ``async_scheduling``: launch each step before the last one's outputs are built
    (``engine/overlap.py``); the outputs are the same.
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Tokenizer,
                 info: EngineInfo, *, proposer: DraftProposer | None = None,
                 structured: StructuredOutputManager | None = None,
                 seed: int | None = None, kv_publisher: KVEventPublisher | None = None,
                 lora: LoRAConfig | None = None, served_model_name: str | None = None,
                 async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.info = info
        self.proposer = proposer
        self.structured = structured
        self.seed = seed
        self.last_step = StepInfo()
        self._draft_probs: dict[str, list] = {}  # of the drafts kept for the coming step
        self._requests: dict[str, RequestState] = {}
        self._failures: dict[str, str] = {}  # requests failed since take_failures(): why
        self._blameless = BlamelessFailures()
        self._num_added = 0
        self._counters = dict(num_steps=0, num_prompt_tokens_computed=0,
                              num_generated_tokens=0, forward_seconds=0.0, step_seconds=0.0,
                              num_failed_steps=0)
        self.fault_hook: FaultHook | None = None  # tests only (engine/faults.py)
        # --kv-events-config: the prefix cache's changes, sent after each step that made any
        self.kv_publisher = kv_publisher
        self.lora_config = lora
        self.loras = LoRARegistry(lora is not None, unload=executor.remove_lora)
        self.served_model_name = served_model_name or info.model
        self.async_scheduling = async_scheduling
        self._inflight: InFlight | None = None  # the launched step (async_scheduling)
        self._needs_plain: set[str] = set()  # requests whose steps run in the plain order
        self.serve(PoolingSetup())

    def serve(self, pooling: PoolingSetup) -> None:
        """The model's ``task``, pooling defaults and ``ModelConfig`` (pooling_requests.py)."""
        self.pooling, self.task = pooling, pooling.task
        self.pooling_defaults, self.model_config = pooling.defaults, pooling.config

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Plan for this machine, then load the model and tokenizer, size the KV cache and
        build executor and scheduler as the plan says (``engine/build.py``)."""
        from tokenmill.engine.build import build_engine_parts
        from tokenmill.engine.plan import make_plan

        plan = make_plan(config)
        pooling = PoolingSetup.for_plan(plan, config.task)  # refuses a task before the load
        engine = cls(**vars(build_engine_parts(config, plan)))
        engine.async_scheduling = plan.async_scheduling.startswith("on")
        engine.serve(pooling)
        return engine

    # ----- requests ---------------------------------------------------------------------------

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """Raise ``PromptError`` (a ValueError) for a prompt ``add_request`` would refuse.
        Reads only fixed facts, so any thread may call it."""
        check_prompt(token_ids, self.info.max_model_len, self.info.vocab_size, param)

    def add_request(self, request_id: str, prompt: str | Sequence[int] | tuple[str, str],
                    params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    grammar: CompiledGrammar | None = None,
                    kv_transfer_params: Mapping[str, Any] | None = None,
                    lora_request: LoRALike | None = None) -> None:
        """Queue a request. Raises ValueError (nothing queued) for a bad prompt or one that can
        never fit the context or the KV cache. Requests with different ``cache_salt`` never
        share prefix-cache entries. ``grammar`` is the request's constraint compiled already
        (``compile_grammar``; the server does it off this thread), else it is compiled here.
        ``kv_transfer_params``: vLLM's prefill/decode hand-over (``kv_transfer/pd.py``); a
        ValueError starting "kv_transfer_params: " when this engine cannot honour them.
        ``lora_request``: the adapter it runs under (its ``LoRARequest`` or name; None: the base
        model); ``LoRAError`` (a ValueError) for one not loaded. ``PoolingParams`` (or a (text,
        text) pair) ask for an embedding or a cross-encoder's score: ``pooling_requests.py``."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams) or isinstance(prompt, tuple):
            return self._add_pooling(request_id, prompt, params, priority=priority,
                                     arrival_time=arrival_time, cache_salt=cache_salt,
                                     lora_request=lora_request)
        self.pooling.check_generate()
        lora = self.loras.resolve(lora_request)
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) \
            else (None, [int(t) for t in prompt])
        self.check_prompt(ids)
        params = self._seeded(params or SamplingParams())
        if kv_transfer_params is not None:
            self._check_kv_transfer(kv_transfer_params, params)
        grammar = self._grammar_for(params.structured_outputs, grammar)
        request = Request(request_id, ids, params, priority=priority, cache_salt=cache_salt,
                          kv_transfer_params=dict(kv_transfer_params)
                          if kv_transfer_params is not None else None, lora=lora,
                          **({} if arrival_time is None else {"arrival_time": arrival_time}))
        sequences = self.scheduler.add_request(request)
        if grammar is not None:
            self.structured.attach(sequences, grammar)
            self._needs_plain.add(request_id)
        self._num_added += 1
        self._requests[request_id] = RequestState(request_id, text, ids, params, sequences,
                                                  self.tokenizer)
        self.loras.acquire(lora)

    def _add_pooling(self, request_id: str, prompt: PoolingPrompt, params: PoolingParams | None,
                     **fields: Any) -> None:
        request, text = self.pooling.request(request_id, prompt, params, self.tokenizer,
                                             self.check_prompt, **fields)
        self._requests[request_id] = RequestState(
            request_id, text, request.prompt_token_ids, request.sampling_params,
            self.scheduler.add_request(request), self.tokenizer)
        self._needs_plain.add(request_id)

    # ----- LoRA adapters (engine/loras.py) ----------------------------------------------------

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load the PEFT adapter at ``path`` and serve it as ``name`` (its ``LoRARequest``, with
        a new id). ``LoRAError`` for a bad adapter (the message names what does not fit), a
        name in use or the base model's, or an engine built without ``enable_lora``."""
        return self.loras.register(name, path, self.executor.add_lora,
                                   base_model_name or self.served_model_name,
                                   reserved=(self.served_model_name, self.info.model))

    def remove_lora(self, name: str) -> None:
        """Refuse new requests under ``name`` now; its weights go when its last request ends.
        ``LoRAError`` for a name not loaded."""
        self.loras.unregister(name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters requests may name (removed ones are not)."""
        return self.loras.list()

    def _end(self, state: RequestState | None) -> None:
        """A request left ``_requests``: an adapter removed while it ran may go now."""
        if state is not None:
            self.loras.release(state.sequences[0].lora)
            self._needs_plain.discard(state.request_id)

    def _check_kv_transfer(self, kv_params: Mapping[str, Any], params: SamplingParams) -> None:
        from tokenmill.kv_transfer.pd import check_kv_transfer_params

        if not isinstance(kv_params, Mapping):
            raise ValueError("kv_transfer_params: must be an object")
        check_kv_transfer_params(kv_params, getattr(self.scheduler.connector, "role", None))
        if kv_params.get("do_remote_decode") and params.n != 1:
            raise ValueError("kv_transfer_params: do_remote_decode prefills one sequence; "
                             "ask the decode instance for n > 1")

    def compile_grammar(self, spec: StructuredOutputs | None) -> CompiledGrammar | None:
        """The compiled constraint (None for None). Raises ``ConstraintError`` (a ValueError
        naming the request field) for one that does not compile. Cached and thread-safe: the
        server calls it off the event loop before queueing."""
        if spec is None:
            return None
        if self.structured is None:
            raise ValueError(f"{spec.param}: this engine was built without structured output")
        return self.structured.compile(spec)

    def _grammar_for(self, spec: StructuredOutputs | None,
                     compiled: CompiledGrammar | None) -> CompiledGrammar | None:
        if compiled is None:
            return self.compile_grammar(spec)
        if spec is None or compiled.spec.key != spec.key:
            raise ValueError("the compiled grammar given is not the request's constraint")
        return compiled

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        if params.seed is not None or self.seed is None or params.greedy:
            return params
        key = f"{self.seed}:{self._num_added}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return replace(params, seed=seed)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; its KV blocks are freed at once."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        aborted = self.scheduler.abort_request(request_id)
        self._end(state)
        self._publish_kv_events()  # freeing may have cached blocks, and no step may come soon
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_work(self) -> bool:
        """Unfinished requests, or KV still moving for finished ones (a producer's blocks
        waiting to be pulled, loads to be reported), or a launched step: the loop keeps
        stepping for any."""
        return bool(self._requests) or self.scheduler.has_pending_kv_work \
            or self._inflight is not None

    def current_output(self, request_id: str) -> RequestOutput | None:
        """What an unfinished request has produced so far (nothing, while it waits)."""
        state = self._requests.get(request_id)
        return state.output() if state is not None else None

    def take_failures(self) -> dict[str, str]:
        """Requests the engine failed since the last call (request id -> why). They are gone:
        no output of theirs follows."""
        failures, self._failures = self._failures, {}
        return failures

    def _fail(self, request_id: str, why: str) -> None:
        """End a request (a caller's id) with an error ``take_failures`` reports, its blocks
        freed; also one whose sequences all ended in the failing step, whose output the caller
        never got."""
        state = self._requests.pop(request_id, None)
        self.scheduler.abort_request(request_id)
        if state is not None:
            self._failures[request_id] = why
            self._end(state)

    def fail_step(self, request_ids: Collection[str], error: Exception) -> None:
        """A step failed after ``step`` returned (in the caller's bookkeeping of it, such as
        metrics): fail ``request_ids`` as ``step`` fails the requests of a step that raised.
        Raises ``EngineDeadError`` when steps keep failing with no request to blame."""
        self._fail_requests(request_ids, error)
        self._count_failure(bool(request_ids), error)

    def _fail_requests(self, request_ids: Collection[str], error: Exception) -> None:
        why = f"the engine step failed: {type(error).__name__}: {error}"
        for request_id in request_ids:
            self._fail(request_id, why)

    def _count_failure(self, blamed: bool, error: Exception) -> None:
        self._counters["num_failed_steps"] += 1
        self._blameless.count(blamed, error)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's EOS ids (a request may bring its own)."""
        return self.scheduler.eos_token_ids

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage, num_preemptions=s.num_preemptions,
            num_blocks=s.num_blocks, num_free_blocks=s.num_free_blocks,
            num_cached_blocks=s.num_cached_blocks,
            num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            scheduler_seconds=s.overhead_seconds_total, **self._grammar_stats(), **self._counters,
            spec=self.proposer.stats() if hasattr(self.proposer, "stats") else None,
            external_cache_hits=s.external_cache_hits, num_loading=s.num_loading,
            num_held=s.num_held, kv_tiers=self._kv_tiers(), running_loras=s.running_loras,
            waiting_loras=s.waiting_loras,
            max_loras=self.lora_config.max_loras if self.lora_config is not None else 0)

    def _kv_tiers(self) -> dict:
        connector = self.scheduler.connector
        return dict(connector.stats()) if connector is not None else {}

    def _grammar_stats(self) -> dict:
        if self.structured is None:
            return {}
        g = self.structured.stats
        return dict(num_structured_requests=self.structured.num_requests,
                    grammar_compile_seconds=g.compile_seconds,
                    grammar_mask_seconds=g.mask_seconds, num_grammar_mask_steps=g.num_mask_steps)

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix; returns the blocks dropped. Refused (RuntimeError) while
        requests are unfinished, whose cached prefixes are in use."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot flush the prefix cache while requests are running")
        self._drain()
        flushed = self.scheduler.flush_prefix_cache()
        self._publish_kv_events()
        return flushed

    def _publish_kv_events(self) -> None:
        """Hand the prefix cache's changes since the last call to the publisher, as one batch
        (none when nothing changed). Only the queueing happens on this thread."""
        if self.kv_publisher is None:
            return
        events = self.scheduler.block_manager.prefix_cache.take_events()
        if events:
            self.kv_publisher.publish(events)

    def check_health(self) -> None:
        """Raise (``executor.ExecutorError``) when the executor cannot run steps any more.
        Reads no step state, so any thread may call it."""
        self.executor.check_health()

    def heartbeat_ages(self) -> dict[int, float]:
        """Per worker rank, seconds since it was last heard from (``Executor.heartbeat_ages``);
        any thread may call it."""
        return self.executor.heartbeat_ages()

    def shutdown(self) -> None:
        """Stop the executor's workers (the model and KV cache go with them) and the KV-event
        publisher, after sending what it still holds; idempotent."""
        self._close_step_thread()
        self.executor.shutdown()
        if self.kv_publisher is not None:
            self._publish_kv_events()
            self.kv_publisher.close()

    # ----- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that changed.

        Whatever raises inside the step (proposer, schedule, forward, sampling, grammar,
        update, output processing) fails the requests the step touched (``take_failures``
        says why), the step returns [] and the engine goes on with the others. Only failures
        that touch no request, ``MAX_BLAMELESS_FAILURES`` steps in a row, raise
        ``EngineDeadError``."""
        s = StepState()
        try:
            overlap = self._inflight is not None or self._may_overlap()
            outputs = self._overlap_step(s) if overlap else self._step(s)
        except EngineDeadError:  # a launch failure's recovery found the engine dead
            raise
        except Exception as e:
            self._recover(s, e)
            if isinstance(e, ExecutorError):  # a worker is gone: no later step can run
                raise EngineDeadError(f"the executor cannot run steps: {e}") from e
            return []
        finally:  # a failed step's rollback changed the cache too
            self._publish_kv_events()
        if s.out is not None and s.out.scheduled:  # work done: not the engine's end
            self._blameless.in_a_row = 0
        return outputs

    def _step(self, s: StepState) -> list[RequestOutput]:
        start = time.perf_counter()
        preempted = self.scheduler.num_preemptions
        self._inject("step", s)
        s.stage = "propose"
        self._inject("propose", s)
        self._propose()
        s.stage = "schedule"
        out = s.out = self.scheduler.schedule()
        self._inject("schedule", s)
        self._forget(out.finished_ids)  # aborted between steps
        moving = out.kv_connector_metadata is not None or self.scheduler.has_pending_kv_work
        result, seconds = self._run(s) if out.scheduled or moving else (ModelOutput(), 0.0)
        s.kv_output = result.kv_connector_output  # a failure below must not lose it
        self._inject("observe", s)
        if hasattr(self.proposer, "observe"):
            self.proposer.observe(out.scheduled, result.token_ids, out.num_batched_tokens,
                                  seconds)
        self._inject("grammar", s)
        if self.structured is not None:  # a request whose grammar broke fails alone
            for group_id, why in self.structured.take_failed().items():
                self._fail(group_id, why)
        s.updated = True
        updates = self.scheduler.update_from_output(out, result.token_ids,
                                                    result.kv_connector_output)
        self._inject("update", s)
        outputs = self._outputs(s, updates, result)
        self._account(out, updates, preempted, start)
        return outputs

    def _outputs(self, s: StepState, updates: list[SeqUpdate],
                 result: ModelOutput) -> list[RequestOutput]:
        """The step's text work: detokenize, match stop strings, build the outputs; finished
        requests leave."""
        take_prompt_logprobs(self._requests, result.prompt_logprobs)
        outputs = self._process(updates, result.logprobs)
        attach_pooled(outputs, getattr(result, "pooled", None))
        self._inject("process", s)
        self._forget(self.scheduler.take_finished_ids())  # now, not at the next step
        self._inject("finish", s)
        for output in outputs:  # only now: a failure before this fails them too
            if output.finished:
                self._end(self._requests.pop(output.request_id))
        return outputs

    def _account(self, out: SchedulerOutput, updates: list[SeqUpdate], preempted: int,
                 start: float) -> None:
        new_tokens = sum(len(u.new_token_ids) for u in updates)
        self.last_step = StepInfo(out.num_batched_tokens, new_tokens,
                                  self.scheduler.num_preemptions - preempted,
                                  frozenset(c.request.group_id for c in out.scheduled))
        self._counters["num_generated_tokens"] += new_tokens
        self._counters["num_steps"] += 1
        self._counters["step_seconds"] += time.perf_counter() - start

    def _forget(self, seq_ids: list[str]) -> None:
        """Ended sequences: the proposer drops what it keeps for them (a drafter's blocks)."""
        if seq_ids and hasattr(self.proposer, "forget"):
            self.proposer.forget(seq_ids)

    def _inject(self, stage: str, s: StepState) -> None:
        """The fault hook (tests only; nothing when unset), with the callers' ids of the
        requests in play: every unfinished one at the start, then those the stage touches."""
        if self.fault_hook is not None:
            in_play = set(self._requests) if s.stage == "step" else \
                touched_requests(s, self.scheduler, self._requests.values())
            self.fault_hook(stage, in_play)

    def _recover(self, s: StepState, error: Exception) -> None:
        """After a step raised: fail the requests it touched, have the scheduler take the step
        back (their blocks are freed, none cached), and count a failure that blamed nobody."""
        touched = touched_requests(s, self.scheduler, self._requests.values())
        logger.error("an engine step failed (%s); failing the %d requests it touched: %s",
                     s.stage if s.out is None else "after schedule", len(touched),
                     sorted(touched)[:8], exc_info=error)
        self._fail_requests(touched, error)
        if s.out is not None and not s.updated:  # every chunk's request was just aborted
            self.scheduler.update_from_output(s.out, {}, s.kv_output or undelivered_kv(s))
        self._draft_probs = {}
        self.last_step = StepInfo()
        try:
            self._forget(self.scheduler.take_finished_ids())
        except Exception:  # the proposer may be what failed; its state for them may leak
            logger.exception("the proposer could not drop the failed sequences")
        self._count_failure(bool(touched), error)

    def _propose(self) -> None:
        self._draft_probs = {}
        if not self.scheduler.num_running:
            return
        # sequences waiting for their KV (a connector's load) draft nothing until it is in
        running = [r for r in self.scheduler.running
                   if r.status is RequestStatus.RUNNING and r.pooling_params is None]
        constrained = self.structured is not None and any(r.grammar is not None for r in running)
        if self.proposer is None and not constrained:  # an unconstrained batch: nothing to do
            return
        proposed = self.proposer.propose(running, self.scheduler.waiting_prompt_tokens()) \
            if self.proposer is not None else {}
        probs = getattr(self.proposer, "draft_probs", None) or {}
        drafts = self.structured.propose(running, proposed) if constrained else proposed
        for request in running:
            seq_id = request.request_id
            request.spec_token_ids = kept = list(drafts.get(seq_id, ()))
            # The distributions go with the drafts while they are a prefix of what was drawn
            # (a grammar may cut the drafts, or replace them by the text it forces).
            if kept and seq_id in probs and list(proposed[seq_id][:len(kept)]) == kept:
                self._draft_probs[seq_id] = probs[seq_id][:len(kept)]

    def _run(self, s: StepState) -> tuple[ModelOutput, float]:
        """The model step: forward and sampling, the grammar masks filled meanwhile."""
        out = s.out
        start = time.perf_counter()
        masks = self.structured.start_masks(out.scheduled) if self.structured else None
        self._inject("forward", s)
        s.kv_sent = True
        result = self._execute(out, masks)
        self._inject("sample", s)
        seconds = time.perf_counter() - start
        self._counters["forward_seconds"] += seconds
        self._count_prompt_tokens(out)
        return result, seconds

    def _count_prompt_tokens(self, out: SchedulerOutput) -> None:
        self._counters["num_prompt_tokens_computed"] += sum(
            min(c.num_tokens, max(0, c.request.num_prompt_tokens - c.start_pos))
            for c in out.scheduled)

    def _execute(self, out: SchedulerOutput, masks: PendingMasks | None) -> ModelOutput:
        """The executor's forward. Adapters it could not load (``LoRALoadError``: their files
        went away while evicted) fail their requests, and the step runs again without their
        chunks; the KV connector's ops already went out with the first try."""
        while True:
            try:
                if self.async_scheduling:  # every forward on the step thread (Executor.launch)
                    return self.executor.launch(out, masks, self._draft_probs or None).result()
                return self.executor.execute(out, masks, self._draft_probs or None)
            except LoRALoadError as e:
                kept = self._fail_adapters(e, out.scheduled)
                if len(kept) == len(out.scheduled):  # it named none of the step's adapters
                    raise
                if not kept:
                    return ModelOutput()
                out = replace(out, scheduled=kept, kv_connector_metadata=None)
                masks = self.structured.start_masks(kept) if self.structured else None

    def _fail_adapters(self, error: LoRALoadError,
                       chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Fail every request of the adapters ``error`` names; the chunks of the others."""
        ids = set(error.lora_ids)
        logger.error("LoRA adapters %s could not be loaded; failing their requests: %s",
                     sorted(ids), error)
        for state in list(self._requests.values()):
            lora = state.sequences[0].lora
            if lora is not None and lora.lora_int_id in ids:
                self._fail(state.request_id, f"its LoRA adapter {lora.lora_name!r} could not "
                                             f"be loaded: {error}")
        return [c for c in chunks if c.request.lora is None
                or c.request.lora.lora_int_id not in ids]

    def _advance_grammar(self, seq: Request, token_ids: list[int]) -> None:
        """The grammar consumes the tokens. A complete grammar allows only EOS next, which ends
        the sequence like any EOS (with or without jump-forward, whose drafts stop short of
        it); a sequence that ignores EOS is ended here instead (stop)."""
        try:
            complete = self.structured.advance(seq, token_ids)
        except ValueError:  # a broken invariant, not bad input: end this sequence, not all
            logger.exception("grammar state of %s lost; aborting it", seq.request_id)
            self.scheduler.abort_request(seq.request_id)
            return
        if complete and seq.stop_token_ids.isdisjoint(self.eos_token_ids):
            self.scheduler.finish_request(seq.request_id, FinishReason.STOP)

    def _take_tokens(self, seq: Request, state: RequestState, update: SeqUpdate,
                     logprobs: Mapping[str, Sequence[object | None]]) -> None:
        stop = state.on_tokens(seq, update.new_token_ids, logprobs.get(seq.request_id))
        if stop is not None:
            text, kept = stop
            dropped = len(update.new_token_ids) - kept
            self._finish_by_stop_string(seq, text, seq.num_output_tokens - dropped)
        elif seq.grammar is not None and not seq.is_finished:
            self._advance_grammar(seq, update.new_token_ids)

    def _process(self, updates: list[SeqUpdate],
                 logprobs: Mapping[str, Sequence[object | None]]) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        for update in updates:
            seq = update.request
            state = self._requests.get(seq.group_id)
            if state is None:
                continue
            try:
                self._take_tokens(seq, state, update, logprobs)
            except Exception as e:  # this request's text or grammar broke: fail it alone
                logger.exception("processing the output of %s failed", seq.request_id)
                self._fail(seq.group_id, f"processing its output failed: "
                           f"{type(e).__name__}: {e}")
                touched.pop(state.request_id, None)
                continue
            touched[state.request_id] = state
        return [state.output() for state in touched.values()]
