"""``tokenmill serve --data-parallel-size N``: N engine replicas behind the router on one port.

The parent process runs no engine. It starts N ``tokenmill serve`` children on 127.0.0.1, each
pinned to its own share of the usable cores, waits until every one answers ``/health``, then
serves the router in front of them on the user's host and port. A supervisor thread restarts a
replica that dies (with a growing back-off) on the same URL, so the router's health checks eject
it and admit it again. Nothing outlives the parent: each child leads its own process group
(stopped as a group), asks the kernel for SIGTERM when the parent dies (``PR_SET_PDEATHSIG``),
and an ``atexit`` hook stops whatever is left.

The children are started through ``python -m tokenmill.router.replicas``, a tiny wrapper that
sets the core mask and the death signal, then ``exec``s the server: doing that in a
``preexec_fn`` is unsafe once the parent has threads (the supervisor, uvicorn's).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from tokenmill.errors import TokenmillError
from tokenmill.router.config import RouterConfig

logger = logging.getLogger("tokenmill.router.replicas")

# Flags of ``serve`` that belong to the parent: stripped from what each replica is given.
PARENT_FLAGS = ("--data-parallel-size", "--port", "--host", "--router-policy")
START_TIMEOUT_S = 600.0  # loading a model on a busy machine; a child that dies fails at once
TAIL_LINES = 40  # of a child's output, kept to explain its death
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ChildStartError(TokenmillError):
    """A child server died or hung while starting; the message carries its last output."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the child binds it a moment later; a clash makes that
    child fail to start, which is reported, not hidden)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_cores(cpus: Sequence[int], n: int, may_share: bool = False) -> list[tuple[int, ...]]:
    """Disjoint, contiguous core sets for ``n`` replicas (the first ones get the remainder), so
    no two replicas' threads fight over a core. More replicas than cores share all of them when
    ``may_share`` (the user chose each replica's threads), else it is an error."""
    cpus = sorted(cpus)
    if n < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    if n > len(cpus) and may_share:
        return [tuple(cpus)] * n
    if n > len(cpus):
        raise ValueError(
            f"--data-parallel-size {n} needs at least {n} usable cores, this process has "
            f"{len(cpus)}; to run replicas on shared cores deliberately, give each its threads "
            f"with --num-threads")
    base, extra = divmod(len(cpus), n)
    sets, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        sets.append(tuple(cpus[start:start + size]))
        start += size
    return sets


def strip_parent_flags(serve_argv: Sequence[str]) -> list[str]:
    """``serve``'s arguments without the parent's own flags (as ``--flag V`` or ``--flag=V``,
    or any abbreviation argparse accepted for them)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=True)
    for flag in PARENT_FLAGS:
        p.add_argument(flag)
    _, rest = p.parse_known_args(list(serve_argv))
    return rest


def kv_events_config(rank: int) -> str:
    """Replica ``rank``'s ``--kv-events-config``: vLLM's JSON, port 0 on loopback (the replica
    binds free ports and reports them in ``/server_info``, where the router reads them); the
    rank is stamped on its batches, as vLLM's data-parallel engines do."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0",
                       "topic": "kv-events", "data_parallel_rank": rank})


# ----- one child process ------------------------------------------------------------------------

