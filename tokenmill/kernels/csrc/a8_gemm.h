// float32 linear layers over 4- or 8-bit weights (groups of 32 along K: a GGUF's Q4_0 / Q4_1 /
// Q8_0 blocks, or --quantization int4 / int8) with the rows of x quantized to int8 on the fly:
// the integer products of llama.cpp's Q8 activations, on AVX2 (vpmaddubsw, vpmaddwd), so on any
// x86 CPU the float32 path runs on. `--quantization auto|int4|int8` with a float32 model asks for
// it; the default (`none`) keeps the float32 sums of f32_gemm.h instead.
//
// x: each group of 32 values of a row gets its own scale d, absmax / 127 (llama.cpp's Q8
// activations), the values rounded to int8 (half to even), and d * the sum of those int8 values
// for the offsets' term, so that a 4-bit weight's products are those of its values s * q + z with
// the rounded x. (With x's exact sum there instead, the rounding errors meet q in 0..15 rather
// than the centred weights: +1.9% perplexity on the default model against -0.1% for int8
// weights.) One scale per row instead of per group cost +5%.
//
// The weight is packed by pack_a8_weight in column blocks of 8 output features, group by group:
//
//   [N / 8 column blocks][K / 32 groups][record]      (an int8 tensor: the kind marker)
//   4 bits: 8 float16 scales, 8 float16 offsets, then 4 chunks of 32 bytes: chunk j byte 4c + t
//           holds column c's q[4j + t] in its low nibble and q[16 + 4j + t] in its high one
//   8 bits: 8 float16 scales, then 8 chunks of 32 bytes: chunk j byte 4c + t = column c's
//           q[4j + t] (int8)
//
// (the scales as the formats hold them: a record is 0.625 / 1.06 bytes per weight, and a decode
// step at one row reads its weights at about the machine's memory bandwidth)
//
// so one 32-bit lane holds four consecutive k of one column, four bytes of x broadcast to every
// lane multiply them (vpmaddubsw, then pairs summed by vpmaddwd) and each lane accumulates its
// own column: no horizontal sums. The 4-bit values (0..15) are the unsigned operand; 8-bit
// weights go in as |q| with x's signs flipped where q < 0 (|q| <= 128, |x| <= 127: a pair's sum
// fits in int16). Per group and column
//
//   y += s * d * sum(q * xq) + z * d * sum(xq)   (d: the group's scale of x; z: 4 bits only),
//
// then + bias, + residual.
//
// linear_f32_packed (f32_linear.h) takes these weights too; the packing's checks and the tiles'
// output (F32Out) are f32_gemm.h's.

#pragma once

#include "common.h"
#include "f32_gemm.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

constexpr int64_t kA8Cols = 8;    // output features per column block: one __m256 of float32
constexpr int64_t kA8Group = 32;  // weights of K per scale (and offset)
constexpr int64_t kA8Rows = 4;    // rows of x per tile (their int16 sums and float32
                                  // accumulators, the unpacked weights: 14 of 16 registers)
constexpr int64_t kA8Panel = 64;  // rows of x whose int8 values stay in L1 / L2 while a task's
                                  // column blocks pass over them

constexpr int64_t a8_params(int64_t bits) { return (bits == 4 ? 2 : 1) * kA8Cols * 2; }

constexpr int64_t a8_record(int64_t bits) {
  return a8_params(bits) + kA8Group * kA8Cols / (bits == 4 ? 2 : 1);
}

