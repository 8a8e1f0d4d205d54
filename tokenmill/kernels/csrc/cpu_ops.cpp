// tokenmill's CPU kernels, built for the machine they run on (tokenmill/kernels/cpu.py): the
// one translation unit, which binds the kernels of the headers beside it (decoder_step.h,
// shm_allreduce.h and lora.h bind their own: register_decoder_step, register_shm_allreduce,
// register_lora). Each header includes what it uses and compiles alone.
// tokenmill/kernels/ladder.py lists every kernel with its header, the PyTorch code it
// replaces, the test that holds it to that code and the benchmark that times the two
// (python -m tokenmill.kernels.ladder prints the table).
//
//   common.h           Vec (a register of float32 lanes), PyTorch's roundings, exp, share_tasks
//   kv_cache.h         the paged K/V cache's layout, int8 K/V, store_kv
//   attention_tiles.h  paged attention's loops over a block: scores, online softmax, values
//   paged_attention.h  paged_attention (with merge: cascade attention's partial results)
//   layer_ops.h        rms_norm, rope_, silu_and_mul (bfloat16 / float16), silu_and_mul_rows
//   bf16_rows.h        linear_bf16_rows: one to four rows (AVX512-BF16)
//   bf16_amx.h         AmxRows: the packed bf16 GEMM's rows on AMX tiles
//   bf16_nibbles.h     4-bit weights multiplied by vdpbf16ps as bf16 16 + q, scaled per group
//   bf16_q8.h          8-bit weights times bf16 rows as float32 FMAs over scale * q
//   bf16_gemm.h        linear_bf16_packed(_silu) over weights packed for vdpbf16ps (or AMX),
//                      bf16_nibbles.h's or bf16_q8.h's
//   f32_gemm.h         the float32 GEMM's packing (float32 or 4/8-bit weights) and tiles
//   a8_gemm.h          4/8-bit weights times rows of x quantized to int8 (AVX2)
//   f32_linear.h       linear_f32_packed(_add), over any of the two above's weights
//   quant_ops.h        quant_linear (w4 / w8 from their bytes), quant_dequantize
//   quant_vnni.h       quant_linear_w8a8 / w4a8: times int8 rows of x (AVX512-VNNI)
//   shm_allreduce.h    ShmAllReduce: the sum over one host's ranks through shared memory
//   lora.h             LoRABank: adapters' LoRA deltas added to a step's rows, grouped by
//                      adapter; silu_and_mul_interleaved (gate/up blocks as bf16 packs them)
//   moe.h              MoEExperts: a mixture-of-experts layer's experts, grouped by expert
//   decoder_step.h     DecoderStack: a model's decoder layers in one call (with the above,
//                      under tensor parallelism, and LoRA rows)

#include <torch/csrc/utils/pybind.h>  // pybind11 and at::Tensor's caster

#include "a8_gemm.h"
#include "bf16_amx.h"
#include "bf16_gemm.h"
#include "bf16_nibbles.h"
#include "bf16_rows.h"
#include "common.h"
#include "decoder_step.h"
#include "f32_linear.h"
#include "kv_cache.h"
#include "layer_ops.h"
#include "lora.h"
#include "moe.h"
#include "paged_attention.h"
#include "quant_ops.h"
#include "quant_vnni.h"
#include "shm_allreduce.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs, as PyTorch's own ops do, so the server's event
  // loop thread keeps streaming while the engine thread computes
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, "attention over paged K/V read in place",
        release());
  m.def("set_attention_widen_from", &set_attention_widen_from,
        "bf16 attention items of at least this many rows by float32 FMAs (vdpbf16ps's bits; "
        "0: never)");
  m.def("attention_widen_from", &attention_widen_from, "set_attention_widen_from's rows");
  m.def("store_kv", &store_kv, "store new K/V at their slots in the kernel's cache layout",
        release());
  m.def("supports", &supports, "whether (head_dim, block_size) suit the kernel");
  // blocks per online-softmax step: a shared pass that hands its state over covers whole steps
  m.attr("attention_step_blocks") = kChunk;
  m.def("linear_bf16_rows", &linear_bf16_rows, "bf16 linear for a few rows (AVX512-BF16)",
        release());
  m.attr("has_bf16_dot") = kHasBf16Dot;
  m.def("rms_norm", &rms_norm, "RMSNorm with the residual add fused: (out, new residual)",
        release());
  m.def("rope_", &rope_, "rotate-half RoPE in place", release());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", release());
  m.def("silu_and_mul_rows", &silu_and_mul_rows,
        "float32 silu(gate) * up by PyTorch's ops, each row on one thread", release());
  m.def("quant_linear", &quant_linear,
        "y = x W^T (+ bias) with W in 8- or 4-bit groups (see quant_ops.h)", release());
  m.def("quant_dequantize", &quant_dequantize,
        "the quantized weights written out in a float dtype", release());
  m.def("quant_linear_w8a8", &quant_linear_w8a8,
        "int8 weights (groups of 32) times int8-quantized rows of x (AVX512-VNNI)", release());
  m.def("quant_linear_w4a8", &quant_linear_w4a8,
        "int4 weights (groups of 32) times int8-quantized rows of x (AVX512-VNNI)", release());
  m.attr("has_int8_dot") = kHasInt8Dot;
#ifdef TOKENMILL_HAS_BF16_GEMM
  m.def("pack_bf16_weight", &pack_bf16_weight, "a bf16 weight in linear_bf16_packed's layout");
  m.def("pack_bf16_nibbles", &pack_bf16_nibbles,
        "a 4-bit weight (groups of 32) for linear_bf16_packed, its nibbles read as bf16 16 + q");
  m.def("linear_bf16_packed", &linear_bf16_packed,
        "bf16 linear over a packed weight, any number of rows (AVX512-BF16; amx: on AMX tiles)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("amx") = false,
        py::arg("widen_from") = 0, release());
  m.def("linear_bf16_packed_silu", &linear_bf16_packed_silu,
        "silu(gate) * up from a packed gate/up weight with interleaved column blocks",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("amx") = false,
        py::arg("widen_from") = 0, release());
  m.attr("has_bf16_gemm") = true;
  m.attr("has_bf16_amx") = kHasAmx && amx_usable();  // linear_bf16_packed(..., amx=True)
#else
  m.attr("has_bf16_gemm") = false;
  m.attr("has_bf16_amx") = false;
#endif
#ifdef TOKENMILL_HAS_F32_GEMM
  m.def("pack_f32_weight", &pack_f32_weight, "a float32 weight in linear_f32_packed's layout");
  m.def("pack_f32_quant_weight", &pack_f32_quant_weight,
        "a 4- or 8-bit weight (groups of 32) in linear_f32_packed's layout, kept in its bits");
  m.def("linear_f32_packed", &linear_f32_packed,
        "float32 linear over a packed weight, any number of rows (AVX2 or AVX512)", release());
  m.def("linear_f32_packed_add", &linear_f32_packed_add,
        "linear_f32_packed(x, packed, bias) + residual, added as the tiles are stored",
        release());
  m.attr("f32_pack_cols") = Vec::W;
#else
  m.attr("f32_pack_cols") = 0;
#endif
#ifdef TOKENMILL_HAS_A8_GEMM
  m.def("pack_a8_weight", &pack_a8_weight,
        "a 4- or 8-bit weight (groups of 32) packed for linear_f32_packed with int8 rows of x");
  m.attr("a8_pack_cols") = kA8Cols;
#else
  m.attr("a8_pack_cols") = 0;
#endif
  register_shm_allreduce(m);
  register_lora(m);
  register_moe(m);
  register_decoder_step(m);
}
