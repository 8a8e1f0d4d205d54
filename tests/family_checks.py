"""What every model family must show against transformers (no tests here): float32 logits of a
whole prompt, and greedy tokens through the engine and through the server under batching,
chunked prefill, prefix-cache hits and preemption.

A family's test builds a tiny random transformers model (``tiny_models.py`` style), saves it
with ``write_word_tokenizer``, then calls these."""

from __future__ import annotations

import concurrent.futures
import copy
from pathlib import Path

import openai
import torch

from tests.test_server_support import start_server, stop_server

STEPS = 32  # greedy tokens compared per prompt


def family_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Six prompts of 9-70 tokens: three share a 40-token prefix (prefix hits), two are longer
    than a chunk of 32 (chunked prefill); ids avoid 0..2 (special tokens of real vocabularies)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=g).tolist()

    shared = ids(40)
    return [shared + ids(9), shared + ids(30), shared + ids(3), ids(70), ids(9), ids(17)]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int = STEPS) -> list[int]:
    """transformers' greedy continuation of ``prompt``: ``steps`` tokens, none of them a stop
    (as the engine's ignore_eos; min_new_tokens would instead forbid the end-of-sequence id)."""
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id, config.pad_token_id = None, 0
    config.max_new_tokens, config.do_sample = steps, False
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_last_logits(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of ``prompt``: (len, vocab)."""
    return hf(torch.tensor([prompt])).logits[0].float()


# an engine that must batch, chunk, hit its prefix cache and preempt to run family_prompts:
# 32-token chunks, and KV blocks for ~100 tokens per sequence at most while six run together
ENGINE_OPTIONS = dict(dtype="float32", block_size=16, num_blocks=24, max_num_batched_tokens=32,
                      max_num_seqs=6, max_model_len=128, enable_prefix_caching=True, seed=0)


def engine_greedy(model_dir: Path, prompts: list[list[int]], steps: int = STEPS,
                  **options) -> tuple[list[list[int]], object]:
    """Greedy tokens of every prompt, all submitted at once, then the first three again (their
    prefix cached); returns (tokens of the first pass, the engine's stats)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(model_dir), **{**ENGINE_OPTIONS, **options})
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
    assert again == first[:3], "a prefix-cache hit changed greedy tokens"
    stats = llm.engine.scheduler.stats()
    return [list(t) for t in first], stats


def check_engine(model_dir: Path, hf, prompts: list[list[int]], **options) -> None:
    """The engine's greedy tokens equal transformers', with preemption and prefix hits seen."""
    want = [hf_greedy(hf, p) for p in prompts]
    got, stats = engine_greedy(model_dir, prompts, **options)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: engine {g} != transformers {w}"
    assert stats.num_preemptions > 0, "the engine never preempted: the check is too easy"
    assert stats.prefix_cache_hits > 0, "no prefix-cache hit"


def check_server(tmp_path_factory, model_dir: Path, hf, prompts: list[list[int]],
                 *flags: str) -> None:
    """The server's greedy completions (token-id prompts, sent concurrently with the official
    client) equal transformers'; the model directory has ``write_word_tokenizer``'s vocabulary."""
    want = [hf_greedy(hf, p) for p in prompts]
    server = start_server(tmp_path_factory, "--dtype", "float32", "--max-num-batched-tokens",
                          "32", "--max-num-seqs", "6", *flags, model=str(model_dir))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def complete(prompt: list[int]) -> list[int]:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=STEPS,
                                          temperature=0.0, extra_body={"ignore_eos": True})
            # write_word_tokenizer's words: "w<id>" each
            return [int(w[1:]) for w in r.choices[0].text.split()]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
    finally:
        stop_server(server)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: server {g} != transformers {w}"