at::Tensor pack_a8_weight(const at::Tensor& qweight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& zeros, int64_t bits,
                          int64_t group_size) {
  const QuantWeightArgs a = quant_weight_args("pack_a8_weight", qweight, scales, zeros, bits,
                                              group_size, kA8Cols);
  TORCH_CHECK(scales.scalar_type() == at::kHalf &&
                  (bits == 8 || zeros->scalar_type() == at::kHalf),
              "pack_a8_weight: float16 scales (and offsets)");
  const int64_t n = a.n, groups = a.groups;
  const at::Tensor sc = scales.contiguous(), zc = bits == 4 ? zeros->contiguous() : at::Tensor();
  const int64_t rec = a8_record(bits), row_bytes = qweight.size(1);
  at::Tensor packed = at::zeros({n / kA8Cols, groups, rec}, qweight.options().dtype(at::kChar));
  const uint8_t* q = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const at::Half* sp = sc.data_ptr<at::Half>();
  const at::Half* zp = bits == 4 ? zc.data_ptr<at::Half>() : nullptr;
  uint8_t* dst = reinterpret_cast<uint8_t*>(packed.data_ptr());
  at::parallel_for(0, n / kA8Cols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* r = dst + (b * groups + g) * rec;
        at::Half* params = reinterpret_cast<at::Half*>(r);
        uint8_t* chunks = r + a8_params(bits);
        for (int64_t c = 0; c < kA8Cols; ++c) {
          const int64_t row = b * kA8Cols + c;
          params[c] = sp[row * groups + g];
          if (bits == 8) {
            for (int64_t i = 0; i < kA8Group; ++i)
              chunks[(i / 4) * 32 + 4 * c + i % 4] = q[row * row_bytes + g * kA8Group + i];
            continue;
          }
          params[kA8Cols + c] = zp[row * groups + g];
          // GGUF's order: byte i of the group holds q[i] low, q[i + 16] high -- the same split
          const uint8_t* src = q + row * row_bytes + g * kA8Group / 2;
          for (int64_t i = 0; i < 16; ++i) chunks[(i / 4) * 32 + 4 * c + i % 4] = src[i];
        }
      }
  });
  return packed;
}

// x's rows as int8, each group of 32 with its own scale, and each group's sum of them
struct A8Rows {
  std::vector<int8_t> q;      // rows x K
  std::vector<float> scale;   // rows x K / 32: absmax / 127 (0 for a group of zeros)
  std::vector<float> sums;    // rows x K / 32: scale * the sum of the int8 values
};

void a8_quantize_rows(const float* x, int64_t x_stride, int64_t rows, int64_t k_len, A8Rows& r) {
  const int64_t groups = k_len / kA8Group;
  r.q.resize(rows * k_len);
  r.scale.resize(rows * groups);
  r.sums.resize(rows * groups);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / k_len), [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    alignas(32) float lanes[8];
    alignas(32) int32_t n[8];
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + m * x_stride + g * kA8Group;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xg + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        _mm256_store_ps(lanes, amax);
        float a = 0.0f;
        for (float l : lanes) a = std::max(a, l);
        const float d = a / 127.0f;
        r.scale[m * groups + g] = d;
        const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        __m256i iv[4];
        for (int i = 0; i < 4; ++i) {  // rounded half to even (MXCSR's default), as torch.round
          const __m256 scaled = _mm256_mul_ps(v[i], inv);
          iv[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, scaled)));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(n),
                           _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]),
                                            _mm256_add_epi32(iv[2], iv[3])));
        r.sums[m * groups + g] =
            d * static_cast<float>(n[0] + n[1] + n[2] + n[3] + n[4] + n[5] + n[6] + n[7]);
        // packed to bytes within 128-bit lanes: 4-byte runs 0, 2, 4, 6, 1, 3, 5, 7 -> in order
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                                 _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(r.q.data() + m * k_len + g * kA8Group),
            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      }
  });
}

inline __m256i a8_broadcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// ROWS rows of x (from row m0 of `xr`) times one column block (its first record at `rec`),
// into acc[r] (8 columns)
template <int64_t ROWS, int64_t BITS>
inline void a8_tile(const A8Rows& xr, int64_t m0, int64_t k_len, const uint8_t* rec,
                    __m256 (&acc)[ROWS]) {
  const int64_t groups = k_len / kA8Group;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* x0 = xr.q.data() + m0 * k_len;
  for (int64_t g = 0; g < groups; ++g, rec += a8_record(BITS), x0 += kA8Group) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec)));
    const float* xs = xr.scale.data() + m0 * groups + g;  // row r's: xs[r * groups]
    if constexpr (BITS == 4) {
      const __m256i nibble = _mm256_set1_epi8(0x0F);
      const uint8_t* chunks = rec + a8_params(4);
      __m256i t[ROWS];  // int16 pair sums: 8 of at most 2 * 15 * 127 each, within int16
      for (int r = 0; r < ROWS; ++r) t[r] = _mm256_setzero_si256();
      for (int64_t j = 0; j < 4; ++j) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * j));
        const __m256i wl = _mm256_and_si256(b, nibble);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* x = x0 + r * k_len;
          t[r] = _mm256_add_epi16(t[r], _mm256_maddubs_epi16(wl, a8_broadcast(x + 4 * j)));
          t[r] = _mm256_add_epi16(t[r], _mm256_maddubs_epi16(wh, a8_broadcast(x + 16 + 4 * j)));
        }
      }
      const __m256 z =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2 * kA8Cols)));
      const float* sums = xr.sums.data() + m0 * groups + g;
      for (int r = 0; r < ROWS; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(t[r], ones));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(xs[r * groups])), acc[r]);
        acc[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(sums[r * groups]), acc[r]);
      }
    } else {
      const uint8_t* chunks = rec + a8_params(8);
      __m256i t[ROWS];  // int32 sums
      for (int r = 0; r < ROWS; ++r) t[r] = _mm256_setzero_si256();
      for (int64_t j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * j));
        const __m256i wa = _mm256_abs_epi8(w);  // -128 gives 0x80: 128 as the unsigned operand
        for (int r = 0; r < ROWS; ++r) {
          const __m256i xs = _mm256_sign_epi8(a8_broadcast(x0 + r * k_len + 4 * j), w);
          t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones));
        }
      }
      for (int r = 0; r < ROWS; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r]),
                                 _mm256_mul_ps(s, _mm256_set1_ps(xs[r * groups])), acc[r]);
    }
  }
}

