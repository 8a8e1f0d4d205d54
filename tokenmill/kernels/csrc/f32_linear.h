// linear_f32_packed, the float32 path's linear layer: x (M, K) times a weight packed by
// pack_f32_weight or pack_f32_quant_weight (f32_gemm.h), or by pack_a8_weight (a8_gemm.h: x's
// rows then quantized to int8), plus the bias, and in linear_f32_packed_add the residual.
#pragma once

#include "a8_gemm.h"
#include "common.h"
#include "f32_gemm.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

namespace {

// x (M, K) times a packed weight, plus the bias and then, when `residual` is defined, the
// residual (M, N): the sum a decoder layer adds its o_proj and down outputs to.
at::Tensor linear_f32_impl(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, const at::Tensor& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "linear_f32_packed: float32 x (M, K) with unit inner stride");
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (packed.scalar_type() == at::kChar) return linear_a8_impl(x, packed, bias, residual);
#endif
  const bool quant = packed.scalar_type() == at::kByte;
  const int64_t bits = !quant ? 32
                       : packed.dim() == 3 && packed.size(2) == f32_quant_record(4) ? 4
                       : packed.dim() == 3 && packed.size(2) == f32_quant_record(8) ? 8 : 0;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && bits &&
                  (quant ? packed.size(1) * kF32QGroup == x.size(1)
                         : packed.scalar_type() == at::kFloat && packed.size(2) == Vec::W &&
                               packed.size(1) == x.size(1)),
              "linear_f32_packed: float32 x (M, K), weight packed by pack_f32_weight or "
              "pack_f32_quant_weight");
  const int64_t rows = x.size(0), k_len = x.size(1);
  const int64_t blocks = packed.size(0), n_out = blocks * Vec::W;
  check_bias_residual(bias, residual, rows, n_out);
  const int64_t block_stride = k_len * Vec::W;
  at::Tensor out = at::empty({rows, n_out}, x.options());
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = quant ? nullptr : packed.data_ptr<float>();
  const uint8_t* qp = quant ? packed.data_ptr<uint8_t>() : nullptr;
  const int64_t q_block = quant ? packed.size(1) * packed.size(2) : 0;  // bytes per block
  const F32Out o{out.data_ptr<float>(), n_out,
                 bias && bias->defined() ? bias->data_ptr<float>() : nullptr,
                 residual.defined() ? residual.data_ptr<float>() : nullptr,
                 residual.defined() ? residual.stride(0) : 0};
  const auto tiles = std::make_integer_sequence<int, kF32TileRows>();
  const int64_t xs = x.stride(0);
  if (quant) {  // tasks of 4 column blocks (the tiles of up to 2 rows take them at once)
    at::parallel_for(0, (blocks + 3) / 4, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = 4 * t, nb = std::min<int64_t>(4, blocks - b0);
        if (bits == 4)
          f32q_blocks<4>(xp, xs, rows, k_len, qp + b0 * q_block, nb, q_block, o.at(0, b0 * Vec::W));
        else
          f32q_blocks<8>(xp, xs, rows, k_len, qp + b0 * q_block, nb, q_block, o.at(0, b0 * Vec::W));
      }
    });
    return out;
  }
  // pairs of column blocks per task; a trailing odd block alone
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = 2 * t;
      // the float32 weight streams from memory: the first row tile prefetches the next task's
      const float* w = wp + b0 * block_stride;
      if (b0 + 1 < blocks)
        f32_rows<2>(tiles, xp, xs, rows, k_len, w, block_stride, o.at(0, b0 * Vec::W), true);
      else
        f32_rows<1>(tiles, xp, xs, rows, k_len, w, block_stride, o.at(0, b0 * Vec::W), true);
    }
  });
  return out;
}

at::Tensor linear_f32_packed(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias) {
  return linear_f32_impl(x, packed, bias, at::Tensor());
}

// linear_f32_packed(x, packed, bias) + residual, the residual added as each tile is stored
at::Tensor linear_f32_packed_add(const at::Tensor& x, const at::Tensor& packed,
                                 const c10::optional<at::Tensor>& bias,
                                 const at::Tensor& residual) {
  TORCH_CHECK(residual.defined(), "linear_f32_packed_add: a residual");
  return linear_f32_impl(x, packed, bias, residual);
}

}  // namespace

#define TOKENMILL_HAS_F32_GEMM 1
#endif
