// paged_attention's inner loops over blocks of keys (paged_attention.h): the online softmax's
// steps, the scores of tiles of query rows, and the probabilities times V, in float32 FMAs, or
// for bfloat16 queries and cache on AVX512-BF16 in vdpbf16ps pairs.
#pragma once

#include "common.h"

namespace {

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
  const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      k0)));
  const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      k1)));
  return _mm512_permutex2var_epi16(a, _mm512_load_si512(kIdx), b);
}

inline __m512bh broadcast_pair(const uint16_t* p) {  // the bf16 pair p[0], p[1] in every lane
  uint32_t x;
  std::memcpy(&x, p, sizeof(x));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x)));
}

// The pairs vdpbf16ps multiplies, read in place for a tile or two of rows and made once into
// a scratch buffer for more (where the permutes / unpacks would repeat per row tile): the same
// pairs either way, so the same sums.
//
// Keys: kpair(d) is, for the 16 keys at kc and dims d, d + 1, the (k_d, k_d+1) pairs (32 bf16).
struct KeyPairsInPlace {
  const uint16_t* kt;  // the block's transposed keys, from key kc on
  int64_t block_size;
  __m512bh operator()(int64_t d) const {
    return reinterpret_cast<__m512bh>(
        load_key_pairs(kt + d * block_size, kt + (d + 1) * block_size));
  }
};

struct KeyPairsMade {
  const uint16_t* kp;  // KeyPairsInPlace's pairs for d = 0, 2, .., D - 2, 32 bf16 each
  __m512bh operator()(int64_t d) const {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + d / 2 * 32));
  }
};

// scores of R query rows (bf16, row stride N * 16) for 16 keys, times scale
template <int64_t N, int64_t R, typename Pairs>
inline void rows_scores_bf16(const uint16_t* q, const Pairs& kpair, float scale, float* sc,
                             int64_t sc_stride) {
  constexpr int64_t D = N * 16;
  __m512 a[R], b[R];
  for (int64_t r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 4) {  // two chains per row, as rows_scores
    const __m512bh k0 = kpair(d), k1 = kpair(d + 2);
    for (int64_t r = 0; r < R; ++r) {
      a[r] = _mm512_dpbf16_ps(a[r], k0, broadcast_pair(q + r * D + d));
      b[r] = _mm512_dpbf16_ps(b[r], k1, broadcast_pair(q + r * D + d + 2));
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < R; ++r)
    _mm512_storeu_ps(sc + r * sc_stride, _mm512_mul_ps(_mm512_add_ps(a[r], b[r]), s));
}

constexpr int64_t kScoreRowsBf16 = 8;  // 16 accumulators

// Values: pairs(s, c, lo, hi) gives, for keys s, s + 1 (s even) of a softmax step's nkeys
// (blocks of block_size, even, one after another) and values 32 c .. 32 c + 31, V's two rows
// interleaved (unpacklo, unpackhi); a key past nkeys as zeros (its slot may hold anything).
struct ValuePairsInPlace {
  const uint16_t* const* rows;  // rows[s / 2]: key s's V row of this head (in its block)
  int64_t v_stride, nkeys;
  void operator()(int64_t s, int64_t c, __m512bh& lo, __m512bh& hi) const {
    const uint16_t* v0 = rows[s / 2] + 32 * c;
    const __m512i x = _mm512_loadu_si512(v0);
    const __m512i y = s + 1 < nkeys ? _mm512_loadu_si512(v0 + v_stride) : _mm512_setzero_si512();
    lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(x, y));
    hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(x, y));
  }
};

template <int64_t C>
struct ValuePairsMade {
  const uint16_t* vp;  // ValuePairsInPlace's lo, hi for each (s / 2, c), 64 bf16 each
  void operator()(int64_t s, int64_t c, __m512bh& lo, __m512bh& hi) const {
    const uint16_t* at = vp + (s / 2 * C + c) * 64;
    lo = reinterpret_cast<__m512bh>(_mm512_loadu_si512(at));
    hi = reinterpret_cast<__m512bh>(_mm512_loadu_si512(at + 32));
  }
};

// acc[row] += sum_s p[row][s] * V[s] for R rows, keys two at a time; p in bf16 (zero beyond
// what a row sees)
template <int64_t N, int64_t R, typename Pairs>
inline void rows_values_bf16(const uint16_t* pb, int64_t pb_stride, const Pairs& pairs,
                             float* acc, int64_t nkeys) {
  constexpr int64_t C = N / 2, D = N * 16;  // C chunks of 32 values per row
  __m512 a[R][2 * C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * C; ++j) a[r][j] = _mm512_loadu_ps(acc + r * D + 16 * j);
  for (int64_t s = 0; s < nkeys; s += 2) {
    __m512bh lo[C], hi[C];
    for (int64_t c = 0; c < C; ++c) pairs(s, c, lo[c], hi[c]);
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

// acc[row] += sum_s p[row][s] * V[s] over a softmax step's nkeys keys, tiles of rows whose
// accumulators stay in registers across its blocks (each row's sums in the order of one block
// at a time); vp: scratch of N * 16 * nkeys (rounded up to even) bf16
template <int64_t N>
void block_values_bf16(const uint16_t* pb, int64_t pb_stride, const ValuePairsInPlace& v,
                       float* acc, int64_t nrows, uint16_t* vp) {
  constexpr int64_t C = N / 2, D = N * 16;
  constexpr int64_t R = C <= 1 ? 8 : C == 2 ? 6 : C == 3 ? 3 : C == 4 ? 2 : 1;  // <= 24 acc.
  auto rows = [&](const auto& pairs) {
    int64_t row = 0;
    for (; row + R <= nrows; row += R)
      rows_values_bf16<N, R>(pb + row * pb_stride, pb_stride, pairs, acc + row * D, v.nkeys);
    for (; row < nrows; ++row)
      rows_values_bf16<N, 1>(pb + row * pb_stride, pb_stride, pairs, acc + row * D, v.nkeys);
  };
  if (nrows <= 2 * R) return rows(v);
  for (int64_t s = 0; s < v.nkeys; s += 2)
    for (int64_t c = 0; c < C; ++c) {
      __m512bh lo, hi;
      v(s, c, lo, hi);
      _mm512_storeu_si512(vp + (s / 2 * C + c) * 64, reinterpret_cast<__m512i>(lo));
      _mm512_storeu_si512(vp + (s / 2 * C + c) * 64 + 32, reinterpret_cast<__m512i>(hi));
    }
  rows(ValuePairsMade<C>{vp});
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

}  // namespace
