"""The engine core process (``tokenmill serve --engine-process``): an ``LLMEngine`` stepping in
a loop of its own, never waiting on HTTP.

It takes commands from its client (``core_client.py``) on one ZMQ socket and answers on
another, one frame per loop turn (``core_wire.py``): add acks, call replies and the step's
output deltas together. Between steps it reads every command already queued without waiting;
with nothing to run it waits on the socket. Its parent gone (the server killed outright), it
stops its executor and exits: no orphaned core keeps a GPU or the cores busy.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from tokenmill.engine import core_wire as wire
from tokenmill.engine.llm_engine import EngineDeadError, LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.structured.backend import CompiledGrammar

logger = logging.getLogger("tokenmill.engine.core")

_IDLE_POLL_MS = 500  # how often an idle core checks that its parent lives
_COMPILE_POLL_MS = 5  # how often a core with nothing else to do looks at its compiles


@dataclass(frozen=True)
class CoreSpec:
    """How to build the core's engine (what ``tokenmill serve`` would build in-process) and
    where its client listens. Sent to the spawned process as its argument."""

    model: str
    options: dict
    served_model_name: str
    lora_modules: list = field(default_factory=list)  # lora_modules.LoRAModule
    faults: str | None = None  # --test-faults (tests only: engine/faults.py)
    log_level: str = "info"
    commands_addr: str = ""  # the client binds both; the core connects
    outputs_addr: str = ""
    socket_dir: str = ""  # the folder holding both sockets: the core removes it if orphaned
    parent_pid: int = 0


def run_core(spec: CoreSpec) -> None:
    """The process' entry point: build the engine, say READY (or FAILED), loop until STOP."""
    # Ctrl+C reaches the whole group: the server drains its requests first, then sends STOP
    # (a core that died at once would fail them all). SIGTERM still ends it: multiprocessing
    # terminates daemon children that way when the server exits without STOP.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, spec.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    commands, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    commands.connect(spec.commands_addr)
    outputs.connect(spec.outputs_addr)
    engine = _load(spec, outputs)
    try:
        if engine is not None:
            outputs.send(wire.encode([wire.READY, _facts(engine)]))
            CoreLoop(engine, commands, outputs, spec.parent_pid).run()
    finally:
        if engine is not None:
            engine.shutdown()
        commands.close(linger=0)
        outputs.close(linger=2000)  # the last frame (DEAD, FAILED) still goes out
        ctx.term()
        if spec.socket_dir and os.getppid() != spec.parent_pid:  # the server died uncleaned
            shutil.rmtree(spec.socket_dir, ignore_errors=True)


def _load(spec: CoreSpec, outputs: zmq.Socket) -> LLMEngine | None:
    """The engine, or None once FAILED (and why) was sent."""
    gc.disable()  # loading makes ~190k long-lived objects: no collections while they pile up
    try:
        engine = _build(spec)
    except (TokenmillError, ValueError) as e:  # a bad setting: the server says it in one line
        outputs.send(wire.encode([wire.FAILED, f"{type(e).__name__}: {e}"]))
        return None
    except BaseException as e:
        logger.exception("the engine core could not start")
        outputs.send(wire.encode([wire.FAILED, f"{type(e).__name__}: {e}"]))
        return None
    finally:
        gc.enable()
    # What exists now lives as long as the core: out of the collector's view, a full
    # collection no longer stalls a step for ~100 ms walking the model's objects.
    gc.collect()
    gc.freeze()
    return engine


def _build(spec: CoreSpec) -> LLMEngine:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.faults import FaultPlan
    from tokenmill.engine.lora_modules import load_lora_modules

    engine = LLMEngine.from_config(EngineConfig.from_options(spec.model, **spec.options))
    engine.fault_hook = FaultPlan.parse(spec.faults) if spec.faults else None
    load_lora_modules(engine, spec.served_model_name, spec.lora_modules)
    return engine


def _facts(engine: LLMEngine) -> dict:
    """What the client serves from without asking: fixed facts and the adapters now."""
    return dict(info=engine.info, task=engine.task, policy=engine.scheduler.config.policy,
                kv_role=getattr(engine.scheduler.connector, "role", None),
                eos_token_ids=sorted(engine.scheduler.eos_token_ids),
                structured=engine.structured is not None,
                loras=engine.list_loras(), stats=engine.stats())