@dataclass(eq=False)  # hashed by identity: kept in a set of live children
class ChildProcess:
    """A ``tokenmill serve`` child: its own process group, optionally pinned to ``cores``, its
    output echoed with ``name`` in front and the last lines kept for error messages."""

    name: str
    argv: tuple[str, ...]  # the command the wrapper execs
    cores: tuple[int, ...] | None = None
    echo: bool = True
    env: dict[str, str] | None = None  # added to ours
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    _tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    _reader: threading.Thread | None = None

    def start(self) -> None:
        """Spawn it through the wrapper (cores and the parent-death signal set before exec)."""
        wrapper = [sys.executable, "-m", "tokenmill.router.replicas", "--parent", str(os.getpid())]
        if self.cores is not None:
            wrapper += ["--cores", ",".join(map(str, self.cores))]
        self._tail.clear()
        self.proc = subprocess.Popen([*wrapper, "--", *self.argv], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env={**os.environ, **self.env} if self.env else None)
        self.started_at = time.monotonic()
        self._reader = threading.Thread(target=self._pump, args=(self.proc,), daemon=True,
                                        name=f"{self.name}-log")
        self._reader.start()
        _LIVE.add(self)

    def _pump(self, proc: subprocess.Popen) -> None:
        """Copy the child's output to ours line by line (a full pipe would stall the child)."""
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._tail.append(line)
            if self.echo:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        """None while it runs (or was never started)."""
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 20) -> str:
        return "\n".join(list(self._tail)[-lines:])

    def stop(self, timeout: float = 40.0) -> None:
        """SIGTERM to its whole group (a graceful drain), SIGKILL to the group after
        ``timeout`` s; a no-op once it is gone."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc.pid, signal.SIGKILL)  # its own children too, if any stayed
        proc.wait()
        if self._reader is not None:  # its last lines, for the error message
            self._reader.join(timeout=2.0)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_LIVE: set[ChildProcess] = set()


@atexit.register
def _stop_leftovers() -> None:
    """Whatever a crash path left running goes with us (SIGKILL: no time to drain)."""
    for child in list(_LIVE):
        if child.proc is not None:
            _signal_group(child.proc.pid, signal.SIGKILL)


def wait_healthy(children: Sequence[ChildProcess], urls: Sequence[str],
                 timeout: float = START_TIMEOUT_S) -> None:
    """Until every child answers 200 on ``/health``. A child that exits meanwhile, or a
    timeout, raises ``ChildStartError`` naming it with the end of its output."""
    import httpx

    pending = dict(zip(urls, children))
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for url, child in list(pending.items()):
                _check_alive(child)
                if _answers_health(client, url):
                    logger.info("%s is healthy at %s", child.name, url)
                    del pending[url]
            if pending and time.monotonic() > deadline:
                child = next(iter(pending.values()))
                raise ChildStartError(f"{child.name} did not become healthy in {timeout:.0f}s; "
                                   f"its last output:\n{child.tail()}")
            if pending:
                time.sleep(0.3)


def _check_alive(child: ChildProcess) -> None:
    code = child.exit_code()
    if code is not None:
        child.stop(timeout=1.0)
        raise ChildStartError(f"{child.name} exited with status {code} while starting; its last "
                           f"output:\n{child.tail()}")


def _answers_health(client, url: str) -> bool:
    import httpx

    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


# ----- the replica set --------------------------------------------------------------------------

@dataclass(frozen=True)
class DataParallelConfig:
    """What ``serve --data-parallel-size N`` runs: the replicas' command line (the user's serve
    flags, less the parent's), their core sets, and the router in front."""

    size: int
    serve_argv: tuple[str, ...]  # what follows ``serve`` on the user's command line
    router: RouterConfig  # host, port, policy, keys; workers are filled in at start
    may_share_cores: bool = False  # the user set --num-threads: more replicas than cores is ok
    kv_events: bool = True  # give each replica a --kv-events-config (exact cache_aware)
    # one GPU per replica (CUDA_VISIBLE_DEVICES of replica i: gpus[i]); None: CPU replicas
    gpus: tuple[str, ...] | None = None
    start_timeout_s: float = START_TIMEOUT_S
    restart_backoff_s: tuple[float, float] = (1.0, 30.0)  # first and longest wait
    stable_after_s: float = 60.0  # up this long: the back-off starts over

    def replica_argv(self, rank: int, port: int) -> tuple[str, ...]:
        argv = [sys.executable, "-m", "tokenmill.cli", "serve",
                *strip_parent_flags(self.serve_argv), "--host", "127.0.0.1", "--port", str(port)]
        if self.kv_events:
            argv += ["--kv-events-config", kv_events_config(rank)]
        return tuple(argv)


def _gpu_env(gpus: tuple[str, ...] | None, rank: int) -> dict[str, str] | None:
    """Replica ``rank`` sees one GPU, its own, as ``cuda`` (device 0 inside it)."""
    return None if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus[rank]}


