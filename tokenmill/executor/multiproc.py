"""The multi-process executor: ``tensor_parallel_size * pipeline_parallel_size`` ranks, each a
process holding its part of the model and its KV cache (``rank.py``), joined by
torch.distributed; the engine's process keeps the scheduler and samples.

Why the engine samples: the logits of a step (the last stage's first TP rank gathers the
vocabulary shards) come back as one frame, and everything sampling reads -- the requests'
histories and seeded generators, the grammar masks being filled while the forward runs, a
drafter's distributions -- is already here, so structured output, speculative decoding, seeds
and ``n > 1`` work as with one process, and no rank holds request state.

Launchers start the ranks: ``MpLauncher`` starts this node's processes (``--nnodes``: the
other nodes run ``tokenmill serve --node-rank N``, headless, which starts theirs:
``run_headless``); ``ray_launcher.RayLauncher`` places them as Ray actors. Failure: a monitor
thread watches every rank's heartbeat and this node's processes; a rank that exits, reports an error
or falls silent for ``worker_timeout`` s breaks the executor (``ExecutorError``) at once, mid-step
included.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.config import ModelConfig, ParallelConfig
from tokenmill.distributed.groups import Rendezvous
from tokenmill.distributed.layout import ParallelLayout
from tokenmill.executor import control
from tokenmill.executor.base import Executor, ExecutorError
from tokenmill.executor.rank import RankInit
from tokenmill.executor.worker import WorkerSpec

if TYPE_CHECKING:
    import torch

    from tokenmill.executor.kv_ranks import RankKVReports
    from tokenmill.request import LoRARequest
    from tokenmill.runner.rows import RowMasks
    from tokenmill.sched.output import ModelOutput, SchedulerOutput

logger = logging.getLogger("tokenmill.executor")


@dataclass(frozen=True)
class DistributedSpec:
    """What the engine's plan says of a distributed model (``ExecutionPlan.distributed_spec``)."""

    worker: WorkerSpec
    layout: ParallelLayout
    parallel: ParallelConfig
    model_config: ModelConfig  # the whole model's shape
    threads_per_rank: int
    cpu_sets: tuple[tuple[int, ...] | None, ...]  # per local rank
    settings: dict[str, Any]  # what every node's ranks must agree on


class Launcher(Protocol):
    def launch(self, inits: Sequence[RankInit]) -> None: ...

    def failure(self) -> str | None:
        """Why a rank it started is gone (None: all alive)."""

    def stop(self, timeout: float) -> None: ...

    def describe(self) -> str: ...