class CoreLoop:
    def __init__(self, engine: LLMEngine, commands: zmq.Socket, outputs: zmq.Socket,
                 parent_pid: int) -> None:
        self.engine = engine
        self.commands = commands
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.deltas = wire.OutputDeltas()
        self.stopping = False
        self._adds_taken = 0
        self._commands_taken = 0  # every frame is answered: the client waits for the count
        self._refused: dict[str, str] = {}  # adds the engine refused since the last frame
        self._replies: list[list] = []
        self._loras_changed = False
        # Adds whose output constraint compiles on a thread (a new JSON schema can take
        # seconds): the steps of every other request go on meanwhile, as in one process,
        # where the server compiles before it queues. Taken into the engine once compiled.
        self._compiling: dict[str, tuple[Future, tuple]] = {}
        self._compiler: ThreadPoolExecutor | None = None

    def run(self) -> None:
        while not self.stopping:
            busy = self.engine.has_pending_work()
            wait = 0 if busy else _COMPILE_POLL_MS if self._compiling else _IDLE_POLL_MS
            took = self.commands.poll(wait) and self._take_commands()
            took += self._take_compiled()
            if os.getppid() != self.parent_pid:
                logger.error("the server process is gone; the engine core stops")
                return
            if self.stopping:
                return
            if self.engine.has_pending_work():
                self._step()
            elif took:  # an abort's freed blocks, a call's reply: the client waits for them
                self._send([], {})

    def _take_commands(self) -> int:
        taken = 0
        while True:
            try:
                frame = wire.decode(self.commands.recv(zmq.NOBLOCK))
            except zmq.Again:
                return taken
            self._apply(frame)
            taken += 1
            self._commands_taken += 1

    def _apply(self, frame: list) -> None:
        kind = frame[0]
        if kind == wire.ADD:
            self._add(*frame[1:])
        elif kind == wire.ABORT:
            if self._compiling.pop(frame[1], None) is not None:
                self._adds_taken += 1  # taken, and gone
            self.engine.abort_request(frame[1])
            self.deltas.forget(frame[1])
        elif kind == wire.CALL:
            self._call(*frame[1:])
        elif kind == wire.STOP:
            self.stopping = True

    def _add(self, request_id: str, *fields: Any) -> None:
        """``fields``: prompt, params, priority, cache salt, KV hand-over, adapter, arrival."""
        params = wire.convert(fields[1], SamplingParams)
        fields = (fields[0], params, *fields[2:])
        spec = params.structured_outputs
        if spec is None or self.engine.structured is None:
            self._admit(request_id, fields, None)
            return
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(2, thread_name_prefix="tokenmill-grammar")
        self._compiling[request_id] = (self._compiler.submit(self.engine.compile_grammar, spec),
                                       fields)

    def _take_compiled(self) -> int:
        done = [rid for rid, (future, _) in self._compiling.items() if future.done()]
        for request_id in done:
            future, fields = self._compiling.pop(request_id)
            try:
                grammar = future.result()
            except Exception as e:  # the client compiled it already: a rare refusal
                self._adds_taken += 1
                self._refused[request_id] = f"{type(e).__name__}: {e}"
                continue
            self._admit(request_id, fields, grammar)
        return len(done)

    def _admit(self, request_id: str, fields: tuple, grammar: CompiledGrammar | None) -> None:
        prompt, params, priority, cache_salt, kv_params, lora, arrival = fields
        self._adds_taken += 1
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority,
                                    arrival_time=arrival, cache_salt=cache_salt,
                                    grammar=grammar, kv_transfer_params=kv_params,
                                    lora_request=lora)
        except Exception as e:  # the client checked what it could; the rest fails the request
            self._refused[request_id] = f"{type(e).__name__}: {e}"

    def _call(self, call_id: int, name: str, args: list) -> None:
        calls = {"flush_prefix_cache": self.engine.flush_prefix_cache,
                 "add_lora": self.engine.add_lora, "remove_lora": self.engine.remove_lora}
        try:
            result = calls[name](*args)
        except Exception as e:
            self._replies.append([call_id, False, wire.error_fields(e)])
        else:
            self._replies.append([call_id, True, result])
        self._loras_changed = name != "flush_prefix_cache"

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError as e:
            logger.exception("the engine core's engine is dead")
            self.outputs.send(wire.encode([wire.DEAD, f"{type(e).__name__}: {e}"]))
            self.stopping = True
            return
        failures = self.engine.take_failures()
        for request_id in failures:
            self.deltas.forget(request_id)
        self._send([self.deltas.delta(o) for o in outputs], failures, stepped=True)

    def _send(self, deltas: list, failures: dict[str, str], stepped: bool = False) -> None:
        step = self.engine.last_step
        failures.update(self._refused)
        frame = [wire.BATCH, self._adds_taken, self._commands_taken, deltas, failures,
                 [step.num_batched_tokens, step.num_new_tokens, step.num_preemptions,
                  sorted(step.scheduled_request_ids)] if stepped else None,
                 self.engine.stats(), self._replies,
                 self.engine.list_loras() if self._loras_changed else None]
        self.outputs.send(wire.encode(frame))
        self._refused, self._replies, self._loras_changed = {}, [], False
