"""Which part of a model each tensor / pipeline parallel rank holds, without starting a process:
the layout (``distributed/layout.py``), the checkpoint slices (``model/sharding.py``), the
micro-batches of a pipeline step (``executor/control.py``) and ``ParallelConfig``'s checks."""

from __future__ import annotations

import argparse

import pytest
import torch

from tokenmill.config import EngineConfig, ModelConfig, ParallelConfig
from tokenmill.distributed.layout import ParallelLayout, split_layers
from tokenmill.executor.control import micro_batches
from tokenmill.model.quant import QuantWeight, dequantize, quantize_int4, quantize_int8
from tokenmill.model.sharding import rank_slice, stage_name

# SmolLM2-135M's shape (the default model): 9 heads, 3 KV heads, 30 layers
SMOLLM2 = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
# the tiny test model of test_distributed: 8 heads, 4 KV heads, a byte vocabulary + <eos>
TINY = ModelConfig("llama", vocab_size=257, hidden_size=256, intermediate_size=128,
                   num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32)


def layout(cfg: ModelConfig, tp: int = 1, pp: int = 1,
           partition: tuple[int, ...] | None = None) -> ParallelLayout:
    return ParallelLayout.plan(ParallelConfig(tp, pp, partition), cfg)


# ----- layers per stage ----------------------------------------------------------------------

@pytest.mark.parametrize("layers, stages, want", [
    (30, 1, (30,)), (30, 2, (15, 15)), (4, 4, (1, 1, 1, 1)),
    (30, 4, (8, 8, 7, 7)), (5, 2, (3, 2)), (7, 3, (3, 2, 2))])
def test_split_layers_is_even_with_the_extra_layers_first(layers, stages, want):
    assert split_layers(layers, stages) == want


def test_split_layers_takes_a_partition_as_given():
    assert split_layers(30, 2, (16, 14)) == (16, 14)
    assert split_layers(4, 3, (1, 2, 1)) == (1, 2, 1)


@pytest.mark.parametrize("partition", [(15, 14), (15, 15, 0), (30,), (31, -1), (0, 30)])
def test_split_layers_refuses_a_partition_that_does_not_split_the_layers(partition):
    with pytest.raises(ValueError, match=r"pp_layer_partition .* does not split 30 layers "
                                         r"into 2 non-empty stages"):
        split_layers(30, 2, partition)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 exceeds the model's 4 layers"):
        split_layers(4, 5)


# ----- ranks and what they hold --------------------------------------------------------------

def test_ranks_are_numbered_stage_major():
    lay = layout(TINY, tp=2, pp=2)
    assert lay.world_size == 4 and lay.stage_layers == (2, 2)
    places = [(p.tp_rank, p.pp_rank, list(p.layers), p.tp_ranks())
              for p in map(lay.position, range(4))]
    assert places == [(0, 0, [0, 1], [0, 1]), (1, 0, [0, 1], [0, 1]),
                      (0, 1, [2, 3], [2, 3]), (1, 1, [2, 3], [2, 3])]
    assert [lay.position(r).is_output_rank for r in range(4)] == [False, False, True, False]
    assert [lay.position(r).is_first_stage for r in range(4)] == [True, True, False, False]
    assert lay.position(1).peer(1) == 3 and lay.position(3).peer(0) == 1
    with pytest.raises(ValueError, match="rank 4 outside 0..3"):
        lay.position(4)


def test_uneven_stages_hold_consecutive_layers():
    lay = layout(SMOLLM2, pp=4)
    assert [list(lay.position(r).layers) for r in range(4)] == [
        list(range(0, 8)), list(range(8, 16)), list(range(16, 23)), list(range(23, 30))]
    lay = layout(SMOLLM2, pp=2, partition=(20, 10))
    assert [lay.position(r).layers for r in range(2)] == [range(0, 20), range(20, 30)]


def test_heads_and_features_split_evenly():
    lay = layout(SMOLLM2, tp=3)
    got = [(p.head_range(SMOLLM2), p.kv_head_range(SMOLLM2), p.intermediate_range(SMOLLM2),
            p.vocab_range(SMOLLM2)) for p in map(lay.position, range(3))]
    assert got == [(range(0, 3), range(0, 1), range(0, 512), range(0, 16384)),
                   (range(3, 6), range(1, 2), range(512, 1024), range(16384, 32768)),
                   (range(6, 9), range(2, 3), range(1024, 1536), range(32768, 49152))]