// ROWS rows from m0 times one column block into `o`: the sums, + bias, + residual
template <int64_t ROWS, int64_t BITS>
void a8_store_tile(const A8Rows& xr, int64_t m0, int64_t k_len, const uint8_t* rec,
                   const F32Out& o) {
  __m256 acc[ROWS];
  a8_tile<ROWS, BITS>(xr, m0, k_len, rec, acc);
  for (int r = 0; r < ROWS; ++r) {
    __m256 v = acc[r];
    if (o.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(o.bias));
    if (o.add) v = _mm256_add_ps(v, _mm256_loadu_ps(o.add + (m0 + r) * o.add_stride));
    _mm256_storeu_ps(o.out + (m0 + r) * o.stride, v);
  }
}

template <int64_t BITS>
void a8_rows(const A8Rows& xr, int64_t m0, int64_t rows, int64_t k_len, const uint8_t* rec,
             const F32Out& o) {
  row_tiles<kA8Rows>(rows, [&](auto tile, int64_t row) {
    a8_store_tile<decltype(tile)::value, BITS>(xr, m0 + row, k_len, rec, o);
  });
}

// linear_f32_packed for a weight packed by pack_a8_weight (x checked by linear_f32_impl)
at::Tensor linear_a8_impl(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, const at::Tensor& residual) {
  const int64_t rows = x.size(0), k_len = x.size(1);
  const int64_t bits = packed.dim() == 3 && packed.size(2) == a8_record(4) ? 4
                       : packed.dim() == 3 && packed.size(2) == a8_record(8) ? 8 : 0;
  TORCH_CHECK(bits && packed.is_contiguous() && packed.size(1) * kA8Group == k_len,
              "linear_f32_packed: an int8 weight packed by pack_a8_weight for K = ", k_len);
  const int64_t blocks = packed.size(0), n_out = blocks * kA8Cols;
  check_bias_residual(bias, residual, rows, n_out);
  at::Tensor out = at::empty({rows, n_out}, x.options());
  if (rows == 0) return out;
  thread_local A8Rows xr;
  a8_quantize_rows(x.data_ptr<float>(), x.stride(0), rows, k_len, xr);
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const int64_t block_bytes = packed.size(1) * packed.size(2);
  const F32Out o{out.data_ptr<float>(), n_out,
                 bias && bias->defined() ? bias->data_ptr<float>() : nullptr,
                 residual.defined() ? residual.data_ptr<float>() : nullptr,
                 residual.defined() ? residual.stride(0) : 0};
  const A8Rows& xs = xr;  // the calling thread's, read by every task
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < rows; m0 += kA8Panel) {
      const int64_t mm = std::min(kA8Panel, rows - m0);
      for (int64_t b = begin; b < end; ++b) {
        const F32Out ob = o.at(0, b * kA8Cols);
        if (bits == 4)
          a8_rows<4>(xs, m0, mm, k_len, qp + b * block_bytes, ob);
        else
          a8_rows<8>(xs, m0, mm, k_len, qp + b * block_bytes, ob);
      }
    }
  });
  return out;
}

}  // namespace

#define TOKENMILL_HAS_A8_GEMM 1
#endif
