// tokenmill's CPU kernels, built for the machine they run on (see tokenmill/kernels/cpu.py).
//
// paged_attention: causal attention of a flat batch that reads K/V through the block tables
// in place. One work item is (request, KV head, tile of query tokens); the query heads that
// share the KV head are computed together, so every K/V row is loaded once per tile and never
// repeated per query head. Softmax is computed online (flash-attention style) block by block,
// and the log-sum-exp of every (token, head) is returned, so partial results over different
// key ranges (cascade attention: a shared prefix attended once for many sequences, then each
// sequence's own blocks) merge exactly. K is stored transposed inside each block (store_kv).
// The cache is in q's dtype or int8 with a float16 scale per (token, head), read in place: the
// K scale multiplies each score, the V scale each probability (no dequantized copy). The scores
// of kChunk blocks are laid side by side and take one softmax step (max, exp, rescale) together.
// bf16 queries with a bf16 cache on AVX512-BF16 multiply on vdpbf16ps (see kBf16Dot).
//
// linear_bf16_rows: a bf16 linear layer for one to four rows of input (AVX512-BF16).
// linear_bf16_packed, linear_f32_packed: linear layers over weights packed for them
// (bf16_gemm.h, f32_gemm.h); DecoderStack: a model's decoder layers in one call.
// rms_norm, rope_, silu_and_mul: a decoder layer's elementwise steps, fused, for bf16/fp16.
//
// Vector code uses AVX512 or AVX2 intrinsics when the build machine has them (the build is
// per machine, -march=native), with a plain fallback; K/V rows are read in their own dtype and
// widened to float32 in registers. exp() is a polynomial with round-to-nearest range reduction
// that the compiler vectorises without -ffast-math.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// exp(x), x clamped to [-87, 88] (below: 0): 2^(x log2 e), split into an integer power of
// two and 2^f with f in [-0.5, 0.5] (Taylor series to degree 7: relative error below 1e-8).
// The constants, shared with the 8- and 16-lane versions below:
constexpr float kExpLow = -87.0f, kExpHigh = 88.0f, kLog2e = 1.4426950408889634f;
constexpr float kRoundBig = 12582912.0f;  // (t + kRoundBig) - kRoundBig: t to an integer
constexpr float kExpPoly[] = {1.525273380405984e-05f, 1.5403530393381608e-04f,
                              1.3333558146428443e-03f, 9.618129107628477e-03f,
                              5.550410866482158e-02f, 2.402265069591007e-01f,
                              6.931471805599453e-01f, 1.0f};  // highest degree first

