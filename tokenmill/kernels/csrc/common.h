// What every CPU kernel here builds on: a register of float32 lanes (Vec) with PyTorch's
// roundings to bfloat16 / float16, a polynomial exp(), rows taken in tiles of a compile-time
// size (row_tiles), and tasks shared out among threads (share_tasks).
//
// Vector code uses AVX512 or AVX2 intrinsics when the build machine has them (the build is
// per machine, -march=native, see tokenmill/kernels/cpu.py), with a plain fallback. exp() is a
// polynomial with round-to-nearest range reduction that the compiler vectorises without
// -ffast-math.
//
// Every header in csrc/ includes what it uses and compiles alone (tests/test_kernel_ladder.py);
// cpu_ops.cpp, the one translation unit, includes them and binds their kernels. Their code
// sits in anonymous namespaces: nothing leaves the module but its bindings.
#pragma once

// ATen's tensor, dispatch and threads, and the few operators the kernels call, rather than
// <ATen/ATen.h>: every header here parses this, and all of ATen costs ~4x the time
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/clamp_max.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>

// The dtypes a model runs in: float32, bfloat16, float16 (PyTorch's AT_DISPATCH_FLOATING_TYPES
// adds double, which no model uses: its instantiations of every kernel only lengthened the
// build, by about a tenth). Another dtype fails with PyTorch's "not implemented for" error.
#define TOKENMILL_DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__)       \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)                 \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__))

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

// A buffer of at least `size` elements that the calling thread keeps from call to call (no
// allocation and no page faults per call), one per (Owner, kSlot); what it holds is valid until
// the thread's next call for the same pair.
template <typename T, typename Owner, int kSlot = 0>
T* thread_buffer(size_t size) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

// The rows of the next row tile when `left` rows remain and a tile takes at most `most`:
// the rows shared out evenly among the fewest tiles (32 rows by 12: 11, 11, 10), so no tile is
// left with a few rows that keep most of the FMA units idle
inline int64_t even_tile_rows(int64_t left, int64_t most) {
  const int64_t tiles = (left + most - 1) / most;
  return (left + tiles - 1) / tiles;
}

// fn(s0, s1) over [0, rows) in slices of at most 1.5 MiB of float32 rows of k_len (but at
// least `least` rows), the rows shared out evenly: a GEMM that runs every task over one slice
// before the next keeps the slice's x in L2 while its tasks read it, where all of x at once
// streams it from L3 once per task (bf16_gemm.h's packed_gemm)
template <typename Fn>
void for_row_slices(int64_t rows, int64_t k_len, int64_t least, const Fn& fn) {
  constexpr int64_t kSliceBytes = 3 << 19;
  const int64_t row_bytes = std::max<int64_t>(k_len, 1) * int64_t{sizeof(float)};
  const int64_t most = std::max<int64_t>(least, kSliceBytes / row_bytes / least * least);
  for (int64_t s0 = 0, s1 = 0; s0 < rows; s0 = s1) {
    s1 = s0 + even_tile_rows(rows - s0, most);
    fn(s0, s1);
  }
}

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

// MXCSR's DAZ and FTZ while it lives, as vdpbf16ps's own rules have them (denormal inputs read
// as zero, denormal results flushed): float32 FMAs that stand in for vdpbf16ps run under it
// (bf16_gemm.h's WidenRows, bf16_nibbles.h, paged attention's bf16 items)
class DenormalsAsZero {
 public:
  DenormalsAsZero() : csr_(_mm_getcsr()) { _mm_setcsr(csr_ | 0x8040); }
  ~DenormalsAsZero() { _mm_setcsr(csr_); }
  DenormalsAsZero(const DenormalsAsZero&) = delete;
  DenormalsAsZero& operator=(const DenormalsAsZero&) = delete;

 private:
  unsigned csr_;
};

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

#if defined(__AVX512F__)
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
#endif

}  // namespace
