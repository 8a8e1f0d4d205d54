"""The host's per-step work in bulk: flat batches and CUDA-graph inputs built with numpy equal
a per-token reference; the sampler's two halves (``launch`` / ``result``) equal one call and,
on a GPU, queue no host sync; the detokenizer's memoised single-token decode changes no text."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.params import SamplingParams
from tokenmill.runner.batch import Chunk, build_flat_batch
from tokenmill.runner.cuda_graphs import StepBuffers
from tokenmill.runner.sampler import Sampler, SamplingRow
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer

CUDA = torch.cuda.is_available()


def random_chunks(rng: random.Random, block_size: int, decode: bool) -> list[Chunk]:
    chunks = []
    for _ in range(rng.randint(1, 9)):
        start = rng.randint(0, 40)
        n = 1 if decode else rng.choice([0, 1, 2, 5, 17])
        blocks = (start + n + block_size - 1) // block_size + rng.randint(0, 2)
        chunks.append(Chunk([rng.randint(0, 999) for _ in range(n)], start,
                            rng.sample(range(1, 500), max(blocks, 1)),
                            rng.randint(0, n) if n else 0))
    return chunks


def reference_batch(chunks: list[Chunk], bs: int, all_logits: bool) -> dict[str, list[int]]:
    """Token by token, the way the flat batch is defined."""
    out: dict[str, list[int]] = {"ids": [], "pos": [], "slots": [], "rows": [], "lens": []}
    row = 0
    for c in chunks:
        n = len(c.token_ids)
        for j, token in enumerate(c.token_ids):
            p = c.start_pos + j
            out["ids"].append(token)
            out["pos"].append(p)
            out["slots"].append(c.block_table[p // bs] * bs + p % bs)
        wanted = n if all_logits else c.num_logits
        out["rows"] += range(row + n - wanted, row + n)
        out["lens"].append(c.start_pos + n)
        row += n
    return out


@pytest.mark.parametrize("decode", [True, False])
def test_flat_batch_matches_per_token_reference(decode: bool) -> None:
    rng = random.Random(int(decode))
    for _ in range(300):
        bs = rng.choice([1, 4, 16])
        chunks = random_chunks(rng, bs, decode)
        for all_logits in (False, True):
            batch = build_flat_batch(chunks, bs, "cpu", all_logits)
            ref = reference_batch(chunks, bs, all_logits)
            assert batch.input_ids.tolist() == ref["ids"]
            assert batch.positions.tolist() == ref["pos"]
            assert batch.meta.slot_mapping.tolist() == ref["slots"]
            assert batch.logits_indices.tolist() == ref["rows"]
            assert batch.meta.seq_lens.tolist() == ref["lens"] == batch.meta.seq_lens_host
            assert batch.meta.query_lens_host == [len(c.token_ids) for c in chunks]
            width = max(len(c.block_table) for c in chunks)
            assert batch.meta.block_tables.tolist() == [
                [*c.block_table, *[0] * (width - len(c.block_table))] for c in chunks]
            assert all(t.dtype == torch.int64 for t in (batch.input_ids, batch.positions,
                                                         batch.logits_indices))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_step_buffers_fill_in_bulk(device: str) -> None:
    rng = random.Random(2)
    buffers = StepBuffers(rows=32, max_blocks=6, device=torch.device(device))
    for _ in range(200):  # in turn through both staging sets, with shrinking batches too
        bs = rng.choice([1, 4, 16])
        chunks = [Chunk([rng.randint(0, 999)], p, rng.sample(range(1, 99), min(6, p // bs + 1)))
                  for p in (rng.randint(0, 6 * bs - 1) for _ in range(rng.randint(1, 32)))]
        padded = rng.randint(len(chunks), 32)
        buffers.fill(chunks, padded, bs)
        ref = reference_batch(chunks, bs, False)
        pad = 32 - len(chunks)
        assert buffers.input_ids.tolist() == ref["ids"] + [0] * pad
        assert buffers.positions.tolist() == ref["pos"] + [0] * pad
        assert buffers.slot_mapping.tolist() == ref["slots"] + [-1] * pad
        assert buffers.seq_lens.tolist() == ref["lens"] + [0] * pad
        for i, c in enumerate(chunks):
            assert buffers.block_tables[i, :len(c.block_table)].tolist() == c.block_table


def sampling_rows(n: int) -> list[SamplingRow]:
    """Greedy, plain sampled, warped, penalised, seeded and logprob rows, mixed."""
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=20),
             dict(temperature=0.7, min_p=0.05, seed=3), dict(repetition_penalty=1.3, seed=1),
             dict(temperature=0.0, logprobs=3), dict(temperature=1.2, logprobs=0, seed=9)]
    return [SamplingRow(f"s{i}", SamplingParams(**kinds[i % len(kinds)]), [1, 2, 3],
                        [4, i % 50], frozenset({0}), i % 3) for i in range(n)]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_launch_then_result_equals_one_call(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(24, 300, generator=gen) * 3).to(device)
    rows = sampling_rows(24)
    whole = Sampler(seed=4)(logits.clone(), rows)
    halves = Sampler(seed=4).launch(logits.clone(), rows).result()
    assert halves.token_ids == whole.token_ids
    assert halves.logprobs == whole.logprobs
    assert all(type(t) is int for t in halves.token_ids)
    assert Sampler().launch(logits[:0], []).result().token_ids == []


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("logprobs", [False, True])
def test_greedy_launch_never_syncs(logprobs: bool) -> None:
    """The whole sampling of a greedy batch is queued without waiting for the device."""
    logits = torch.randn(64, 1000, device="cuda")
    params = SamplingParams(temperature=0.0, logprobs=2 if logprobs else None)
    rows = [SamplingRow(f"s{i}", params, [1], [2], frozenset(), 0) for i in range(64)]
    sampler = Sampler()
    sampler(logits, rows)  # warm-up: pinned memory, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.launch(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.result().token_ids == logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def tok(default_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path)


def test_memoised_token_decode_keeps_the_text(tok: Tokenizer) -> None:
    ids = tok.encode("Streaming 東京 text 🎉 goes on,  and   on. <|im_end|> ") * 3
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = "".join(detok.add(i) for i in ids) + detok.finish()
        assert text == tok.decode(ids, skip_special_tokens=skip)
    assert all(tok.decode_token(i) == tok.decode([i], skip_special_tokens=False) for i in ids)