inline float exp_clamped(float x) {
  const bool underflow = x < kExpLow;
  x = underflow ? kExpLow : (x > kExpHigh ? kExpHigh : x);
  const float t = x * kLog2e;
  const float r = (t + kRoundBig) - kRoundBig;
  const float f = t - r;
  float p = kExpPoly[0];
  for (size_t i = 1; i < std::size(kExpPoly); ++i) p = p * f + kExpPoly[i];
  const int32_t n = static_cast<int32_t>(r);
  const float y = bits_to_float(float_to_bits(p) + (static_cast<uint32_t>(n) << 23));
  return underflow ? 0.0f : y;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>  // one by one; write_row (below Vec) takes whole registers first
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// A register of float32 lanes: 16 with AVX512, 8 with AVX2, 8 plain floats without either.
#if defined(__AVX512F__)
struct Vec {
  static constexpr int64_t W = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const at::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  static Vec load(const at::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Vec load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  template <typename T>  // any other dtype: widened one by one
  static Vec load(const T* p) {
    float tmp[W];
    load_row(p, tmp, W);
    return load(tmp);
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  static Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  static constexpr int64_t W = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const at::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  static Vec load(const int8_t* p) {
    return {_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  template <typename T>  // any other dtype: widened one by one
  static Vec load(const T* p) {
    float tmp[W];
    load_row(p, tmp, W);
    return load(tmp);
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  static Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
};
#else
struct Vec {  // no AVX2: eight plain lanes, which the compiler vectorises as it can
  static constexpr int64_t W = 8;
  float v[W];
  static Vec zero() { return set1(0.0f); }
  static Vec set1(float x) {
    Vec r;
    for (int64_t i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  template <typename T>
  static Vec load(const T* p) {
    Vec r;
    load_row(p, r.v, W);
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  static Vec fma(Vec a, Vec b, Vec c) {
    for (int64_t i = 0; i < W; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static Vec add(Vec a, Vec b) {
    for (int64_t i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  static Vec mul(Vec a, Vec b) {
    for (int64_t i = 0; i < W; ++i) a.v[i] *= b.v[i];
    return a;
  }
};
#endif

// ---- float32 -> T, rounded as PyTorch rounds (bfloat16: to nearest even, NaN -> 0x7FC0),
// Vec::W lanes at a time. A bfloat16 is a float32's upper half, so rounding keeps it in a
// lane's upper 16 bits: read as a float, the lane is the rounded value (round_as); store_as
// writes the upper halves out.
#if defined(__AVX512F__)
inline __m512i bf16_round_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(
      _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
      _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC00000));
}
inline Vec round_bf16(Vec v) { return {_mm512_castsi512_ps(bf16_round_bits(v.v))}; }
inline void store_as(Vec v, at::BFloat16* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v.v), 16)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256i bf16_round_bits(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(
      _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
      _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                                              _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
inline Vec round_bf16(Vec v) { return {_mm256_castsi256_ps(bf16_round_bits(v.v))}; }
inline void store_as(Vec v, at::BFloat16* dst) {
  const __m256i h = _mm256_srli_epi32(bf16_round_bits(v.v), 16);  // each lane <= 0xFFFF
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
#else
inline Vec round_bf16(Vec v) {
  for (int64_t i = 0; i < Vec::W; ++i)
    v.v[i] = static_cast<float>(static_cast<at::BFloat16>(v.v[i]));
  return v;
}
inline void store_as(Vec v, at::BFloat16* dst) { store_row(v.v, dst, Vec::W); }
#endif

inline void store_as(Vec v, float* dst) { v.store(dst); }

template <typename T>  // any other dtype (float16): one by one
inline void store_as(Vec v, T* dst) {
  float tmp[Vec::W];
  v.store(tmp);
  store_row(tmp, dst, Vec::W);
}

// v rounded to T's precision, as float32 again: float(T(v)) per lane
template <typename T>
inline Vec round_as(Vec v) {
  if constexpr (std::is_same<T, float>::value) {
    return v;
  } else if constexpr (std::is_same<T, at::BFloat16>::value) {
    return round_bf16(v);
  } else {
    float tmp[Vec::W];
    v.store(tmp);
    for (int64_t i = 0; i < Vec::W; ++i) tmp[i] = static_cast<float>(static_cast<T>(tmp[i]));
    return Vec::load(tmp);
  }
}

// n float32 values written as T: whole registers through store_as, the rest by store_row
template <typename T>
inline void write_row(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W) store_as(Vec::load(src + i), dst + i);
  store_row(src + i, dst + i, n - i);
}

inline float lane_sum(Vec v) {  // lane 0 + lane 1 + ... in that order
  float tmp[Vec::W];
  v.store(tmp);
  float s = 0.0f;
  for (int64_t i = 0; i < Vec::W; ++i) s += tmp[i];
  return s;
}

// ---- work shared out as it is done: `work(take)` runs once on each thread, and take(t) sets
// t to the calling thread's next task (false: none left). Tasks are claimed in runs, each a
// (threads * 2)-th of what is left, at least one: early runs are long, so a thread works on
// neighbouring tasks (which share their inputs in cache), and the last ones are single tasks,
// so the threads finish together even when tasks differ in cost -- a prompt's attention tiles
// beside decode rows -- where a fixed split leaves one thread the expensive half. Called from
// inside a parallel region, parallel_for runs the threads' work in turn and the first one
// takes every task.
template <typename F>
void share_tasks(int64_t n, const F& work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t cur = 0, last = 0;  // this thread's run
      const auto take = [&](int64_t& task) {
        if (cur == last) {
          cur = next.load(std::memory_order_relaxed);
          do {
            if (cur >= n) return false;
            last = cur + std::max<int64_t>(1, (n - cur) / (2 * threads));
          } while (!next.compare_exchange_weak(cur, last, std::memory_order_relaxed));
        }
        task = cur++;
        return true;
      };
      work(take);
    }
  });
}

// ---- paged attention ----------------------------------------------------------------------
//
// Cache layout of this backend (the block table and slot mapping are the contract; the layout
// inside a block is the backend's own): V as (num_blocks, block_size, KVH, D) like the
// reference, K transposed per block and head, (num_blocks, KVH, D, block_size), stored by
// store_kv. A block's keys for one head are then 2-4 KB of contiguous memory, and the scores
// of one query row for W keys at once are D register FMAs with no horizontal sums.
//
// int8 cache (tensors (num_blocks, block_size, KVH, D + 2)): each (token, head) has a float16
// scale, x ~= q * scale. V: a token's row per head is D int8 then its scale's 2 bytes. K: per
// block and head, D rows of block_size int8 (transposed as above), then the block's
// block_size scales (2 * block_size bytes), (num_blocks, KVH, D + 2, block_size) bytes in all.
// The scores are score_t = scale_k[t] * sum_d q_d k_d and the values
// acc += (p_t * scale_v[t]) * v_t, read from the int8 rows in place.

template <typename C>  // bytes of scale after each (token, head)'s values: float16 for int8
constexpr int64_t kScaleBytes = std::is_same<C, int8_t>::value ? 2 : 0;

// row: elements per (token, head) in the cache, head_dim + kScaleBytes<C>
inline int64_t k_offset(int64_t block, int64_t head, int64_t num_kv_heads, int64_t row,
                        int64_t block_size) {
  return (block * num_kv_heads + head) * row * block_size;
}

inline float half_at(const int8_t* p) {  // the float16 stored at p (any alignment)
  at::Half h;
  std::memcpy(&h.x, p, sizeof(h.x));
  return static_cast<float>(h);
}

// the smallest float16 >= s >= 0, saturating at 65504 (so |x| / scale <= 127: nothing clips)
inline at::Half round_up_half(float s) {
  at::Half h(s);
  if (static_cast<float>(h) < s) h.x = static_cast<uint16_t>(h.x + 1);
  if (h.x > 0x7BFF) h.x = 0x7BFF;
  return h;
}

// q[i * q_stride] = clamp(round(x[i] / scale), -127, 127), scale = absmax / 127 rounded up to
// float16 (0 for a zero vector, whose q are 0); the same bytes as attention/kv_quant.py
template <typename T>
inline at::Half quantize_row(const T* x, int8_t* q, int64_t n, int64_t q_stride) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(static_cast<float>(x[i])));
  const at::Half scale = round_up_half(absmax / 127.0f);
  const float s = static_cast<float>(scale) > 0.0f ? static_cast<float>(scale) : 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(static_cast<float>(x[i]) / s);
    q[i * q_stride] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return scale;
}

// The online softmax's steps over one block's scores: the largest of the first vis, and
// sc[s] = exp(sc[s] - m) for s < vis, 0 after (returning their sum).
#if defined(__AVX512F__)
inline float block_max(const float* sc, int64_t vis) {
  __m512 mx = _mm512_set1_ps(kNegInf);
  int64_t s = 0;
  for (; s + 16 <= vis; s += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + s));
  if (s < vis)
    mx = _mm512_mask_max_ps(mx, static_cast<__mmask16>((1u << (vis - s)) - 1), mx,
                            _mm512_loadu_ps(sc + s));
  return _mm512_reduce_max_ps(mx);
}

// exp_clamped on 16 lanes, the same operations (so the same results) as the scalar one
inline __m512 exp_clamped16(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLow)), _mm512_set1_ps(kExpHigh));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 big = _mm512_set1_ps(kRoundBig);
  const __m512 r = _mm512_sub_ps(_mm512_add_ps(t, big), big);
  const __m512 f = _mm512_sub_ps(t, r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (size_t i = 1; i < std::size(kExpPoly); ++i)
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(kExpPoly[i]));
  const __m512i n = _mm512_slli_epi32(_mm512_cvtps_epi32(r), 23);
  const __m512 y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), n));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), y);
}

// silu(g) = g / (1 + exp(-g)) on 16 lanes, as the scalar g / (1.0f + exp_clamped(-g))
inline __m512 silu16(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                        exp_clamped16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

inline float block_exp(float* sc, int64_t vis, int64_t block_size, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s = 0; s < block_size; s += 16) {
    const int64_t live = std::min<int64_t>(std::max<int64_t>(vis - s, 0), 16);
    const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1);
    const __m512 p =
        _mm512_maskz_mov_ps(keep, exp_clamped16(_mm512_sub_ps(_mm512_loadu_ps(sc + s), mv)));
    _mm512_storeu_ps(sc + s, p);
    sum = _mm512_add_ps(sum, p);
  }
  return _mm512_reduce_add_ps(sum);
}
#elif defined(__AVX2__) && defined(__FMA__)
template <typename Op>  // op over the 8 lanes, pairwise
inline float reduce8(__m256 v, Op op) {
  __m128 x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(op(x, _mm_movehdup_ps(x)));
}

// lanes [0, live) of sc as a mask (live in 0..8)
inline __m256i live_mask8(int64_t live) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float block_max(const float* sc, int64_t vis) {
  __m256 mx = _mm256_set1_ps(kNegInf);
  int64_t s = 0;
  for (; s + 8 <= vis; s += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + s));
  if (s < vis)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(sc + s),
                                            _mm256_castsi256_ps(live_mask8(vis - s))));
  return reduce8(mx, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); });
}

