"""The shared-memory all-reduce (``distributed/shm.py`` over ``kernels/csrc/shm_allreduce.h``) and
the fused CPU step's two hooks for parallelism (``runner/cpu_step.py``): the all-reduce of the
o_proj and down outputs under tensor parallelism, and a pipeline stage's incoming residual.

The all-reduce runs in 2 to 4 spawned processes joined by gloo on loopback (more ranks than
the machine's cores: its waits must yield). Every result is compared bit for bit with the sum
in rank order in float32 that each rank computes from everyone's inputs, which it can rebuild
from their seeds.
"""

from __future__ import annotations

import hashlib
import os
import time
import types
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.test_server_support import free_port
from tests.tiny_models import make_hf_model, save_hf_model, write_word_tokenizer
from tokenmill.distributed.shm import ShmAllReduce, shm_dir
from tokenmill.kernels import cpu as cpu_kernels

ops = cpu_kernels.load()
pytestmark = pytest.mark.skipif(ops is None or not hasattr(ops, "ShmAllReduce"),
                                reason="the CPU kernels are not built (no compiler)")
F32_STEP = ops is not None and getattr(ops, "f32_pack_cols", 0) > 0 and \
    hasattr(ops, "DecoderStack")
BF16_STEP = F32_STEP and getattr(ops, "has_bf16_gemm", False)
SLOT = 4096  # bytes per rank and round: 1024 float32 values, so that most sizes take several
SIZES = [1, 7, 1000, 1024, 1025, 2048 + 13, 3 * 576 + 5, 5000]
BLOCK = 16


def run_ranks(fn, world: int, *args) -> None:
    """``fn(rank, world, port, *args)`` in ``world`` spawned processes; a rank's exception
    fails the test with its traceback."""
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def join_group(rank: int, world: int, port: int, timeout: float = 60.0) -> ShmAllReduce:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    shm = ShmAllReduce.create(f"test-{port}", rank, world, SLOT, dist.barrier, timeout)
    assert shm is not None
    return shm