class MpLauncher:
    """This node's ranks as processes: ``python -m tokenmill.executor.rank``, each reading its
    pickled ``RankInit`` from stdin (a fresh interpreter: the caller's ``__main__`` is never
    re-imported, as multiprocessing's spawn would)."""

    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen] = {}

    def launch(self, inits: Sequence[RankInit]) -> None:
        for init in inits:
            p = subprocess.Popen([sys.executable, "-m", "tokenmill.executor.rank"],
                                 stdin=subprocess.PIPE)
            p.stdin.write(pickle.dumps(init))
            p.stdin.close()
            self.processes[init.rank] = p

    def failure(self) -> str | None:
        ended = {rank: code for rank, p in self.processes.items()
                 if (code := p.poll()) is not None}
        if not ended:
            return None
        # one killed by a signal is the cause; the others exit after their peer vanished
        rank = min(ended, key=lambda r: (ended[r] >= 0, r))
        code = ended[rank]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"rank {rank} (pid {self.processes[rank].pid}) {how}"

    def stop(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.processes.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def wait(self) -> int:
        """Until every rank has ended (headless nodes); the worst exit status."""
        return max(abs(p.wait()) for p in self.processes.values())

    def describe(self) -> str:
        return "processes"


def rank_inits(spec: DistributedSpec, rv: Rendezvous, addresses: control.Addresses,
               node_rank: int) -> list[RankInit]:
    """The ranks node ``node_rank`` starts."""
    per_node = spec.parallel.ranks_per_node
    first = node_rank * per_node
    return [RankInit(spec.worker, spec.layout, spec.model_config, rank, rank - first, rv,
                     addresses, spec.threads_per_rank, spec.cpu_sets[rank - first],
                     spec.settings, spec.parallel.worker_timeout)
            for rank in range(first, first + per_node)]


def node_endpoints(parallel: ParallelConfig) -> tuple[int, tuple[int, int, int]]:
    """The store's port and the control sockets' ports of a multi-node run: ``master_port``
    and the three after it."""
    port = parallel.master_port
    return port, (port + 1, port + 2, port + 3)


def run_id(parallel: ParallelConfig) -> str:
    """Names this run's shared-memory files: the same on every node (each has its own
    /dev/shm), different for every single-node run."""
    return f"port{parallel.master_port}" if parallel.nnodes > 1 else uuid.uuid4().hex[:12]


def run_headless(spec: DistributedSpec, launcher: MpLauncher | None = None) -> int:
    """A node other than 0 (``--node-rank``): start this node's ranks, which join node 0's
    engine at ``--master-addr:--master-port``, and wait for them; the worst exit status."""
    parallel = spec.parallel
    store_port, ports = node_endpoints(parallel)
    host = parallel.master_addr
    addresses = control.Addresses(*(f"tcp://{host}:{port}" for port in ports))
    launcher = launcher or MpLauncher()
    inits = rank_inits(spec, Rendezvous(host, store_port, run_id(parallel)), addresses,
                       parallel.node_rank)
    logger.info("node %d of %d: starting ranks %s for the engine at %s:%d", parallel.node_rank,
                parallel.nnodes, [i.rank for i in inits], host, store_port)
    launcher.launch(inits)
    return launcher.wait()


def _endpoints(parallel: ParallelConfig, launcher: Launcher
               ) -> tuple[str, str | None, int, tuple[int, int, int]]:
    """Where the ranks reach the engine (host), what it binds (None: that host only), the
    store's port and the control sockets' (0: any free port)."""
    if parallel.nnodes > 1:
        return (parallel.master_addr, "0.0.0.0", *node_endpoints(parallel))
    ports = (parallel.master_port or 0, (0, 0, 0))
    if hasattr(launcher, "host"):  # Ray may place ranks on any node of its cluster
        return (launcher.host(), "0.0.0.0", *ports)
    return ("127.0.0.1", None, *ports)


class MultiprocExecutor(Executor):
    """Runs steps on ranks in other processes; samples here (see the module's docstring)."""

    START_TIMEOUT = 900.0  # loading a large model on every rank

    def __init__(self, spec: DistributedSpec, launcher: Launcher | None = None):
        import torch.distributed as dist

        from tokenmill.runner.sampler import Sampler

        self.spec = spec
        self.launcher = launcher or MpLauncher()
        host, bind, store_port, ports = _endpoints(spec.parallel, self.launcher)
        self._store = dist.TCPStore(bind or host, store_port, is_master=True,
                                    wait_for_workers=False)
        self.rendezvous = Rendezvous(host, self._store.port, run_id(spec.parallel))
        self.link = control.DriverLink(host, ports, bind_host=bind)
        self.ranks = list(range(spec.layout.world_size))
        self.sampler = Sampler()
        self._failure: str | None = None
        self._hellos: dict[int, dict[str, Any]] = {}
        self._last_beat: dict[int, float] = {}
        self._step = 0
        self._logits: torch.Tensor | None = None  # of the running step, once a rank sent them
        self._kv_answers = 0  # ranks that reported the running step's KV connector ops
        self._kv_reports: RankKVReports | None = None
        if spec.worker.kv_transfer is not None:
            from tokenmill.executor.kv_ranks import RankKVReports

            self._kv_reports = RankKVReports(spec.layout.world_size)
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="tokenmill-ranks", daemon=True)
        atexit.register(self.shutdown)  # a script that never calls it still stops its ranks
        try:
            self.launcher.launch(rank_inits(spec, self.rendezvous, self.link.addresses, 0))
            self._monitor.start()
            self._wait_for_hellos()
        except BaseException:
            self.shutdown()
            raise

    # ----- start-up ---------------------------------------------------------------------------

    def _wait_for_hellos(self) -> None:
        deadline = time.monotonic() + self.START_TIMEOUT
        while len(self._hellos) < len(self.ranks):
            if self._failure is not None:
                raise ExecutorError(f"the workers did not start: {self._failure}")
            if time.monotonic() > deadline:
                missing = sorted(set(self.ranks) - set(self._hellos))
                raise ExecutorError(f"ranks {missing} did not start within "
                                    f"{self.START_TIMEOUT:.0f} s")
            message = self.link.receive(100)
            if message is None:
                continue
            if message.kind == "error":
                self._rank_failed(message)
            elif message.kind == "hello":
                self._hellos[message.rank] = message.info
                self._last_beat[message.rank] = time.monotonic()
        logger.info("%d ranks up: %s", len(self.ranks), self.describe()["ranks"])

    # ----- steps ------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, masks: RowMasks | None = None,
                draft_probs: Mapping[str, Sequence[object | None]] | None = None
                ) -> ModelOutput:
        from tokenmill.runner.model_runner import logits_view, sample_step
        from tokenmill.sched.output import ModelOutput

        view = logits_view(out.scheduled)  # prompt-scoring chunks want every position's logits
        if self._kv_reports is None:
            return sample_step(self.sampler, out.scheduled, self.logits(view), masks,
                               draft_probs)
        # every rank runs the step's KV ops (its shard) and reports, forward or not
        logits = self.logits(view, out.kv_connector_metadata)
        self._wait(lambda: self._kv_answers == len(self.ranks))
        result = sample_step(self.sampler, out.scheduled, logits, masks, draft_probs) \
            if out.scheduled else ModelOutput()
        result.kv_connector_output = self._kv_reports.take()
        return result

    def logits(self, chunks, kv: Any = None) -> torch.Tensor | None:
        """One forward of plain chunks (``runner.batch.Chunk``): the logits of their scored
        positions, as ``ModelRunner.forward`` returns them (``execute`` samples them); None
        for a step of KV connector ops only (``kv``) and no chunks."""
        self.check_health()
        self._step += 1
        self._kv_answers = 0
        self._logits = None
        self.link.send_all(self.ranks, control.step(self._step, chunks, self.spec.layout.pp_size,
                                                    kv))
        if not chunks:
            return None
        self._wait(lambda: self._logits is not None)
        return self._logits

    def _wait(self, done) -> None:
        """Take the ranks' messages until ``done()``: logits and KV reports of this step."""
        while not done():
            message = self.link.receive(50)
            if message is not None:
                if message.kind == "logits" and message.step == self._step:
                    self._logits = message.logits
                elif message.kind == "kv" and message.step == self._step:
                    self._kv_reports.add(message.rank, message.kv)
                    self._kv_answers += 1
                elif message.kind == "error":
                    self._rank_failed(message)
            self.check_health()

    def kv_connector_info(self) -> dict[str, Any] | None:
        if self._kv_reports is None:
            return None
        from tokenmill.executor.kv_ranks import merge_connector_info

        return merge_connector_info([self._hellos[r]["kv_connector"] for r in self.ranks])

    # ----- health -----------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        if self._failure is None:
            self._failure = why
            logger.error("the executor is broken: %s", why)

    def _rank_failed(self, message: control.Message) -> None:
        """A rank reported an error. When a peer's death caused it (a collective that lost
        its peer), the dead process is the news: its exit shows within a moment."""
        why = f"rank {message.rank}: {message.error}"
        deadline = time.monotonic() + control.BEAT_SECONDS * 2
        while time.monotonic() < deadline:
            gone = self.launcher.failure()
            if gone is not None and not gone.startswith(f"rank {message.rank} "):
                self._fail(f"{gone} (then {why})")
                return
            time.sleep(0.05)
        self._fail(why)

    def check_health(self) -> None:
        if self._failure is not None:
            raise ExecutorError(self._failure)

    def _watch(self) -> None:
        timeout = self.spec.parallel.worker_timeout
        while not self._closed.wait(control.BEAT_SECONDS / 2):
            self.link.announce()
            now = time.monotonic()
            for rank in self.link.beats():
                self._last_beat[rank] = now
            gone = self.launcher.failure()
            if gone is not None:
                self._fail(gone)
            for rank, last in list(self._last_beat.items()):
                if now - last > timeout:
                    self._fail(f"rank {rank} sent no heartbeat for {now - last:.0f} s "
                               "(hung, or its host is gone)")

    # ----- the rest of the seam ---------------------------------------------------------------

    def add_lora(self, lora: LoRARequest) -> str:
        from tokenmill.errors import LoRAError  # EngineConfig refuses this set-up first

        raise LoRAError(f"adapter {lora.lora_name!r}: LoRA adapters are served in one process "
                        "only; tensor / pipeline parallel ranks hold none")

    def heartbeat_ages(self) -> dict[int, float]:
        now = time.monotonic()
        return {rank: now - last for rank, last in sorted(self._last_beat.copy().items())}

    @property
    def kv_capacity(self) -> int:
        return min(info["kv_blocks"] for info in self._hellos.values())

    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        atexit.unregister(self.shutdown)
        try:
            self.link.send_all(self.ranks, control.Message("stop"))
        finally:
            # broken, the others may wait forever in a collective with the dead one: killed
            self.launcher.stop(timeout=0.0 if self._failure else 10.0)
            self.link.close()

    def describe(self) -> dict[str, Any]:
        first = self._hellos.get(0, {})
        layout = self.spec.layout
        return {"kind": f"{layout.world_size} ranks ({self.launcher.describe()})",
                "workers": layout.world_size, "tensor_parallel_size": layout.tp_size,
                "pipeline_parallel_size": layout.pp_size,
                "stage_layers": list(layout.stage_layers),
                "all_reduce": first.get("all_reduce", "none"),
                "cpu_step": first.get("cpu_step", "off"), "cuda_graphs": "off: parallel ranks",
                "quantization": first.get("quantization", "none"),
                "ranks": {rank: {k: info[k] for k in ("host", "pid", "threads", "cpus",
                                                     "layers", "kv_blocks")}
                          for rank, info in sorted(self._hellos.items())}}
