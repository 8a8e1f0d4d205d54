// quant_linear_w8a8 / quant_linear_w4a8: 8- and 4-bit weights in groups of 32 (quant_ops.h's
// formats) times rows of x quantized to int8 on the fly, in vpdpbusd's byte products
// (AVX512-VNNI; built without it, both refuse and has_int8_dot is false).
//
// int8 weights times int8 activations (W8A8), for int8 weights in groups of 32 with float16
// scales (tokenmill's int8, GGUF's Q8_0): each row of x is quantized to int8 with its own scale
// (absmax / 127) and offset by 128 to unsigned bytes, so vpdpbusd multiplies 64 byte pairs --
// two groups -- into 16 int32 lanes in one instruction; lanes 0-7 hold the first group's
// partial sums, 8-15 the second's, and one FMA applies both groups' scales. The offset comes
// back out through each row's offsets[n] = sum over groups of scale * sum q:
//   y = sx * (sum_g s_g sum_i (xq_i + 128) q_i - 128 offsets[n]).
#pragma once

#include "common.h"
#include "quant_ops.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasInt8Dot = true;

template <int64_t M, int64_t C>
inline void w8a8_tile(const uint8_t* xu, int64_t kp, const int8_t* w, const at::Half* sw,
                      int64_t k_len, float* out /* [M][C] */) {
  const int64_t groups = k_len / 32;
  __m512 acc[M][C];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_len; k += 64) {
    const bool pair = k + 64 <= k_len;  // else one group of 32 is left
    const __mmask64 mask = pair ? ~__mmask64(0) : (__mmask64(1) << 32) - 1;
    for (int64_t c = 0; c < C; ++c) {
      __builtin_prefetch(w + (c + kPrefetchRows) * k_len + k);
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + c * k_len + k);
      const at::Half* s = sw + c * groups + k / 32;
      const __m512 sv = _mm512_insertf32x8(
          _mm512_set1_ps(quant_half_to_float(s[0])),
          _mm256_set1_ps(pair ? quant_half_to_float(s[1]) : 0.0f), 1);
      for (int64_t m = 0; m < M; ++m) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                              _mm512_loadu_si512(xu + m * kp + k), wv);
        acc[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, acc[m][c]);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) out[m * C + c] = _mm512_reduce_add_ps(acc[m][c]);
}

// The tiling both int8-activation linears share: output features in blocks of kActCols split
// across threads, rows of x in tiles of up to 4. `tile(M, C, m0, n, dots)` (M, C as
// std::integral_constant) computes the products of rows m0.. (M of them) with features n..
// (C of them: kActCols, or 1 for the last few features one at a time) into
// dots[m * kActCols + c]; `store(m, n, dot)` writes each one's result.
constexpr int64_t kActCols = 4;

template <int64_t V>
using Const = std::integral_constant<int64_t, V>;

template <typename Tile, typename Store>
void int8_activation_tiles(int64_t rows, int64_t n_out, const Tile& tile, const Store& store) {
  constexpr int64_t C = kActCols;
  at::parallel_for(0, (n_out + C - 1) / C, 4, [&](int64_t begin, int64_t end) {
    float dots[4 * C];
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * C, cols = std::min(C, n_out - n0);
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t mm = std::min<int64_t>(4, rows - m0);
        if (cols == C) {
          switch (mm) {
            case 4: tile(Const<4>{}, Const<C>{}, m0, n0, dots); break;
            case 3: tile(Const<3>{}, Const<C>{}, m0, n0, dots); break;
            case 2: tile(Const<2>{}, Const<C>{}, m0, n0, dots); break;
            default: tile(Const<1>{}, Const<C>{}, m0, n0, dots); break;
          }
        } else {  // the last few features, one at a time
          for (int64_t c = 0; c < cols; ++c)
            for (int64_t m = 0; m < mm; ++m)
              tile(Const<1>{}, Const<1>{}, m0 + m, n0 + c, dots + m * C + c);
        }
        for (int64_t m = 0; m < mm; ++m)
          for (int64_t c = 0; c < cols; ++c) store(m0 + m, n0 + c, dots[m * C + c]);
      }
    }
  });
}