def inputs(call: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s tensor at ``call``: any rank can make every rank's."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    scale = 10.0 ** (call % 5 - 2)  # sums whose float32 rounding depends on the order
    return (torch.randn(n, generator=g) * scale).to(dtype)


def rank_order_sum(call: int, world: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    total = inputs(call, 0, n, dtype).float()
    for r in range(1, world):
        total = total + inputs(call, r, n, dtype).float()
    return total.to(dtype)


def _sums_in_rank_order(rank: int, world: int, port: int) -> None:
    shm = join_group(rank, world, port)
    call, got = 0, []
    for _ in range(6):  # many calls in a row: the slots alternate and chunks pair up
        for dtype in (torch.float32, torch.bfloat16):
            for n in SIZES:
                t = inputs(call, rank, n, dtype)
                assert shm.all_reduce_(t) is t
                want = rank_order_sum(call, world, n, dtype)
                assert torch.equal(t, want), (call, dtype, n, (t.float() - want).abs().max())
                got.append(hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest())
                call += 1
    # a 2-D tensor and a strided one (the wrapper sums a copy and writes it back)
    t = inputs(call, rank, 6 * 576, torch.float32).view(6, 576)
    shm.all_reduce_(t[:, :300])
    want = rank_order_sum(call, world, 6 * 576, torch.float32).view(6, 576)
    assert torch.equal(t[:, :300], want[:, :300]) and torch.equal(
        t[:, 300:], inputs(call, rank, 6 * 576, torch.float32).view(6, 576)[:, 300:])
    every = [None] * world
    dist.all_gather_object(every, got)
    assert all(g == got for g in every)  # the same bits on every rank
    shm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_rank_order_sum_bit_for_bit(world):
    before = set(os.listdir(shm_dir()))
    run_ranks(_sums_in_rank_order, world)
    # This test's own segments (join_group's "test-<port>") are gone; an engine's, which a test
    # on the other xdist worker may hold for a moment, is not this test's to count.
    left = set(os.listdir(shm_dir())) - before
    assert not {f for f in left if f.startswith("tokenmill-allreduce-test-")}


def _one_rank_never_comes(rank: int, world: int, port: int) -> None:
    shm = join_group(rank, world, port, timeout=1.0)
    if rank != world - 1:  # the last rank never calls
        with pytest.raises(RuntimeError, match=rf"rank\(s\) {world - 1} did not arrive"):
            shm.all_reduce_(torch.ones(3000))
        with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
            shm.all_reduce_(torch.ones(10))
    dist.barrier()
    dist.destroy_process_group()


def test_a_rank_that_never_calls_is_named_after_the_timeout():
    run_ranks(_one_rank_never_comes, 3)


def _one_rank_exits(rank: int, world: int, port: int) -> None:
    shm = join_group(rank, world, port, timeout=60.0)
    if rank == 1:
        os._exit(0)  # gone without a word: no gloo, no all-reduce
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) 1 \(process \d+\) exited"):
        shm.all_reduce_(torch.ones(10))
    assert time.monotonic() - start < 10  # noticed long before the timeout


def test_a_rank_whose_process_exits_is_noticed_before_the_timeout():
    run_ranks(_one_rank_exits, 2)


def _one_rank_aborts(rank: int, world: int, port: int) -> None:
    shm = join_group(rank, world, port, timeout=60.0)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank\\(s\\) 1 did not arrive .* rank 1 gave up"):
            shm.all_reduce_(torch.ones(10))  # waiting when rank 1 aborts
        assert time.monotonic() - start < 10
    else:
        time.sleep(0.5)
        shm.abort()
    dist.barrier()
    with pytest.raises(RuntimeError, match="rank 1 aborted the group|unusable"):
        shm.all_reduce_(torch.ones(10))
    dist.destroy_process_group()


def test_an_abort_makes_the_waiting_rank_raise_at_once():
    run_ranks(_one_rank_aborts, 2)


def _sizes_that_disagree(rank: int, world: int, port: int) -> None:
    shm = join_group(rank, world, port, timeout=5.0)
    with pytest.raises(RuntimeError, match="another size or dtype"):
        shm.all_reduce_(torch.ones(10 + rank))
    dist.destroy_process_group()


def test_ranks_passing_different_sizes_are_refused():
    run_ranks(_sizes_that_disagree, 2)


def test_create_without_kernels_returns_none(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert ShmAllReduce.create("none", 0, 2, SLOT, lambda: pytest.fail("no barrier")) is None


# ----- the fused step's hooks -----------------------------------------------------------------

TINY = dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4)  # 4 heads of 32, the kernels' smallest head


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = save_hf_model(make_hf_model("llama", seed=5, **TINY),
                              tmp_path_factory.mktemp("tp"))
    write_word_tokenizer(directory, 96)
    return str(directory)


def load(path: str, dtype: str):
    from tokenmill.model.loader import load_model

    return load_model(path, "cpu", dtype=dtype)


def caches_for(loaded, heads: int | None = None) -> list:
    from tokenmill.runner.kv_cache import allocate_kv_cache

    cfg = loaded.config if heads is None else replace(loaded.config, num_kv_heads=heads)
    return allocate_kv_cache(cfg, 32, BLOCK, "cpu", loaded.model.model.norm.weight.dtype)


def steps() -> list:
    """A prefill of two prompts, then a decode row for each: (chunks, embeddings' ids)."""
    from tokenmill.runner.batch import Chunk

    g = torch.Generator().manual_seed(7)
    a, b = (torch.randint(0, 96, (n,), generator=g).tolist() for n in (37, 20))
    return [[Chunk(a, 0, [1, 2, 3]), Chunk(b, 0, [4, 5])],
            [Chunk([5], 37, [1, 2, 3]), Chunk([9], 20, [4, 5])]]


def layer_inputs(model, chunks):
    from tokenmill.runner.batch import build_flat_batch

    batch = build_flat_batch(chunks, BLOCK, "cpu")
    inner = model.model
    return inner.embed_tokens(batch.input_ids), inner.rotary(batch.positions), batch.meta


def eager_layers(model, caches, chunks):
    h, rope, meta = layer_inputs(model, chunks)
    residual = None
    for layer, cache in zip(model.model.layers, caches):
        h, residual = layer(rope, h, residual, cache, meta)
    return h, residual


def shard_layers(model, path: str, rank: int, world: int) -> None:
    """Keep this rank's share of every layer, as tensor parallelism splits it: its heads' rows
    of q, k and v, its slice of gate and up, and the matching columns of o_proj and down."""
    from safetensors.torch import load_file

    from tokenmill.model.linear.packed import F32Packed

    hf = load_file(os.path.join(path, "model.safetensors"))
    heads, kv_heads, d = TINY["num_attention_heads"], TINY["num_key_value_heads"], 32
    q_rows, kv_rows = heads // world * d, kv_heads // world * d
    inter = TINY["intermediate_size"] // world
    for i, layer in enumerate(model.model.layers):
        w = {k.split(f"layers.{i}.", 1)[1]: v for k, v in hf.items() if f"layers.{i}." in k}
        qkv = torch.cat([w["self_attn.q_proj.weight"][rank * q_rows:(rank + 1) * q_rows],
                         w["self_attn.k_proj.weight"][rank * kv_rows:(rank + 1) * kv_rows],
                         w["self_attn.v_proj.weight"][rank * kv_rows:(rank + 1) * kv_rows]])
        part = slice(rank * inter, (rank + 1) * inter)
        gate_up = torch.cat([w["mlp.gate_proj.weight"][part], w["mlp.up_proj.weight"][part]])
        attn, mlp = layer.self_attn, layer.mlp
        for linear, weight in ((attn.qkv_proj, qkv), (mlp.gate_up_proj, gate_up),
                               (attn.o_proj, w["self_attn.o_proj.weight"][:, rank * q_rows:
                                                                        (rank + 1) * q_rows]),
                               (mlp.down_proj, w["mlp.down_proj.weight"][:, part])):
            kernel = F32Packed.build(weight.contiguous(), None, ops)
            assert kernel is not None, weight.shape
            linear.use_kernel(kernel)
        attn.num_heads, attn.num_kv_heads = heads // world, kv_heads // world


def _tensor_parallel_step(rank: int, world: int, port: int, path: str) -> None:
    from tokenmill.runner.cpu_step import CpuStep

    shm = join_group(rank, world, port)
    with torch.inference_mode():
        full, part = load(path, "float32"), load(path, "float32")
        shard_layers(part.model, path, rank, world)
        step = CpuStep(part.model, all_reduce=shm.native)
        full_caches = caches_for(full)
        part_caches = caches_for(part, TINY["num_key_value_heads"] // world)
        for chunks in steps():
            want = eager_layers(full.model, full_caches, chunks)
            h, rope, meta = layer_inputs(part.model, chunks)
            got = step(h, rope, part_caches, meta)
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
            every = [None] * world
            dist.all_gather_object(every, [t.tolist() for t in got])
            assert all(e == every[0] for e in every)  # every rank the same bits
    dist.destroy_process_group()


@pytest.mark.skipif(not F32_STEP, reason="the CPU kernels' float32 GEMM is not built")
def test_two_ranks_each_with_half_of_every_layer_run_the_whole_model(tiny_dir):
    run_ranks(_tensor_parallel_step, 2, tiny_dir)


DTYPES = [pytest.param("float32", marks=pytest.mark.skipif(not F32_STEP, reason="no f32 GEMM")),
          pytest.param("bfloat16", marks=pytest.mark.skipif(not BF16_STEP,
                                                            reason="no bf16 GEMM"))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_rank_all_reduce_leaves_the_step_bit_for_bit(tiny_dir, dtype):
    """With an all-reduce, the o_proj and down outputs are joined to the residual after the
    GEMM instead of in its epilogue (float32): the same roundings, so one rank's results are
    the plain step's exactly."""
    from tokenmill.runner.cpu_step import CpuStep

    shm = ShmAllReduce.create("single", 0, 1, SLOT, lambda: None)
    with torch.inference_mode():
        loaded = load(tiny_dir, dtype)
        plain, reduced = CpuStep(loaded.model), CpuStep(loaded.model, all_reduce=shm.native)
        caches = [caches_for(loaded), caches_for(loaded)]
        for chunks in steps():
            h, rope, meta = layer_inputs(loaded.model, chunks)
            want, got = plain(h, rope, caches[0], meta), reduced(h, rope, caches[1], meta)
            assert all(torch.equal(w, g) for w, g in zip(want, got))


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_pipeline_stages_with_the_residual_equal_one_stack(tiny_dir, dtype):
    """Layers [0, k) then [k, n) given the first part's (h, residual): the whole stack's
    results bit for bit, whichever layer the split falls after."""
    from tokenmill.runner.cpu_step import CpuStep

    n = TINY["num_hidden_layers"]
    with torch.inference_mode():
        loaded = load(tiny_dir, dtype)
        model, layers = loaded.model, list(loaded.model.model.layers)
        whole = CpuStep(model)
        for k in (1, n - 1):
            tail = types.SimpleNamespace(model=types.SimpleNamespace(
                layers=nn.ModuleList(layers[k:]), norm=model.model.norm))
            second = CpuStep(tail)
            caches = [caches_for(loaded), caches_for(loaded)]
            for chunks in steps():
                h, rope, meta = layer_inputs(model, chunks)
                want = whole(h, rope, caches[0], meta)
                mid_h, mid_residual = whole(h, rope, caches[1], meta, num_layers=k)
                got = second(mid_h, rope, caches[1][k:], meta, residual=mid_residual)
                assert all(torch.equal(w, g) for w, g in zip(want, got)), k
