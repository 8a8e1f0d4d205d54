"""One rank of a tensor / pipeline parallel model: a worker process's whole life.

``run_rank(init)`` is what each ``python -m tokenmill.executor.rank`` process runs (started by
``multiproc.py``, here or on a headless node: ``tokenmill serve --node-rank N``), and what a Ray
actor's method runs (``ray_launcher.py``): pin threads, join the other ranks
(``distributed.groups.connect``), load this rank's part of the model, say hello to the engine,
then run every step the engine sends until it says stop. A heartbeat
thread tells the engine the rank is alive and ends the process when the engine has gone quiet
(it died: nothing may outlive it).

Every rank builds the step's flat batch from the chunks; the first stage embeds the tokens,
a later one receives the previous stage's hidden states; the last stage's first TP rank sends
the logits back (``control.py``), the engine samples them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.distributed.groups import Rendezvous
from tokenmill.distributed.layout import ParallelLayout
from tokenmill.executor import control
from tokenmill.executor.worker import WorkerSpec

logger = logging.getLogger("tokenmill.executor")


@dataclass(frozen=True)
class RankInit:
    """Everything a rank needs, as plain data (pickled to its process, or sent in a Ray call)."""

    spec: WorkerSpec
    layout: ParallelLayout
    model_config: ModelConfig  # the whole model's shape
    rank: int
    local_rank: int  # its index among its node's ranks (its GPU there)
    rendezvous: Rendezvous
    addresses: control.Addresses
    threads: int
    cpus: tuple[int, ...] | None  # the cores to run on (None: unbound)
    settings: dict[str, Any]  # compared with rank 0's at rendezvous
    heartbeat_timeout: float


def run_rank(init: RankInit) -> int:
    """Run rank ``init.rank`` until the engine stops it; the process's exit status."""
    init = _set_up_process(init)
    link = control.WorkerLink(init.addresses, init.rank)
    beat = _Heartbeat(init, link.addresses)
    beat.start()
    try:
        worker, comm = _build(init)
        link.send(control.hello(init.rank, _hello_info(init, worker, comm)))
        _serve(init, link, worker, comm)
        return 0
    except BaseException as e:  # the engine learns why before the process ends
        logger.error("rank %d failed: %s", init.rank, traceback.format_exc())
        link.send(control.error(init.rank, f"{type(e).__name__}: {e}"))
        time.sleep(0.2)  # let the message go out
        return 1
    finally:
        beat.stop()
        link.close()


def _set_up_process(init: RankInit) -> RankInit:
    """Threads, cores and device of the rank; the init with its own GPU on CUDA."""
    import torch

    if init.cpus:
        os.sched_setaffinity(0, init.cpus)
    torch.set_num_threads(init.threads)
    if init.spec.device.startswith("cuda"):  # one GPU per rank of the node
        torch.cuda.set_device(init.local_rank)
        return replace(init, spec=replace(init.spec, device=f"cuda:{init.local_rank}"))
    return init


def _build(init: RankInit):
    from tokenmill.distributed.groups import Comm, connect, shm_all_reduce
    from tokenmill.executor.worker import build_worker

    position = init.layout.position(init.rank)
    tp_group = connect(init.rendezvous, position, init.spec.device, init.settings)
    shm = None
    if init.spec.device == "cpu" and not init.settings["custom_all_reduce_off"]:
        shm = shm_all_reduce(init.rendezvous, position, tp_group, _all_reduce_bytes(init))
    comm = Comm(position, init.model_config, tp_group, shm)
    return build_worker(init.spec, position, comm), comm


def _all_reduce_bytes(init: RankInit) -> int:
    """The shared-memory slots' size: a step's hidden states in float32, at most 16 MiB a slot
    (larger tensors go through in pieces)."""
    return min(init.spec.max_batched_tokens * init.model_config.hidden_size * 4, 16 << 20)


