"""AsyncEngine: the LLMEngine step loop in one background thread, one output stream per request.

Threading model: only the loop thread touches the ``LLMEngine`` (it is not thread-safe). The
asyncio side sends it commands (add, abort, calls such as loading a LoRA adapter) through a
locked deque and wakes it with a ``Condition``; the loop thread hands outputs back with one
``call_soon_threadsafe`` per step.
PyTorch releases the GIL during the forward, so the event loop stays responsive while it runs.

A caller iterates ``generate()``; when it stops iterating (client gone: ``GeneratorExit`` or
``CancelledError``) the request is aborted at once and its KV blocks freed.

A step that fails (in the engine, or in this loop's own metrics of it) fails the requests it
touched, each stream ending with ``RequestFailedError``, and the loop goes on. The loop stops
only when the engine does (``EngineDeadError``: steps failing with no request to blame) or on
a bug in the loop itself; every stream then ends with ``EngineUnavailableError`` and
``is_alive`` turns False (``/health`` answers 503 and says why, ``error``).

With ``--engine-process`` the engine is ``core_client.EngineCoreClient``: the same surface over
an engine in another process, whose ``step()`` waits for that process' next outputs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.engine.async_types import (EngineOverloadedError, EngineSnapshot,
                                          EngineUnavailableError, RequestFailedError,
                                          RequestTimings, StatsListener)
from tokenmill.params import PoolingParams, SamplingParams
from tokenmill.request import LoRARequest, PoolingOutput, RequestOutput
from tokenmill.structured.spec import StructuredOutputs
from tokenmill.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenmill.engine.core_client import EngineCoreClient
    from tokenmill.engine.llm_engine import EngineInfo, LLMEngine
    from tokenmill.structured.backend import CompiledGrammar

logger = logging.getLogger("tokenmill.engine")


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | Sequence[int] | tuple[str, str]
    params: SamplingParams | PoolingParams
    priority: int
    cache_salt: str | None
    stream: RequestStream
    added: asyncio.Future  # settled on the event loop once the engine took (or refused) it
    grammar: CompiledGrammar | None = None  # compiled off the loop thread: it never compiles
    kv_transfer_params: dict | None = None  # prefill/decode hand-over (kv_transfer/pd.py)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], object]  # run on the loop thread, between steps
    done: asyncio.Future  # its result, or what it raised


@dataclass(frozen=True)
class _FailAll:
    reason: str  # every request still running ends with EngineUnavailableError(reason)


_Command = _Add | _Abort | _Call | _FailAll


class RequestStream:
    """The outputs of one request, in order; intermediate ones are coalesced when the reader is
    slower than the engine (outputs are cumulative, so only the newest matters)."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue,
                 timings: RequestTimings):
        self.request_id = request_id
        self.timings = timings
        self.finished = False
        self.last: RequestOutput | None = None  # written by the loop thread
        self._engine = engine
        self._queue = queue

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort unless finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Wraps an ``LLMEngine``; call ``start()`` from inside the running event loop."""

    def __init__(self, engine: LLMEngine | EngineCoreClient,
                 max_queued_requests: int | None = None,
                 listener: StatsListener | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.listener = listener
        self.snapshot = EngineSnapshot()
        self._streams: dict[str, RequestStream] = {}  # loop-thread side
        self._commands: deque[_Command] = deque()
        self._cond = threading.Condition()
        self._adds_sent = 0  # event-loop side; the loop thread counts what it took
        self._adds_taken = 0
        self._accepting = True
        self._stop = False
        self._closed = False  # the loop has ended: commands are refused at once
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._step_start = 0.0
        self._in_step = False
        self._loras = tuple(engine.list_loras())  # replaced whole by the loop thread
        # An engine in another process (engine/core_client.py) has the loop thread wait in
        # step() for its outputs: a command must end that wait, as it ends the idle one.
        self._wake: Callable[[], None] | None = getattr(engine, "wake", None)

    def in_flight(self) -> list[RequestStream]:
        """The requests running or waiting now (a snapshot; the dashboard's table). The
        dict belongs to the loop thread; copying its values is one C call under the GIL."""
        return list(self._streams.values())

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def heartbeat_ages(self) -> dict[int, float]:
        """Per worker rank, seconds since it was last heard from (any thread)."""
        return self.engine.heartbeat_ages()

    @property
    def tokenizer(self) -> Tokenizer:
        """Safe to use from the event loop: tokenizers are thread-safe for encode/decode."""
        return self.engine.tokenizer

    def compile_grammar(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile (and cache) an output constraint for ``add_request(grammar=)``; raises
        ``ConstraintError``. Thread-safe and slow for a new schema: call it off the event
        loop."""
        return self.engine.compile_grammar(spec)

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """The engine's prompt check, callable before anything is queued."""
        self.engine.check_prompt(token_ids, param)

    # ----- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._publish()  # gauges are right before the first command (the thread is not up)
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def executor_problem(self) -> str | None:
        """Why the engine's executor cannot run steps (a worker gone), or None."""
        try:
            self.engine.check_health()
        except Exception as e:  # whatever a worker reports, /health says it
            return f"{type(e).__name__}: {e}"
        return None

    @property
    def error(self) -> str | None:
        """Why the loop stopped, when it died (None while it runs or after a clean stop)."""
        return None if self._error is None else f"{type(self._error).__name__}: {self._error}"

    @property
    def num_active(self) -> int:
        snap = self.snapshot
        return self._adds_sent - snap.num_adds_taken + snap.num_running + snap.num_waiting

    @property
    def step_seconds(self) -> float:
        """How long the step now running has run (0 between steps): the watchdog's input."""
        return time.monotonic() - self._step_start if self._in_step else 0.0

    async def drain(self, timeout: float) -> int:
        """Stop accepting; let running requests finish for up to ``timeout`` s, then end the
        rest with EngineUnavailableError (their callers can still say so to their clients).
        Returns how many were ended that way."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.num_active and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.num_active
        if left and self.is_alive:
            logger.info("shutdown: %d requests did not finish in %.0fs; ending them", left,
                        timeout)
            self._send(_FailAll("the server is shutting down"))
        return left

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; let running requests finish for up to ``timeout`` s; stop the loop."""
        await self.drain(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._wake is not None:
            self._wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        if self._thread is None or not self._thread.is_alive():  # no step can run any more
            self.engine.shutdown()

    # ----- the caller's side (event loop) ---------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | Sequence[int] | tuple[str, str],
                          params: SamplingParams | PoolingParams, priority: int = 0,
                          cache_salt: str | None = None,
                          grammar: CompiledGrammar | None = None,
                          kv_transfer_params: dict | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request and return its output stream once the engine took it. Pass its
        constraint's ``grammar`` (``compile_grammar``), or the loop thread compiles it;
        ``lora_request``: one of ``loras()`` (None: the base model).

        Raises ValueError (bad prompt, or ``LoRAError``: an adapter not loaded any more;
        nothing queued), EngineOverloadedError or EngineUnavailableError. The caller must
        iterate the stream to its end or ``abort()`` it.
        """
        self._admit()
        stream = RequestStream(self, request_id, asyncio.Queue(), RequestTimings(time.monotonic()))
        added = self._loop.create_future()
        self._adds_sent += 1
        self._send(_Add(request_id, prompt, params, priority, cache_salt, stream, added,
                        grammar, kv_transfer_params, lora_request))
        try:
            await added
        except asyncio.CancelledError:
            self.abort(request_id)  # commands run in order: this abort follows the add
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | Sequence[int],
                       params: SamplingParams, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request; the last one has ``finished`` set.

        Stopping the iteration early (``GeneratorExit`` / ``CancelledError``) aborts the request.
        """
        stream = await self.add_request(request_id, prompt, params, priority,
                                        lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def encode(self, request_id: str, prompt: str | Sequence[int] | tuple[str, str],
                     params: PoolingParams) -> PoolingOutput:
        """The embedding of ``prompt`` (or a cross-encoder's logits for a (text, text) pair),
        batched with every other request. Raises as ``add_request``, and
        ``RequestFailedError``; cancelling aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                if output.finished and output.pooled is not None:
                    return output.pooled
        finally:
            stream.abort()
        raise RequestFailedError(f"request {request_id} ended without its pooled vector")

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def flush_prefix_cache(self) -> int:
        """Drop every cached prefix on the loop thread; returns the blocks dropped. Raises
        RuntimeError while requests are running or waiting."""
        return await self._call(self.engine.flush_prefix_cache)

    async def add_lora(self, name: str, path: str,
                       base_model_name: str | None = None) -> LoRARequest:
        """Load a PEFT adapter and serve it as ``name`` (``LLMEngine.add_lora``, on the loop
        thread between steps); ``loras()`` lists it once this returns. Raises ``LoRAError``."""
        return await self._call(
            lambda: self._listing(self.engine.add_lora(name, path, base_model_name)))

    async def remove_lora(self, name: str) -> None:
        """Refuse new requests under ``name``; its weights go when its last request ends.
        Raises ``LoRAError`` for a name not loaded."""
        await self._call(lambda: self._listing(self.engine.remove_lora(name)))

    def loras(self) -> list[LoRARequest]:
        """The adapters requests may name, as of the last add or remove (any thread)."""
        return list(self._loras)

    def _listing(self, result: object) -> object:
        """(loop thread) ``result``, once ``loras()`` shows what the call changed."""
        self._loras = tuple(self.engine.list_loras())
        return result

    async def _call(self, fn: Callable[[], object]) -> object:
        done = self._loop.create_future()
        self._send(_Call(fn, done))
        return await done

    def _admit(self) -> None:
        if not self._accepting or not self.is_alive:
            raise EngineUnavailableError("the server is shutting down or its engine has stopped")
        limit = self.max_queued_requests
        # Requests beyond what can run at once are the queue (a just-added request shows as
        # waiting until its first step, so waiting alone would over-count). One snapshot gives
        # a consistent count: each request is either not yet taken or waiting or running.
        snap = self.snapshot
        not_taken = self._adds_sent - snap.num_adds_taken
        queued = not_taken + snap.num_waiting + snap.num_running - self.info.max_num_seqs
        if limit is not None and queued >= limit:
            raise EngineOverloadedError(
                f"the server is overloaded: more than {limit} requests are waiting; retry later")

    def _send(self, command: _Command) -> None:
        with self._cond:
            if self._closed:
                _refuse(command)
                return
            self._commands.append(command)
            self._cond.notify()
        if self._wake is not None:
            self._wake()

    # ----- the loop thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stop or self.engine.has_pending_work()):
                        self._cond.wait()
                    if self._stop:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    self._apply(command)
                if commands:
                    self._publish_or_log()
                if self.engine.has_pending_work():
                    self._step()
                else:
                    self._publish_or_log()
        except BaseException as e:  # the loop is dead: fail every stream, /health turns 503
            logger.exception("engine loop died")
            self._error = e
            error = EngineUnavailableError(f"the engine loop died: {e}")
            streams = list(self._streams.values())
            self._abort_all()  # before anyone is told: their blocks are free by then
            self._deliver([(s, error) for s in streams])
        finally:
            self._abort_all()
            self._refuse_pending()

    def _refuse_pending(self) -> None:
        """The loop has ended: adds and flushes it will never take are refused, now and
        later (``_send``), instead of waiting forever."""
        with self._cond:
            self._closed = True
            pending = list(self._commands)
            self._commands.clear()
        for command in pending:
            self._loop.call_soon_threadsafe(_refuse, command)

    def _apply(self, command: _Command) -> None:
        try:
            self._apply_one(command)
        except Exception:  # one command's failure (a metrics listener's, say) is not the loop's
            logger.exception("the engine loop's %s command failed", type(command).__name__)

    def _apply_one(self, command: _Command) -> None:
        match command:
            case _Abort(request_id):
                self._finish_aborted(request_id)
            case _Call(fn, done):
                self._run_call(fn, done)
            case _FailAll(reason):
                self._fail_all(reason)
            case _Add():
                self._add(command)

    def _add(self, c: _Add) -> None:
        self._adds_taken += 1
        try:
            self.engine.add_request(c.request_id, c.prompt, c.params, priority=c.priority,
                                    arrival_time=c.stream.timings.arrival,
                                    cache_salt=c.cache_salt, grammar=c.grammar,
                                    kv_transfer_params=c.kv_transfer_params,
                                    lora_request=c.lora_request)
        except Exception as e:
            # Publish first: a stale snapshot would count this refused add as queued, and a
            # caller told of the refusal could be refused admission for it.
            self._publish_or_log()
            self._loop.call_soon_threadsafe(_settle, c.added, e)
            return
        self._streams[c.request_id] = c.stream
        self._loop.call_soon_threadsafe(_settle, c.added, None)

    def _run_call(self, fn: Callable[[], object], future: asyncio.Future) -> None:
        try:
            result = fn()
        except Exception as e:
            self._loop.call_soon_threadsafe(_settle, future, e)
            return
        self._loop.call_soon_threadsafe(_settle_value, future, result)

    def _finish_aborted(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        # One that produced nothing yet (still waiting) counts as an abort all the same.
        last = stream.last or self.engine.current_output(request_id)
        self.engine.abort_request(request_id)
        stream.timings.finished = time.monotonic()
        _log_finished(request_id, stream, aborted=True)
        if last is not None and self.listener:
            self.listener.on_request_finished(last, stream.timings)

    def _fail_all(self, reason: str) -> None:
        error = EngineUnavailableError(reason)
        streams = list(self._streams.values())
        self._abort_all()
        self._deliver([(s, error) for s in streams])

    def _step(self) -> None:
        self._step_start = start = time.monotonic()
        self._in_step = True
        try:
            outputs = self.engine.step()  # fails its own requests; raises only when dead
        finally:
            self._in_step = False
        failures = self.engine.take_failures()
        try:
            deliveries = self._account(outputs, start)
        except Exception as e:  # metrics of the step failed: its requests fail, as in a step
            deliveries = []
            failures.update(self._fail_step(outputs, e))
        self._fail_streams(failures)
        self._deliver(deliveries)

    def _account(self, outputs: list[RequestOutput], start: float) -> list:
        """The step's timings, listener calls and gauges; returns the outputs to deliver.
        Finished requests leave ``_streams`` only once all of it succeeded."""
        now = time.monotonic()
        step = self.engine.last_step
        if self.engine.fault_hook is not None:  # tests only
            self.engine.fault_hook("metrics", step.scheduled_request_ids)
        self._mark_scheduled(step.scheduled_request_ids, start)
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                self._record(stream, output, now)
                deliveries.append((stream, output))
        if self.listener:
            self.listener.on_step(step.num_batched_tokens, step.num_new_tokens,
                                  step.num_preemptions)
        self._publish()
        for stream, output in deliveries:
            if output.finished:
                del self._streams[output.request_id]
                _log_finished(output.request_id, stream)
        return deliveries

    def _fail_step(self, outputs: list[RequestOutput], error: Exception) -> dict[str, str]:
        """Fail the requests of a step whose accounting raised (those that finished in it
        too: their callers get the error, not the output). Raises ``EngineDeadError`` from
        the engine when steps keep failing with no request to blame."""
        ids = set(self.engine.last_step.scheduled_request_ids)
        ids.update(o.request_id for o in outputs)
        logger.error("accounting for an engine step failed; failing its %d requests", len(ids),
                     exc_info=error)
        self.engine.fail_step(ids, error)
        why = f"the engine step failed: {type(error).__name__}: {error}"
        failures = {rid: why for rid in ids}
        failures.update(self.engine.take_failures())
        self._publish_or_log()
        return failures

    def _fail_streams(self, failures: dict[str, str]) -> None:
        deliveries = []
        for request_id, why in failures.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.timings.finished = time.monotonic()
                deliveries.append((stream, RequestFailedError(f"the request failed: {why}")))
        self._deliver(deliveries)

    def _mark_scheduled(self, request_ids: frozenset[str], now: float) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None and stream.timings.scheduled is None:
                stream.timings.scheduled = now

    def _record(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        t = stream.timings
        total = sum(len(c.token_ids) for c in output.outputs)
        if total > t.num_tokens:
            if t.first_token is None:
                t.first_token = now
                t.scheduled = t.scheduled or self._step_start
            else:
                t.token_gaps.append(now - t.last_token)
            t.last_token = now
            t.num_tokens = total
        stream.last = output
        if output.finished:
            t.finished = now
            if self.listener:
                self.listener.on_request_finished(output, t)

    def _deliver(self, deliveries: list) -> None:
        if deliveries:
            self._loop.call_soon_threadsafe(_put_all, deliveries)

    def _publish_or_log(self) -> None:
        try:
            self._publish()
        except Exception:  # stale gauges until the next step publishes (or fails for it)
            logger.exception("publishing the engine's gauges failed")

    def _publish(self) -> None:
        stats = self.engine.stats()
        self.snapshot = EngineSnapshot(stats.num_running, stats.num_waiting,
                                       stats.kv_cache_usage, stats.num_preemptions,
                                       self._adds_taken, stats)

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            try:
                self._finish_aborted(request_id)
            except Exception:  # best effort while going down
                logger.exception("abort of %s failed", request_id)
        self._publish_or_log()


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller went away while the add was in flight
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _refuse(command: _Command) -> None:
    """Settle a command the loop will never take (on the event loop)."""
    future = command.added if isinstance(command, _Add) else \
        command.done if isinstance(command, _Call) else None
    if future is not None:
        _settle(future, EngineUnavailableError("the engine loop has stopped"))


def _settle_value(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _put_all(deliveries: list) -> None:
    for stream, item in deliveries:
        stream._queue.put_nowait(item)


def _log_finished(request_id: str, stream: RequestStream, aborted: bool = False) -> None:
    t = stream.timings
    out = stream.last
    prompt = len(out.prompt_token_ids) if out else 0
    latency = (t.finished or time.monotonic()) - t.arrival
    ttft = f"{t.first_token - t.arrival:.3f}s" if t.first_token else "-"
    logger.info("request %s %s: prompt %d tokens, completion %d tokens, ttft %s, latency %.3fs",
                request_id, "aborted" if aborted else "finished", prompt, t.num_tokens, ttft,
                latency)
