// Linear layers over quantized weights (the formats: tokenmill/model/quant.py).
//
//   8 bits: qweight int8 (N, K), w = scale * q
//   4 bits: qweight uint8 (N, K / 2); each 32 weights are 16 bytes, byte j holding weight j in
//           its low nibble and weight j + 16 in its high one (GGUF's Q4_0 / Q4_1 order), and
//           w = scale * q + zero with q in 0..15
//   scales (and zeros): (N, K / group) in float16 or float32, group a multiple of 32
//
// quant_linear computes y = x W^T from those bytes directly: each 32 weights are widened to
// float32 in registers, scaled, and multiplied with up to kRowTile rows of x, for kColTile output
// features at a time (independent accumulator chains; every weight byte is read once per row
// tile). With one to a few rows (decode) the layer is a pass over the quantized weights, so it
// runs at the speed of reading 4.5-8.5 bits per weight instead of 16 or 32. The products are
// those of the dequantized weights (model/quant.py's dequantize, bit for bit).
//
// quant_dequantize writes the weights out in a float dtype (prefill: a large batch multiplies
// faster through oneDNN's GEMM, and the unpacking is then paid once for many rows). With rows of
// x quantized to int8 as well, AVX512-VNNI multiplies bytes: quant_vnni.h.
#pragma once

#include "common.h"

#if defined(__F16C__) && (defined(__AVX512F__) || defined(__AVX2__))
inline float quant_half_to_float(at::Half h) { return _cvtsh_ss(h.x); }
#else
inline float quant_half_to_float(at::Half h) { return static_cast<float>(h); }
#endif
inline float quant_half_to_float(float f) { return f; }

namespace {

constexpr int64_t kQChunk = 32;                 // weights unpacked at once
constexpr int64_t kQVecs = kQChunk / Vec::W;    // registers they fill
#if defined(__AVX512F__)
constexpr int64_t kRowTile = 4, kColTile = 4;
#else
constexpr int64_t kRowTile = 2, kColTile = 2;  // 16 registers: fewer accumulators
#endif

// Weight rows read ahead of the ones being multiplied: with a row or a few of input the rows
// are consumed faster than the hardware prefetcher alone brings them in (a step over the
// default model's layers: 13.7 -> 10.8 ms in W8A8). Prefetching past a weight's end is harmless.
constexpr int64_t kPrefetchRows = 8;

// 32 weights of a 4-bit row (16 bytes), unsigned, as float32
inline void unpack_q4(const uint8_t* q, Vec* w) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  w[0].v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
  w[1].v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  w[0].v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1].v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2].v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3].v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#else
  float tmp[kQChunk];
  for (int64_t j = 0; j < 16; ++j) {
    tmp[j] = static_cast<float>(q[j] & 0x0F);
    tmp[j + 16] = static_cast<float>(q[j] >> 4);
  }
  for (int64_t i = 0; i < kQVecs; ++i) w[i] = Vec::load(tmp + i * Vec::W);
#endif
}

inline void unpack_q8(const int8_t* q, Vec* w) {
  for (int64_t i = 0; i < kQVecs; ++i) w[i] = Vec::load(q + i * Vec::W);
}

// Weights k..k+31 of one row (`q`: the row's bytes), dequantized with the group's s and z.
template <int Bits>
inline void dequant_chunk(const uint8_t* q, int64_t k, Vec s, Vec z, Vec* w) {
  // scale * q, then + zero: two roundings like the reference (with GGUF's float16 scales the
  // product is exact, so both equal the gguf package's values)
  if constexpr (Bits == 4) {
    unpack_q4(q + k / 2, w);
    for (int64_t i = 0; i < kQVecs; ++i) w[i] = Vec::add(Vec::fma(w[i], s, Vec::zero()), z);
  } else {
    unpack_q8(reinterpret_cast<const int8_t*>(q + k), w);
    for (int64_t i = 0; i < kQVecs; ++i) w[i] = Vec::fma(w[i], s, Vec::zero());
  }
}

template <int Bits, typename S>
inline void group_params(const S* scales, const S* zeros, int64_t at, Vec& s, Vec& z) {
  s = Vec::set1(quant_half_to_float(scales[at]));
  z = Bits == 4 ? Vec::set1(quant_half_to_float(zeros[at])) : Vec::zero();
}

inline float hsum(Vec v) {
  float tmp[Vec::W];
  v.store(tmp);
  float s = 0.0f;
  for (int64_t i = 0; i < Vec::W; ++i) s += tmp[i];
  return s;
}

