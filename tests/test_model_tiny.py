"""tokenmill's Llama-family forward vs transformers on tiny random weights (float32).

Each architecture is checked for a whole prompt in one pass and for the same prompt fed as a
prefix, chunks and one-token decode steps through a paged cache of block size 4 whose block ids
are shuffled (so a request's blocks are not contiguous).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.tiny_models import ARCHS, make_hf_model, save_hf_model
from tokenmill.model.loader import load_model
from tokenmill.runner.batch import Chunk
from tokenmill.runner.model_runner import ModelRunner

TOL = 1e-4
BLOCK = 4


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory, device):
    """(transformers model on the CPU, tokenmill runner on ``--device``), same random weights."""
    hf = make_hf_model(request.param)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    runner = ModelRunner(load_model(str(path), device), num_blocks=64, block_size=BLOCK,
                         device=device)
    return hf, _OnCpu(runner)


class _OnCpu:
    """The runner with its logits brought back to the CPU for comparison."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def forward(self, chunks, all_logits: bool = False) -> torch.Tensor:
        return self.runner.forward(chunks, all_logits).cpu()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def shuffled_table(num_tokens: int, seed: int, pool: int = 64) -> list[int]:
    blocks = list(range(pool))
    random.Random(seed).shuffle(blocks)
    return blocks[: -(-num_tokens // BLOCK)]


def test_whole_prompt_matches_transformers(pair):
    hf, runner = pair
    ids = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = runner.forward([Chunk(ids, 0, shuffled_table(len(ids), 0))], all_logits=True)
    assert ours.shape == (37, 96)
    assert (ours - hf_logits(hf, ids)).abs().max().item() <= TOL


def test_prefix_chunks_and_decode_through_paged_cache(pair):
    hf, runner = pair
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(hf, ids)
    table = shuffled_table(len(ids), 1)
    assert table != sorted(table)  # genuinely non-contiguous
    # prefix of 7 (ends mid-block), chunks of 6 and 9, then one token at a time
    cuts = [0, 7, 13, 22] + list(range(23, 31))
    for start, end in zip(cuts, cuts[1:]):
        out = runner.forward([Chunk(ids[start:end], start, table)], all_logits=True)
        diff = (out - ref[start:end]).abs().max().item()
        assert diff <= TOL, f"tokens {start}:{end} differ by {diff}"


def test_last_token_logits_only_by_default(pair):
    hf, runner = pair
    ids = list(range(3, 20))
    out = runner.forward([Chunk(ids, 0, shuffled_table(len(ids), 3))])
    assert out.shape == (1, 96)
    assert (out[0] - hf_logits(hf, ids)[-1]).abs().max().item() <= TOL


def test_mixed_batch_equals_each_request_alone(pair):
    """One flat batch: a long fresh prompt chunk, a prompt continuing a cached prefix, and
    several decode tokens, each compared with that request run alone."""
    hf, runner = pair
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (40, 25, 12, 17, 9)]
    blocks = list(range(64))
    random.Random(5).shuffle(blocks)
    tables, used = [], 0
    for s in seqs:
        need = -(-len(s) // BLOCK)
        tables.append(blocks[used:used + need])
        used += need
    # Warm the cache: request 1's prefix of 10 tokens, and requests 2-4 up to their last token.
    warm = [Chunk(seqs[1][:10], 0, tables[1])] + [
        Chunk(s[:-1], 0, t) for s, t in zip(seqs[2:], tables[2:])]
    runner.forward(warm)
    batch = [Chunk(seqs[0], 0, tables[0]), Chunk(seqs[1][10:], 10, tables[1])] + [
        Chunk(s[-1:], len(s) - 1, t) for s, t in zip(seqs[2:], tables[2:])]
    out = runner.forward(batch)
    assert out.shape == (5, 96)
    for row, s in enumerate(seqs):
        alone = hf_logits(hf, s)[-1]
        assert (out[row] - alone).abs().max().item() <= TOL, f"request {row} differs"


def test_cpu_linear_layers_packed(pair, device):
    """On a CPU in fp32 every projection runs on a packed weight (the tests above check its
    logits): the CPU kernels' float32 layout where they are built for AVX2/AVX512 and the output
    size is a multiple of their register width, else oneDNN's; a weight no other module
    shares is not kept twice, a tied one is."""
    if device != "cpu" or not torch.backends.mkldnn.is_available():
        pytest.skip("weight packing applies to fp32 on a CPU")
    from tokenmill.model.layers import Linear

    module = pair[1].runner.model
    embed = module.model.embed_tokens.weight
    ops = getattr(module.model.layers[0].self_attn.backend, "ops", None)
    cols = getattr(ops, "f32_pack_cols", 0) if ops is not None else 0
    kernel_packed = 0
    for name, layer in module.named_modules():
        if isinstance(layer, Linear):
            kernel = layer.kernel
            if kernel.family == "f32-packed":
                assert cols and kernel.packed.shape[2] == cols, name
                kernel_packed += 1
            else:  # oneDNN only where the kernels cannot take the weight
                assert kernel.family == "onednn" and kernel.packed.is_mkldnn, name
                assert not cols or kernel.packed.size(0) % cols, name
            if layer.weight is not None:  # only the lm_head tied to the embedding keeps it
                assert name == "lm_head" and layer.weight is embed
    assert kernel_packed == (0 if not cols else 4 * len(module.model.layers) + 1)  # sizes of 16
