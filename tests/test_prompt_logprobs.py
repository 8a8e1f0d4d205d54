"""Prompt logprobs: the engine's ``prompt_logprobs`` against a transformers forward of the same
tokens (float32, 1e-4), chunked and batched with plain requests; over HTTP the completion
endpoint's ``echo`` + ``logprobs`` (lm-evaluation-harness's loglikelihood wire format, with
``max_tokens`` 1 and 0), vLLM's ``prompt_logprobs`` on completions and chat, and the 400s."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.test_server_support import MODEL, server_fixtures
from tokenmill.params import ParamError, SamplingParams

server, client = server_fixtures("--dtype", "float32", "--max-num-batched-tokens", "96")

TEXTS = ["The capital of France is Paris. The capital of Germany is Berlin. " * 8,
         "Question: what is two plus two? Answer: four"]
CONTEXT = "Question: which animal barks?\nAnswer:"
CHOICES = [" a dog", " a cat", " a fish", " an owl"]


def hf_token_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 under transformers' float32 forward."""
    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = logits.log_softmax(-1)
    return lp[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def hf_top(hf, ids: list[int], k: int) -> list[list[int]]:
    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits[:-1].topk(k, dim=-1).indices.tolist()


@pytest.fixture(scope="module")
def chunked_llm():
    """The default model in float32 with a 64-token step budget: long prompts are scored
    over several chunks."""
    from tokenmill import LLM

    return LLM(MODEL, num_blocks=256, block_size=16, dtype="float32",
               max_num_batched_tokens=64)


@pytest.mark.slow
def test_engine_prompt_logprobs_match_transformers(chunked_llm, hf_default_float32):
    params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
              SamplingParams(max_tokens=3, temperature=0),  # batched beside a plain request
              SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, n=2)]
    outs = chunked_llm.generate([TEXTS[0], TEXTS[1], TEXTS[1]], params, use_tqdm=False)
    assert outs[1].prompt_logprobs is None
    for out, k in ((outs[0], 3), (outs[2], 0)):
        ids = out.prompt_token_ids
        scored = out.prompt_logprobs
        assert len(scored) == len(ids) and scored[0] is None
        assert [e.token_id for e in scored[1:]] == ids[1:]
        want = hf_token_logprobs(hf_default_float32, ids)
        got = torch.tensor([e.logprob for e in scored[1:]])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert all(len(e.top) == k for e in scored[1:])
        if k:
            assert [[t for t, _ in e.top] for e in scored[1:]] == hf_top(hf_default_float32,
                                                                         ids, k)
            assert all((e.rank == 1) == (e.top[0][0] == e.token_id) for e in scored[1:])
    assert len(outs[0].prompt_token_ids) > 64  # scored over several chunks


@pytest.mark.slow
def test_prompt_logprobs_recompute_a_cached_prefix(chunked_llm):
    """A scored prompt never reads the prefix cache (its positions' logits are needed), so a
    prompt already cached scores the same."""
    p = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    first = chunked_llm.generate(TEXTS[0], p, use_tqdm=False)[0]
    again = chunked_llm.generate(TEXTS[0], p, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert [e and e.logprob for e in again.prompt_logprobs] == \
        [e and e.logprob for e in first.prompt_logprobs]


def test_params_check_prompt_logprobs():
    for bad in (-1, 21, 1.5):
        with pytest.raises(ParamError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)


def _loglikelihood(server, tok, context: str, continuation: str, max_tokens: int) -> float:
    """lm-evaluation-harness's local-completions scoring of one item."""
    ctx = tok.encode(context)
    whole = ctx + tok.encode(continuation)
    body = _post(server, "/v1/completions", {"prompt": whole, "echo": True, "logprobs": 1,
                                             "max_tokens": max_tokens, "temperature": 0}).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(whole) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    end = len(lp["token_logprobs"]) - max_tokens
    return sum(lp["token_logprobs"][len(ctx):end])


def test_lm_eval_wire_format_picks_transformers_choice(server, hf_default_float32):
    _, tok = hf_default_float32
    ctx = tok.encode(CONTEXT)
    want = []
    for choice in CHOICES:
        ids = ctx + tok.encode(choice)
        want.append(float(hf_token_logprobs(hf_default_float32, ids)[len(ctx) - 1:].sum()))
    for max_tokens in (1, 0):
        got = [_loglikelihood(server, tok, CONTEXT, c, max_tokens) for c in CHOICES]
        assert got == pytest.approx(want, abs=1e-3)
        assert got.index(max(got)) == want.index(max(want))


def test_echo_max_tokens_zero_generates_nothing(server):
    body = _post(server, "/v1/completions", {"prompt": TEXTS[1], "echo": True, "logprobs": 2,
                                             "max_tokens": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == TEXTS[1] and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == body["usage"]["prompt_tokens"]
    assert all(len(top) >= 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_logprobs_stream_like_the_body(server):
    body = {"prompt": TEXTS[1], "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    tokens, lps = [], []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                      json={"model": MODEL, **body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    if c["logprobs"]:
                        tokens += c["logprobs"]["tokens"]
                        lps += c["logprobs"]["token_logprobs"]
    assert tokens == whole["logprobs"]["tokens"]
    assert lps == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5)


def test_vllm_prompt_logprobs_field(server, client):
    comp = client.completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=2,
                                     extra_body={"prompt_logprobs": 2}).model_dump()
    scored = comp["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == comp["usage"]["prompt_tokens"]
    assert all(2 <= len(entry) <= 3 for entry in scored[1:])
    first = next(iter(scored[1].values()))
    assert set(first) == {"logprob", "rank", "decoded_token"}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0}).model_dump()
    scored = chat["prompt_logprobs"]
    assert scored[0] is None and len(scored) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in scored[1:])
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).model_dump()
    assert "prompt_logprobs" not in plain["choices"][0] or \
        plain["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 50}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": "x"}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/responses", {"input": "Hi", "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_bad_prompt_scoring_is_a_400(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
