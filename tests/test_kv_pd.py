"""Prefill/decode hand-over, scheduler side (``kv_transfer/pd.py``): what a producer answers,
what a consumer pulls, and the params either refuses. No torch, no worker."""

from __future__ import annotations

import pytest

from tokenmill.kv_transfer.base import ExposeBlocks, KVConnectorOutput, PullBlocks
from tokenmill.kv_transfer.pd import PDScheduler, check_kv_transfer_params
from tokenmill.request import Request

BS = 4
PROMPT = list(range(100, 114))  # 14 tokens: 13 to pull, over 4 blocks


def _pd(role: str) -> PDScheduler:
    return PDScheduler(role, BS, host="10.0.0.1", port=5600, timeout=30.0)


def _hand_over() -> tuple[PDScheduler, dict]:
    producer = _pd("producer")
    request = Request("p", PROMPT, kv_transfer_params={"do_remote_decode": True})
    delay, params = producer.request_finished(request, [7, 8, 9, 10])
    assert delay and producer.has_pending_work
    (expose,) = producer.build_connector_meta().ops
    assert expose == ExposeBlocks("p", (7, 8, 9, 10), 30.0)
    return producer, params


def test_a_producer_keeps_the_blocks_and_says_where_they_are():
    producer, params = _hand_over()
    assert params["remote_block_ids"] == [7, 8, 9, 10] and params["remote_request_id"] == "p"
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.1", 5600)
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    producer.update_connector_output(KVConnectorOutput(finished_sending={"p"}))
    assert not producer.has_pending_work
    # a request that asked for no hand-over finishes as usual
    assert producer.request_finished(Request("q", PROMPT), [1]) == (False, None)


def test_a_consumer_pulls_all_but_the_last_prompt_token_once():
    _, params = _hand_over()
    consumer = _pd("consumer")
    request = Request("c", PROMPT, kv_transfer_params=params)
    assert consumer.get_num_new_matched_tokens(request, BS) == (len(PROMPT) - 1 - BS, True)
    consumer.update_state_after_alloc(request, [3, 4, 5, 6], BS, len(PROMPT) - 1 - BS)
    (pull,) = consumer.build_connector_meta().ops
    assert pull == PullBlocks("c", "p", (8, 9, 10), (4, 5, 6), "10.0.0.1", 5600,
                              params["remote_engine_id"])
    # readmitted after a preemption: the producer may have freed them, so it computes
    assert consumer.get_num_new_matched_tokens(request, 0) == (0, False)


def test_params_made_for_another_prompt_are_not_used():
    _, params = _hand_over()
    consumer = _pd("consumer")
    other = Request("c", [*PROMPT[:-1], 999], kv_transfer_params=params)
    assert consumer.get_num_new_matched_tokens(other, 0) == (0, False)


@pytest.mark.parametrize("params, role, message", [
    ({"do_remote_decode": True}, None, "no KV connector"),
    ({"do_remote_decode": True}, "consumer", "is a consumer"),
    ({"do_remote_prefill": True, "remote_block_ids": [1]}, "consumer", "needs remote_host"),
    ({"do_remote_prefill": True, "remote_block_ids": [0], "remote_host": "h",
      "remote_port": 1, "remote_request_id": "r"}, "consumer", "list of block ids"),
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_host": "h",
      "remote_port": 70000, "remote_request_id": "r"}, "both", "port number"),
    ({"do_remote_prefill": True}, "producer", "is a producer"),
])
def test_params_the_engine_cannot_honour_are_refused(params, role, message):
    with pytest.raises(ValueError, match=message):
        check_kv_transfer_params(params, role)
