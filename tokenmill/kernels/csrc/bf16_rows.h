// linear_bf16_rows: a bfloat16 linear layer for one to four rows of input (decode at small
// batch).
//
// With one to a few rows of input a linear layer is a pass over its weights, bound by memory;
// with AVX512-BF16 the products are taken straight from the bf16 weights (vdpbf16ps: pairs of
// bf16 multiplied and summed into float32), so the weights stream at memory speed. Four output
// features at a time give independent accumulator chains; each group of up to four input rows
// reuses the weight rows from L1.
#pragma once

#include "common.h"

namespace {

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;

template <int64_t M>
inline void dot_rows_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                          int64_t k_len, float* out /* [M][4] */) {
  __m512 acc[M][4];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < k_len; k += 32) {
    const __mmask32 mask = k + 32 <= k_len ? ~__mmask32(0)
                                           : (__mmask32(1) << (k_len - k)) - 1;
    __m512bh wv[4];
    for (int64_t j = 0; j < 4; ++j)
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * k_len + k);
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
      for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < 4; ++j) out[m * 4 + j] = _mm512_reduce_add_ps(acc[m][j]);
}

at::Tensor linear_bf16_rows(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "linear_bf16_rows: bf16 x (M, K), weight (N, K)");
  const int64_t rows = x.size(0), n_out = weight.size(0), k_len = x.size(1);
  TORCH_CHECK(n_out % 4 == 0, "linear_bf16_rows: output features must be a multiple of 4");
  at::Tensor out = at::empty({rows, n_out}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const at::BFloat16* bp = bias && bias->defined() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, n_out / 4, 16, [&](int64_t begin, int64_t end) {
    float sums[16];
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint16_t* w = wp + nb * 4 * k_len;
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mm = std::min<int64_t>(4, rows - m0);
        const uint16_t* xr = xp + m0 * xs;
        switch (mm) {
          case 4: dot_rows_bf16<4>(xr, xs, w, k_len, sums); break;
          case 3: dot_rows_bf16<3>(xr, xs, w, k_len, sums); break;
          case 2: dot_rows_bf16<2>(xr, xs, w, k_len, sums); break;
          default: dot_rows_bf16<1>(xr, xs, w, k_len, sums); break;
        }
        for (int64_t m = 0; m < mm; ++m)
          for (int64_t j = 0; j < 4; ++j) {
            const int64_t n = nb * 4 + j;
            const float b = bp ? static_cast<float>(bp[n]) : 0.0f;
            op[(m0 + m) * n_out + n] = static_cast<at::BFloat16>(sums[m * 4 + j] + b);
          }
      }
    }
  });
  return out;
}
#else
constexpr bool kHasBf16Dot = false;

at::Tensor linear_bf16_rows(const at::Tensor&, const at::Tensor&,
                            const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "linear_bf16_rows: built without AVX512-BF16");
}
#endif

}  // namespace
