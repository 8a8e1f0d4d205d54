"""KV connectors in engines built on the tiny random model of test_distributed.py (float32,
where every layout gives one process's tokens): a transfer cut mid-way or a producer gone
before the pull is recomputed to the same tokens; under tensor parallelism each rank moves its
own shard of every block and the engine hears of a load once every rank is done."""

from __future__ import annotations

import pytest

from tests.test_distributed import write_tiny_llama
from tests.test_distributed_serve import free_port_run
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine

# loads the real model or starts servers / ranks: not in the fast loop
pytestmark = pytest.mark.slow

BASE = dict(dtype="float32", block_size=4, max_model_len=128, num_blocks=64)
TP2 = dict(tensor_parallel_size=2)
PROMPT = list(b"The lighthouse keeper found a bottle between the rocks.")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny_tp"), 4))


def _engine(model: str, **options) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.from_options(model, **{**BASE, **options}))


def _generate(engine: LLMEngine, request_id: str, params: SamplingParams = GREEDY,
              kv_transfer_params: dict | None = None):
    engine.add_request(request_id, PROMPT, params, kv_transfer_params=kv_transfer_params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    engine.step()  # hands what the finish decided (a producer's exposed blocks) to the ranks
    return final


def test_the_disk_tier_under_tensor_parallel_ranks(tiny, tmp_path):
    engine = _engine(tiny, **TP2, kv_offload="disk", kv_offload_size=16 << 20,
                     kv_offload_dir=str(tmp_path))
    try:
        first = _generate(engine, "a")
        from_radix = _generate(engine, "b")
        engine.flush_prefix_cache()
        computed = engine.stats().num_prompt_tokens_computed
        from_disk = _generate(engine, "c")
        stats = engine.stats()
    finally:
        engine.shutdown()
    cacheable = (len(PROMPT) - 1) // 4 * 4
    assert from_radix.num_cached_tokens == from_disk.num_cached_tokens == cacheable
    assert from_disk.outputs[0].token_ids == from_radix.outputs[0].token_ids \
        == first.outputs[0].token_ids
    assert stats.num_prompt_tokens_computed - computed == len(PROMPT) - cacheable
    assert stats.kv_tiers["disk"].hits == 2 * cacheable // 4  # each rank its shard
    shards = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(shards) == 2  # one fingerprint (directory) per rank


def test_prefill_and_decode_instances_with_two_ranks_each(tiny):
    # rank r listens on the port + r: both must be free, not the first alone
    producer = _engine(tiny, **TP2, kv_role="producer", kv_transfer_port=free_port_run(2))
    consumer = _engine(tiny, **TP2, kv_role="consumer")
    try:
        reference = _generate(producer, "whole")
        hand_over = _generate(producer, "prefill", SamplingParams(temperature=0.0, max_tokens=1),
                              {"do_remote_decode": True})
        params = hand_over.kv_transfer_params
        assert params["tp_size"] == 2 and params["do_remote_prefill"]
        computed = consumer.stats().num_prompt_tokens_computed
        decoded = _generate(consumer, "decode", kv_transfer_params=params)
        stats = consumer.stats()
        for _ in range(200):  # the producer frees the blocks once both ranks were pulled
            if not producer.has_pending_work():
                break
            producer.step()
        held = producer.stats().num_held
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert decoded.outputs[0].token_ids == reference.outputs[0].token_ids
    assert stats.num_prompt_tokens_computed - computed == 1
    assert stats.external_cache_hits == len(PROMPT) - 1
    assert stats.kv_tiers["p2p"].hits == 2 * -(-(len(PROMPT) - 1) // 4)  # both ranks' shards
    assert held == 0


def _hand_over(producer: LLMEngine) -> dict:
    out = _generate(producer, "prefill", SamplingParams(temperature=0.0, max_tokens=1),
                    {"do_remote_decode": True})
    return out.kv_transfer_params


@pytest.mark.parametrize("producer_options, gone, arrived", [
    (dict(kv_test_fail_after_blocks=2), False, 2),  # cut mid-way: the 2 blocks that came stay
    ({}, True, 0),  # the producer shut down before the pull: its side channel finds nobody
], ids=["cut-mid-way", "producer-gone"])
def test_a_failed_transfer_keeps_what_arrived_and_recomputes_the_rest(tiny, producer_options,
                                                                      gone, arrived):
    producer = _engine(tiny, kv_role="producer", **producer_options)
    consumer = _engine(tiny, kv_role="consumer", kv_pull_timeout=1.0)
    try:
        reference = _generate(consumer, "whole")
        consumer.flush_prefix_cache()
        params = _hand_over(producer)
        if gone:
            producer.shutdown()
        computed = consumer.stats().num_prompt_tokens_computed
        decoded = _generate(consumer, "decode", kv_transfer_params=params)
        stats = consumer.stats()
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert decoded.outputs[0].token_ids == reference.outputs[0].token_ids
    assert stats.num_prompt_tokens_computed - computed == len(PROMPT) - arrived * 4
    assert decoded.num_cached_tokens == arrived * 4
    assert stats.kv_tiers["p2p"].misses > 0


def test_a_consumer_with_a_host_tier_keeps_what_it_pulled(tiny):
    """--kv-role with --kv-offload: the pulled prompt's blocks, evicted later, come back from
    the consumer's own host tier."""
    producer = _engine(tiny, kv_role="producer")
    consumer = _engine(tiny, kv_role="consumer", num_blocks=40, kv_offload="host",
                       kv_offload_size=8 << 20)
    try:
        params = _hand_over(producer)
        pulled = _generate(consumer, "decode", kv_transfer_params=params)
        for i in range(2):  # two other prompts push the pulled blocks out of the KV cache
            filler = [(7 * i + 3 * j) % 250 for j in range(100)]
            consumer.add_request(f"filler-{i}", filler, GREEDY)
            while consumer.has_unfinished_requests():
                consumer.step()
        stats = consumer.stats()
        again = _generate(consumer, "again")
        after = consumer.stats()
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert stats.kv_tiers["host"].blocks_saved > 0
    assert again.outputs[0].token_ids == pulled.outputs[0].token_ids
    assert again.num_cached_tokens == (len(PROMPT) - 1) // 4 * 4
    assert after.external_cache_hits > stats.external_cache_hits  # from the host tier
    assert after.kv_tiers["host"].hits > 0
