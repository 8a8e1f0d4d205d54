"""Models started on demand: ``tokenmill router --models FILE``.

The file names each model a client may ask for and how to start its tokenmill worker::

    models:
      chat:   {model: smollm2-135m-instruct, args: [--max-num-seqs, "32"], preload: true}
      coder:  {model: /models/coder.gguf}

A request for a model that no worker serves starts it (``ensure``); past ``max_running_models``
the least recently used model with no request in flight is stopped first — removed from the pool
before its process is told to go, so nothing new is routed to it. A model that is serving is
never stopped: a start that finds every slot busy waits for one to go idle, then gives up with
``ModelUnavailable`` (503 with Retry-After), so a burst of requests for many models queues
rather than deadlocks.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.errors import TokenmillError
from tokenmill.router.replicas import (START_TIMEOUT_S, ChildProcess, ChildStartError,
                                       free_port, wait_healthy)

if TYPE_CHECKING:
    from tokenmill.router.config import RouterConfig

_SPEC_KEYS = frozenset({"model", "args", "preload"})
# set by the launcher itself for every model it starts
_RESERVED_ARGS = ("--host", "--port", "--served-model-name", "--data-parallel-size",
                  "--api-key")


class ModelUnavailable(TokenmillError):
    """A model could not be made ready: its start failed or timed out, or every running model
    stayed busy. The router answers ``status`` with a Retry-After of ``retry_after`` s."""

    status = 503

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the models file: the name clients send, and how to start its worker."""

    name: str
    model: str  # a .gguf file, a Hugging Face directory or a known name
    args: tuple[str, ...] = ()  # further ``tokenmill serve`` flags
    preload: bool = False  # started with the router, not on the first request


# ----- the models file --------------------------------------------------------------------------

def load_models_file(path: str) -> dict[str, ModelSpec]:
    """Read and check a models file; every mistake is a ``ValueError`` naming the entry."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read the models file {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    return parse_models(data, path)


def parse_models(data: Any, source: str = "models file") -> dict[str, ModelSpec]:
    """``{"models": {name: {model, args, preload}}}`` -> specs by name."""
    if not isinstance(data, dict) or set(data) != {"models"}:
        raise ValueError(f"{source}: expected one top-level key, 'models' (a mapping of model "
                         f"name to its settings)")
    models = data["models"]
    if not isinstance(models, dict) or not models:
        raise ValueError(f"{source}: 'models' must be a non-empty mapping of name -> settings")
    return {str(name): _parse_spec(name, entry, f"{source}: models.{name}")
            for name, entry in models.items()}


def _parse_spec(name: Any, entry: Any, where: str) -> ModelSpec:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: a model name must be a non-empty string")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with 'model' (and optionally 'args', "
                         f"'preload')")
    unknown = set(entry) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                         f"allowed: {', '.join(sorted(_SPEC_KEYS))}")
    model, args, preload = entry.get("model"), entry.get("args", []), entry.get("preload", False)
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"{where}.model: required, a path or a known model name")
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
        raise ValueError(f"{where}.args: must be a list of command-line arguments")
    args = [str(a) for a in args]
    for a in args:
        if a.split("=", 1)[0] in _RESERVED_ARGS:
            raise ValueError(f"{where}.args: {a.split('=', 1)[0]} is set by the router itself")
    if not isinstance(preload, bool):
        raise ValueError(f"{where}.preload: must be true or false")
    return ModelSpec(name, model, tuple(args), preload)


# ----- the launcher -----------------------------------------------------------------------------

class PoolLike(Protocol):
    """What the launcher needs of the router's ``WorkerPool``."""

    def add(self, url: str, models: Sequence[str] = ()) -> Any: ...

    def remove(self, url: str) -> Any: ...


@dataclass(eq=False)
class _Running:
    child: ChildProcess
    url: str
    worker: Any  # the pool's Worker: its in_flight says whether the model is serving


def serve_command(spec: ModelSpec, port: int) -> list[str]:
    """The ``tokenmill serve`` command line of one model's worker."""
    return [sys.executable, "-m", "tokenmill.cli", "serve", spec.model, *spec.args,
            "--served-model-name", spec.name, "--host", "127.0.0.1", "--port", str(port)]


