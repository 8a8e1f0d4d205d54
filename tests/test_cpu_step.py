"""The fused CPU step (``runner/cpu_step.py``) against the layer-by-layer path it replaces.

Both call the same kernels in the same order, so every logit must be equal bit for bit, for
every kind of batch: prompts, chunks after a cached prefix, decode rows, ragged lengths, GQA,
q/k/v biases, the shared-prefix (cascade) pass, an int8 KV cache and a bfloat16 one; bf16 (on
AVX512-BF16) and float32 (AVX2 or AVX512). Tiny random models of head size 32 (the kernels'
smallest) and blocks of 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import COMMON, make_hf_model, save_hf_model, write_word_tokenizer
from tokenmill import LLM
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.model.layers import Linear
from tokenmill.model.linear import routed
from tokenmill.model.linear.routed import OneDnnRouted
from tokenmill.model.loader import load_model
from tokenmill.runner.batch import Chunk, build_flat_batch
from tokenmill.runner.model_runner import ModelRunner

ops = cpu_kernels.load()
FUSED = {"bfloat16": ops is not None and getattr(ops, "has_bf16_gemm", False),
         "float32": ops is not None and getattr(ops, "f32_pack_cols", 0) > 0}
DTYPES = [pytest.param(d, marks=pytest.mark.skipif(
    not FUSED[d], reason=f"the CPU kernels' {d} GEMM is not built on this CPU"))
    for d in FUSED]
BLOCK = 16
SIZES = dict(hidden_size=128, intermediate_size=96)  # 4 heads of 32


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for arch, extra in [("llama", {}), ("smollm2", {}), ("qwen2", {}),
                        ("qwen3", {"head_dim": 32})]:
        hf = make_hf_model(arch, seed=3, **SIZES, **extra)
        directory = save_hf_model(hf, tmp_path_factory.mktemp(arch))
        write_word_tokenizer(directory, COMMON["vocab_size"])
        dirs[arch] = str(directory)
    return dirs


def make_runner(path: str, dtype: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(load_model(path, "cpu", dtype=dtype), num_blocks=64,
                       block_size=BLOCK, kv_cache_dtype=kv_cache_dtype)


def packed_weight(m: Linear) -> torch.Tensor | None:
    """The weight the fused step multiplies for ``m`` (its kernel's packed tensor), or None."""
    step = m.kernel.step_weight()
    return None if step is None else step.packed


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "auto"), ("smollm2", "auto"),
                                                 ("qwen2", "auto"), ("llama", "int8"),
                                                 ("llama", "bfloat16")])