// exp_clamped on 8 lanes, the same operations (so the same results) as the scalar one
inline __m256 exp_clamped8(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 big = _mm256_set1_ps(kRoundBig);
  const __m256 r = _mm256_sub_ps(_mm256_add_ps(t, big), big);
  const __m256 f = _mm256_sub_ps(t, r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (size_t i = 1; i < std::size(kExpPoly); ++i)
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(kExpPoly[i]));
  const __m256i n = _mm256_slli_epi32(_mm256_cvtps_epi32(r), 23);
  const __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), n));
  return _mm256_andnot_ps(under, y);
}

inline float block_exp(float* sc, int64_t vis, int64_t block_size, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t s = 0; s < block_size; s += 8) {
    const int64_t live = std::min<int64_t>(std::max<int64_t>(vis - s, 0), 8);
    const __m256 p = _mm256_and_ps(_mm256_castsi256_ps(live_mask8(live)),
                                   exp_clamped8(_mm256_sub_ps(_mm256_loadu_ps(sc + s), mv)));
    _mm256_storeu_ps(sc + s, p);
    sum = _mm256_add_ps(sum, p);
  }
  return reduce8(sum, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); });
}
#else
inline float block_max(const float* sc, int64_t vis) {
  float mx = kNegInf;
  for (int64_t s = 0; s < vis; ++s) mx = std::max(mx, sc[s]);
  return mx;
}

inline float block_exp(float* sc, int64_t vis, int64_t block_size, float m) {
  float sum = 0.0f;
  for (int64_t s = 0; s < block_size; ++s) {
    const float p = s < vis ? exp_clamped(sc[s] - m) : 0.0f;
    sc[s] = p;
    sum += p;
  }
  return sum;
}
#endif

// scores of R rows (scaled queries, float32, row stride N * W) for the W keys at kt[.. + kc]
// (an int8 cache's: times the keys' scales ks[kc ..])
template <int64_t N, int64_t R, typename T>
inline void rows_scores(const float* q, const T* kt, const float* ks, int64_t block_size,
                        int64_t kc, float* sc, int64_t sc_stride) {
  constexpr int64_t D = N * Vec::W;
  Vec a[R], b[R];
  for (int64_t r = 0; r < R; ++r) a[r] = b[r] = Vec::zero();
  for (int64_t d = 0; d < D; d += 2) {  // two chains per row: half the FMA latency
    const Vec k0 = Vec::load(kt + d * block_size + kc);
    const Vec k1 = Vec::load(kt + (d + 1) * block_size + kc);
    for (int64_t r = 0; r < R; ++r) {
      a[r] = Vec::fma(Vec::set1(q[r * D + d]), k0, a[r]);
      b[r] = Vec::fma(Vec::set1(q[r * D + d + 1]), k1, b[r]);
    }
  }
  if constexpr (std::is_same<T, int8_t>::value) {
    const Vec scale = Vec::load(ks + kc);
    for (int64_t r = 0; r < R; ++r)
      Vec::mul(Vec::add(a[r], b[r]), scale).store(sc + r * sc_stride + kc);
  } else {
    for (int64_t r = 0; r < R; ++r) Vec::add(a[r], b[r]).store(sc + r * sc_stride + kc);
  }
}

// f(std::integral_constant<int64_t, n>{}, row) for the n = R + 1 that equals left, if any
template <typename F, int64_t... R>
inline void last_tile(std::integer_sequence<int64_t, R...>, int64_t left, int64_t row, F& f) {
  (void)((left == R + 1 ? (f(std::integral_constant<int64_t, R + 1>{}, row), true) : false) ||
         ...);
}

// f(std::integral_constant<int64_t, R>{}, row) for the rows in tiles of R = Tile, then one tile
// of the 1 .. Tile - 1 left
template <int64_t Tile, typename F>
inline void row_tiles(int64_t nrows, F&& f) {
  int64_t row = 0;
  for (; row + Tile <= nrows; row += Tile) f(std::integral_constant<int64_t, Tile>{}, row);
  last_tile(std::make_integer_sequence<int64_t, Tile - 1>(), nrows - row, row, f);
}

// scores of R rows for the 2 W keys at kt[.. + kc]: each query element broadcast once for
// both key registers (rows_scores broadcasts it once per W keys), 2 R accumulators
template <int64_t N, int64_t R, typename T>
inline void rows_scores2(const float* q, const T* kt, const float* ks, int64_t block_size,
                         int64_t kc, float* sc, int64_t sc_stride) {
  constexpr int64_t D = N * Vec::W;
  Vec a[R], b[R];
  for (int64_t r = 0; r < R; ++r) a[r] = b[r] = Vec::zero();
  for (int64_t d = 0; d < D; ++d) {
    const Vec k0 = Vec::load(kt + d * block_size + kc);
    const Vec k1 = Vec::load(kt + d * block_size + kc + Vec::W);
    for (int64_t r = 0; r < R; ++r) {
      const Vec qv = Vec::set1(q[r * D + d]);
      a[r] = Vec::fma(qv, k0, a[r]);
      b[r] = Vec::fma(qv, k1, b[r]);
    }
  }
  if constexpr (std::is_same<T, int8_t>::value) {
    const Vec s0 = Vec::load(ks + kc), s1 = Vec::load(ks + kc + Vec::W);
    for (int64_t r = 0; r < R; ++r) {
      Vec::mul(a[r], s0).store(sc + r * sc_stride + kc);
      Vec::mul(b[r], s1).store(sc + r * sc_stride + kc + Vec::W);
    }
  } else {
    for (int64_t r = 0; r < R; ++r) {
      a[r].store(sc + r * sc_stride + kc);
      b[r].store(sc + r * sc_stride + kc + Vec::W);
    }
  }
}

// the scores of nrows query rows for one block's keys, row r's at sc[r * sc_stride ..]: 2 W
// keys at a time in tiles of up to kScoreRows rows while the block has them, then W at a time
template <int64_t N, typename T>
void block_scores(const float* qbuf, const T* kt, const float* ks, float* sc, int64_t sc_stride,
                  int64_t nrows, int64_t nvalid, int64_t block_size) {
  // 2 R accumulators, two key registers and a broadcast within the 16 (AVX2) or 32 registers
  constexpr int64_t kScoreRows = Vec::W == 16 ? 12 : 6;
  int64_t kc = 0;
  for (; kc + 2 * Vec::W <= block_size && kc < nvalid; kc += 2 * Vec::W) {
    row_tiles<kScoreRows>(nrows, [&](auto tile, int64_t row) {
      rows_scores2<N, decltype(tile)::value>(qbuf + row * N * Vec::W, kt, ks, block_size, kc,
                                             sc + row * sc_stride, sc_stride);
    });
  }
  for (; kc < nvalid; kc += Vec::W)
    row_tiles<4>(nrows, [&](auto tile, int64_t row) {
      rows_scores<N, decltype(tile)::value>(qbuf + row * N * Vec::W, kt, ks, block_size, kc,
                                            sc + row * sc_stride, sc_stride);
    });
}