class ModelLauncher:
    """Starts and stops one tokenmill worker per model on demand, at most
    ``max_running_models`` at once, least recently used first out."""

    def __init__(self, specs: dict[str, ModelSpec], max_running_models: int = 2,
                 api_key: str | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 busy_timeout_s: float = 60.0, idle_grace_s: float = 2.0,
                 command: Callable[[ModelSpec, int], list[str]] = serve_command):
        if max_running_models < 1:
            raise ValueError("max_running_models must be >= 1")
        preloads = [s.name for s in specs.values() if s.preload]
        if len(preloads) > max_running_models:
            raise ValueError(f"{len(preloads)} models have preload: true "
                             f"({', '.join(preloads)}), more than max_running_models "
                             f"({max_running_models})")
        self.specs = dict(specs)
        self.max_running_models = max_running_models
        self.api_key = api_key
        self.start_timeout_s = start_timeout_s
        self.busy_timeout_s = busy_timeout_s
        # a model ensured this recently is about to get its request: not a victim yet
        self.idle_grace_s = idle_grace_s
        self._command = command
        self._running: dict[str, _Running] = {}
        self._starting: set[str] = set()
        self._last_used: dict[str, float] = {}
        self._locks = {name: asyncio.Lock() for name in specs}  # one start at a time per model
        self._slots = asyncio.Lock()  # one decision at a time about which models run
        self._created = int(time.time())

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> ModelLauncher:
        """The launcher of ``cfg.models_file`` (which must be set)."""
        if not cfg.models_file:
            raise ValueError("no models file given (--models FILE)")
        return cls(load_models_file(cfg.models_file), cfg.max_running_models,
                   api_key=cfg.worker_api_key)

    # ----- what the router asks ----------------------------------------------------------------

    def known(self, model: str) -> bool:
        return model in self.specs

    def running(self) -> list[str]:
        """Models whose worker process is alive now (healthy or not)."""
        return [name for name in self._running if self._alive(name)]

    def cards(self) -> list[dict]:
        """OpenAI model cards of every model in the file, with whether it runs now."""
        return [{"id": name, "object": "model", "created": self._created,
                 "owned_by": "tokenmill", "status": self._status(name)} for name in self.specs]

    def _status(self, name: str) -> str:
        if name in self._starting:
            return "starting"
        return "running" if self._alive(name) else "stopped"

    def touch(self, model: str) -> None:
        """A request used ``model``: it becomes the most recently used."""
        if model in self.specs:
            self._last_used[model] = time.monotonic()

    async def ensure(self, model: str, pool: PoolLike) -> None:
        """Return once ``model`` has a healthy worker in ``pool``, starting it if needed.
        Raises ``KeyError`` for a model not in the file, ``ModelUnavailable`` when it cannot be
        made ready in time."""
        if model not in self.specs:
            raise KeyError(model)
        self.touch(model)
        if self._alive(model):
            return
        async with self._locks[model]:  # callers for a cold model all wait on one start
            if self._alive(model):
                return
            self._forget(model, pool)  # a worker that died since its start
            await self._make_room(model, pool)
            try:
                await self._start(model, pool)
            finally:
                self._starting.discard(model)
            self.touch(model)

    async def preload(self, pool: PoolLike) -> None:
        """Start the models marked ``preload`` (at the router's start-up)."""
        for spec in self.specs.values():
            if spec.preload:
                await self.ensure(spec.name, pool)

    async def shutdown(self) -> None:
        """Stop every worker this launcher started (in parallel; each drains)."""
        running, self._running = list(self._running.values()), {}
        await asyncio.gather(*(asyncio.to_thread(r.child.stop) for r in running))

    # ----- slots -------------------------------------------------------------------------------

    def _alive(self, name: str) -> bool:
        r = self._running.get(name)
        return r is not None and r.child.exit_code() is None

    def _forget(self, name: str, pool: PoolLike) -> None:
        r = self._running.pop(name, None)
        if r is not None:
            pool.remove(r.url)
            r.child.stop(timeout=1.0)  # already exited: reaps it at once

    def _occupied(self, pool: PoolLike) -> int:
        for name in [n for n in self._running if not self._alive(n)]:
            self._forget(name, pool)
        return len(self._running) + len(self._starting)

    async def _make_room(self, model: str, pool: PoolLike) -> None:
        """Reserve a slot for ``model``, stopping idle models as needed; waits while every
        running model is busy, up to ``busy_timeout_s``."""
        async with self._slots:
            deadline = time.monotonic() + self.busy_timeout_s
            while self._occupied(pool) >= self.max_running_models:
                victim = self._idle_victim()
                if victim is not None:
                    await self._stop(victim, pool)
                elif time.monotonic() > deadline:
                    raise ModelUnavailable(
                        f"cannot start model {model!r}: all {self.max_running_models} running "
                        f"models stayed busy for {self.busy_timeout_s:.0f}s "
                        f"(max_running_models)", retry_after=10)
                else:
                    await asyncio.sleep(0.1)
            self._starting.add(model)

    def _idle_victim(self) -> str | None:
        """The least recently used running model with no request in flight (and not used in
        the last ``idle_grace_s``: its request may be on its way)."""
        now = time.monotonic()
        idle = [n for n, r in self._running.items()
                if getattr(r.worker, "in_flight", 0) == 0
                and now - self._last_used.get(n, 0.0) >= self.idle_grace_s]
        return min(idle, key=lambda n: self._last_used.get(n, 0.0), default=None)

    async def _stop(self, name: str, pool: PoolLike) -> None:
        r = self._running.pop(name)
        pool.remove(r.url)  # first: nothing new is routed to it
        await asyncio.to_thread(r.child.stop)

    # ----- one start ---------------------------------------------------------------------------

    async def _start(self, model: str, pool: PoolLike) -> None:
        """Spawn the worker, wait until it answers /health, add it to the pool."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {"TOKENMILL_API_KEY": self.api_key} if self.api_key else None
        child = ChildProcess(f"model {model}", tuple(self._command(self.specs[model], port)),
                             env=env)
        child.start()
        try:
            await asyncio.to_thread(wait_healthy, [child], [url], self.start_timeout_s)
        except ChildStartError as e:
            hung = child.exit_code() is None  # running, but not answering in time
            await asyncio.to_thread(child.stop, 5.0)
            raise ModelUnavailable(str(e), retry_after=30 if hung else 5) from None
        except BaseException:
            await asyncio.to_thread(child.stop, 5.0)
            raise
        worker = pool.add(url, models=(model,))
        self._running[model] = _Running(child, url, worker)