at::Tensor quant_linear_w8a8(const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& scales, const at::Tensor& offsets,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_linear_w8a8: x must be (M, K)");
  const int64_t rows = x.size(0), k_len = x.size(1), n_out = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous() &&
                  qweight.size(1) == k_len && k_len % 32 == 0 &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == n_out * (k_len / 32) &&
                  offsets.scalar_type() == at::kFloat && offsets.numel() == n_out,
              "quant_linear_w8a8: int8 weights in groups of 32, float16 scales, float32 "
              "offsets");
  const std::vector<float> xf = rows_as_float(x);
  const int64_t kp = (k_len + 63) / 64 * 64;
  std::vector<uint8_t> xu(rows * kp, 128);
  std::vector<float> sx(rows);
  const float* xp = xf.data();
  for (int64_t m = 0; m < rows; ++m) {
    float amax = 0.0f;
    for (int64_t k = 0; k < k_len; ++k) amax = std::max(amax, std::fabs(xp[m * k_len + k]));
    sx[m] = amax > 0.0f ? amax / 127.0f : 1.0f;
    const float inv = 1.0f / sx[m];
    for (int64_t k = 0; k < k_len; ++k)
      xu[m * kp + k] = static_cast<uint8_t>(
          std::nearbyint(std::min(127.0f, std::max(-127.0f, xp[m * k_len + k] * inv))) + 128);
  }
  std::vector<float> res(rows * n_out);
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const float* off = offsets.data_ptr<float>();
  const int64_t groups = k_len / 32;
  int8_activation_tiles(
      rows, n_out,
      [&](auto M, auto C, int64_t m0, int64_t n, float* dots) {
        w8a8_tile<decltype(M)::value, decltype(C)::value>(
            xu.data() + m0 * kp, kp, wp + n * k_len, sp + n * groups, k_len, dots);
      },
      [&](int64_t m, int64_t n, float dot) {
        res[m * n_out + n] = sx[m] * (dot - 128.0f * off[n]);
      });
  return results_as(res, rows, n_out, x, bias);
}
// Rows of x quantized to int8 with a scale per row (absmax / 127): sx, and the values laid out
// for the int4 kernel, each 64 inputs (groups A, B) as A0-15, B0-15, A16-31, B16-31 (the order
// in which a 4-bit weight's 32 bytes unpack: low nibbles of A and B, then high ones), with each
// group's sum of quantized values (the offsets' term).
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> group_sums;
  int64_t stride;
};

Int8Rows quantize_rows_w4(const std::vector<float>& xf, int64_t rows, int64_t k_len) {
  Int8Rows r;
  const int64_t groups = k_len / 32;
  r.stride = (k_len + 63) / 64 * 64;
  r.q.assign(rows * r.stride, 0);
  r.scale.resize(rows);
  r.group_sums.assign(rows * groups, 0.0f);
  for (int64_t m = 0; m < rows; ++m) {
    const float* x = xf.data() + m * k_len;
    float amax = 0.0f;
    for (int64_t k = 0; k < k_len; ++k) amax = std::max(amax, std::fabs(x[k]));
    r.scale[m] = amax > 0.0f ? amax / 127.0f : 1.0f;
    const float inv = 1.0f / r.scale[m];
    for (int64_t k = 0; k < k_len; ++k) {
      const int64_t g = k / 32, i = k % 32, chunk = k / 64 * 64;
      const int64_t at = chunk + (i < 16 ? 0 : 32) + (g % 2) * 16 + i % 16;
      const int8_t v = static_cast<int8_t>(
          std::nearbyint(std::min(127.0f, std::max(-127.0f, x[k] * inv))));
      r.q[m * r.stride + at] = v;
      r.group_sums[m * groups + g] += v;
    }
  }
  return r;
}

