// attention_tiles.h's bf16 products (vdpbf16ps) by float32 FMAs with the same bits, for
// paged_attention.h's items where the load's trial measured them faster; and the scores of a
// block by either route (block_scores_pairs).
#pragma once

#include <type_traits>

#include "attention_tiles.h"
#include "common.h"

namespace {

#if defined(__AVX512BF16__)
// The same products by float32 FMAs (a CPU whose FMA units issue twice as often as its
// vdpbf16ps: a Xeon with AVX512-BF16 but no AMX exposed), bit for bit: vdpbf16ps adds per lane
// the odd input's product, then the even one's, each exact in float32 and rounded once as it is
// added, with denormals read as zero and flushed (the caller sets MXCSR's DAZ and FTZ for both
// routes alike: common.h's DenormalsAsZero). Each pair's odd and even halves are widened (an AND, a
// shift) in registers or, for many rows, once into a scratch panel of floats; the accumulators
// keep vdpbf16ps's lanes, so unscramble_bf16 and saved states hold for both.
inline __m512 widen_odd(__m512i pairs) {  // the high bf16 of each 32-bit lane as float32
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(
      static_cast<int32_t>(0xFFFF0000u))));
}
inline __m512 widen_even(__m512i pairs) {  // the low one
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
inline __m512 widen16(const uint16_t* p) {  // 16 bf16 as float32
  return Vec::load(reinterpret_cast<const at::BFloat16*>(p)).v;
}

// Keys for the FMAs: keys(d, odd, even) gives dims d + 1 and d of the 16 keys at kc as float32
struct KeysWideInPlace {
  const uint16_t* kt;  // the block's transposed keys, from key kc on
  int64_t block_size;
  void operator()(int64_t d, __m512& odd, __m512& even) const {
    odd = widen16(kt + (d + 1) * block_size);
    even = widen16(kt + d * block_size);
  }
};

struct KeysWideMade {
  const float* kw;  // per pair d / 2: KeysWideInPlace's odd, then even (32 floats)
  void operator()(int64_t d, __m512& odd, __m512& even) const {
    odd = _mm512_loadu_ps(kw + d / 2 * 32);
    even = _mm512_loadu_ps(kw + d / 2 * 32 + 16);
  }
};

// rows_scores_bf16's sums by FMAs: q the rows widened to float32 (row stride N * 16)
template <int64_t N, int64_t R, typename Keys>
inline void rows_scores_wide(const float* q, const Keys& keys, float scale, float* sc,
                             int64_t sc_stride) {
  constexpr int64_t D = N * 16;
  __m512 a[R], b[R];
  for (int64_t r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 4) {
    __m512 o0, e0, o1, e1;
    keys(d, o0, e0);
    keys(d + 2, o1, e1);
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * D + d;
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[1]), o0, a[r]);
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[0]), e0, a[r]);
      b[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[3]), o1, b[r]);
      b[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[2]), e1, b[r]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < R; ++r)
    _mm512_storeu_ps(sc + r * sc_stride, _mm512_mul_ps(_mm512_add_ps(a[r], b[r]), s));
}

// The scores of nrows query rows for one block's keys, by vdpbf16ps (q in bf16; scratch of
// N * 16 * 16 bf16) or, kWide, by FMAs (q widened; scratch of N * 16 * 16 floats): 16 keys at a
// time, read in place for up to two row tiles, else made once into the scratch for all tiles
template <int64_t N, bool kWide>
void block_scores_pairs(const std::conditional_t<kWide, float, uint16_t>* q, const uint16_t* kt,
                        float scale, float* sc, int64_t sc_stride, int64_t nrows,
                        int64_t nvalid, int64_t block_size,
                        std::conditional_t<kWide, float, uint16_t>* scratch) {
  constexpr int64_t D = N * 16;
  using InPlace = std::conditional_t<kWide, KeysWideInPlace, KeyPairsInPlace>;
  for (int64_t kc = 0; kc < nvalid; kc += 16) {
    const InPlace in_place{kt + kc, block_size};
    auto rows = [&](const auto& keys) {
      row_tiles<kScoreRowsBf16>(nrows, [&](auto tile, int64_t row) {
        constexpr int64_t R = decltype(tile)::value;
        float* out = sc + row * sc_stride + kc;
        if constexpr (kWide)
          rows_scores_wide<N, R>(q + row * D, keys, scale, out, sc_stride);
        else
          rows_scores_bf16<N, R>(q + row * D, keys, scale, out, sc_stride);
      });
    };
    if (nrows <= 2 * kScoreRowsBf16) {
      rows(in_place);
      continue;
    }
    for (int64_t d = 0; d < D; d += 2) {
      if constexpr (kWide) {
        __m512 odd, even;
        in_place(d, odd, even);
        _mm512_storeu_ps(scratch + d / 2 * 32, odd);
        _mm512_storeu_ps(scratch + d / 2 * 32 + 16, even);
      } else {
        _mm512_storeu_si512(scratch + d / 2 * 32, reinterpret_cast<__m512i>(in_place(d)));
      }
    }
    if constexpr (kWide)
      rows(KeysWideMade{scratch});
    else
      rows(KeyPairsMade{scratch});
  }
}