def test_fused_step_equals_layer_by_layer(model_dirs, arch, kv_cache_dtype, dtype):
    # two runners, each with its own cache: the fused one reads only the K/V it stored itself
    eager = make_runner(model_dirs[arch], dtype, kv_cache_dtype)
    runner = make_runner(model_dirs[arch], dtype, kv_cache_dtype)
    # (bf16 on a CPU with AMX may add from how many rows oneDNN takes prompt chunks: more
    # than any batch here)
    assert runner.fuse_cpu_step().split(";")[0] == "fused"
    assert eager.model.model.fused_layers is None
    a, b = ids(40, 1), ids(23, 2)
    steps = [
        # prompts of ragged lengths in one batch (a: 2.5 blocks, b: 1.4, c: one token)
        [Chunk(a, 0, [1, 2, 3]), Chunk(b, 0, [4, 5]), Chunk([7], 0, [6])],
        # a chunk after a cached prefix, a decode row, a chunk ending mid-block
        [Chunk(ids(9, 3), 40, [1, 2, 3, 7]), Chunk([11], 23, [4, 5]), Chunk(ids(5, 4), 1, [6])],
        # three sequences sharing a's first two blocks: the cascade pass
        [Chunk(ids(3, 10 + i), 32, [1, 2, 8 + i]) for i in range(3)],
        # plain decode of several sequences at different lengths
        [Chunk([5 + i], 35 + 3 * i, [1, 2, 8 + i]) for i in range(3)] + [Chunk([9], 24, [4, 5])],
    ]
    plan = runner.model.model.layers[0].self_attn.backend.plan
    assert plan(build_flat_batch(steps[2], BLOCK, "cpu").meta).shared is not None
    for i, chunks in enumerate(steps):
        want = eager.forward(chunks, all_logits=True)
        got = runner.forward(chunks, all_logits=True)
        assert want.shape == got.shape == (sum(len(c.token_ids) for c in chunks), 96)
        assert torch.isfinite(want).all()
        assert torch.equal(want, got), f"step {i}: max diff {(want - got).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_step_generates_what_the_eager_path_does(model_dirs, dtype):
    eager = LLM(model_dirs["llama"], dtype=dtype, num_blocks=64, block_size=BLOCK,
                enforce_eager=True)
    fused = LLM(model_dirs["llama"], dtype=dtype, num_blocks=64, block_size=BLOCK)
    assert eager.engine.info.cpu_step == "eager: --enforce-eager"
    assert fused.engine.info.cpu_step.split(";")[0] == "fused"
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [ids(n, 20 + n) for n in (5, 17, 33)]
    out_e = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    out_f = [o.outputs[0].token_ids for o in fused.generate(prompts, params, use_tqdm=False)]
    assert out_f == out_e and all(len(t) == 24 for t in out_f)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_early_exit_runs_the_first_layers_fused_as_eagerly(model_dirs, dtype):
    """``num_layers``: the first layers, then the final norm and lm_head (layer-skip drafting),
    from the caches of those layers only; the fused step takes the same limit and gives the
    eager path's logits bit for bit, and all layers is the plain forward."""
    eager, fused = (make_runner(model_dirs["llama"], dtype) for _ in range(2))
    assert fused.fuse_cpu_step().split(";")[0] == "fused"
    total = COMMON["num_hidden_layers"]
    chunks = [Chunk(ids(20, 1), 0, [1, 2]), Chunk(ids(7, 2), 0, [3])]
    batch = build_flat_batch(chunks, BLOCK, "cpu", all_logits=True)
    logits = {}
    with torch.inference_mode():
        for name, runner in (("eager", eager), ("fused", fused)):
            for n in (1, total, None):
                caches = runner.kv_caches[:n or total]
                logits[name, n] = runner.model(batch.input_ids, batch.positions, caches,
                                               batch.meta, batch.logits_indices, num_layers=n)
        with pytest.raises(ValueError, match="layers"):
            eager.model(batch.input_ids, batch.positions, eager.kv_caches, batch.meta,
                        num_layers=total + 1)
    for n in (1, total, None):
        assert torch.equal(logits["eager", n], logits["fused", n]), n
    assert torch.equal(logits["eager", total], logits["eager", None])
    assert not torch.equal(logits["eager", 1], logits["eager", None])