// acc[row][c .. c + H) += sum_s p[row][s] * V[s][c .. c + H) (in registers) for R rows and
// H registers of the head: each V register loaded once for R rows, each probability broadcast
// once for H registers
template <int64_t N, int64_t R, int64_t H, typename T>
inline void rows_values(const float* sc, int64_t sc_stride, const T* vblock, int64_t v_stride,
                        float* acc, int64_t c, int64_t nvalid) {
  constexpr int64_t D = N * Vec::W;
  Vec a[R][H];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) a[r][h] = Vec::load(acc + r * D + (c + h) * Vec::W);
  for (int64_t s = 0; s < nvalid; ++s) {
    Vec p[R];
    for (int64_t r = 0; r < R; ++r) p[r] = Vec::set1(sc[r * sc_stride + s]);
    const T* v = vblock + s * v_stride + c * Vec::W;
    for (int64_t h = 0; h < H; ++h) {
      const Vec vv = Vec::load(v + h * Vec::W);
      for (int64_t r = 0; r < R; ++r) a[r][h] = Vec::fma(p[r], vv, a[r][h]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) a[r][h].store(acc + r * D + (c + h) * Vec::W);
}

// acc[row] += sum_s p[row][s] * V[s] for one block: tiles of kValueRows rows by kValueRegs
// registers of the head (a masked probability is 0 and adds nothing)
template <int64_t N, typename T>
void block_values(const float* sc, int64_t sc_stride, const T* vblock, int64_t v_stride,
                  float* acc, int64_t nrows, int64_t nvalid) {
  constexpr int64_t D = N * Vec::W;
  // R H accumulators, R broadcasts and a V register within the 16 (AVX2) or 32 registers
  constexpr int64_t kValueRows = Vec::W == 16 ? 4 : 3, kValueRegs = 4;
  constexpr int64_t kWhole = N / kValueRegs * kValueRegs, kRest = N - kWhole;
  auto tile = [&](auto rows, int64_t row) {
    constexpr int64_t R = decltype(rows)::value;
    const float* p = sc + row * sc_stride;
    float* a = acc + row * D;
    for (int64_t c = 0; c < kWhole; c += kValueRegs)
      rows_values<N, R, kValueRegs>(p, sc_stride, vblock, v_stride, a, c, nvalid);
    if constexpr (kRest > 0)
      rows_values<N, R, kRest>(p, sc_stride, vblock, v_stride, a, kWhole, nvalid);
  };
  row_tiles<kValueRows>(nrows, tile);
}

#if defined(__AVX512BF16__)
// bfloat16 queries and cache on a CPU with AVX512-BF16: the two products of attention run on
// vdpbf16ps (pairs of bf16 multiplied, summed into float32 lanes) instead of widening every
// K/V element to float32. Scores: K's transposed rows d and d+1 of a block are interleaved
// into (k_d, k_d+1) pairs of 16 keys, and each query row's (q_d, q_d+1) pair is broadcast.
// Values: the probabilities are rounded to bf16 (as flash attention does on GPUs) and V's
// rows s and s+1 interleaved into pairs, so the accumulators hold a row's values in the
// order unpacklo/unpackhi leave them (see unscramble_bf16); the softmax stays in float32.
constexpr bool kBf16Dot = true;

inline __m512i load_key_pairs(const uint16_t* k0, const uint16_t* k1) {
  alignas(64) static const uint16_t kIdx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0)));
  const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1)));
  return _mm512_permutex2var_epi16(a, _mm512_load_si512(kIdx), b);
}

inline __m512bh broadcast_pair(const uint16_t* p) {  // the bf16 pair p[0], p[1] in every lane
  uint32_t x;
  std::memcpy(&x, p, sizeof(x));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x)));
}

// scores of R query rows (bf16, row stride N * 16) for the 16 keys at kt[.. + kc], times scale
template <int64_t N, int64_t R>
inline void rows_scores_bf16(const uint16_t* q, const uint16_t* kt, int64_t block_size,
                             int64_t kc, float scale, float* sc, int64_t sc_stride) {
  constexpr int64_t D = N * 16;
  __m512 a[R], b[R];
  for (int64_t r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 4) {  // two chains per row, as rows_scores
    const __m512bh k0 = reinterpret_cast<__m512bh>(
        load_key_pairs(kt + d * block_size + kc, kt + (d + 1) * block_size + kc));
    const __m512bh k1 = reinterpret_cast<__m512bh>(
        load_key_pairs(kt + (d + 2) * block_size + kc, kt + (d + 3) * block_size + kc));
    for (int64_t r = 0; r < R; ++r) {
      a[r] = _mm512_dpbf16_ps(a[r], k0, broadcast_pair(q + r * D + d));
      b[r] = _mm512_dpbf16_ps(b[r], k1, broadcast_pair(q + r * D + d + 2));
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < R; ++r)
    _mm512_storeu_ps(sc + r * sc_stride + kc, _mm512_mul_ps(_mm512_add_ps(a[r], b[r]), s));
}

template <int64_t N>
void block_scores_bf16(const uint16_t* qbuf, const uint16_t* kt, float scale, float* sc,
                       int64_t sc_stride, int64_t nrows, int64_t nvalid, int64_t block_size) {
  for (int64_t kc = 0; kc < nvalid; kc += 16)
    row_tiles<4>(nrows, [&](auto tile, int64_t row) {
      rows_scores_bf16<N, decltype(tile)::value>(qbuf + row * N * 16, kt, block_size, kc, scale,
                                                 sc + row * sc_stride, sc_stride);
    });
}

// acc[row] += sum_s p[row][s] * V[s] for R rows, keys two at a time; p in bf16 (zero beyond
// what a row sees), a key past nvalid multiplied as zeros (its slot may hold anything)
template <int64_t N, int64_t R>
inline void rows_values_bf16(const uint16_t* pb, int64_t pb_stride, const uint16_t* vblock,
                             int64_t v_stride, float* acc, int64_t nvalid) {
  constexpr int64_t C = N / 2, D = N * 16;  // C chunks of 32 values per row
  __m512 a[R][2 * C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * C; ++j) a[r][j] = _mm512_loadu_ps(acc + r * D + 16 * j);
  for (int64_t s = 0; s < nvalid; s += 2) {
    const uint16_t* v0 = vblock + s * v_stride;
    const bool both = s + 1 < nvalid;
    __m512bh lo[C], hi[C];
    for (int64_t c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + 32 * c);
      const __m512i y = both ? _mm512_loadu_si512(v0 + v_stride + 32 * c) : _mm512_setzero_si512();
      lo[c] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(x, y));
      hi[c] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(x, y));
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh p = broadcast_pair(pb + r * pb_stride + s);
      for (int64_t c = 0; c < C; ++c) {
        a[r][2 * c] = _mm512_dpbf16_ps(a[r][2 * c], lo[c], p);
        a[r][2 * c + 1] = _mm512_dpbf16_ps(a[r][2 * c + 1], hi[c], p);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * C; ++j) _mm512_storeu_ps(acc + r * D + 16 * j, a[r][j]);
}