// ValuePairsInPlace's pairs, widened: w[0..3] the odd and even halves of lo, then of hi
struct ValuesWideInPlace {
  ValuePairsInPlace v;
  void operator()(int64_t s, int64_t c, __m512* w) const {
    __m512bh lo, hi;
    v(s, c, lo, hi);
    w[0] = widen_odd(reinterpret_cast<__m512i>(lo));
    w[1] = widen_even(reinterpret_cast<__m512i>(lo));
    w[2] = widen_odd(reinterpret_cast<__m512i>(hi));
    w[3] = widen_even(reinterpret_cast<__m512i>(hi));
  }
};

template <int64_t C>
struct ValuesWideMade {
  const float* vw;  // ValuesWideInPlace's four registers for each (s / 2, c), 64 floats
  void operator()(int64_t s, int64_t c, __m512* w) const {
    const float* at = vw + (s / 2 * C + c) * 64;
    for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_ps(at + 16 * j);
  }
};

// rows_values_bf16's sums by FMAs for chunks c0 .. c0 + CS - 1 of 32 values: pf the
// probabilities rounded to bf16, as float32; per pair of keys the chunks' widened values (four
// registers each) loaded once for R rows
template <int64_t N, int64_t R, int64_t CS, typename Values>
inline void rows_values_wide(const float* pf, int64_t pf_stride, const Values& values,
                             float* acc, int64_t c0, int64_t nkeys) {
  constexpr int64_t D = N * 16;
  __m512 a[R][2 * CS];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * CS; ++j)
      a[r][j] = _mm512_loadu_ps(acc + r * D + 32 * c0 + 16 * j);
  for (int64_t s = 0; s < nkeys; s += 2) {
    __m512 w[CS][4];
    for (int64_t c = 0; c < CS; ++c) values(s, c0 + c, w[c]);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 po = _mm512_set1_ps(pf[r * pf_stride + s + 1]);
      const __m512 pe = _mm512_set1_ps(pf[r * pf_stride + s]);
      for (int64_t c = 0; c < CS; ++c) {
        a[r][2 * c] = _mm512_fmadd_ps(po, w[c][0], a[r][2 * c]);
        a[r][2 * c] = _mm512_fmadd_ps(pe, w[c][1], a[r][2 * c]);
        a[r][2 * c + 1] = _mm512_fmadd_ps(po, w[c][2], a[r][2 * c + 1]);
        a[r][2 * c + 1] = _mm512_fmadd_ps(pe, w[c][3], a[r][2 * c + 1]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * CS; ++j)
      _mm512_storeu_ps(acc + r * D + 32 * c0 + 16 * j, a[r][j]);
}

// block_values_bf16 by FMAs, two chunks of 32 values at a time; vw: scratch of N * 16 * nkeys
// (rounded up to even) floats
template <int64_t N>
void block_values_wide(const float* pf, int64_t pf_stride, const ValuePairsInPlace& v,
                       float* acc, int64_t nrows, float* vw) {
  constexpr int64_t C = N / 2, D = N * 16;
  // R 2 CS accumulators, 4 CS values and two broadcasts within the 32 registers
  constexpr int64_t CS = C == 1 ? 1 : 2, R = CS == 1 ? 8 : 5;
  auto rows = [&](const auto& values) {
    for (int64_t c0 = 0; c0 < C; c0 += CS) {
      auto run = [&](auto tile, int64_t row) {
        constexpr int64_t rr = decltype(tile)::value;
        if (c0 + CS <= C)
          rows_values_wide<N, rr, CS>(pf + row * pf_stride, pf_stride, values, acc + row * D,
                                      c0, v.nkeys);
        else  // an odd C's last chunk
          rows_values_wide<N, rr, 1>(pf + row * pf_stride, pf_stride, values, acc + row * D,
                                     c0, v.nkeys);
      };
      row_tiles<R>(nrows, run);
    }
  };
  const ValuesWideInPlace in_place{v};
  if (nrows <= 2 * R) return rows(in_place);
  for (int64_t s = 0; s < v.nkeys; s += 2)
    for (int64_t c = 0; c < C; ++c) {
      __m512 w[4];
      in_place(s, c, w);
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(vw + (s / 2 * C + c) * 64 + 16 * j, w[j]);
    }
  rows(ValuesWideMade<C>{vw});
}

// n float32 probabilities rounded to bf16 as probs_to_bf16 rounds them, kept as float32
inline void probs_to_wide(const float* p, float* pf, int64_t n) {
  for (int64_t s = 0; s < n; s += 16) {
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(p + s)));
    _mm512_storeu_ps(pf + s, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(h), 16)));
  }
}
#endif

}  // namespace
