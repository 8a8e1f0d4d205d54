"""The multi-process executor's control plane: pyzmq sockets on TCP, pickled messages.

The engine (``DriverLink``) binds three sockets; each rank connects to them:

    control    ROUTER <-> DEALER   steps and "stop" to every rank; hello, logits, errors back
    heartbeat  PULL   <-  PUSH     each rank's beat every ``BEAT_SECONDS``
    liveness   PUB    ->  SUB      the engine's own beat: a rank that stops hearing it exits

A step message carries each chunk as plain data (token ids, start position, block table,
logits wanted) -- what every rank needs to build the flat batch; requests, sampling parameters
and grammars stay with the engine, which samples. The logits come back as one raw frame.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import zmq

BEAT_SECONDS = 0.5


@dataclass(frozen=True)
class Addresses:
    control: str  # "tcp://host:port"
    heartbeat: str
    liveness: str


@dataclass
class Message:
    kind: str  # "step" | "stop" (to a rank); "hello" | "logits" | "kv" | "error" (from one)
    rank: int = -1
    step: int = -1
    chunks: list[tuple[list[int], int, list[int], int]] | None = None
    parts: list[int] | None = None  # micro-batches: how many chunks each takes, in order
    info: dict[str, Any] | None = None
    error: str | None = None
    logits: Any = None  # a torch.Tensor, once decoded
    # KV connector: the step's ops (kv_transfer.base.KVConnectorMetadata) to a rank, what it
    # finished (KVConnectorOutput) from one
    kv: Any = None


def step(step_id: int, chunks, num_parts: int = 1, kv: Any = None) -> Message:
    """A step's message; with pipeline stages, its chunks split into ``num_parts``
    micro-batches of about equal tokens (``micro_batches``). ``kv``: the KV connector's ops."""
    return Message("step", step=step_id,
                   chunks=[(c.token_ids, c.start_pos, c.block_table, c.num_logits)
                           for c in chunks],
                   parts=micro_batches([len(c.token_ids) for c in chunks], num_parts), kv=kv)


def micro_batches(tokens: list[int], parts: int) -> list[int]:
    """Split chunks of ``tokens`` tokens, in order, into at most ``parts`` runs of about equal
    tokens; the runs' lengths. Stage s works on run i + 1 while stage s + 1 works on run i, so
    P stages idle (P - 1) / (M + P - 1) of a step with M runs instead of (P - 1) / P."""
    parts = max(1, min(parts, len(tokens)))
    total = sum(tokens)
    sizes: list[int] = []
    taken = run = 0
    for i, n in enumerate(tokens):
        run += 1
        taken += n
        left = len(tokens) - i - 1
        # close the run at its share of the tokens, keeping a chunk for every run still to come
        if len(sizes) < parts - 1 and (taken >= total * (len(sizes) + 1) / parts
                                       or left == parts - 1 - len(sizes)):
            sizes.append(run)
            run = 0
    if run:
        sizes.append(run)
    return sizes


def hello(rank: int, info: dict[str, Any]) -> Message:
    return Message("hello", rank=rank, info=info)


def error(rank: int, why: str) -> Message:
    return Message("error", rank=rank, error=why)


def _dumps(message: Message) -> bytes:
    return pickle.dumps(message, protocol=5)


class WorkerLink:
    """A rank's end of the control socket."""

    def __init__(self, addresses: Addresses, rank: int):
        self.addresses = addresses
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, str(rank).encode())
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(addresses.control)

    def send(self, message: Message) -> None:
        self._sock.send(_dumps(message))

    def send_logits(self, step_id: int, logits) -> None:
        """``logits`` (rows, vocab) float32, as a header and one raw frame."""
        header = Message("logits", step=step_id, info={"shape": tuple(logits.shape)})
        self._sock.send_multipart([_dumps(header), logits.cpu().contiguous().numpy()],
                                  copy=False)

    def receive(self) -> Message:
        return pickle.loads(self._sock.recv())

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class HeartbeatLink:
    """A rank's heartbeat sockets (used by its heartbeat thread only)."""

    def __init__(self, addresses: Addresses, rank: int):
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 4)
        self._push.connect(addresses.heartbeat)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(addresses.liveness)
        self._beat = str(rank).encode()

    def beat(self) -> None:
        try:
            self._push.send(self._beat, zmq.NOBLOCK)
        except zmq.Again:  # the engine is not reading: it is busy, or gone (heard_engine says)
            pass

    def heard_engine(self) -> bool:
        """Whether the engine's beat arrived since the last call."""
        heard = False
        while self._sub.poll(0):
            self._sub.recv()
            heard = True
        return heard

    def close(self) -> None:
        self._push.close()
        self._sub.close()
        self._ctx.term()


class DriverLink:
    """The engine's end: binds the three sockets (port 0: any free port on ``host``)."""

    def __init__(self, host: str, ports: tuple[int, int, int] = (0, 0, 0),
                 bind_host: str | None = None):
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pub = self._ctx.socket(zmq.PUB)
        bound = []
        for sock, port in zip((self._router, self._pull, self._pub), ports):
            sock.setsockopt(zmq.LINGER, 0)
            where = f"tcp://{bind_host or host}"
            if port:
                sock.bind(f"{where}:{port}")
            else:
                port = sock.bind_to_random_port(where)
            bound.append(f"tcp://{host}:{port}")
        self.addresses = Addresses(*bound)

    def send(self, rank: int, message: Message) -> None:
        self._router.send_multipart([str(rank).encode(), _dumps(message)])

    def send_all(self, ranks, message: Message) -> None:
        payload = _dumps(message)
        for rank in ranks:
            self._router.send_multipart([str(rank).encode(), payload])

    def receive(self, timeout_ms: int) -> Message | None:
        """The next message from any rank, or None after ``timeout_ms``."""
        if not self._router.poll(timeout_ms):
            return None
        _, header, *data = self._router.recv_multipart(copy=False)
        message = pickle.loads(header.buffer)
        if message.kind == "logits":
            import torch

            shape = message.info["shape"]
            message.logits = torch.frombuffer(bytearray(data[0].buffer), dtype=torch.float32
                                              ).view(shape) if len(data[0].buffer) else \
                torch.empty(shape)  # a step whose chunks all only write KV
        return message

    def beats(self) -> list[int]:
        """The ranks whose beats arrived since the last call (the monitor thread's only)."""
        ranks = []
        while self._pull.poll(0):
            ranks.append(int(self._pull.recv()))
        return ranks

    def announce(self) -> None:
        """The engine's own beat (the monitor thread's only)."""
        self._pub.send(b"engine")

    def close(self) -> None:
        for sock in (self._router, self._pull, self._pub):
            sock.close()
        self._ctx.term()