def test_models_the_fused_step_does_not_take_run_eagerly(model_dirs):
    """Qwen3's per-head q/k norms, float16, quantized linears, and bf16 on a CPU without the
    bf16 GEMM keep the layer-by-layer path (and say why)."""
    kernels_reason = "eager: needs the CPU kernels' attention and GEMM (AVX2 or AVX512)"
    qwen3 = make_runner(model_dirs["qwen3"], "float32")
    fp16 = make_runner(model_dirs["llama"], "float16")
    int8 = ModelRunner(load_model(model_dirs["llama"], "cpu", dtype="float32",
                                  quantization="int8"), num_blocks=64, block_size=BLOCK)
    stack = ops is not None and hasattr(ops, "DecoderStack")
    assert qwen3.fuse_cpu_step() == ("eager: per-head q/k norms (Qwen3) run eagerly"
                                     if stack else kernels_reason)
    assert fp16.fuse_cpu_step() == ("eager: torch.float16 runs eagerly"
                                    if stack else kernels_reason)
    # int8 weights packed for the float32 GEMM (for int8 activations where the kernels have
    # them, else in their bits) fuse; left as they are, they run layer by layer
    packed = all(packed_weight(m) is not None
                 and packed_weight(m).dtype in (torch.uint8, torch.int8)
                 for m in int8.model.modules() if isinstance(m, Linear))
    assert packed == (ops is not None and ops.f32_pack_cols > 0)
    assert int8.fuse_cpu_step() == (
        "fused" if stack and packed else
        "eager: not every linear layer is a packed float32 weight (quantized, or a size the "
        "kernels do not pack)" if stack else kernels_reason)
    if packed:
        int8 = ModelRunner(load_model(model_dirs["llama"], "cpu", dtype="float32",
                                      quantization="int8"), num_blocks=64, block_size=BLOCK)
    # bf16 fuses only where the kernels multiply bf16 (AVX512-BF16); elsewhere it says so
    bf16 = make_runner(model_dirs["llama"], "bfloat16")
    assert bf16.fuse_cpu_step().split(";")[0] == (
        "fused" if FUSED["bfloat16"] else
        "eager: bf16 needs the CPU kernels' bf16 GEMM (AVX512-BF16)" if stack else
        kernels_reason)
    for runner in (qwen3, fp16, int8):
        assert runner.model.model.fused_layers is None
        logits = runner.forward([Chunk(ids(20, 5), 0, [1, 2])])
        assert logits.shape == (1, 96) and torch.isfinite(logits).all()


# ----- batches through oneDNN where it measured faster (model/linear/routed.py) ----------------

def test_dense_rows_from_takes_the_rows_where_onednn_stays_ahead():
    from tokenmill.model.linear.routed import dense_rows_from

    # (packed seconds, oneDNN seconds) per rows
    assert dense_rows_from({128: (1.0, 2.0), 256: (4.0, 2.0), 512: (8.0, 4.0)}) == 256
    assert dense_rows_from({128: (3.0, 2.0), 256: (6.0, 4.0)}) == 128
    assert dense_rows_from({128: (1.0, 2.0), 256: (2.0, 4.0)}) is None
    # ahead at 128 rows but not beyond: packed throughout
    assert dense_rows_from({128: (4.0, 2.0), 256: (2.0, 4.0)}) is None
    # within the margin is not ahead
    assert dense_rows_from({128: (1.1, 1.0)}) is None
    assert dense_rows_from({128: (1.1, 1.0)}, margin=1.05) == 128
    assert dense_rows_from({}) is None


@pytest.mark.skipif(not FUSED["float32"], reason="the CPU kernels' float32 GEMM is not built")
def test_batches_run_through_onednn_from_the_rows_chosen(model_dirs, monkeypatch):
    """The trial (forced on for float32 here; by default it runs for bf16 on a CPU with AMX)
    times both kernels on real layers; from the rows chosen, a batch's linears multiply on the
    dense weights through oneDNN, in the fused step as layer by layer, and below them on the
    packed ones."""
    from tokenmill.model.linear import plan as linear_plan
    from tokenmill.model.linear.routed import ONEDNN_TRIAL_ROWS

    seen = []
    monkeypatch.setattr(linear_plan, "ONEDNN_TRIAL", "always")
    monkeypatch.setattr(routed, "dense_rows_from", lambda t: seen.append(t) or 16)
    routed_runner = make_runner(model_dirs["llama"], "float32")
    eager_routed = make_runner(model_dirs["llama"], "float32")  # not fused: layer by layer
    assert len(seen) == 2  # one trial per load
    timings = seen[0]
    assert tuple(timings) == ONEDNN_TRIAL_ROWS
    assert all(packed > 0 and dense > 0 for packed, dense in timings.values())
    linears = [m for m in routed_runner.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.kernel, OneDnnRouted) and m.kernel.from_rows == 16
               and m.weight is not None and m.kernel.packed.family == "f32-packed"
               for m in linears)
    assert routed_runner.fuse_cpu_step() == "fused; linears through oneDNN from 16 rows"
    monkeypatch.setattr(linear_plan, "ONEDNN_TRIAL", "never")
    plain = make_runner(model_dirs["llama"], "float32")
    assert plain.fuse_cpu_step() == "fused"
    assert all(not isinstance(m.kernel, OneDnnRouted) and m.weight is None
               for m in plain.model.modules() if isinstance(m, Linear))
    dense_calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda *a: dense_calls.append(a[0].shape[0]) or linear(*a))
    small = [Chunk(ids(9, 1), 0, [1]), Chunk(ids(6, 2), 0, [2])]  # 15 rows: packed
    large = [Chunk(ids(30, 3), 0, [3, 4]), Chunk([7], 9, [1])]  # 31 rows: oneDNN
    got = {}
    for chunks in (small, large):
        want = plain.forward(chunks, all_logits=True)
        assert dense_calls == []
        got[len(chunks[0].token_ids)] = out = routed_runner.forward(chunks, all_logits=True)
        # the fused step calls oneDNN from C++: only the output layer is a Python F.linear
        assert dense_calls == ([] if chunks is small else [31])
        assert torch.isfinite(out).all()
        assert torch.allclose(out, want, atol=1e-4, rtol=1e-4)
        if chunks is small:
            assert torch.equal(out, want)
        dense_calls.clear()
        # layer by layer, every linear and the output layer through F.linear: the same bits
        assert torch.equal(out, eager_routed.forward(chunks, all_logits=True))
        layers = COMMON["num_hidden_layers"]
        assert dense_calls == ([] if chunks is small else [31] * (4 * layers + 1))
        dense_calls.clear()
    # the fused step reads the packed weights below the rows and never from them
    for m in linears:
        packed_weight(m).zero_()
    assert torch.equal(routed_runner.forward(large, all_logits=True), got[30])
    assert not torch.equal(routed_runner.forward(small, all_logits=True), got[9])


