"""The kernel ladder: every fast CPU kernel of ``csrc/`` beside the PyTorch code it replaces, the
test that holds it to that code, and the benchmark that times the two, in one table (llm.c's
habit: no fast kernel without its plain reference, a check against it and a timing).

    python -m tokenmill.kernels.ladder        # the table

Adding a kernel: a header in ``csrc/`` that includes what it uses (each compiles alone), its
binding in ``cpu_ops.cpp``, and a rung here. ``tests/test_kernel_ladder.py`` checks every rung:
the header defines the binding, each reference imports, the test exists, and the benchmark's
script names what it times; and every binding of the module is a rung or a helper below.
"""

from __future__ import annotations

from dataclasses import dataclass

F_LINEAR = "torch.nn.functional.linear"
DEQUANTIZE = "tokenmill.model.quant.dequantize"
ATTENTION_BENCH = "python benchmarks/attention_speed.py --backends torch,cpu"
LAYER_BENCH = "python benchmarks/layer_kernels.py"
LINEAR_BENCH = "python benchmarks/linear_kernels.py"  # it names the kernels' classes
QUANT_BENCH = "python benchmarks/quant_linear.py"


@dataclass(frozen=True)
class Rung:
    """One kernel. ``binding``: the name the compiled module gives it (``ops.<binding>``; for a
    GEMM over weights in a packing of its own, the packing function that picks it); ``header``:
    the file of ``csrc/`` that defines it; ``references``: dotted names (importable from the
    repository root) of the PyTorch code it replaces; ``test``: the pytest node id that checks
    it against them; ``bench``: the command, from the repository root, that times both;
    ``timed_as``: the words in that script naming what it times, when not the binding."""

    name: str
    binding: str
    header: str
    references: tuple[str, ...]
    test: str
    bench: str
    timed_as: str = ""

    @property
    def bench_script(self) -> str:
        return next(word for word in self.bench.split() if word.endswith(".py"))