template <int64_t M, int64_t C>
inline void w4a8_tile(const Int8Rows& xr, int64_t m0, const uint8_t* w, const at::Half* sw,
                      const at::Half* zw, int64_t k_len, float* out /* [M][C] */) {
  const int64_t groups = k_len / 32, row_bytes = k_len / 2;
  const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m512 acc[M][C];
  float zacc[M][C];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps(), zacc[m][c] = 0.0f;
  for (int64_t k = 0; k < k_len; k += 64) {
    const int64_t g = k / 32;
    const bool pair = g + 1 < groups;  // else one group of 32 is left
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t* q = w + c * row_bytes + k / 2;
      __builtin_prefetch(q + kPrefetchRows * row_bytes);
      const __m256i b = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
                             : _mm256_castsi128_si256(
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      const __m256i lo = _mm256_and_si256(b, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
      const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      const float dA = quant_half_to_float(sw[c * groups + g]);
      const float dB = pair ? quant_half_to_float(sw[c * groups + g + 1]) : 0.0f;
      const float zA = quant_half_to_float(zw[c * groups + g]);
      const float zB = pair ? quant_half_to_float(zw[c * groups + g + 1]) : 0.0f;
      const __m512 dv = _mm512_permutexvar_ps(lanes,
                                              _mm512_castps128_ps512(_mm_set_ps(0, 0, dB, dA)));
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* x = xr.q.data() + (m0 + m) * xr.stride + k;
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv,
                                              _mm512_loadu_si512(x));
        acc[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), dv, acc[m][c]);
        const float* gs = xr.group_sums.data() + (m0 + m) * groups + g;
        zacc[m][c] += zA * gs[0] + (pair ? zB * gs[1] : 0.0f);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c)
      out[m * C + c] = _mm512_reduce_add_ps(acc[m][c]) + zacc[m][c];
}

// int4 weights (groups of 32, float16 scales and offsets: int4, Q4_0, Q4_1) times int8 rows:
// the unsigned nibbles and the signed activations go straight into vpdpbusd;
// y = sx * sum_g (s_g sum_i q_i xq_i + z_g sum_i xq_i).
at::Tensor quant_linear_w4a8(const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& scales, const at::Tensor& zeros,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_linear_w4a8: x must be (M, K)");
  const int64_t rows = x.size(0), k_len = x.size(1), n_out = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.size(1) * 2 == k_len && k_len % 32 == 0 &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == n_out * (k_len / 32) && zeros.sizes() == scales.sizes() &&
                  zeros.scalar_type() == at::kHalf && zeros.is_contiguous(),
              "quant_linear_w4a8: int4 weights in groups of 32, float16 scales and offsets");
  const Int8Rows xr = quantize_rows_w4(rows_as_float(x), rows, k_len);
  std::vector<float> res(rows * n_out);
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* zp = zeros.data_ptr<at::Half>();
  const int64_t groups = k_len / 32;
  int8_activation_tiles(
      rows, n_out,
      [&](auto M, auto C, int64_t m0, int64_t n, float* dots) {
        w4a8_tile<decltype(M)::value, decltype(C)::value>(
            xr, m0, wp + n * (k_len / 2), sp + n * groups, zp + n * groups, k_len, dots);
      },
      [&](int64_t m, int64_t n, float dot) { res[m * n_out + n] = xr.scale[m] * dot; });
  return results_as(res, rows, n_out, x, bias);
}
#else
constexpr bool kHasInt8Dot = false;

at::Tensor quant_linear_w4a8(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "quant_linear_w4a8: built without AVX512-VNNI");
}

at::Tensor quant_linear_w8a8(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "quant_linear_w8a8: built without AVX512-VNNI");
}
#endif

}  // namespace