template <int64_t N>
void block_values_bf16(const uint16_t* pb, int64_t pb_stride, const uint16_t* vblock,
                       int64_t v_stride, float* acc, int64_t nrows, int64_t nvalid) {
  constexpr int64_t C = N / 2, D = N * 16;
  constexpr int64_t R = C <= 1 ? 8 : C == 2 ? 4 : C <= 4 ? 2 : 1;  // <= 16 accumulators
  int64_t row = 0;
  for (; row + R <= nrows; row += R)
    rows_values_bf16<N, R>(pb + row * pb_stride, pb_stride, vblock, v_stride, acc + row * D,
                           nvalid);
  for (; row < nrows; ++row)
    rows_values_bf16<N, 1>(pb + row * pb_stride, pb_stride, vblock, v_stride, acc + row * D,
                           nvalid);
}

// n float32 probabilities -> bf16 (round to nearest even), n a multiple of 16
inline void probs_to_bf16(const float* p, uint16_t* pb, int64_t n) {
  for (int64_t s = 0; s < n; s += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + s),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(p + s))));
}

// a row's accumulators back in value order: in each chunk of 32, the first 16 floats hold
// values 8L + j and the next 16 values 8L + 4 + j, for lane L = i / 4, j = i % 4
inline void unscramble_bf16(float* acc, float* tmp, int64_t head_dim) {
  std::memcpy(tmp, acc, head_dim * sizeof(float));
  for (int64_t c = 0; c < head_dim; c += 32)
    for (int64_t i = 0; i < 16; ++i) {
      acc[c + 8 * (i / 4) + i % 4] = tmp[c + i];
      acc[c + 8 * (i / 4) + 4 + i % 4] = tmp[c + 16 + i];
    }
}
#else
constexpr bool kBf16Dot = false;
#endif

// blocks whose scores take one online-softmax step together (fewer rescales and reductions)
constexpr int64_t kChunk = 8;

struct WorkItem {
  int64_t req, kv_head, t0, t1;
};

// An int8 cache's scales of one block for one head, as float32: K's (all block_size of them,
// after the block's transposed keys) and V's (the first nvalid, each after its token's row).
inline void block_scales(const int8_t* kt, const int8_t* vblock, int64_t head_dim,
                         int64_t v_stride, int64_t block_size, int64_t nvalid, float* ks,
                         float* vs) {
  const int8_t* kscales = kt + head_dim * block_size;
  for (int64_t s = 0; s < block_size; ++s) ks[s] = half_at(kscales + 2 * s);
  for (int64_t s = 0; s < nvalid; ++s) vs[s] = half_at(vblock + s * v_stride + head_dim);
}

