"""Decode steps replayed from CUDA graphs (runner/cuda_graphs.py).

Without a GPU: the buckets, and the captured computation itself (the model over the persistent
buffers, padded to a bucket) run eagerly with the Triton backend under Triton's interpreter,
against the ordinary eager step -- the padded rows must change nothing. With a GPU: capture and
replay against eager, and the real model's greedy outputs with graphs on == off == the CPU's
float32 reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.runner.batch import Chunk
from tokenmill.runner.cuda_graphs import StepBuffers, graph_buckets, is_plain_decode

CUDA = torch.cuda.is_available()


def test_buckets_cover_every_batch_size():
    assert graph_buckets(1) == [1]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(256)[-1] == 256 and len(graph_buckets(256)) == 4 + 16
    for n in range(1, 65):  # every batch fits a bucket no more than twice as large
        b = next(b for b in graph_buckets(64) if b >= n)
        assert b < 2 * n or b - n < 16


def test_only_plain_decode_steps_are_replayed():
    assert is_plain_decode([Chunk([5], 10, [1]), Chunk([6], 3, [2])])
    assert not is_plain_decode([Chunk([5, 6], 10, [1])])  # a prompt chunk
    assert not is_plain_decode([Chunk([5], 10, [1], num_logits=0)])
    assert not is_plain_decode([Chunk([5], 10, [1], num_logits=2)])


def test_step_buffers_pad_rows_to_write_nowhere():
    buf = StepBuffers(rows=8, max_blocks=4, device=torch.device("cpu"))
    buf.fill([Chunk([11], 17, [3, 5]), Chunk([12], 0, [7])], padded=4, block_size=16)
    assert buf.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert buf.positions[:4].tolist() == [17, 0, 0, 0]
    assert buf.slot_mapping.tolist() == [5 * 16 + 1, 7 * 16, -1, -1, -1, -1, -1, -1]
    assert buf.seq_lens[:4].tolist() == [18, 1, 0, 0]
    assert buf.block_tables[:2, :2].tolist() == [[3, 5], [7, 0]]
    meta = buf.metadata(4, 16)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.seq_lens.shape == (4,)
    with pytest.raises(ValueError, match="exceeds"):
        buf.fill([Chunk([1], 0, [1, 2, 3, 4, 5])], padded=1, block_size=16)


def tiny_runner(tmp_path, backend: str, device: str = "cpu"):
    from tests.tiny_models import make_hf_model, save_hf_model
    from tokenmill.model.loader import load_model
    from tokenmill.runner.model_runner import ModelRunner

    path = save_hf_model(make_hf_model("llama"), tmp_path / "hf")
    return ModelRunner(load_model(str(path), device, "float32", backend), num_blocks=40,
                       block_size=16, device=device)


def test_padded_graph_step_equals_the_eager_step(tmp_path):
    """The computation a graph captures -- the model over the persistent buffers, 3 sequences
    padded to 4 -- against the eager step; the padding writes nothing into the cache."""
    if not CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from tokenmill.runner.cuda_graphs import DecodeGraphs

    device = "cuda" if CUDA else "cpu"
    runner = tiny_runner(tmp_path, "triton", device)
    tables = [[1, 2], [3], [4, 5, 6]]
    prompts = [list(range(3, 20)), [7, 8, 9], list(range(40, 75))]
    runner.forward([Chunk(p, 0, t) for p, t in zip(prompts, tables)])
    step = [Chunk([p[-1] + 1], len(p), t) for p, t in zip(prompts, tables)]
    eager = runner.forward(step)
    cache_after = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 16, max_num_seqs=8,
                          max_model_len=128, device=torch.device(device))
    assert graphs.bucket(3) == 4
    graphs.buffers.fill(step, 4, 16)
    with torch.inference_mode():
        padded = graphs._forward(4)
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    for (k, v), (k0, v0) in zip(runner.kv_caches, cache_after):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # same values, nothing else written


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_replayed_steps_equal_eager_steps(tmp_path):
    pytest.importorskip("triton")
    runner = tiny_runner(tmp_path, "triton", "cuda")
    eager = tiny_runner(tmp_path, "triton", "cuda")
    runner.capture_graphs(max_num_seqs=8, max_model_len=128)
    for r in (runner, eager):
        r.forward([Chunk(list(range(3, 20)), 0, [1, 2]), Chunk([7, 8, 9], 0, [3])])
    for pos in range(5):
        step = [Chunk([10 + pos], 17 + pos, [1, 2]), Chunk([20 + pos], 3 + pos, [3])]
        torch.testing.assert_close(runner.forward(step), eager.forward(step),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_real_model_greedy_graphs_on_equals_off_equals_cpu():
    pytest.importorskip("triton")
    from tests.test_engine_real import PROMPTS
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24)
    outs = {}
    for name, opts in {"cpu": dict(device="cpu", dtype="float32"),
                       "graphs": dict(device="cuda", dtype="float32"),
                       "eager": dict(device="cuda", dtype="float32", enforce_eager=True)}.items():
        llm = LLM("smollm2-135m-instruct", kv_cache_memory=64 << 20, **opts)
        assert (llm.engine.info.cuda_graphs != "off") == (name == "graphs")
        outs[name] = [o.outputs[0].token_ids for o in
                      llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outs["graphs"] == outs["eager"]
    same = sum(a == b for x, y in zip(outs["graphs"], outs["cpu"]) for a, b in zip(x, y))
    assert same / sum(map(len, outs["cpu"])) >= 0.95, same


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_overlapped_scheduling_equals_plain_on_cuda(tmp_path):
    """bf16, graphs and the fused kernels: overlapped scheduling (the next step launched
    before this one's outputs are built) gives the plain engine's tokens and logprobs, greedy
    and seeded, with requests joining mid-run."""
    pytest.importorskip("triton")
    from tests.tiny_models import make_hf_model, save_hf_model, write_word_tokenizer
    from tokenmill import LLM, SamplingParams

    model = make_hf_model("llama")
    path = save_hf_model(model, tmp_path / "hf")
    write_word_tokenizer(path, model.config.vocab_size)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(5 + 3 * i)] for i in range(24)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=8 + i,
                             logprobs=1, ignore_eos=True) for i in range(24)]
    runs = []
    for flag in (False, True):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=16,
                  max_num_batched_tokens=64, async_scheduling=flag)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [e.logprob for e in o.outputs[0].logprobs])
                     for o in outs])
    assert runs[0] == runs[1]