def _hello_info(init: RankInit, worker, comm) -> dict[str, Any]:
    import socket

    import torch

    return {"host": socket.gethostname(), "pid": os.getpid(), "threads": torch.get_num_threads(),
            "cpus": list(init.cpus) if init.cpus else None,
            "kv_blocks": worker.runner.num_blocks, "cpu_step": worker.cpu_step,
            "quantization": worker.loaded.quantization,
            "all_reduce": "none" if comm.tp_group is None else
            "shared memory" if comm.shm is not None else "gloo" if init.spec.device == "cpu"
            else "nccl",
            "layers": _layer_span(init), "kv_connector": _connector_info(init, worker)}


def _connector_info(init: RankInit, worker) -> dict[str, Any] | None:
    if worker.connector is None:
        return None
    from tokenmill.kv_transfer.factory import worker_connector_info

    return worker_connector_info(worker.connector, init.spec.kv_transfer.config)


def _layer_span(init: RankInit) -> list[int]:
    layers = init.layout.position(init.rank).layers
    return [layers.start, layers.stop]


def _serve(init: RankInit, link: control.WorkerLink, worker, comm) -> None:
    import torch

    from tokenmill.kv_transfer.worker import IDLE_POLL_SECONDS

    connector = worker.connector
    while True:
        message = link.receive()
        if message.kind == "stop":
            if connector is not None:  # pending disk writes are finished first
                connector.shutdown()
            return
        if connector is not None:  # saves copy their blocks out before the forward
            connector.start_step(message.kv)
        logits = None
        if message.chunks:
            with torch.inference_mode():
                logits = _run_step(init, worker.runner, comm, message)
        if logits is not None:
            link.send_logits(message.step, logits)
        if connector is not None:  # every step, so the engine knows when all ranks answered
            report = connector.get_finished(wait=0.0 if message.chunks else IDLE_POLL_SECONDS)
            link.send(control.Message("kv", rank=init.rank, step=message.step, kv=report))


def _run_step(init: RankInit, runner, comm, message: control.Message):
    """This rank's part of a step, micro-batch by micro-batch: a stage sends each micro-batch's
    hidden states on (without waiting for them to arrive) and starts the next. The logits on
    the output rank, in chunk order; None elsewhere."""
    import torch

    from tokenmill.runner.batch import Chunk, build_flat_batch

    chunks = [Chunk(*c) for c in message.chunks]
    logits, sends, start = [], [], 0
    for size in message.parts or [len(chunks)]:
        batch = build_flat_batch(chunks[start:start + size], runner.block_size, runner.device)
        start += size
        intermediate = None if comm.is_first_stage else comm.recv_prev(
            batch.input_ids.shape[0], init.model_config.hidden_size,
            getattr(torch, init.spec.dtype), init.spec.device)
        out = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta,
                           batch.logits_indices, intermediate=intermediate)
        if isinstance(out, tuple):
            sends.append(comm.send_next(*out))
        elif out is not None:
            logits.append(out)
    for sent in sends:
        sent.wait()
    return torch.cat(logits) if logits else None


class _Heartbeat:
    """A thread that tells the engine this rank lives, and ends the process once the engine
    has sent nothing for ``heartbeat_timeout`` s (it died, or its host went away)."""

    def __init__(self, init: RankInit, addresses: control.Addresses):
        self.rank = init.rank
        self.timeout = init.heartbeat_timeout
        self.addresses = addresses
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-heartbeat",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        beats = control.HeartbeatLink(self.addresses, self.rank)
        last_heard = time.monotonic()
        try:
            while not self._stop.wait(control.BEAT_SECONDS):
                beats.beat()
                if beats.heard_engine():
                    last_heard = time.monotonic()
                elif time.monotonic() - last_heard > self.timeout:
                    logger.error("rank %d: the engine has been silent for %.0f s; exiting",
                                 self.rank, self.timeout)
                    os._exit(3)
        finally:
            beats.close()


def main() -> None:
    """``python -m tokenmill.executor.rank``: one rank, its ``RankInit`` pickled on stdin."""
    import pickle
    import sys

    init: RankInit = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank{init.rank} %(name)s: %(message)s")
    sys.exit(run_rank(init))


if __name__ == "__main__":
    main()
