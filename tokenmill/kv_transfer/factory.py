"""Both sides of the configured connector, built where they live.

The worker side is built first, beside the KV cache tensors (``build_worker_connector``): it
knows the block layout, binds the side channel and finds what the disk tier already holds. What
it learnt (``describe``) is what the scheduler side is then built from
(``build_scheduler_connector``), in the engine's process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.config import KVTransferConfig
from tokenmill.kv_transfer.base import KVConnectorScheduler

if TYPE_CHECKING:
    import torch

    from tokenmill.kv_transfer.worker import ConnectorWorker


@dataclass(frozen=True)
class KVTransferSpec:
    """What a worker needs to build its side (plain data: it travels to worker processes)."""

    config: KVTransferConfig
    model: str  # the model file or directory (its identity enters the block fingerprint)
    block_size: int
    attention_backend: str
    kv_cache_dtype: str
    quantization: str = "none"  # the weights' format: blocks of another one differ in value


def build_worker_connector(spec: KVTransferSpec,
                           kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           rank: int = 0, world_size: int = 1) -> ConnectorWorker:
    from tokenmill.kv_transfer.blocks import BlockIO, layout_fingerprint, model_identity
    from tokenmill.kv_transfer.worker import ConnectorWorker

    cfg = spec.config
    io = BlockIO(kv_caches)
    model_id = f"{model_identity(spec.model)} weights={spec.quantization}"
    fingerprint = layout_fingerprint(model_id, kv_caches,
                                     block_size=spec.block_size,
                                     attention_backend=spec.attention_backend,
                                     kv_cache_dtype=spec.kv_cache_dtype, rank=rank,
                                     world_size=world_size)
    sender = receiver = None
    if cfg.kv_role in ("producer", "both"):
        from tokenmill.kv_transfer.p2p import KVSender

        port = cfg.kv_transfer_port + rank if cfg.kv_transfer_port else 0
        sender = KVSender(io, fingerprint, host=cfg.kv_transfer_host or "127.0.0.1", port=port,
                          transport=cfg.kv_transport,
                          fail_after_blocks=cfg.kv_test_fail_after_blocks)
    if cfg.kv_role in ("consumer", "both"):
        from tokenmill.kv_transfer.p2p import KVReceiver

        receiver = KVReceiver(io, fingerprint, transport=cfg.kv_transport,
                              timeout=cfg.kv_pull_timeout, rank=rank)
    return ConnectorWorker(io, _stores(cfg, fingerprint), sender=sender, receiver=receiver,
                           fingerprint=fingerprint)


def _stores(cfg: KVTransferConfig, fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    from tokenmill.kv_transfer.store import DiskStore, HostStore

    stores: dict[str, Any] = {}
    if cfg.kv_offload == "host" or cfg.kv_offload_host_size:
        stores["host"] = HostStore()
    if cfg.kv_offload == "disk":
        stores["disk"] = DiskStore(cfg.kv_offload_dir, fingerprint)
    return stores


def worker_connector_info(worker: ConnectorWorker, cfg: KVTransferConfig) -> dict[str, Any]:
    """What the scheduler side is built from: block bytes, the side channel's address and the
    blocks the disk tier holds from earlier runs (least recently used first)."""
    info: dict[str, Any] = {"block_nbytes": worker.io.block_nbytes, "disk_known": []}
    if worker.sender is not None:
        info["host"], info["port"] = worker.sender.host, worker.sender.port
    if cfg.kv_offload == "disk":
        from tokenmill.kv_transfer.store import DiskStore

        info["disk_known"] = DiskStore.scan(cfg.kv_offload_dir, worker.fingerprint)
    return info


def build_scheduler_connector(cfg: KVTransferConfig, block_size: int,
                              info: Mapping[str, Any], tp_size: int = 1) -> KVConnectorScheduler:
    pd = offload = None
    if cfg.kv_role is not None:
        from tokenmill.kv_transfer.pd import PDScheduler

        pd = PDScheduler(cfg.kv_role, block_size, host=info.get("host", "127.0.0.1"),
                         port=info.get("port", 0), timeout=cfg.kv_transfer_timeout,
                         tp_size=tp_size)
    if cfg.kv_offload != "none":
        offload = _offload_scheduler(cfg, block_size, info)
    if pd is not None and offload is not None:
        from tokenmill.kv_transfer.multi import PDWithOffload

        return PDWithOffload(pd, offload)
    return pd or offload


def _offload_scheduler(cfg: KVTransferConfig, block_size: int,
                       info: Mapping[str, Any]) -> KVConnectorScheduler:
    from tokenmill.kv_transfer.offload import OffloadScheduler

    nbytes = info["block_nbytes"]
    tiers = []
    if cfg.kv_offload == "host":
        tiers.append(("host", cfg.kv_offload_size // nbytes))
    elif cfg.kv_offload_host_size:
        tiers.append(("host", cfg.kv_offload_host_size // nbytes))
    if cfg.kv_offload == "disk":
        tiers.append(("disk", cfg.kv_offload_size // nbytes))
    known = {"disk": [(key, None) for key, _ in info["disk_known"]]}
    return OffloadScheduler(tiers, block_size, write_through=cfg.kv_offload == "disk",
                            known=known)