@pytest.mark.skipif(not FUSED["float32"], reason="the CPU kernels' float32 GEMM is not built")
def test_a_linear_without_a_dense_weight_stays_packed_in_a_routed_batch(model_dirs, monkeypatch):
    """Each linear decides for itself, as on the eager path: one that kept no dense weight (a
    weight kept in 4 or 8 bits has none) multiplies on its packed weight in a routed batch."""
    from tokenmill.model.linear import plan as linear_plan

    monkeypatch.setattr(linear_plan, "ONEDNN_TRIAL", "always")
    monkeypatch.setattr(routed, "dense_rows_from", lambda t: 16)
    fused, eager = (make_runner(model_dirs["llama"], "float32") for _ in range(2))
    for runner in (fused, eager):
        down = runner.model.model.layers[1].mlp.down_proj
        down.use_kernel(down.kernel.packed)  # the packed kernel alone, no dense weight
    assert fused.fuse_cpu_step() == "fused; linears through oneDNN from 16 rows"
    large = [Chunk(ids(30, 3), 0, [3, 4]), Chunk([7], 9, [1])]
    got = fused.forward(large, all_logits=True)
    assert torch.equal(got, eager.forward(large, all_logits=True))
    packed_weight(fused.model.model.layers[1].mlp.down_proj).zero_()  # read: output changes
    assert not torch.equal(fused.forward(large, all_logits=True), got)


@pytest.mark.skipif(not FUSED["float32"], reason="the CPU kernels' float32 GEMM is not built")
def test_a_trial_that_keeps_the_packed_gemm_drops_the_dense_weights(model_dirs, monkeypatch):
    from tokenmill.model.linear import plan as linear_plan

    monkeypatch.setattr(linear_plan, "ONEDNN_TRIAL", "always")
    monkeypatch.setattr(routed, "dense_rows_from", lambda t: None)
    for arch in ("llama", "smollm2"):  # smollm2 ties its output layer to the embeddings
        runner = make_runner(model_dirs[arch], "float32")
        assert runner.fuse_cpu_step() == "fused"
        model = runner.model
        tied = model.lm_head.weight is not None and \
            model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == (arch == "smollm2")
        for m in model.modules():
            if isinstance(m, Linear):
                assert not isinstance(m.kernel, OneDnnRouted)
                assert (m.weight is not None) == (m is model.lm_head and tied)
