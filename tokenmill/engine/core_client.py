"""The server's side of the engine core process (``tokenmill serve --engine-process``).

``EngineCoreClient`` has the surface of ``LLMEngine`` that ``AsyncEngine`` and the server use,
so ``AsyncEngine`` wraps it unchanged: its loop thread's ``step()`` waits on the core's next
frame (ZMQ releases the GIL while it waits) instead of running the model. The core
(``core_proc.py``) steps on its own, so HTTP work here (JSON, SSE, pydantic, tokenizing) no
longer holds the GIL its step loop needs.

What stays here: the tokenizer (prompts are tokenized and checked before they are sent),
grammar compiling (a bad constraint is refused here; the core compiles it again, on a thread
beside its steps), and each request's output rebuilt from the core's deltas. What the core
keeps: scheduling, the model, sampling, detokenization and stop strings (a stop string ends the
request in the scheduler, so it is matched where the scheduler runs). Embeddings and scores
are not served this way (yet): their vectors do not cross the channel.

When this side falls behind the core, ``step()`` takes every frame that arrived at once and
hands on each request's newest output: a stream then gets several tokens in one chunk rather
than a growing backlog.

An add the core refuses after this side's checks (rare: a KV hand-over it cannot honour, say)
fails its request (``RequestFailedError``) instead of raising from ``add_request``. The core
process gone, in-flight requests fail (``EngineDeadError`` from ``step``: ``AsyncEngine``'s
loop stops) and ``check_health`` says so: ``/health`` answers 503 and the server exits non-zero,
as when an executor's worker dies.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import types
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq

from tokenmill.engine import core_wire as wire
from tokenmill.engine.core_proc import CoreSpec, run_core
from tokenmill.engine.info import EngineInfo, EngineStats, StepInfo
from tokenmill.engine.llm_engine import EngineDeadError
from tokenmill.errors import LoRAError, TokenmillError
from tokenmill.params import PoolingParams, SamplingParams
from tokenmill.request import LoRARequest, RequestOutput, check_prompt

if TYPE_CHECKING:
    from tokenmill.structured.backend import CompiledGrammar
    from tokenmill.structured.spec import StructuredOutputs
    from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill.engine.core")

_POLL_MS = 1000  # how often a wait on the core checks that it still runs


def engine_process_choice(args: argparse.Namespace, options: Mapping[str, Any]
                          ) -> tuple[bool, str]:
    """Whether ``serve`` runs the engine core in a process of its own, and why. Unasked: on
    for one worker serving text generation, on a GPU (an H100 server 1.6-1.75x at c=64-256)
    and on a CPU (2 cores: +10-30% at c=32-128 on an AMX Xeon, +34-38% at c=8 and +9-33% at
    c=32 on an AVX512-BF16 Xeon; docs/benchmarks.md), for ~100 MiB more (the server's process
    loads no torch) and a second copy of the tokenizer; off for parallel ranks (not tried behind
    it), for ``--kv-role`` (a producer's held blocks were not released behind it:
    tests/test_kv_pd_real.py) and for pooling models (pooled vectors do not cross its
    channel)."""
    from tokenmill.engine.pooling_requests import serving_task

    if args.engine_process is not None:
        return args.engine_process, "asked for"
    if any(options.get(k, 1) > 1 for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                             "nnodes")):
        return False, "parallel ranks (--engine-process turns it on)"
    if options.get("kv_role"):
        return False, ("prefill/decode roles: a producer's held blocks are released in one "
                       "process only (--engine-process turns it on)")
    task = serving_task(args.model, options.get("task"))
    if task != "generate":
        return False, f"the {task} task: pooled vectors do not cross its channel"
    return True, "one worker generating text: HTTP apart from the step loop"


def launch_core(args: argparse.Namespace, options: dict, served_model_name: str) -> CoreLaunch:
    """``tokenmill serve --engine-process``: spawn the core for the engine ``args`` and
    ``options`` describe and return at once, so that the server's own imports (3-4 s on a Zen 3
    core, torch among them) run beside the core's start rather than before it;
    ``CoreLaunch.client()`` then waits for it."""
    return CoreLaunch(CoreSpec(args.model, options, served_model_name, list(args.lora_modules),
                               args.test_faults, args.log_level))


class CoreLaunch:
    """A core process spawned and starting: ``client()`` waits until it is READY,
    ``abandon()`` stops it before then (the server could not start)."""

    def __init__(self, spec: CoreSpec) -> None:
        workdir = tempfile.mkdtemp(prefix="tokenmill-core-")
        ctx = zmq.Context()
        commands, outputs = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        commands.bind(f"ipc://{workdir}/commands")
        outputs.bind(f"ipc://{workdir}/outputs")
        self.spec = replace(spec, commands_addr=f"ipc://{workdir}/commands",
                            outputs_addr=f"ipc://{workdir}/outputs", socket_dir=workdir,
                            parent_pid=os.getpid())
        # spawn, not fork: a CUDA context (and torch's threads) do not survive a fork
        process = multiprocessing.get_context("spawn").Process(
            target=run_core, args=(self.spec,), name="tokenmill-engine-core", daemon=True)
        process.start()
        self.channel = _Channel(ctx, commands, outputs, process, workdir)

    def client(self) -> EngineCoreClient:
        """The tokenizer loaded meanwhile, the core's READY awaited; raises
        ``TokenmillError`` (the core stopped) when it failed to start."""
        from tokenmill.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(self.spec.model)
            facts = self.channel.wait_ready()
            if facts["task"] != "generate":  # pooled vectors do not cross the channel (yet)
                raise TokenmillError(f"--engine-process serves text generation only; this "
                                     f"model runs the {facts['task']} task: leave the flag out")
        except BaseException:
            self.channel.close()
            raise
        return EngineCoreClient(self.channel, tokenizer, facts)

    def abandon(self) -> None:
        """Stop a core that was never used: killed, as it may still be loading (it would read
        a STOP only once ready)."""
        self.channel.process.kill()
        self.channel.close()


class _Channel:
    """The two sockets and the process behind them; only ``AsyncEngine``'s loop thread uses
    them once the server runs (ZMQ sockets are not thread-safe)."""

    def __init__(self, ctx: zmq.Context, commands: zmq.Socket, outputs: zmq.Socket,
                 process: multiprocessing.process.BaseProcess, workdir: str) -> None:
        self.ctx, self.commands, self.outputs = ctx, commands, outputs
        self.process = process
        self.workdir = workdir
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self.poller = zmq.Poller()
        self.poller.register(outputs, zmq.POLLIN)
        self.poller.register(self.wake_r, zmq.POLLIN)
        self.closed = False
        self._sockets_kept = True

    def forget_sockets(self) -> None:
        """The core is gone or going: nothing connects to its sockets' files again, so their
        folder goes now, not at ``close()``, which a server killed while unhealthy never runs
        (the core, which removes it when its server dies first, is gone already)."""
        if self._sockets_kept:
            self._sockets_kept = False
            shutil.rmtree(self.workdir, ignore_errors=True)

    def send(self, frame: list) -> None:
        """Raises ``EngineDeadError`` once the core is gone: a PUSH socket without its peer
        would wait for it forever."""
        data = wire.encode(frame)
        while True:
            try:
                self.commands.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                if (why := self.death()) is not None:
                    raise EngineDeadError(why) from None
                self.commands.poll(100, zmq.POLLOUT)

    def death(self) -> str | None:
        """Why the core cannot answer any more, or None while it runs."""
        if self.process.is_alive():
            return None
        self.forget_sockets()
        return f"the engine core process exited (exit code {self.process.exitcode})"

    def wait_ready(self) -> dict:
        while not self.outputs.poll(_POLL_MS):
            why = self.death()
            if why is not None:
                raise TokenmillError(f"{why} before it was ready; its log says why")
        frame = wire.decode(self.outputs.recv())
        if frame[0] != wire.READY:
            raise TokenmillError(f"the engine core could not start: {frame[1]}")
        return frame[1]

    def wait(self, wakeable: bool) -> bool:
        """Block until a frame arrives (True) or, when ``wakeable``, ``wake()`` was called
        (False). Raises ``EngineDeadError`` once the core is gone."""
        while True:
            events = dict(self.poller.poll(_POLL_MS))
            if self.outputs in events:
                return True
            if self.wake_r in events:
                self._drain_wakes()
                if wakeable:
                    return False
            elif not events and (why := self.death()) is not None:
                raise EngineDeadError(why)

    def _drain_wakes(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"w")
        except (BlockingIOError, OSError):  # a full pipe wakes all the same; closed: no loop
            pass

    def receive_all(self) -> list[list]:
        frames = []
        while True:
            try:
                frames.append(wire.decode(self.outputs.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return frames

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it, kill it if it will not; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.process.is_alive():
            try:
                self.send([wire.STOP])
            except (zmq.ZMQError, EngineDeadError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            logger.error("the engine core did not stop in %.0fs; killing it", timeout)
            self.process.kill()
            self.process.join(5.0)
        self.commands.close(linger=0)
        self.outputs.close(linger=0)
        self.ctx.term()
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.forget_sockets()


class EngineCoreClient:
    """``LLMEngine``'s surface over the core process; ``AsyncEngine`` drives it as it would
    drive the engine (every method but the read-only facts from its loop thread)."""

    def __init__(self, channel: _Channel, tokenizer: Tokenizer, facts: dict) -> None:
        self._channel = channel
        self.tokenizer = tokenizer
        self.info = wire.convert(facts["info"], EngineInfo)
        self.task = facts["task"]
        self.model_config = None  # pooling models are not served this way (add_request)
        # the server reads the scheduling policy as ``engine.scheduler.config.policy``
        self.scheduler = types.SimpleNamespace(
            config=types.SimpleNamespace(policy=facts["policy"]))
        self.fault_hook = None  # the core runs --test-faults; nothing is injected here
        self.last_step = StepInfo()
        self._grammars = _grammar_backend(tokenizer, self.info, facts)
        self._kv_role: str | None = facts["kv_role"]
        self._loras = [wire.convert(x, LoRARequest) for x in facts["loras"]]
        self._stats = _stats(facts["stats"])
        self._mirror = wire.OutputMirror()
        self._frames: list[list] = []  # received, not yet taken by step()
        self._failures: dict[str, str] = {}
        self._replies: dict[int, list] = {}
        self._call_ids = itertools.count()
        self._adds_sent = 0
        self._adds_taken = 0  # by the core, as its latest frame said
        self._commands_sent = 0  # the core answers each with a frame: stats after an abort
        self._commands_taken = 0

    # ----- facts and checks (any thread) ----------------------------------------------------

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        check_prompt(token_ids, self.info.max_model_len, self.info.vocab_size, param)

    def compile_grammar(self, spec: StructuredOutputs | None) -> CompiledGrammar | None:
        """Compiled here to refuse a bad constraint before anything is sent (thread-safe,
        cached); the core compiles the request's constraint again from its own cache."""
        if spec is None:
            return None
        if self._grammars is None:
            raise ValueError(f"{spec.param}: this engine was built without structured output")
        return self._grammars.compile(spec)

    def check_health(self) -> None:
        why = self._channel.death()
        if why is not None:
            raise RuntimeError(why)

    def heartbeat_ages(self) -> dict[int, float]:
        return {}  # the core's executor watches its own workers

    def list_loras(self) -> list[LoRARequest]:
        return list(self._loras)

    def wake(self) -> None:
        """A command is queued for the loop thread: end its wait in ``step()``."""
        self._channel.wake()

    # ----- requests (the loop thread) -------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int] | tuple[str, str],
                    params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    grammar: CompiledGrammar | None = None,
                    kv_transfer_params: dict | None = None,
                    lora_request: LoRARequest | str | None = None) -> None:
        """Check what can be checked here (ValueError, nothing sent) and send the add."""
        if isinstance(params, PoolingParams) or isinstance(prompt, tuple):
            raise ValueError("embeddings and scores are not served with --engine-process")
        if request_id in self._mirror:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) \
            else (None, [int(t) for t in prompt])
        self.check_prompt(ids)
        params = params or SamplingParams()
        if kv_transfer_params is not None:
            self._check_kv_transfer(kv_transfer_params, params)
        self._command([wire.ADD, request_id, ids, params, priority,
                       cache_salt, kv_transfer_params, self._lora_name(lora_request),
                       arrival_time])
        self._adds_sent += 1
        self._mirror.add(request_id, text, ids)

    def _check_kv_transfer(self, kv_params: Mapping, params: SamplingParams) -> None:
        """``LLMEngine``'s check, here: its ValueError is the client's 400, not a failure."""
        from tokenmill.kv_transfer.pd import check_kv_transfer_params

        if not isinstance(kv_params, Mapping):
            raise ValueError("kv_transfer_params: must be an object")
        check_kv_transfer_params(kv_params, self._kv_role)
        if kv_params.get("do_remote_decode") and params.n != 1:
            raise ValueError("kv_transfer_params: do_remote_decode prefills one sequence; "
                             "ask the decode instance for n > 1")

    def _command(self, frame: list) -> None:
        self._channel.send(frame)
        self._commands_sent += 1

    def _lora_name(self, lora: LoRARequest | str | None) -> str | None:
        if lora is None:
            return None
        name = lora if isinstance(lora, str) else lora.lora_name
        current = next((x for x in self._loras if x.lora_name == name), None)
        if current is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        if isinstance(lora, LoRARequest) and lora.fingerprint \
                and lora.fingerprint != current.fingerprint:  # as LoRARegistry.resolve refuses
            raise LoRAError(f"LoRA adapter {name!r} was replaced by other weights since this "
                            "request named it")
        return name

    def abort_request(self, request_id: str) -> bool:
        known = request_id in self._mirror
        self._mirror.forget(request_id)
        if self._channel.death() is None:  # a dead core has freed everything already
            self._command([wire.ABORT, request_id])
        return known

    def current_output(self, request_id: str) -> RequestOutput | None:
        return self._mirror.current(request_id)

    def has_pending_work(self) -> bool:
        return bool(self._mirror) or bool(self._frames) \
            or self._commands_sent > self._commands_taken

    def take_failures(self) -> dict[str, str]:
        failures, self._failures = self._failures, {}
        return failures

    def fail_step(self, request_ids: Sequence[str], error: Exception) -> None:
        """This side's accounting of a step failed: its requests end in the core too."""
        for request_id in request_ids:
            self.abort_request(request_id)

    def stats(self) -> EngineStats:
        # adds sent but not yet taken by the core count as waiting: neither side has them
        # otherwise, and a drain or the admission count would miss them
        in_flight = self._adds_sent - self._adds_taken
        if not in_flight:
            return self._stats
        return replace(self._stats, num_waiting=self._stats.num_waiting + in_flight)

    def step(self) -> list[RequestOutput]:
        """The outputs of every step the core ran since the last call (each request's newest),
        or [] when woken for a command first. Raises ``EngineDeadError`` when the core died."""
        self.last_step = StepInfo()
        if not self._frames:
            self._channel.wait(wakeable=True)
        self._receive()
        frames, self._frames = self._frames, []
        outputs: dict[str, RequestOutput] = {}
        for frame in frames:
            if frame[0] == wire.DEAD:
                self._channel.forget_sockets()
                raise EngineDeadError(f"the engine core stopped: {frame[1]}")
            self._absorb(frame, outputs)
        return list(outputs.values())

    def _receive(self) -> None:
        """Take every frame that arrived; call replies and the adapters' list are read at
        once (a call waits for them), the rest when ``step()`` takes the frame."""
        for frame in self._channel.receive_all():
            if frame[0] == wire.BATCH:
                self._commands_taken = frame[2]
                for call_id, ok, payload in frame[7]:
                    self._replies[call_id] = [ok, payload]
                if frame[8] is not None:
                    self._loras = [wire.convert(x, LoRARequest) for x in frame[8]]
            self._frames.append(frame)

    def _absorb(self, frame: list, outputs: dict[str, RequestOutput]) -> None:
        _, self._adds_taken, _, deltas, failures, step, stats, _, _ = frame
        self._stats = _stats(stats)
        for delta in deltas:
            out = self._mirror.apply(delta)
            if out is not None:
                outputs[out.request_id] = out
        for request_id, why in failures.items():
            self._mirror.forget(request_id)
            outputs.pop(request_id, None)
            self._failures[request_id] = why
        if step is not None:
            last = self.last_step
            self.last_step = StepInfo(last.num_batched_tokens + step[0],
                                      last.num_new_tokens + step[1],
                                      last.num_preemptions + step[2],
                                      last.scheduled_request_ids | frozenset(step[3]))

    # ----- calls into the core (the loop thread, between steps) ----------------------------

    def _call(self, name: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._command([wire.CALL, call_id, name, list(args)])
        while call_id not in self._replies:
            self._channel.wait(wakeable=False)
            self._receive()
            if any(f[0] == wire.DEAD for f in self._frames):
                raise EngineDeadError("the engine core stopped during a call")
        ok, payload = self._replies.pop(call_id)
        if not ok:
            raise wire.rebuild_error(payload)
        return payload

    def flush_prefix_cache(self) -> int:
        return self._call("flush_prefix_cache")

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        return wire.convert(self._call("add_lora", name, path, base_model_name), LoRARequest)

    def remove_lora(self, name: str) -> None:
        self._call("remove_lora", name)

    def shutdown(self) -> None:
        """Stop the core (its executor with it) and close the channel; idempotent."""
        self._channel.close()


def _grammar_backend(tokenizer: Tokenizer, info: EngineInfo, facts: dict) -> Any:
    if not facts["structured"]:
        return None
    from tokenmill.structured.backend import GrammarBackend

    return GrammarBackend(tokenizer.backend.to_str(), info.vocab_size, facts["eos_token_ids"])


def _stats(raw: dict) -> EngineStats:
    stats = wire.convert(raw, EngineStats)
    if isinstance(stats.spec, dict):  # sent as a plain map: the metrics read its fields
        from tokenmill.speculative.decoder import SpecStats

        stats = replace(stats, spec=wire.convert(stats.spec, SpecStats))
    if stats.kv_tiers:  # the same, one plain map per KV tier
        from tokenmill.kv_transfer.base import TierStats

        stats = replace(stats, kv_tiers={name: wire.convert(t, TierStats)
                                         for name, t in stats.kv_tiers.items()})
    return stats