class ReplicaSet:
    """The N replica processes, started together and kept running by a supervisor thread."""

    def __init__(self, cfg: DataParallelConfig, cpus: Sequence[int] | None = None,
                 command: Callable[[int, int], Sequence[str]] | None = None):
        """``command(rank, port)``: a replica's command line (tests start fake servers);
        default ``cfg.replica_argv``."""
        self.cfg = cfg
        command = command or cfg.replica_argv
        if cfg.gpus is not None and len(cfg.gpus) < cfg.size:
            raise ValueError(f"--data-parallel-size {cfg.size} needs a GPU per replica; "
                             f"CUDA_VISIBLE_DEVICES has {len(cfg.gpus)}")
        cores = split_cores(cpus if cpus is not None else sorted(os.sched_getaffinity(0)),
                            cfg.size, cfg.may_share_cores)
        ports = [free_port() for _ in range(cfg.size)]
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.children = [ChildProcess(f"replica {i}", tuple(command(i, port)), cores[i],
                                      env=_gpu_env(cfg.gpus, i))
                          for i, port in enumerate(ports)]
        self._stopping = threading.Event()
        self._failures = [0] * cfg.size
        self._supervisor: threading.Thread | None = None

    def start(self) -> None:
        """Start all, wait until each is healthy (any failure stops them all and raises), then
        supervise."""
        for child, url in zip(self.children, self.urls):
            child.start()
            logger.info("%s: %s, pid %d, cores %s", child.name, url, child.pid,
                        ",".join(map(str, child.cores or ())))
        try:
            wait_healthy(self.children, self.urls, self.cfg.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, daemon=True,
                                            name="replica-supervisor")
        self._supervisor.start()

    def _supervise(self) -> None:
        """Restart a replica that exited, after 1, 2, 4 ... 30 s in a row of failures; a replica
        that stayed up ``stable_after_s`` starts the count over."""
        due: dict[int, float] = {}
        while not self._stopping.wait(0.5):
            for i, child in enumerate(self.children):
                if child.proc is not None and child.exit_code() is not None:
                    due[i] = self._note_exit(i, child)
                if i in due and time.monotonic() >= due[i] and not self._stopping.is_set():
                    del due[i]
                    child.start()
                    logger.warning("%s restarted: pid %d", child.name, child.pid)

    def _note_exit(self, i: int, child: ChildProcess) -> float:
        """Log the death, forget the process, return when to start it again."""
        code = child.exit_code()
        child.stop(timeout=1.0)  # reaps it and any of its group still there; its last lines read
        if time.monotonic() - child.started_at > self.cfg.stable_after_s:
            self._failures[i] = 0
        first, longest = self.cfg.restart_backoff_s
        wait = min(longest, first * 2 ** self._failures[i])
        self._failures[i] += 1
        logger.error("%s exited with status %s; restarting in %.0fs. Its last output:\n%s",
                     child.name, code, wait, child.tail())
        return time.monotonic() + wait

    def stop(self) -> None:
        """Stop supervising, then every replica (in parallel: each may drain for a while)."""
        self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
        threads = [threading.Thread(target=c.stop) for c in self.children]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class _Terminated(Exception):
    """SIGTERM arrived: leave through the clean-up path."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def run_data_parallel(cfg: DataParallelConfig, serve: Callable[[RouterConfig], None],
                      command: Callable[[int, int], Sequence[str]] | None = None) -> int:
    """Start the replicas, run ``serve`` (``app.serve_router``: passed in, as the app imports
    this package's launcher) in front of them until SIGINT/SIGTERM, stop all. Returns 0 on a
    clean stop; a replica that fails to start raises ``ChildStartError``. ``command`` stands in
    for the replicas in tests."""
    logging.basicConfig(level=getattr(logging, cfg.router.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.router.log_level != "debug":  # a line per health probe otherwise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    replicas = ReplicaSet(cfg, command=command)  # too many replicas for the cores fails here
    # uvicorn re-raises the signal that stopped it once it is done: a handler (not death by the
    # signal) is what lets the replicas be stopped in order after the router.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        replicas.start()
        logger.info("router on http://%s:%d in front of %d replicas", cfg.router.host,
                    cfg.router.port, cfg.size)
        serve(replace(cfg.router, workers=tuple(replicas.urls)))
    except _Terminated:
        pass
    finally:
        # a second SIGTERM ends us at once; the replicas then get theirs from the kernel
        signal.signal(signal.SIGTERM, previous)
        replicas.stop()
    return 0


# ----- the wrapper a child runs before exec ------------------------------------------------------

def _set_parent_death_signal(parent: int) -> None:
    """Linux: SIGTERM to us when the parent dies; gone already → exit now (it might have died
    before the request took effect)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's atexit hook and group stop remain
    if os.getppid() != parent:
        sys.exit(1)


def _wrapper_main(argv: Sequence[str]) -> None:
    """``python -m tokenmill.router.replicas --parent PID [--cores 0,1] -- COMMAND...``."""
    p = argparse.ArgumentParser(prog="python -m tokenmill.router.replicas")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--cores", default=None)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to run")
    if args.cores:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    _set_parent_death_signal(args.parent)
    os.execv(command[0], command)


if __name__ == "__main__":
    _wrapper_main(sys.argv[1:])