LADDER: tuple[Rung, ...] = (
    Rung("paged attention; merge: cascade's second pass", "paged_attention", "paged_attention.h",
         ("tokenmill.attention.torch_ref.TorchReferenceBackend.forward",),
         "tests/test_attention.py::test_backend_matches_dense_reference", ATTENTION_BENCH),
    Rung("K/V stored in the kernel's layout", "store_kv", "kv_cache.h",
         ("tokenmill.attention.torch_ref.TorchReferenceBackend.store_kv",),
         "tests/test_cpu_kernels.py::test_store_kv_holds_the_references_values", ATTENTION_BENCH),
    Rung("RMSNorm with the residual add, bf16/fp16", "rms_norm", "layer_ops.h",
         ("tokenmill.model.layers.RMSNorm.forward",),
         "tests/test_cpu_kernels.py::test_rms_norm_matches_torch", LAYER_BENCH),
    Rung("RMSNorm, float32", "rms_norm_f32", "decoder_step.h",
         ("torch.nn.functional.rms_norm",),
         "tests/test_cpu_kernels.py::test_float32_rms_norm_rounds_as_pytorch_does", LAYER_BENCH),
    Rung("RoPE in place", "rope_", "layer_ops.h", ("tokenmill.model.layers.apply_rope",),
         "tests/test_cpu_kernels.py::test_rope_in_place_matches_torch_on_strided_rows",
         LAYER_BENCH),
    Rung("SiLU(gate) * up", "silu_and_mul", "layer_ops.h",
         ("tokenmill.model.linear.activation.silu_and_mul",),
         "tests/test_cpu_kernels.py::test_silu_and_mul_matches_torch", LAYER_BENCH),
    Rung("bf16 linear for a few rows, plain weight", "linear_bf16_rows", "bf16_rows.h", (F_LINEAR,),
         "tests/test_cpu_kernels.py::test_bf16_linear_for_few_rows_matches_float_reference",
         LINEAR_BENCH, timed_as="Bf16Rows"),
    Rung("bf16 packed GEMM (amx=True: on AMX tiles)", "linear_bf16_packed", "bf16_gemm.h",
         (F_LINEAR,),
         "tests/test_cpu_kernels.py::test_packed_bf16_linear_matches_float_reference",
         LINEAR_BENCH, timed_as="Bf16Packed"),
    Rung("bf16 packed GEMM, SiLU·mul epilogue", "linear_bf16_packed_silu", "bf16_gemm.h",
         (F_LINEAR, "tokenmill.model.linear.activation.silu_and_mul"),
         "tests/test_cpu_kernels.py::test_gate_up_with_silu_in_the_epilogue_is_the_two_step_result",
         LAYER_BENCH),
    Rung("bf16 GEMM, 4-bit weights read as bf16 16 + q", "pack_bf16_nibbles", "bf16_nibbles.h",
         (DEQUANTIZE, F_LINEAR),
         "tests/test_linear_kernels.py::test_blocks_sum_each_row_alike_at_every_row_count",
         LINEAR_BENCH, timed_as="Bf16Blocks4"),
    Rung("f32 packed GEMM", "linear_f32_packed", "f32_linear.h", (F_LINEAR,),
         "tests/test_cpu_kernels.py::test_packed_f32_linear_matches_float64_reference",
         LINEAR_BENCH, timed_as="F32Packed"),
    Rung("f32 packed GEMM, residual epilogue", "linear_f32_packed_add", "f32_linear.h",
         (F_LINEAR, "torch.add"),
         "tests/test_cpu_kernels.py::test_packed_f32_linear_adds_the_residual_as_pytorch_does",
         LAYER_BENCH),
    Rung("f32 GEMM, weights kept in 4/8 bits", "pack_f32_quant_weight", "f32_gemm.h",
         (DEQUANTIZE, F_LINEAR),
         "tests/test_quant.py::test_weight_packed_in_its_bits_sums_like_the_float32_weight",
         LAYER_BENCH),
    Rung("f32 GEMM, 4/8-bit weights times int8 rows of x", "pack_a8_weight", "a8_gemm.h",
         (DEQUANTIZE, F_LINEAR),
         "tests/test_quant.py::test_a8_packed_linear_multiplies_int8_groups_of_x", LAYER_BENCH),
    Rung("quantized linear w4/w8 from the bytes", "quant_linear", "quant_ops.h",
         (DEQUANTIZE, F_LINEAR),
         "tests/test_quant.py::test_kernel_products_equal_the_dequantized_weights",
         QUANT_BENCH),
    Rung("quantized linear w8a8, AVX512-VNNI", "quant_linear_w8a8", "quant_vnni.h",
         (DEQUANTIZE, F_LINEAR),
         "tests/test_quant.py::test_w8a8_equals_quantized_activations_times_int8_weights",
         QUANT_BENCH),
    Rung("quantized linear w4a8, AVX512-VNNI", "quant_linear_w4a8", "quant_vnni.h",
         (DEQUANTIZE, F_LINEAR),
         "tests/test_quant.py::test_w4a8_equals_quantized_activations_times_int4_weights",
         QUANT_BENCH),
    Rung("4/8-bit weights written out", "quant_dequantize", "quant_ops.h", (DEQUANTIZE,),
         "tests/test_quant.py::test_kernel_dequantization_is_bit_exact",
         QUANT_BENCH),
    Rung("LoRA deltas of a step's rows, grouped by adapter", "LoRABank", "lora.h",
         ("tokenmill.model.lora.slots.lora_reference",),
         "tests/test_lora_kernels.py::test_bank_adds_what_the_reference_adds", LAYER_BENCH),
    Rung("SiLU(gate) * up over interleaved gate/up blocks", "silu_and_mul_interleaved", "lora.h",
         ("tokenmill.model.linear.activation.silu_and_mul",),
         "tests/test_lora_kernels.py::test_silu_and_mul_interleaved_is_silu_and_mul_per_block",
         LAYER_BENCH),
    Rung("a model's decoder layers in one call", "DecoderStack", "decoder_step.h",
         ("tokenmill.model.llama.LlamaDecoderLayer.forward",),
         "tests/test_cpu_step.py::test_fused_step_equals_layer_by_layer",
         "python benchmarks/step_overhead.py --sampling greedy [--enforce-eager]",
         timed_as="fused CPU step"),
    Rung("routed experts of a step's tokens, grouped by expert", "MoEExperts", "moe.h",
         ("tokenmill.model.moe.grouped_experts",),
         "tests/test_moe.py::test_grouped_kernel_equals_torch_loop", "python benchmarks/moe.py"),
    Rung("all-reduce over one host's ranks, shared memory", "ShmAllReduce", "shm_allreduce.h",
         ("torch.distributed.all_reduce",),
         "tests/test_shm_allreduce.py::test_every_rank_gets_the_rank_order_sum_bit_for_bit",
         "python benchmarks/allreduce.py"),
)

# Bindings that are not kernels of their own: weight packing for a rung's GEMM, what a kernel
# takes, the fused step's argument type, and PyTorch's own float32 SiLU·mul split over threads
# by rows (the same ops: nothing to time it against; batch invariance's, tested in
# tests/test_batch_invariant.py), and the setting of paged attention's route for bf16 products
# (vdpbf16ps or float32 FMAs with its bits: tests/test_attention_wide.py).
HELPERS = frozenset({"supports", "pack_bf16_weight", "pack_f32_weight", "LayerWeights",
                     "silu_and_mul_rows", "set_attention_widen_from", "attention_widen_from"})


def table() -> str:
    """The ladder as text, a block per rung."""
    blocks = []
    for r in LADDER:
        blocks.append("\n".join([
            f"{r.binding}: {r.name}",
            f"  header     tokenmill/kernels/csrc/{r.header}",
            f"  replaces   {', '.join(r.references)}",
            f"  test       {r.test}",
            f"  timing     {r.bench}",
        ]))
    return "\n\n".join(blocks)


if __name__ == "__main__":
    print(table())