// out[m][n0 + c] = x[m] . w[n0 + c] for M rows of x (float32, stride k_len) and C features
template <int Bits, typename S, int64_t M, int64_t C>
void quant_tile(const float* x, int64_t k_len, const uint8_t* qweight, int64_t row_bytes,
                const S* scales, const S* zeros, int64_t groups, int64_t group, int64_t n0,
                float* out, int64_t out_stride) {
  Vec acc[M][C];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) acc[m][c] = Vec::zero();
  const uint8_t* q[C];
  for (int64_t c = 0; c < C; ++c) q[c] = qweight + (n0 + c) * row_bytes;
  for (int64_t g = 0, k = 0; g < groups; ++g) {
    Vec s[C], z[C];
    for (int64_t c = 0; c < C; ++c)
      group_params<Bits>(scales, zeros, (n0 + c) * groups + g, s[c], z[c]);
    for (const int64_t k_end = k + group; k < k_end; k += kQChunk) {
      for (int64_t c = 0; c < C; ++c) {
        __builtin_prefetch(q[c] + kPrefetchRows * row_bytes + k * Bits / 8);
        Vec w[kQVecs];
        dequant_chunk<Bits>(q[c], k, s[c], z[c], w);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t i = 0; i < kQVecs; ++i)
            acc[m][c] = Vec::fma(w[i], Vec::load(x + m * k_len + k + i * Vec::W), acc[m][c]);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) out[m * out_stride + n0 + c] = hsum(acc[m][c]);
}

template <int Bits, typename S, int64_t M>
void quant_cols(const float* x, int64_t k_len, const uint8_t* qweight, int64_t row_bytes,
                const S* scales, const S* zeros, int64_t groups, int64_t group, int64_t n0,
                int64_t n1, float* out, int64_t out_stride) {
  int64_t n = n0;
  for (; n + kColTile <= n1; n += kColTile)
    quant_tile<Bits, S, M, kColTile>(x, k_len, qweight, row_bytes, scales, zeros, groups, group,
                                     n, out, out_stride);
  for (; n < n1; ++n)
    quant_tile<Bits, S, M, 1>(x, k_len, qweight, row_bytes, scales, zeros, groups, group, n,
                              out, out_stride);
}

template <int Bits, typename S>
void quant_linear_impl(const float* xp, int64_t rows, int64_t k_len, const at::Tensor& qweight,
                       const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
                       float* op) {
  const int64_t n_out = qweight.size(0), row_bytes = qweight.size(1), groups = scales.size(1);
  const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const S* sp = scales.data_ptr<S>();
  const S* zp = Bits == 4 ? zeros.data_ptr<S>() : nullptr;
  // Features split across threads; each thread's weight rows stay in cache while every row
  // tile of x passes over them.
  constexpr int64_t kBlock = 16;
  at::parallel_for(0, (n_out + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kBlock, n1 = std::min(n_out, n0 + kBlock);
      for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
        const float* x = xp + m0 * k_len;
        float* o = op + m0 * n_out;
        switch (std::min<int64_t>(kRowTile, rows - m0)) {
#if defined(__AVX512F__)
          case 4: quant_cols<Bits, S, 4>(x, k_len, qp, row_bytes, sp, zp, groups, group, n0, n1,
                                         o, n_out); break;
          case 3: quant_cols<Bits, S, 3>(x, k_len, qp, row_bytes, sp, zp, groups, group, n0, n1,
                                         o, n_out); break;
#endif
          case 2: quant_cols<Bits, S, 2>(x, k_len, qp, row_bytes, sp, zp, groups, group, n0, n1,
                                         o, n_out); break;
          default: quant_cols<Bits, S, 1>(x, k_len, qp, row_bytes, sp, zp, groups, group, n0,
                                          n1, o, n_out); break;
        }
      }
    }
  });
}

void check_quant_args(const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& zeros, int64_t bits, int64_t group,
                      int64_t k_len) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights: bits must be 4 or 8");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.device().is_cpu() &&
                  qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "quantized weights: qweight must be contiguous (N, K) int8 or (N, K/2) uint8");
  TORCH_CHECK(qweight.size(1) * (bits == 4 ? 2 : 1) == k_len,
              "quantized weights: input features do not match the weight");
  TORCH_CHECK(group > 0 && group % kQChunk == 0 && k_len % group == 0,
              "quantized weights: the group must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.size(0) == qweight.size(0) &&
                  scales.size(1) == k_len / group &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "quantized weights: scales must be contiguous (N, K / group) float16/float32");
  if (bits == 4) {
    TORCH_CHECK(zeros && zeros->defined() && zeros->is_contiguous() &&
                    zeros->sizes() == scales.sizes() &&
                    zeros->scalar_type() == scales.scalar_type(),
                "quantized weights: 4 bits need zeros shaped and typed like the scales");
  }
}

