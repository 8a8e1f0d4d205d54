"""KV-cache events in vLLM's wire format: what a worker's prefix cache stored and dropped.

A worker publishes, per engine step that changed its prefix cache, one ``KVEventBatch`` on a
ZMQ PUB socket as three frames ``[topic, seq, payload]`` (``seq``: 8 bytes big-endian, one more
per batch; ``payload``: msgpack of the batch). The structs are msgpack arrays with a tag
naming the event, as vLLM encodes them, so a consumer written for vLLM (NVIDIA Dynamo,
llm-d's KV indexer, ``tokenmill router``) reads tokenmill's events unchanged, and tokenmill's
router reads vLLM's.

Block hashes are opaque 64-bit integers chained through ``parent_block_hash``; a consumer that
matches prompts against them rebuilds its own chain from ``token_ids`` (``block_size`` tokens
per hash), because each engine hashes differently.

This module is a leaf: the engine side (publisher) and the router side (subscriber) both
import it, and it imports nothing of either.
"""

from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to a worker's prefix cache."""


# BlockStored and BlockRemoved write their optional fields even when None (omit_defaults off):
# vLLM's decoders require them (an array shorter than their fields is refused), and a decoder
# ignores trailing fields it does not know, so the longest form reads everywhere.
class BlockStored(KVCacheEvent, omit_defaults=False):
    """Whole blocks became reusable: ``block_hashes[i]`` holds ``token_ids[i*block_size:
    (i+1)*block_size]``, the first one continuing ``parent_block_hash`` (None: a root).
    ``lora_id`` / ``lora_name``: the LoRA adapter the KV was computed under (tokenmill's
    ``LoRARequest.lora_int_id`` / ``lora_name``), None for the base model."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None  # newer vLLM releases require it too


class BlockRemoved(KVCacheEvent, omit_defaults=False):
    """Blocks no longer held (evicted, or their cache flushed)."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the worker is gone (a flush, a restart)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on a payload that is not a batch."""
    return _DECODER.decode(payload)


# The replay socket's last answer: seq -1 (8 signed big-endian bytes) with an empty payload.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big")
