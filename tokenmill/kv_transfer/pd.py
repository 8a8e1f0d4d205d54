"""Prefill/decode disaggregation, scheduler side, speaking vLLM's ``kv_transfer_params``.

    client -> router                                                     (tokenmill router --pd)
    router -> producer   body + max_tokens=1, kv_transfer_params={"do_remote_decode": true}
    producer             prefills, samples one token; request_finished keeps the blocks and
                         answers kv_transfer_params = {"do_remote_prefill": true,
                         "remote_block_ids": [...], "remote_host", "remote_port",
                         "remote_engine_id", "remote_request_id", "tp_size", "prompt_hash"}
    router -> consumer   the original body + those kv_transfer_params
    consumer             admits the request with its prompt short of the last token as an
                         external hit, pulls the blocks (worker side, ``p2p.py``) while other
                         requests run, then computes only the last prompt token and decodes
    producer             frees the blocks once the consumer acknowledged the pull, or after
                         ``kv_transfer_timeout`` seconds

A pull that fails (producer gone, transfer cut, layouts differ) reports how many leading blocks
arrived; the scheduler keeps those and computes the rest, so the tokens are the same either way.
"""

from __future__ import annotations

import logging
import uuid
from array import array
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Any

from tokenmill.kv_transfer.base import (ExposeBlocks, KVConnectorOutput, PullBlocks,
                                        QueuedOpsScheduler, TierStats)
from tokenmill.request import Request
from tokenmill.util import cdiv

_REMOTE_KEYS = ("remote_block_ids", "remote_host", "remote_port", "remote_request_id")
logger = logging.getLogger("tokenmill.kv_transfer")


def prompt_hash(token_ids: Sequence[int]) -> str:
    """Names the prompt a hand-over's KV belongs to: a consumer whose own tokens differ (another
    chat template, tokenizer or prompt) computes the prompt rather than read wrong KV."""
    return blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def check_kv_transfer_params(params: Mapping[str, Any], role: str | None) -> None:
    """Refuse (ValueError naming the field) what this engine cannot honour."""
    if role is None:
        raise ValueError("kv_transfer_params: this server has no KV connector (start it with "
                         "--kv-role producer, consumer or both)")
    if params.get("do_remote_decode") and role == "consumer":
        raise ValueError("kv_transfer_params: do_remote_decode asks for a prefill, but this "
                         "server is a consumer (--kv-role consumer)")
    if params.get("do_remote_prefill"):
        if role == "producer":
            raise ValueError("kv_transfer_params: do_remote_prefill asks for a decode, but "
                             "this server is a producer (--kv-role producer)")
        _check_remote(params)


def _check_remote(params: Mapping[str, Any]) -> None:
    missing = [k for k in _REMOTE_KEYS if params.get(k) is None]
    if missing:
        raise ValueError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)}")
    blocks = params["remote_block_ids"]
    if not (isinstance(blocks, list) and all(type(b) is int and b > 0 for b in blocks)):
        raise ValueError("kv_transfer_params: remote_block_ids must be a list of block ids")
    port = params["remote_port"]
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError("kv_transfer_params: remote_port must be a port number")
    if not isinstance(params["remote_host"], str) or not isinstance(
            params["remote_request_id"], str):
        raise ValueError("kv_transfer_params: remote_host and remote_request_id are strings")


class PDScheduler(QueuedOpsScheduler):
    """``role``: producer, consumer or both. ``host``/``port``: where this instance's side
    channel listens (rank 0's; a producer advertises them). ``tp_size``: ranks per engine."""

    def __init__(self, role: str, block_size: int, *, host: str, port: int,
                 timeout: float, tp_size: int = 1) -> None:
        super().__init__()
        self.role = role
        self.block_size = block_size
        self.host, self.port = host, port
        self.timeout = timeout
        self.tp_size = tp_size
        self.engine_id = uuid.uuid4().hex
        self._exposed: set[str] = set()  # producer: blocks held for a consumer
        self._pulling: set[str] = set()  # consumer: pulls not reported yet
        self._tried: set[str] = set()  # consumer: pulled once (a readmission recomputes)
        self._stats: dict[str, TierStats] = {}

    # ----- consumer -----------------------------------------------------------------------

    def _remote(self, request: Request) -> Mapping[str, Any] | None:
        params = request.kv_transfer_params
        if (self.role == "producer" or not params or not params.get("do_remote_prefill")
                or request.request_id in self._tried):
            return None
        expected = params.get("prompt_hash")  # a tokenmill producer's; others send none
        if expected is not None and expected != prompt_hash(request.prompt_token_ids):
            logger.warning("kv_transfer_params of %s were made for another prompt (another "
                           "chat template or tokenizer?): computing it here", request.request_id)
            self._tried.add(request.request_id)
            return None
        return params

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = self._remote(request)
        if params is None:
            return 0, False
        # KV of every prompt token but the last, which is computed here for its logits
        wanted = min(request.num_prompt_tokens - 1,
                     len(params["remote_block_ids"]) * self.block_size)
        return max(0, wanted - num_computed_tokens), True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_local_tokens: int, num_external_tokens: int) -> None:
        params = self._remote(request)
        if params is None or not num_external_tokens:
            return
        self._tried.add(request.request_id)
        first = num_local_tokens // self.block_size
        last = cdiv(num_local_tokens + num_external_tokens, self.block_size)
        remote = params["remote_block_ids"]
        self._ops.append(PullBlocks(
            request.request_id, params["remote_request_id"], tuple(remote[first:last]),
            tuple(block_ids[first:last]), params["remote_host"], params["remote_port"],
            str(params.get("remote_engine_id") or "")))
        self._pulling.add(request.request_id)

    # ----- producer -----------------------------------------------------------------------

    def request_finished(self, request: Request,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tried.discard(request.request_id)
        params = request.kv_transfer_params
        if (self.role == "consumer" or not params or not params.get("do_remote_decode")
                or not block_ids):
            return False, None
        self._ops.append(ExposeBlocks(request.request_id, tuple(block_ids), self.timeout))
        self._exposed.add(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.engine_id,
                      "remote_request_id": request.request_id,
                      "remote_block_ids": list(block_ids), "remote_host": self.host,
                      "remote_port": self.port, "tp_size": self.tp_size,
                      "prompt_hash": prompt_hash(request.prompt_token_ids)}

    def request_aborted(self, request: Request) -> None:
        self._tried.discard(request.request_id)

    # ----- each step ----------------------------------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._exposed -= output.finished_sending
        self._pulling -= output.finished_recving | output.failed_recving.keys()
        if output.tiers:
            self._stats = dict(output.tiers)

    @property
    def has_pending_work(self) -> bool:
        return bool(self._ops or self._exposed or self._pulling)

    def stats(self) -> Mapping[str, TierStats]:
        return self._stats

    def describe(self) -> dict[str, Any]:
        return {"kv_role": self.role, "host": self.host, "port": self.port,
                "engine_id": self.engine_id, "tp_size": self.tp_size,
                "timeout": self.timeout}