// T: q's dtype; C: the cache's (T, or int8 with scales); O: out's (T or float32)
template <typename T, typename C, typename O, int64_t N>
void attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& query_start,
                    const at::Tensor& key_start_block, const at::Tensor& key_limit,
                    const at::Tensor& rows, at::Tensor& out, at::Tensor& lse, double scale,
                    bool merge, int64_t tile) {
  constexpr int64_t head_dim = N * Vec::W;
  const int64_t num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_reqs = query_start.size(0) - 1;
  const int64_t table_width = block_tables.size(1);

  constexpr bool kInt8 = std::is_same<C, int8_t>::value;
  constexpr int64_t row_len = head_dim + kScaleBytes<C>;  // one (token, head) in the cache
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* kstart = key_start_block.data_ptr<int64_t>();
  const int64_t* klimit = key_limit.data_ptr<int64_t>();
  const int64_t* row_of = rows.numel() ? rows.data_ptr<int64_t>() : nullptr;
  O* op = out.data_ptr<O>();
  float* lp = lse.data_ptr<float>();
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t v_stride = num_kv_heads * row_len;  // one token's V in the cache
  constexpr int64_t kLine = 64 / sizeof(C);  // elements per cache line
  // bf16 queries and cache with AVX512-BF16, head_dim a multiple of 32: vdpbf16ps products
  constexpr bool kDot = kBf16Dot && std::is_same<T, at::BFloat16>::value &&
                        std::is_same<C, at::BFloat16>::value && N % 2 == 0;

  std::vector<WorkItem> items;
  for (int64_t r = 0; r < num_reqs; ++r)
    for (int64_t t0 = qs[r]; t0 < qs[r + 1]; t0 += tile)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({r, h, t0, std::min(t0 + tile, qs[r + 1])});

  const int64_t num_items = static_cast<int64_t>(items.size());
  share_tasks(num_items, [&](const auto& take) {  // items differ in cost
    const int64_t span = kChunk * block_size;  // keys of one softmax step
    std::vector<float> qbuf, acc, m, l, sc, tmp(head_dim), ks(span), vs(span);
    std::vector<uint16_t> qb, pb;  // kDot: the queries and probabilities in bf16
    for (int64_t it; take(it);) {
      const WorkItem& w = items[it];
      const int64_t nrows = (w.t1 - w.t0) * group;
      if constexpr (!kDot) qbuf.assign(nrows * head_dim, 0.0f);
      acc.assign(nrows * head_dim, 0.0f);
      m.assign(nrows, kNegInf);
      l.assign(nrows, 0.0f);
      sc.assign(nrows * span, 0.0f);
      if constexpr (kDot) {
        qb.resize(nrows * head_dim);
        pb.resize(nrows * span);
      }
      int64_t kmax = 0;
      for (int64_t t = w.t0; t < w.t1; ++t) {
        const int64_t src = row_of ? row_of[t] : t;
        kmax = std::max(kmax, klimit[t]);
        if constexpr (kDot) {  // as they are (the scale multiplies the scores)
          std::memcpy(&qb[(t - w.t0) * group * head_dim],
                      qp + src * q_stride + w.kv_head * group * head_dim,
                      group * head_dim * sizeof(T));
          continue;
        }
        for (int64_t g = 0; g < group; ++g) {
          float* dst = &qbuf[((t - w.t0) * group + g) * head_dim];
          load_row(qp + src * q_stride + (w.kv_head * group + g) * head_dim, dst, head_dim);
          for (int64_t d = 0; d < head_dim; ++d) dst[d] *= static_cast<float>(scale);
        }
      }
      const int64_t* table = tables + w.req * table_width;
      // kChunk blocks at a time: their scores side by side in sc, one softmax step over all
      const int64_t kend = std::min(table_width, (kmax + block_size - 1) / block_size);
      for (int64_t b0 = kstart[w.req]; b0 < kend; b0 += kChunk) {
        const int64_t nb = std::min(kChunk, kend - b0);
        const int64_t base = b0 * block_size;
        const int64_t nkeys = std::min(nb * block_size, kmax - base);
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t b = b0 + i;
          const int64_t nvalid = std::min(block_size, kmax - b * block_size);
          const C* kt = kp + k_offset(table[b], w.kv_head, num_kv_heads, row_len, block_size);
          const C* vblock = vp + table[b] * block_size * v_stride + w.kv_head * row_len;
          if (b + 1 < kend) {
            // blocks lie anywhere in the cache: fetch the next one while this one is computed
            const C* knext = kp + k_offset(table[b + 1], w.kv_head, num_kv_heads, row_len,
                                           block_size);
            for (int64_t e = 0; e < row_len * block_size; e += kLine)
              __builtin_prefetch(knext + e);
            const C* vnext = vp + table[b + 1] * block_size * v_stride + w.kv_head * row_len;
            for (int64_t s = 0; s < block_size; ++s)
              for (int64_t d = 0; d < row_len; d += kLine)
                __builtin_prefetch(vnext + s * v_stride + d);
          }
          float* sblock = sc.data() + i * block_size;
          if constexpr (kInt8)
            block_scales(kt, vblock, head_dim, v_stride, block_size, nvalid,
                         ks.data() + i * block_size, vs.data() + i * block_size);
#if defined(__AVX512BF16__)
          if constexpr (kDot)
            block_scores_bf16<N>(qb.data(), reinterpret_cast<const uint16_t*>(kt),
                                 static_cast<float>(scale), sblock, span, nrows, nvalid,
                                 block_size);
          else
#endif
            block_scores<N>(qbuf.data(), kt, ks.data() + i * block_size, sblock, span, nrows,
                            nvalid, block_size);
        }
        // online softmax, row by row
        for (int64_t row = 0; row < nrows; ++row) {
          const int64_t vis = std::min(nkeys, klimit[w.t0 + row / group] - base);
          float* srow = &sc[row * span];
          if (vis <= 0) {
            for (int64_t s = 0; s < span; ++s) srow[s] = 0.0f;
            continue;
          }
          const float m_new = std::max(m[row], block_max(srow, vis));
          const float alpha = exp_clamped(m[row] - m_new);
          const float psum = block_exp(srow, vis, nb * block_size, m_new);
          l[row] = l[row] * alpha + psum;
          m[row] = m_new;
          if constexpr (kInt8)  // fold V's scale into the probability: (p_t * scale_v) * v_t
            for (int64_t s = 0; s < vis; ++s) srow[s] *= vs[s];
          if (alpha != 1.0f) {
            float* arow = &acc[row * head_dim];
            for (int64_t d = 0; d < head_dim; ++d) arow[d] *= alpha;
          }
#if defined(__AVX512BF16__)
          if constexpr (kDot) probs_to_bf16(srow, &pb[row * span], nb * block_size);
#endif
        }
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t b = b0 + i;
          const int64_t nvalid = std::min(block_size, kmax - b * block_size);
          const C* vblock = vp + table[b] * block_size * v_stride + w.kv_head * row_len;
#if defined(__AVX512BF16__)
          if constexpr (kDot)
            block_values_bf16<N>(pb.data() + i * block_size, span,
                                 reinterpret_cast<const uint16_t*>(vblock), v_stride, acc.data(),
                                 nrows, nvalid);
          else
#endif
            block_values<N>(sc.data() + i * block_size, span, vblock, v_stride, acc.data(),
                            nrows, nvalid);
        }
      }
      for (int64_t row = 0; row < nrows; ++row) {
        const int64_t t = w.t0 + row / group;
        const int64_t dst = row_of ? row_of[t] : t;
        const int64_t head = w.kv_head * group + row % group;
        float* arow = &acc[row * head_dim];
#if defined(__AVX512BF16__)
        if constexpr (kDot) unscramble_bf16(arow, tmp.data(), head_dim);
#endif
        float new_lse = l[row] > 0.0f ? m[row] + std::log(l[row]) : kNegInf;
        const float inv = l[row] > 0.0f ? 1.0f / l[row] : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) arow[d] *= inv;
        O* orow = op + dst * out_stride + head * head_dim;
        float* lrow = lp + dst * num_heads + head;
        if (merge && *lrow != kNegInf) {
          // combine with the partial result already there (another key range)
          const float old_lse = *lrow;
          const float top = std::max(old_lse, new_lse);
          const float w_old = std::exp(old_lse - top), w_new = std::exp(new_lse - top);
          const float denom = w_old + w_new;
          load_row(orow, tmp.data(), head_dim);
          for (int64_t d = 0; d < head_dim; ++d)
            arow[d] = (tmp[d] * w_old + arow[d] * w_new) / denom;
          new_lse = top + std::log(denom);
        }
        write_row(arow, orow, head_dim);
        *lrow = new_lse;
      }
    }
  });
}

// Head sizes the kernels take: head_dim = N * W for these N (32..128 on AVX512 and AVX2).
#define TOKENMILL_HEAD_VECS(X) X(2) X(4) X(5) X(6) X(8) X(10) X(12) X(16)

bool supports(int64_t head_dim, int64_t block_size) {
  if (head_dim % Vec::W || block_size % Vec::W) return false;
  switch (head_dim / Vec::W) {
#define TOKENMILL_CASE(n) case n: return true;
    TOKENMILL_HEAD_VECS(TOKENMILL_CASE)
#undef TOKENMILL_CASE
    default: return false;
  }
}

template <typename T, typename C, typename O>
void attention_dispatch(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& query_start, const at::Tensor& key_start_block,
                        const at::Tensor& key_limit, const at::Tensor& rows, at::Tensor& out,
                        at::Tensor& lse, double scale, bool merge, int64_t tile) {
  switch (q.size(2) / Vec::W) {
#define TOKENMILL_CASE(n)                                                                     \
    case n:                                                                                   \
      return attention_impl<T, C, O, n>(q, k_cache, v_cache, block_tables, query_start,      \
                                        key_start_block, key_limit, rows, out, lse, scale,    \
                                        merge, tile);
    TOKENMILL_HEAD_VECS(TOKENMILL_CASE)
#undef TOKENMILL_CASE
    default: TORCH_CHECK(false, "paged_attention: unsupported head_dim ", q.size(2));
  }
}

template <typename C>
struct TypeTag {
  using type = C;
};

// What a cache holds beside queries / new K/V of dtype T: T itself, int8 with scales, or
// bfloat16 under float32 (`--kv-cache-dtype bfloat16`: half the bytes, widened as read).
enum class CacheKind { kSame, kInt8, kBf16 };