// The rows of x (M, K), any float dtype and row stride, as contiguous float32. Done here rather
// than with aten's to(): two conversions per layer through the dispatcher cost ~13 us each,
// 3 ms of a decode step over the default model's 121 layers.
std::vector<float> rows_as_float(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantized linear: x must be (M, K), K dense");
  const int64_t rows = x.size(0), k_len = x.size(1);
  std::vector<float> out(rows * k_len);
  TOKENMILL_DISPATCH_MODEL_TYPES(x.scalar_type(), "rows_as_float",
                                  [&] {
    for (int64_t m = 0; m < rows; ++m)
      load_row(x.data_ptr<scalar_t>() + m * x.stride(0), out.data() + m * k_len, k_len);
  });
  return out;
}

// float32 results (M, N) (+ bias) as a tensor in x's dtype
at::Tensor results_as(const std::vector<float>& res, int64_t rows, int64_t n_out,
                      const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({rows, n_out}, x.options());
  const bool has_bias = bias && bias->defined();
  const at::Tensor b = has_bias ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
  TOKENMILL_DISPATCH_MODEL_TYPES(x.scalar_type(), "results_as", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* bp = has_bias ? b.data_ptr<scalar_t>() : nullptr;
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t n = 0; n < n_out; ++n)
        op[m * n_out + n] = static_cast<scalar_t>(
            res[m * n_out + n] + (bp ? static_cast<float>(bp[n]) : 0.0f));
  });
  return out;
}

template <typename F>
void dispatch_quant(int64_t bits, const at::Tensor& scales, F&& f) {
  const bool half = scales.scalar_type() == at::kHalf;
  if (bits == 4) {
    if (half) f(std::integral_constant<int, 4>{}, at::Half{});
    else f(std::integral_constant<int, 4>{}, float{});
  } else {
    if (half) f(std::integral_constant<int, 8>{}, at::Half{});
    else f(std::integral_constant<int, 8>{}, float{});
  }
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& zeros, int64_t bits, int64_t group,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_linear: x must be (M, K) on the CPU");
  check_quant_args(qweight, scales, zeros, bits, group, x.size(1));
  const int64_t rows = x.size(0), n_out = qweight.size(0);
  const std::vector<float> xf = rows_as_float(x);
  std::vector<float> res(rows * n_out);
  const at::Tensor z = zeros && zeros->defined() ? *zeros : at::Tensor();
  dispatch_quant(bits, scales, [&](auto b, auto s) {
    quant_linear_impl<decltype(b)::value, decltype(s)>(xf.data(), rows, x.size(1), qweight,
                                                       scales, z, group, res.data());
  });
  return results_as(res, rows, n_out, x, bias);
}

at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& zeros, int64_t bits, int64_t group,
                            at::ScalarType dtype) {
  const int64_t k_len = qweight.size(1) * (bits == 4 ? 2 : 1);
  check_quant_args(qweight, scales, zeros, bits, group, k_len);
  const int64_t n_out = qweight.size(0), row_bytes = qweight.size(1), groups = scales.size(1);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "quant_dequantize: dtype must be float32, bfloat16 or float16");
  at::Tensor out = at::empty({n_out, k_len}, at::TensorOptions().dtype(dtype));
  const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const at::Tensor z = zeros && zeros->defined() ? *zeros : at::Tensor();
  dispatch_quant(bits, scales, [&](auto b, auto s) {
    using S = decltype(s);
    constexpr int Bits = decltype(b)::value;
    const S* sp = scales.data_ptr<S>();
    const S* zp = Bits == 4 ? z.data_ptr<S>() : nullptr;
    TOKENMILL_DISPATCH_MODEL_TYPES(dtype, "quant_dequantize", [&] {
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n)
          for (int64_t g = 0, k = 0; g < groups; ++g) {
            Vec sv, zv;
            group_params<Bits>(sp, zp, n * groups + g, sv, zv);
            for (const int64_t k_end = k + group; k < k_end; k += kQChunk) {
              Vec w[kQVecs];
              dequant_chunk<Bits>(qp + n * row_bytes, k, sv, zv, w);
              for (int64_t i = 0; i < kQVecs; ++i) store_as(w[i], op + n * k_len + k + i * Vec::W);
            }
          }
      });
    });
  });
  return out;
}

}  // namespace