@pytest.mark.parametrize("heads, kv_heads, tp", [(8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 1, 4),
                                                 (8, 2, 8), (9, 3, 3), (12, 4, 2), (8, 8, 8)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(heads, kv_heads, tp):
    cfg = ModelConfig("llama", 100, 8 * heads, 120, 2, heads, kv_heads, 8)
    lay = layout(cfg, tp=tp)
    group = heads // kv_heads  # query heads per KV head (grouped-query attention)
    held = []
    for p in map(lay.position, range(tp)):
        kv = p.kv_head_range(cfg)
        assert {h // group for h in p.head_range(cfg)} <= set(kv)
        assert len(kv) == max(1, kv_heads // tp)
        held.extend(kv)
    # every KV head is somewhere; replicated over tp / kv_heads ranks when there are fewer
    assert sorted(set(held)) == list(range(kv_heads))
    assert len(held) == max(tp, kv_heads)


def test_kv_heads_replicated_when_tp_exceeds_them():
    cfg = ModelConfig("llama", 257, 64, 128, 4, 8, 2, 8)
    lay = layout(cfg, tp=4)
    assert [lay.position(r).kv_head_range(cfg) for r in range(4)] == [
        range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert lay.position(3).local_config(cfg).num_kv_heads == 1


def test_a_vocabulary_that_does_not_split_is_padded_on_the_last_rank():
    lay = layout(TINY, tp=4)
    ranges = [lay.position(r).vocab_range(TINY) for r in range(4)]
    assert ranges == [range(0, 65), range(65, 130), range(130, 195), range(195, 260)]
    assert ranges[-1].stop > TINY.vocab_size  # 3 padding rows
    assert {lay.position(r).local_config(TINY).vocab_size for r in range(4)} == {65}


def test_local_config_is_the_ranks_part():
    lay = layout(TINY, tp=2, pp=2)
    local = lay.position(3).local_config(TINY)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size,
            local.num_layers) == (4, 2, 64, 129, 2)
    assert (local.hidden_size, local.head_dim) == (TINY.hidden_size, TINY.head_dim)


@pytest.mark.parametrize("tp, cfg, problem", [
    (2, SMOLLM2, "9 attention heads"),
    (2, SMOLLM2, "3 KV heads (neither divides the other)"),
    (4, TINY.__class__("llama", 257, 64, 130, 4, 8, 4, 8), "130 intermediate features"),
    (3, TINY, "8 attention heads and 4 KV heads (neither divides the other) and 128 "
              "intermediate features")])
def test_a_tp_size_that_does_not_split_the_model_names_what(tp, cfg, problem):
    with pytest.raises(ValueError, match=f"tensor_parallel_size {tp} does not split the "
                                         "model's .*") as e:
        layout(cfg, tp=tp)
    assert problem in str(e.value)


# ----- micro-batches of a pipeline step -------------------------------------------------------

@pytest.mark.parametrize("tokens", [[1], [5, 1, 1], [1] * 7, [100, 1, 1, 1], [1, 1, 1, 100],
                                    [3, 9, 2, 7, 7, 1], [64, 64], list(range(1, 20))])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_micro_batches_keep_order_and_cover_every_chunk_once(tokens, parts):
    sizes = micro_batches(tokens, parts)
    assert sum(sizes) == len(tokens)  # consecutive runs: each chunk once, in order
    assert all(s >= 1 for s in sizes)
    assert len(sizes) == min(parts, len(tokens))  # all the stages get work where they can


def test_micro_batches_balance_tokens():
    assert micro_batches([1] * 8, 2) == [4, 4]
    assert micro_batches([10, 10, 10, 10], 4) == [1, 1, 1, 1]
    assert micro_batches([30, 1, 1, 1, 1, 30], 2) == [3, 3]
    runs = micro_batches([2] * 12, 3)
    assert runs == [4, 4, 4]


# ----- a rank's slice of each checkpoint tensor -----------------------------------------------

def test_stage_name_renumbers_the_stages_layers():
    lay = layout(TINY, tp=2, pp=2)
    first, last = lay.position(1), lay.position(2)
    assert stage_name("model.layers.1.mlp.down_proj.weight", first) == \
        "model.layers.1.mlp.down_proj.weight"
    assert stage_name("model.layers.2.mlp.down_proj.weight", first) is None
    assert stage_name("model.layers.3.self_attn.q_proj.weight", last) == \
        "model.layers.1.self_attn.q_proj.weight"
    assert stage_name("model.layers.0.input_layernorm.weight", last) is None
    # outside the layers, every stage sees the name (the model takes what its stage uses)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert stage_name(name, first) == stage_name(name, last) == name
    lay = layout(SMOLLM2, pp=2, partition=(20, 10))
    assert stage_name("model.layers.12.mlp.up_proj.weight", lay.position(1)) is None
    assert stage_name("model.layers.29.mlp.up_proj.weight", lay.position(1)) == \
        "model.layers.9.mlp.up_proj.weight"


def _checkpoint(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"q": (cfg.num_heads * d, h), "k": (cfg.num_kv_heads * d, h),
              "v": (cfg.num_kv_heads * d, h), "o": (h, cfg.num_heads * d), "gate": (i, h),
              "up": (i, h), "down": (h, i), "embed": (cfg.vocab_size, h)}
    return {k: torch.randn(s) for k, s in shapes.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_float_slices_put_back_together_are_the_whole(tp):
    cfg = ModelConfig("llama", 257, 64, 128, 1, 8, 2, 8)
    w = _checkpoint(cfg)
    lay = layout(cfg, tp=tp)
    cut = {k: [] for k in w}
    for p in map(lay.position, range(tp)):
        s = lambda target, shard, t: rank_slice(target, shard, t, p, cfg)  # noqa: E731
        cut["q"].append(s("model.layers.0.self_attn.qkv_proj.weight", "q", w["q"]))
        cut["k"].append(s("model.layers.0.self_attn.qkv_proj.weight", "k", w["k"]))
        cut["o"].append(s("model.layers.0.self_attn.o_proj.weight", None, w["o"]))
        cut["gate"].append(s("model.layers.0.mlp.gate_up_proj.weight", 0, w["gate"]))
        cut["down"].append(s("model.layers.0.mlp.down_proj.weight", None, w["down"]))
        cut["embed"].append(s("model.embed_tokens.weight", None, w["embed"]))
    assert torch.equal(torch.cat(cut["q"]), w["q"])
    assert torch.equal(torch.cat(cut["o"], dim=1), w["o"])
    assert torch.equal(torch.cat(cut["gate"]), w["gate"])
    assert torch.equal(torch.cat(cut["down"], dim=1), w["down"])
    # each rank's KV head: its query heads' (2 KV heads of 8 dims, replicated at TP=4)
    kv_rows = [range(r.start * 8, r.stop * 8)
               for r in (lay.position(i).kv_head_range(cfg) for i in range(tp))]
    assert all(torch.equal(k, w["k"][rows.start:rows.stop]) for k, rows in zip(cut["k"], kv_rows))
    embed = torch.cat(cut["embed"])
    pad = embed.shape[0] - cfg.vocab_size
    assert pad == (1 if tp == 2 else 3) and not embed[cfg.vocab_size:].any()
    assert torch.equal(embed[:cfg.vocab_size], w["embed"])


def test_norms_stay_whole_and_a_row_parallel_bias_is_added_once():
    lay = layout(TINY, tp=2)
    norm, bias = torch.randn(64), torch.randn(64)
    for rank in range(2):
        p = lay.position(rank)
        assert rank_slice("model.layers.0.input_layernorm.weight", None, norm, p, TINY) is norm
        got = rank_slice("model.layers.0.mlp.down_proj.bias", None, bias, p, TINY)
        assert torch.equal(got, bias if rank == 0 else torch.zeros(64))
    one = ParallelLayout.plan(ParallelConfig(), TINY).position(0)
    assert rank_slice("model.embed_tokens.weight", None, bias, one, TINY) is bias


def _assert_quant_slice(got, whole: QuantWeight, cols: range) -> None:
    assert isinstance(got, QuantWeight) and got.bits == whole.bits and got.kind == whole.kind
    assert got.shape == (whole.shape[0], len(cols))
    assert torch.equal(dequantize(got), dequantize(whole)[:, cols.start:cols.stop])


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
@pytest.mark.parametrize("tp", [2, 4])
def test_quantized_columns_are_sliced_in_whole_blocks(quantize, tp):
    """GGUF-style groups of 32 inputs: a row-parallel layer's column slice keeps the bytes and
    scales of its blocks, and dequantizes to exactly that slice of the whole."""
    cfg = ModelConfig("llama", 256, 128, 512, 1, 8, 4, 16)
    lay = layout(cfg, tp=tp)
    down, o = quantize(torch.randn(128, 512)), quantize(torch.randn(128, 128))
    assert down.group_size == o.group_size == 32
    for p in map(lay.position, range(tp)):
        f = p.intermediate_range(cfg)
        _assert_quant_slice(rank_slice("model.layers.0.mlp.down_proj.weight", None, down, p, cfg),
                            down, f)
        heads = p.head_range(cfg)
        cols = range(heads.start * 16, heads.stop * 16)
        if len(cols) % 32:  # a slice that would cut a block: dequantized, still exact
            got = rank_slice("model.layers.0.self_attn.o_proj.weight", None, o, p, cfg)
            assert torch.equal(got, dequantize(o)[:, cols.start:cols.stop])
        else:
            _assert_quant_slice(rank_slice("model.layers.0.self_attn.o_proj.weight", None, o,
                                           p, cfg), o, cols)


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
def test_quantized_rows_and_a_padded_vocabulary(quantize):
    cfg = ModelConfig("llama", 250, 64, 128, 1, 8, 4, 8)
    lay = layout(cfg, tp=4)
    gate, embed = quantize(torch.randn(128, 64)), quantize(torch.randn(250, 64))
    rows = []
    for p in map(lay.position, range(4)):
        got = rank_slice("model.layers.0.mlp.gate_up_proj.weight", 0, gate, p, cfg)
        assert isinstance(got, QuantWeight)
        rows.append(dequantize(got))
    assert torch.equal(torch.cat(rows), dequantize(gate))
    vocab = [rank_slice("lm_head.weight", None, embed, p, cfg) for p in map(lay.position, range(4))]
    assert all(isinstance(v, QuantWeight) for v in vocab[:3])  # whole rows: kept quantized
    parts = [dequantize(v) if isinstance(v, QuantWeight) else v for v in vocab]
    whole = torch.cat(parts)
    assert whole.shape == (252, 64) and not whole[250:].any()
    assert torch.equal(whole[:250], dequantize(embed))


def test_a_quantized_slice_that_cuts_a_block_is_dequantized():
    cfg = ModelConfig("llama", 256, 64, 96, 1, 8, 4, 8)
    lay = layout(cfg, tp=2)
    down = quantize_int8(torch.randn(64, 96))  # 48 columns a rank: not whole blocks of 32
    for p in map(lay.position, range(2)):
        got = rank_slice("model.layers.0.mlp.down_proj.weight", None, down, p, cfg)
        f = p.intermediate_range(cfg)
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, dequantize(down)[:, f.start:f.stop])


# ----- ParallelConfig ------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be at least 1, got 0"),
    (dict(pipeline_parallel_size=-1), "pipeline_parallel_size must be at least 1"),
    (dict(tensor_parallel_size=3, nnodes=2, master_port=29500),
     "3 ranks (tensor x pipeline parallel) do not split evenly over 2 nodes"),
    (dict(tensor_parallel_size=2, nnodes=2), "--nnodes > 1 needs --master-port"),
    (dict(pipeline_parallel_size=2, pp_layer_partition=(1, 2, 1)),
     "pp_layer_partition has 3 stages; pipeline_parallel_size is 2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1),
     "node_rank 2 outside 0..1"),
    (dict(distributed_executor_backend="mpi"), "distributed_executor_backend must be mp or ray"),
])
def test_parallel_config_refuses_what_cannot_run(options, message):
    with pytest.raises(ValueError) as e:
        ParallelConfig(**options)
    assert message in str(e.value)


def test_parallel_config_counts_ranks_and_says_when_it_is_distributed():
    p = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                       master_port=29500)
    assert (p.world_size, p.ranks_per_node, p.distributed) == (4, 2, True)
    assert not ParallelConfig().distributed
    assert ParallelConfig(distributed_executor_backend="ray").distributed  # one Ray actor
    cfg = EngineConfig.from_options("m", tensor_parallel_size=2, pp_layer_partition=(3, 1),
                                    pipeline_parallel_size=2, worker_timeout=3.0)
    assert cfg.parallel == ParallelConfig(2, 2, (3, 1), worker_timeout=3.0)


def test_parallel_cli_flags_reach_the_config():
    from tokenmill.cli import build_parser, engine_options

    args = build_parser().parse_args(
        ["serve", "m", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
         "--pp-layer-partition", "3,1", "--nnodes", "2", "--node-rank", "1",
         "--master-addr", "10.0.0.1", "--master-port", "29500", "--cpu-bind", "0-3|4-7",
         "--cpu-cores-per-rank", "4", "--worker-timeout", "2.5",
         "--distributed-executor-backend", "mp"])
    assert isinstance(args, argparse.Namespace)
    cfg = EngineConfig.from_options("m", **engine_options(args))
    assert cfg.parallel == ParallelConfig(2, 2, (3, 1), "mp", 2, 1, "10.0.0.1", 29500, 4,
                                          ("0-3", "4-7"), 2.5)
