"""The load-time plan: made for machines this one is not (AVX2-only, AVX512-BF16, AMX, CUDA, no
compiler), from the default model's config alone, and followed by the engine that is built."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.plan import ExecutionPlan, detect_machine, make_plan
from tokenmill.platform import Machine
from tokenmill.runner.kv_cache import bytes_per_block

MACHINES = ("bare", "avx2", "avx512-bf16", "amx", "cuda")


def plan_for(kind: str, **options) -> ExecutionPlan:
    device = "cuda" if kind == "cuda" else "cpu"
    return make_plan(EngineConfig.from_options(device=device, **options),
                     Machine.described(kind))


@pytest.mark.parametrize("kind", MACHINES)
def test_a_plan_for_every_machine_class_is_printable_and_frozen(kind: str) -> None:
    plan = plan_for(kind)
    text = str(plan)
    for section in ("dtype", "kv_cache_dtype", "attention_backend", "linear", "kv_cache",
                    "threads", "cpu_step", "cuda_graphs"):
        assert f"  {section}: " in text, (section, text)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dtype = "float16"  # type: ignore[misc]


@pytest.mark.parametrize("kind, dtype, kv, backend, step", [
    ("bare", "float32", "bfloat16", "torch", "eager: needs the CPU kernels"),
    ("avx2", "float32", "bfloat16", "cpu", "fused"),
    ("avx512-bf16", "bfloat16", "auto", "cpu", "fused"),
    ("amx", "bfloat16", "auto", "cpu", "fused"),
])
def test_cpu_plans_choose_dtype_backend_and_step_per_machine(kind, dtype, kv, backend,
                                                             step) -> None:
    plan = plan_for(kind)
    assert (plan.dtype, plan.kv_cache_dtype, plan.attention_backend) == (dtype, kv, backend)
    assert plan.cpu_step.startswith(step), plan.cpu_step
    assert plan.cuda_graphs.startswith("off")
    assert plan.threads == 2 and plan.thread_governor


def test_bf16_on_amx_multiplies_on_its_tiles_and_times_onednn_against_them() -> None:
    """With AMX, bf16 weights run on the packed GEMM's AMX tiles (gate/up with SiLU·mul fused)
    and the load times them against oneDNN for large batches; without, on vdpbf16ps with the
    float32-FMA trial instead. The batch-invariant mode keeps the tiles at every row count."""
    amx = plan_for("amx").linear
    assert [amx.kernel_for(r) for r in ("qkv", "gate_up", "lm_head")] == [
        "bf16-amx", "bf16-amx-silu", "bf16-amx"]
    assert amx.onednn_trial and not amx.widen_trial
    assert amx.with_batch_invariance().float_kernels == amx.float_kernels
    assert not amx.with_batch_invariance().onednn_trial
    plain = plan_for("avx512-bf16").linear
    assert plain.kernel_for("qkv") == "bf16-packed" and plain.kernel_for("gate_up") == \
        "bf16-packed-silu"
    assert plain.widen_trial and not plain.onednn_trial and "bf16-amx" not in \
        plain.with_batch_invariance().float_kernels


def test_cpu_kv_blocks_come_from_the_machines_memory() -> None:
    """A fifth of the available memory, at most 4 GiB, in blocks of the planned dtype."""
    import torch

    plan = plan_for("avx2")
    per_block = bytes_per_block(plan.model_config, 16, torch.float32, "bfloat16")
    assert plan.kv.bytes_per_block == per_block
    assert plan.kv.num_blocks == min((16 << 30) // 5, 4 << 30) // per_block  # 16 GiB free
    assert plan.kv.tokens == (plan.kv.num_blocks - 1) * 16


def test_a_gpu_plan_sizes_kv_after_load_and_captures_graphs() -> None:
    from tokenmill.attention import has_triton

    plan = plan_for("cuda")
    assert plan.dtype == "bfloat16" and plan.threads == 0 and not plan.thread_governor
    assert plan.kv.num_blocks is None and "GPU memory" in plan.kv.budget_rule
    assert plan.cpu_step.startswith("eager")
    if has_triton():
        assert plan.attention_backend == "triton"
        assert plan.cuda_graphs == "decode batches up to 64"
    assert plan_for("cuda", enforce_eager=True).cuda_graphs == "off: --enforce-eager"


def test_choices_asked_for_are_kept_and_say_so() -> None:
    plan = plan_for("amx", dtype="float32", kv_cache_dtype="int8", num_threads=1,
                     enforce_eager=True, num_blocks=100)
    assert (plan.dtype, plan.dtype_reason) == ("float32", "asked for")
    assert plan.kv_cache_dtype == "int8" and plan.kv.num_blocks == 100
    assert plan.threads == 1 and not plan.thread_governor
    assert plan.cpu_step == "eager: --enforce-eager"


def test_a_drafting_model_shares_the_kv_budget() -> None:
    plain, layerskip = plan_for("avx2"), plan_for("avx2", speculative_method="layerskip")
    assert layerskip.speculative["draft_layers"] == plain.model_config.num_layers // 4
    assert layerskip.kv.draft_bytes_per_block > 0
    assert layerskip.kv.num_blocks < plain.kv.num_blocks
    assert plan_for("avx2", speculative_method="ngram").kv.draft_bytes_per_block == 0


def test_an_unknown_machine_class_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown machine class"):
        Machine.described("riscv")


@pytest.mark.slow
def test_the_built_engine_follows_its_plan(fp32_llm) -> None:
    """The engine reports the plan it was built from, and what runs is what it says."""
    info = fp32_llm.engine.info
    plan = info.plan
    assert plan["dtype"]["value"] == info.dtype == "float32"
    assert plan["attention_backend"]["value"] == info.attention_backend
    assert plan["kv_cache"]["block_size"] == info.block_size
    if plan["cpu_step"] == "fused":
        assert info.cpu_step.startswith("fused")
    assert plan["machine"] == detect_machine("cpu").describe()


def test_tokenmill_plan_prints_a_described_machines_plan(capsys) -> None:
    import json

    from tokenmill.cli import main

    assert main(["plan", "--machine", "amx", "--quantization", "int8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["machine"]["cpu"] == "described: amx"
    assert plan["dtype"]["value"] == "bfloat16" and plan["linear"]["quantization"] == "int8"
    # with AMX, int8 weights keep the VNNI kernels (prompts dequantized through oneDNN's tiles)
    assert plan["cpu_step"].startswith("eager: not every linear layer")
    # without, they multiply on the packed bf16 GEMM, dequantized per task: the fused step
    # takes them
    assert main(["plan", "--machine", "avx512-bf16", "--quantization", "int8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["linear"]["kernels"]["qkv"] == "bf16-blocks"
    assert plan["linear"]["kernels"]["gate_up"] == "bf16-blocks-silu"
    assert plan["cpu_step"] == "fused" and plan["batch_invariant"].startswith("on")