// The kind of `cache` for K/V or queries of dtype `t`, checked: int8 caches are read for
// float32 / bfloat16 / float16, bfloat16 ones for float32 too.
CacheKind cache_kind(const at::Tensor& cache, at::ScalarType t, const char* op) {
  const at::ScalarType c = cache.scalar_type();
  if (c == t) return CacheKind::kSame;
  if (c == at::kChar && t != at::kDouble) return CacheKind::kInt8;
  if (c == at::kBFloat16 && t == at::kFloat) return CacheKind::kBf16;
  TORCH_CHECK(false, op, ": a ", c, " cache does not hold ", t, " K/V (the same dtype, int8, "
              "or bfloat16 under float32)");
}

// f(TypeTag<C>{}) with C the cache's element type for T: T, int8_t or at::BFloat16
template <typename T, typename F>
void with_cache_type(CacheKind kind, F&& f) {
  if constexpr (std::is_same<T, double>::value) {
    f(TypeTag<T>{});  // cache_kind allows only kSame
  } else if (kind == CacheKind::kInt8) {
    f(TypeTag<int8_t>{});
  } else if constexpr (std::is_same<T, float>::value) {
    if (kind == CacheKind::kBf16)
      f(TypeTag<at::BFloat16>{});
    else
      f(TypeTag<T>{});
  } else {
    f(TypeTag<T>{});
  }
}

// Attention of the queries in ``q`` to the paged K/V (this backend's layout, see above).
//   q               (T, H, D) float32 / bfloat16 / float16 (the cache's dtype unless that is
//                   int8); rows may be strided (the q part of a fused qkv projection)
//   k_cache/v_cache (num_blocks, block_size, KVH, D) tensors; K's blocks hold (KVH, D, bs);
//                   or int8 (num_blocks, block_size, KVH, D + 2) with float16 scales
//   block_tables    (R, W) int64; request r reads blocks key_start_block[r] .. of its row
//   query_start     (R + 1) int64: request r owns query tokens query_start[r] .. [r + 1] - 1
//   key_limit       (T') int64: query token t sees keys [key_start_block[r] * block_size,
//                   key_limit[t]) of its request (positions; causal: its own position + 1)
//   rows            (T') int64 or empty: query token t is row rows[t] of q / out / lse
//                   (empty: row t), so a call may cover any subset of a batch's tokens
//   out, lse        (T, H, D) q's dtype or float32, and (T, H) float32: written, or with
//                   ``merge`` combined with the partial results they hold (lse -inf: none)
//   tile            query tokens of one request computed together (sharing each K/V load)
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start,
                     const at::Tensor& key_start_block, const at::Tensor& key_limit,
                     const at::Tensor& rows, at::Tensor out, at::Tensor lse, double scale,
                     bool merge, int64_t tile) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q (T, H, D) and caches (blocks, block_size, KVH, D) expected");
  const CacheKind kind = cache_kind(k_cache, q.scalar_type(), "paged_attention");
  const bool int8 = kind == CacheKind::kInt8;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: K and V caches of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q heads must be "
              "contiguous (T, H, D)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
                  lse.is_contiguous(), "paged_attention: caches, out and lse must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 &&
                  q.size(2) + (int8 ? kScaleBytes<int8_t> : 0) == k_cache.size(3),
              "paged_attention: heads must be a multiple of KV heads, head dims equal");
  TORCH_CHECK(supports(q.size(2), k_cache.size(1)), "paged_attention: head_dim ", q.size(2),
              " / block_size ", k_cache.size(1), " not supported (see supports())");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == q.size(2) &&
                  lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                  lse.scalar_type() == at::kFloat, "paged_attention: out/lse shapes");
  for (const at::Tensor* t : {&block_tables, &query_start, &key_start_block, &key_limit, &rows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int64");
  TORCH_CHECK(key_start_block.size(0) == query_start.size(0) - 1 &&
                  block_tables.size(0) == key_start_block.size(0), "paged_attention: one "
              "block table row and key start per request");
  TORCH_CHECK(rows.numel() == 0 || rows.numel() == key_limit.numel(), "paged_attention: rows");
  TORCH_CHECK(tile >= 1, "paged_attention: tile >= 1");
  const bool same = out.scalar_type() == q.scalar_type();
  TORCH_CHECK(same || out.scalar_type() == at::kFloat, "paged_attention: out is q's dtype or "
              "float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention",
                                  [&] {
    with_cache_type<scalar_t>(kind, [&](auto cache_type) {
      using C = typename decltype(cache_type)::type;
      if (same) {
        attention_dispatch<scalar_t, C, scalar_t>(q, k_cache, v_cache, block_tables,
                                                  query_start, key_start_block, key_limit, rows,
                                                  out, lse, scale, merge, tile);
      } else {
        attention_dispatch<scalar_t, C, float>(q, k_cache, v_cache, block_tables, query_start,
                                               key_start_block, key_limit, rows, out, lse,
                                               scale, merge, tile);
      }
    });
  });
}

// Store new K/V at their slots in this backend's layout (K transposed per block and head;
// an int8 cache's values quantized, with their scales, see above).
template <typename T, typename C>
void store_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t block_size = k_cache.size(1), row_len = head_dim + kScaleBytes<C>;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0), khs = k.stride(1), vhs = v.stride(1);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t block = sp[t] / block_size, off = sp[t] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      C* kblock = kc + k_offset(block, h, kv_heads, row_len, block_size);
      C* vdst = vc + (sp[t] * kv_heads + h) * row_len;
      const T* ksrc = kp + t * ks + h * khs;
      const T* vsrc = vp + t * vs + h * vhs;
      if constexpr (std::is_same<C, int8_t>::value) {
        const at::Half k_scale = quantize_row(ksrc, kblock + off, head_dim, block_size);
        std::memcpy(kblock + head_dim * block_size + 2 * off, &k_scale.x, 2);
        const at::Half v_scale = quantize_row(vsrc, vdst, head_dim, 1);
        std::memcpy(vdst + head_dim, &v_scale.x, 2);
      } else {  // a bfloat16 cache under float32: rounded to nearest even, as torch's .to()
        for (int64_t d = 0; d < head_dim; ++d) kblock[off + d * block_size] = ksrc[d];
        if constexpr (std::is_same<C, T>::value)
          std::memcpy(vdst, vsrc, head_dim * sizeof(T));
        else
          for (int64_t d = 0; d < head_dim; ++d) vdst[d] = vsrc[d];
      }
    }
  }
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv: k, v (T, KVH, D) with unit inner stride");
  const CacheKind kind = cache_kind(k_cache, k.scalar_type(), "store_kv");
  const bool int8 = kind == CacheKind::kInt8;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) &&
                  k_cache.size(3) == k.size(2) + (int8 ? kScaleBytes<int8_t> : 0) &&
                  v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: cache shapes/dtypes (int8 ones with room for the scales)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == k.size(0), "store_kv: one int64 slot per token");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kv", [&] {
    with_cache_type<scalar_t>(kind, [&](auto cache_type) {
      using C = typename decltype(cache_type)::type;
      store_kv_impl<scalar_t, C>(k, v, k_cache, v_cache, slots);
    });
  });
}

