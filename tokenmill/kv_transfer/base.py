"""The KV connector interface, in vLLM's shape: one object per side of the engine.

The scheduler side decides (which tokens of a request another instance or tier holds, which
blocks to fill from there, whether a finished request's blocks must wait to be pulled); the
worker side moves bytes (into and out of the KV cache tensors, on threads of its own). Each step
the scheduler side turns what it decided into ``KVConnectorMetadata`` (an ordered list of plain
ops), which travels with the ``SchedulerOutput`` to every worker; the worker side reports back
in ``KVConnectorOutput`` with the step's ``ModelOutput``::

    admission   get_num_new_matched_tokens(req, local)  -> (external tokens, load is async)
                update_state_after_alloc(req, blocks, local, external)
    each step   build_connector_meta()                  -> ops: saves, loads, pulls, exposes
                worker: start_step(meta) before the forward (saves copy their blocks out first)
                worker: get_finished()                  -> KVConnectorOutput
                update_connector_output(output)         (scheduler side learns what finished)
    finish      request_finished(req, blocks)           -> (free later?, kv_transfer_params)

This module imports no torch: the scheduler (``sched/``) holds a ``KVConnectorScheduler``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.request import Request


@dataclass(frozen=True)
class SaveBlocks:
    """Copy ``block_ids`` out of the KV cache (before this step's forward may overwrite them)
    into ``tier`` under ``keys`` (chained block hashes); ``tokens[i]`` are block i's token ids,
    stored beside it so a load can check it holds what was asked for."""

    keys: tuple[int, ...]
    block_ids: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    tier: str


@dataclass(frozen=True)
class MoveBlocks:
    """Move ``keys`` (holding ``tokens``) from tier ``src`` to tier ``dst`` (a full host tier
    spilling to disk)."""

    keys: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    src: str
    dst: str


@dataclass(frozen=True)
class DropBlocks:
    keys: tuple[int, ...]
    tier: str


@dataclass(frozen=True)
class LoadBlocks:
    """Fill the request's ``block_ids`` from tiers (``tiers[i]`` holds ``keys[i]``); the request
    is reported in ``finished_recving`` (or ``failed_recving``) once done."""

    request_id: str
    keys: tuple[int, ...]
    block_ids: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    tiers: tuple[str, ...]


@dataclass(frozen=True)
class ExposeBlocks:
    """Producer: keep ``block_ids`` of ``request_id`` readable for a consumer to pull, until it
    says done or ``timeout`` seconds pass; then it is reported in ``finished_sending``."""

    request_id: str
    block_ids: tuple[int, ...]
    timeout: float


@dataclass(frozen=True)
class PullBlocks:
    """Consumer: fetch the producer's ``remote_block_ids`` of ``remote_request_id`` (at
    ``host:port``, rank r at ``port + r``) into our ``block_ids``, pairwise."""

    request_id: str
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    host: str
    port: int
    engine_id: str


KVOp = SaveBlocks | MoveBlocks | DropBlocks | LoadBlocks | ExposeBlocks | PullBlocks


@dataclass(frozen=True)
class KVConnectorMetadata:
    """One step's ops for the worker side, in the order the scheduler decided them (a save of a
    block evicted this step comes before a load into it)."""

    ops: tuple[KVOp, ...] = ()


@dataclass
class TierStats:
    """Counters of one tier (host, disk) or transfer (p2p), cumulative since start."""

    hits: int = 0  # blocks loaded from it
    misses: int = 0  # blocks asked for and not found or failed the check
    blocks_saved: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0  # time spent loading (reading, checking, copying in)
    stored_blocks: int = 0  # blocks it holds now
    stored_bytes: int = 0

    def add(self, other: TierStats) -> None:
        """Sum counters (several ranks' shards)."""
        for name in ("hits", "misses", "blocks_saved", "bytes_loaded", "bytes_saved",
                     "load_seconds", "stored_blocks", "stored_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class KVConnectorOutput:
    """What the worker side finished since it last reported.

    ``failed_recving`` maps a request whose load or pull failed to how many of its blocks,
    from the first, were written correctly (the scheduler keeps those and recomputes the rest).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, TierStats] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)

    def merge(self, other: KVConnectorOutput) -> None:
        """Several ranks: a request is done when every rank is (the caller intersects), a
        failure on any rank fails it with the fewest good blocks."""
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        for rid, good in other.failed_recving.items():
            self.failed_recving[rid] = min(good, self.failed_recving.get(rid, good))
        for name, stats in other.tiers.items():
            self.tiers.setdefault(name, TierStats()).add(stats)


class KVConnectorScheduler(ABC):
    """The scheduler's side of a connector. Every call comes from the engine's loop thread."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past the ``num_computed_tokens`` the local prefix cache has that this
        connector can fill, and whether filling them is asynchronous (the request then waits
        in ``WAITING_FOR_REMOTE_KVS`` while others run). Never more than the request's tokens
        less one (its last token is always computed, for logits)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        """The request got blocks: ``block_ids`` is its whole table, the first
        ``num_local_tokens`` from the local prefix cache, the next ``num_external_tokens`` to
        fill. Queue the load (or pull) for the next ``build_connector_meta``."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """The ops decided since the last call (None when there are none)."""

    def request_finished(self, request: Request,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request ended (not aborted). Returns whether its blocks must stay allocated until
        ``finished_sending`` names it (a consumer pulls them), and the ``kv_transfer_params``
        its response carries."""
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the workers finished, after each step."""

    def request_aborted(self, request: Request) -> None:
        """A request ended before its load finished, or was never admitted: forget it."""

    @property
    def has_pending_work(self) -> bool:
        """Ops queued, or loads / exposes the workers have not reported: the engine polls the
        workers even when no tokens are scheduled."""
        return False

    def stats(self) -> Mapping[str, TierStats]:
        """Per tier or transfer, the latest counters the workers reported."""
        return {}

    def describe(self) -> dict[str, Any]:
        """For ``/server_info`` and the start-up log."""
        return {}


class QueuedOpsScheduler(KVConnectorScheduler):
    """A scheduler side that queues its ops as it decides them (``_ops``, in order) and hands
    them over once per step."""

    def __init__(self) -> None:
        self._ops: list[KVOp] = []

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if not self._ops:
            return None
        ops, self._ops = tuple(self._ops), []
        return KVConnectorMetadata(ops)


class KVConnectorWorker(ABC):
    """The worker's side: holds the KV cache tensors' bytes and the threads that move them."""

    @abstractmethod
    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        """Before the step's forward: copy out every block a save names (synchronously: the
        forward may overwrite them), then hand loads, pulls and exposes to its threads."""

    @abstractmethod
    def get_finished(self, wait: float = 0.0) -> KVConnectorOutput:
        """What finished since the last call; waits up to ``wait`` seconds for something to
        finish when nothing has (a step that ran no forward polls with a short wait)."""

    def describe(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Stop the threads (pending saves are written first); idempotent."""
