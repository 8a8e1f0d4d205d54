"""The process groups that join a model's ranks at run time, over torch.distributed.

``connect`` joins the world through the engine's ``TCPStore`` (gloo on a CPU, NCCL on CUDA),
refuses ranks whose settings differ from rank 0's (naming the difference), and makes one
tensor-parallel group per pipeline stage. ``Comm`` is what the model calls: the TP all-reduce
(through shared memory when the group's ranks share a host and the CPU kernels are built --
``shm.py``, which the fused C++ step also calls -- else through the group's backend), the
gather of the vocabulary-parallel logits, and the stage-to-stage hidden states.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.config import ModelConfig
from tokenmill.distributed.layout import RankPosition

logger = logging.getLogger("tokenmill.distributed")


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: the engine's TCPStore, and the run's name (shared-memory files)."""

    host: str
    port: int
    run_id: str
    timeout: float = 600.0  # a rank slower than this to join fails the start


def connect(rv: Rendezvous, position: RankPosition, device: str,
            settings: dict[str, Any]) -> dist.ProcessGroup | None:
    """Join the world as ``position.rank`` and check ``settings`` against rank 0's; returns the
    rank's TP group (None at TP=1)."""
    store = dist.TCPStore(rv.host, rv.port, is_master=False,
                          timeout=timedelta(seconds=rv.timeout))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=position.rank,
                            world_size=position.layout.world_size,
                            timeout=timedelta(seconds=rv.timeout))
    check_settings(settings)
    tp_group = None
    t = position.layout.tp_size
    for stage in range(position.layout.pp_size):  # every rank makes every group, in order
        group = dist.new_group(list(range(stage * t, (stage + 1) * t)))
        if stage == position.pp_rank:
            tp_group = group
    return tp_group if t > 1 else None


def check_settings(settings: dict[str, Any]) -> None:
    """Raise ``SettingsMismatch`` on every rank when any rank's settings differ from rank 0's
    (another node started with another model, dtype or size)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, settings)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        diff = [f"{key}: rank 0 has {first.get(key)!r}, rank {rank} has {theirs.get(key)!r}"
                for key in sorted(first.keys() | theirs.keys())
                if first.get(key) != theirs.get(key)]
        if diff:
            raise SettingsMismatch("the ranks were started with different settings: "
                                   + "; ".join(diff))


class SettingsMismatch(ValueError):
    pass


class Comm:
    """A rank's collectives, as the model calls them (``model/llama.py``)."""

    def __init__(self, position: RankPosition, cfg: ModelConfig,
                 tp_group: dist.ProcessGroup | None, shm=None):
        """``cfg``: the whole model's shape; ``shm``: a ``shm.ShmAllReduce`` over the TP group
        (None: the group's backend all-reduces)."""
        self.position = position
        self.tp_group = tp_group
        self.shm = shm
        self.vocab_size = cfg.vocab_size
        self.vocab_start = position.vocab_range(cfg).start
        self.is_first_stage = position.is_first_stage
        self.is_last_stage = position.is_last_stage
        self._tp_first = position.tp_ranks()[0]

    @property
    def tp_size(self) -> int:
        return self.position.layout.tp_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the TP group, in place."""
        if self.tp_group is None:
            return t
        if self.shm is not None:
            return self.shm.all_reduce_(t)
        dist.all_reduce(t, group=self.tp_group)
        return t

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The whole vocabulary's logits ``(rows, vocab)`` on the stage's first TP rank (None
        on the others) from each rank's ``(rows, vocab / tp)``."""
        if self.tp_group is None:
            return logits[:, :self.vocab_size]
        logits = logits.contiguous()
        first = self.position.tp_rank == 0
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if first else None
        dist.gather(logits, parts, dst=self._tp_first, group=self.tp_group)
        return torch.cat(parts, dim=1)[:, :self.vocab_size] if first else None

    def send_next(self, h: torch.Tensor, residual: torch.Tensor) -> Sending:
        """The stage's (h, residual) on their way to the same TP place in the next stage; wait
        on the returned sending before the step ends."""
        both = torch.stack([h, residual])
        return Sending(dist.isend(both, self.position.peer(self.position.pp_rank + 1)), both)

    def recv_prev(self, num_tokens: int, hidden: int,
                  dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (h, residual) for a batch of ``num_tokens`` tokens."""
        both = torch.empty(2, num_tokens, hidden, dtype=dtype, device=device)
        dist.recv(both, self.position.peer(self.position.pp_rank - 1))
        return both[0], both[1]


@dataclass
class Sending:
    """A send in flight, holding its tensor until it is done."""

    work: dist.Work
    tensor: torch.Tensor

    def wait(self) -> None:
        self.work.wait()


def same_host(group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` runs on this host (a shared-memory all-reduce works)."""
    if group is None:
        return True
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def shm_all_reduce(rv: Rendezvous, position: RankPosition, group: dist.ProcessGroup | None,
                   max_bytes: int):
    """A shared-memory all-reduce over the TP ``group`` where its ranks share this host and the
    CPU kernels are built; None where they do not (the group's backend all-reduces)."""
    if group is None or not same_host(group):
        return None
    try:
        from tokenmill.distributed.shm import ShmAllReduce
    except ImportError:
        return None
    name = f"tokenmill-{rv.run_id}-tp{position.pp_rank}"
    shm = None
    try:
        shm = ShmAllReduce.create(name, position.tp_rank, position.layout.tp_size, max_bytes,
                                  lambda: dist.barrier(group=group))
    except (RuntimeError, OSError) as e:
        logger.warning("no shared-memory all-reduce (%s): the TP group all-reduces by gloo", e)
    # all or none: a rank on gloo while the others wait in shared memory would hang them
    votes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(votes, shm is not None, group=group)
    if all(votes):
        return shm
    if shm is not None:
        shm.close()
    return None


def disconnect() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