// ---- bfloat16 linear for a few rows (decode at small batch) -----------------------------
//
// With one to a few rows of input a linear layer is a pass over its weights, bound by memory;
// with AVX512-BF16 the products are taken straight from the bf16 weights (vdpbf16ps: pairs of
// bf16 multiplied and summed into float32), so the weights stream at memory speed. Four output
// features at a time give independent accumulator chains; each group of up to four input rows
// reuses the weight rows from L1.

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

// ---- fused elementwise steps of a decoder layer (for bfloat16 / float16, where PyTorch runs
// each of them as several passes with float32 round trips). Each computes in float32 and rounds
// where the unfused PyTorch code rounds, so results match it to the dtype's last bit save for
// the order of a sum.

// out = w * dtype(s * rsqrt(mean(s^2) + eps)), s = x (+ residual, rounded; written to res_out)
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps, at::Tensor& out, at::Tensor& res_out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual.numel() ? residual.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = rp ? res_out.data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = rp ? residual.stride(0) : 0;
  constexpr int64_t W = Vec::W;
  const int64_t nv = n - n % W;  // whole registers, then one by one
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> v(n), wf(n);
    load_row(wp, wf.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      Vec sq = Vec::zero();
      if (rp) {
        const T* rr = rp + r * rs;
        T* sr = sp + r * n;
        for (int64_t i = 0; i < nv; i += W) {
          const Vec s = round_as<T>(Vec::add(Vec::load(xr + i), Vec::load(rr + i)));
          store_as(s, sr + i);
          s.store(v.data() + i);
          sq = Vec::fma(s, s, sq);
        }
        for (int64_t i = nv; i < n; ++i) {
          sr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          v[i] = static_cast<float>(sr[i]);
        }
      } else {
        for (int64_t i = 0; i < nv; i += W) {
          const Vec s = Vec::load(xr + i);
          s.store(v.data() + i);
          sq = Vec::fma(s, s, sq);
        }
        for (int64_t i = nv; i < n; ++i) v[i] = static_cast<float>(xr[i]);
      }
      float ss = lane_sum(sq);
      for (int64_t i = nv; i < n; ++i) ss += v[i] * v[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      T* orow = op + r * n;
      const Vec iv = Vec::set1(inv);
      for (int64_t i = 0; i < nv; i += W)
        store_as(Vec::mul(Vec::load(wf.data() + i),
                          round_as<T>(Vec::mul(Vec::load(v.data() + i), iv))),
                 orow + i);
      for (int64_t i = nv; i < n; ++i) {
        const float normed = static_cast<float>(static_cast<T>(v[i] * inv));
        orow[i] = static_cast<T>(wf[i] * normed);
      }
    }
  });
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x (T, N) with unit inner stride and a weight (N) of its dtype");
  TORCH_CHECK(residual.numel() == 0 || (residual.sizes() == x.sizes() &&
                                        residual.stride(1) == 1 &&
                                        residual.scalar_type() == x.scalar_type()),
              "rms_norm: residual must match x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor res_out = residual.numel() ? at::empty(x.sizes(), x.options()) : residual;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, residual, weight, eps, out, res_out);
  });
  return {out, res_out};
}

// rotate-half RoPE in place on x (T, H, D) (rows may be strided, e.g. the q/k part of a fused
// qkv projection), with float32 cos/sin (T, D/2): dtype(x1 c - x2 s), dtype(x2 c + x1 s)
template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* xp = x.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1);
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = xp + t * ts + h * hs;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
          const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
          x1[i] = static_cast<T>(ac - bs);
          x2[i] = static_cast<T>(bc + as);
        }
      }
    }
  });
}

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope_: x (T, H, D) with unit inner stride");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * x.size(2) / 2 && sin.numel() == cos.numel(),
              "rope_: float32 contiguous cos/sin of (T, D/2)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    rope_impl<scalar_t>(x, cos, sin);
  });
}

// x (T, 2I) = [gate | up] -> dtype(dtype(silu(gate)) * up), (T, I)
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> g(n), u(n), y(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(xp + r * xs, g.data(), n);
      load_row(xp + r * xs + n, u.data(), n);
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(y.data() + j, silu16(_mm512_loadu_ps(g.data() + j)));
#endif
      for (; j < n; ++j) y[j] = g[j] / (1.0f + exp_clamped(-g[j]));
      T* orow = op + r * n;
      int64_t i = 0;
      for (; i + Vec::W <= n; i += Vec::W)
        store_as(Vec::mul(round_as<T>(Vec::load(y.data() + i)), Vec::load(u.data() + i)),
                 orow + i);
      for (; i < n; ++i)
        orow[i] = static_cast<T>(static_cast<float>(static_cast<T>(y[i])) * u[i]);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x (T, 2I) with unit inner stride");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(x, out); });
  return out;
}

}  // namespace

#include "quant_ops.h"
#include "bf16_gemm.h"
#include "f32_gemm.h"
#include "a8_gemm.h"
#include "decoder_step.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs, as PyTorch's own ops do, so the server's event
  // loop thread keeps streaming while the engine thread computes
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, "attention over paged K/V read in place",
        release());
  m.def("store_kv", &store_kv, "store new K/V at their slots in the kernel's cache layout",
        release());
  m.def("supports", &supports, "whether (head_dim, block_size) suit the kernel");
  m.def("linear_bf16_rows", &linear_bf16_rows, "bf16 linear for a few rows (AVX512-BF16)",
        release());
  m.attr("has_bf16_dot") = kHasBf16Dot;
  m.def("rms_norm", &rms_norm, "RMSNorm with the residual add fused: (out, new residual)",
        release());
  m.def("rope_", &rope_, "rotate-half RoPE in place", release());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", release());
  register_quant_ops(m);
#ifdef TOKENMILL_HAS_BF16_GEMM
  m.def("pack_bf16_weight", &pack_bf16_weight, "a bf16 weight in linear_bf16_packed's layout");
  m.def("linear_bf16_packed", &linear_bf16_packed,
        "bf16 linear over a packed weight, any number of rows (AVX512-BF16)", release());
  m.def("linear_bf16_packed_silu", &linear_bf16_packed_silu,
        "silu(gate) * up from a packed gate/up weight with interleaved column blocks",
        release());
  m.attr("has_bf16_gemm") = true;
#else
  m.attr("has_bf16_gemm") = false;
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
#if defined(TOKENMILL_HAS_BF16_GEMM) || defined(TOKENMILL_HAS_F32_GEMM)
  py::class_<DecoderStack>(m, "DecoderStack",
                           "the decoder layers of a bf16 or float32 model, run in one call")
      .def(py::init<const std::vector<at::Tensor>&, int64_t, int64_t, int64_t, double, double,
                    int64_t, int64_t, int64_t>())
      .def("forward", &DecoderStack::forward, release());
  m.def("rms_norm_f32", &rms_norm_f32,
        "float32 rms_norm with PyTorch's roundings (its own mean), in three calls", release());
#endif
}
