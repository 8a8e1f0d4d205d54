"""Prefix caching with the real default model: exact outputs, prefill saved, multi-turn reuse."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sched import Scheduler

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
        "wine making. Within decades presses spread across Europe, books became cheaper, and "
        "literacy rose in the cities. Scholars exchanged ideas faster than ever before, and the "
        "Reformation followed close behind.")


@pytest.fixture(scope="module")
def llm():
    # float32: outputs with and without the cache must be token-exact
    return LLM("smollm2-135m-instruct", num_blocks=160, block_size=BS, dtype="float32")


def assert_clean(llm: LLM) -> None:
    manager = llm.engine.scheduler.block_manager
    manager.check_integrity()
    assert manager.usage == 0.0 and not llm.engine.has_unfinished_requests()


def test_outputs_identical_with_cache_on_and_off(llm):
    base = llm.tokenizer.encode(TEXT)
    assert len(base) > 64
    warm = base[:64]  # exactly 4 blocks
    # Shared prefixes of varying length, ending on and inside a block; then whole prompts cached
    # (block-aligned and not), which must still compute their last token.
    prompts = [base[:k] + llm.tokenizer.encode(f" Fact {k}: the") for k in (16, 23, 40, 57)]
    prompts += [warm, base[:50], base]
    llm.engine.scheduler.flush_prefix_cache()
    llm.generate([warm, base], GREEDY, use_tqdm=False)
    cached_run = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in cached_run] == [16, 16, 32, 48, 48, 48, 64]
    assert_clean(llm)

    # An engine built from the same runner and a scheduler without prefix caching (one load).
    engine = llm.engine
    scheduler = Scheduler(engine.scheduler.config,
                          CacheConfig(block_size=BS, enable_prefix_caching=False),
                          num_blocks=engine.scheduler.block_manager.pool.num_blocks,
                          eos_token_ids=engine.eos_token_ids)
    no_cache = LLM(engine=LLMEngine(scheduler, engine.executor, engine.tokenizer, engine.info))
    no_cache.generate([warm, base], GREEDY, use_tqdm=False)
    plain = no_cache.generate(prompts, GREEDY, use_tqdm=False)
    assert scheduler.block_manager.prefix_cache.num_cached_blocks == 0
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert [o.outputs[0].token_ids for o in cached_run] == [o.outputs[0].token_ids for o in plain]


def test_shared_system_prompt_is_computed_once(llm):
    ids = llm.tokenizer.encode(TEXT)
    system = (ids * (1024 // len(ids) + 1))[:1024]
    suffixes = [llm.tokenizer.encode(f" Question {i}:")[:4] for i in range(32)]
    suffixes = [(s * 4)[:4] for s in suffixes]
    prompts = [system + s for s in suffixes]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.engine.scheduler.flush_prefix_cache()
    before = llm.engine.stats().num_prompt_tokens_computed
    first = llm.generate(prompts[0], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    computed = llm.engine.stats().num_prompt_tokens_computed - before
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 1024 for o in rest)
    assert computed == 1024 + 32 * 4  # not 32 * 1028
    assert_clean(llm)


def test_multi_turn_conversation_reuses_each_previous_turn(llm):
    llm.engine.scheduler.flush_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    conversation = [{"role": "system", "content": "You are a terse assistant."}]
    cached, prompt_lens = [], []
    for turn in range(8):
        conversation.append({"role": "user", "content": f"Turn {turn}: name a number."})
        prompt = llm.chat_prompt_ids(conversation)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        cached.append(out.num_cached_tokens)
        prompt_lens.append(len(prompt))
        conversation.append({"role": "assistant", "content": out.outputs[0].text})
    assert cached[0] == 0
    assert all(b > a for a, b in zip(cached, cached[1:])), cached
    for t in range(1, 8):  # at least every whole block of the previous turn's prompt
        assert cached[t] >= prompt_lens[t - 1] // BS * BS, (t, cached, prompt_lens)
    assert_clean(llm)
