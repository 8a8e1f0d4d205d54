// Linear layers over quantized weights (the formats: tokenmill/model/quant.py), included at the
// end of cpu_ops.cpp (it uses that file's Vec).
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
// faster through oneDNN's GEMM, and the unpacking is then paid once for many rows).

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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rows_as_float",
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "results_as", [&] {
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
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quant_dequantize", [&] {
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

// ---- int8 weights times int8 activations (W8A8), AVX512-VNNI --------------------------------
//
// For int8 weights in groups of 32 with float16 scales (tokenmill's int8, GGUF's Q8_0): each row
// of x is quantized to int8 with its own scale (absmax / 127) and offset by 128 to unsigned
// bytes, so vpdpbusd multiplies 64 byte pairs -- two groups -- into 16 int32 lanes in one
// instruction; lanes 0-7 hold the first group's partial sums, 8-15 the second's, and one FMA
// applies both groups' scales. The offset comes back out through each row's
// offsets[n] = sum over groups of scale * sum q:
//   y = sx * (sum_g s_g sum_i (xq_i + 128) q_i - 128 offsets[n]).

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

inline void register_quant_ops(pybind11::module_& m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("quant_linear", &quant_linear,
        "y = x W^T (+ bias) with W in 8- or 4-bit groups (see quant_ops.h)", release());
  m.def("quant_dequantize", &quant_dequantize,
        "the quantized weights written out in a float dtype", release());
  m.def("quant_linear_w8a8", &quant_linear_w8a8,
        "int8 weights (groups of 32) times int8-quantized rows of x (AVX512-VNNI)", release());
  m.def("quant_linear_w4a8", &quant_linear_w4a8,
        "int4 weights (groups of 32) times int8-quantized rows of x (AVX512-VNNI)", release());
  m.attr("has_int8_dot") = kHasInt8Dot;
}
