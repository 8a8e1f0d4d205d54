// 4-bit weights in groups of 32 (a GGUF's Q4_0 / Q4_1, --quantization int4) multiplied by
// vdpbf16ps without dequantizing them: each nibble q becomes the bf16 number 16 + q by two
// bit operations (q in the top four bits of the mantissa of 16.0), so a pair step of 16
// features costs one shift and one vpternlogd where a dequantization to bf16 (scale * q +
// offset, rounded) costs about nine operations. Per group g of a row and feature,
//
//   S = sum over the group of x[k] * (16 + q[k])      (vdpbf16ps; every product exact)
//   y += d * S                                         (d: the group's scale)
//   y += (m - 16 d) * X                                (m: its offset; X: the row's sum of x
//                                                       over the group, float32)
//
// which is x times d * q + m, the weights the blocks stand for, summed in float32 without
// rounding the weights to bf16: not the sums of a bf16 model read from the blocks, but one
// order per row and feature whatever the batch (the same tile for every row count; from
// widen_from rows the pair steps run as float32 FMAs over 16 + q, widened in registers or, from
// 33 rows, in a panel per task: the products vdpbf16ps's, bit for bit). Packed layout, per
// column block of 16 features:
//
//   [N / 16 column blocks][K / 32 groups][record: 6 x 64 bytes]
//   record: 16 float32 scales d, 16 float32 (m - 16 d), then 4 vectors of 64 bytes; vector j
//           holds pair steps s = 4j .. 4j + 3 (k = 2s, 2s + 1 of the group): lane L's 32-bit
//           word has feature L's q[2s] in bits 4t .. 4t + 3 and q[2s + 1] in bits
//           16 + 4t .. 19 + 4t, t = s - 4j
//
// 0.75 bytes per weight, as pack_f32_quant_weight's 4 bits. The default model's 120 4-bit
// linears against the same shapes in bf16, each way at its best (2-core Xeon, AVX512-BF16, no
// AMX; vdpbf16ps at 1-2 rows, float32 FMAs from 4): 1 row 4.6 / 8.0 ms, 4 rows 7.2 / 9.1, 8 rows
// 9.7 / 9.6, 16 rows 16.4 / 20.5, 32 rows 30.3 / 35.7 (dequantized to bf16 as the 8-bit
// blocks are: 1 row 6.8, 8 rows 15.6).

#pragma once

#include <array>
#include <utility>

#include "common.h"
#include "f32_gemm.h"

#if defined(__AVX512BF16__)

namespace {

constexpr int64_t kNibbleCols = 16;  // features per column block (one zmm of float32)
constexpr int64_t kNibbleVectors = 6;  // 64-byte vectors per record: d, m - 16 d, 4 of q
constexpr int64_t kNibbleTileRows = 16;  // rows per tile (one column block from 9 rows)
constexpr int64_t kNibbleRegisterRows = 32;  // FMAs: up to this many rows without a panel

// Whether `packed` is pack_bf16_nibbles' layout
bool is_nibble_pack(const at::Tensor& packed) {
  return packed.scalar_type() == at::kByte && packed.dim() == 4 &&
         packed.size(2) == kNibbleVectors && packed.size(3) == 64;
}

at::Tensor pack_bf16_nibbles(const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& zeros, int64_t bits,
                             int64_t group_size) {
  TORCH_CHECK(bits == 4, "pack_bf16_nibbles: 4-bit weights");
  const QuantWeightArgs a = quant_weight_args("pack_bf16_nibbles", qweight, scales, zeros, bits,
                                              group_size, kNibbleCols);
  const int64_t groups = a.groups, row_bytes = qweight.size(1);
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  const at::Tensor zc = zeros->to(at::kFloat).contiguous();
  at::Tensor packed = at::zeros({a.n / kNibbleCols, groups, kNibbleVectors, 64},
                                qweight.options().dtype(at::kByte));
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* zp = zc.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, a.n / kNibbleCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* rec = dst + (b * groups + g) * kNibbleVectors * 64;
        float* rs = reinterpret_cast<float*>(rec);
        for (int64_t c = 0; c < kNibbleCols; ++c) {
          const int64_t row = b * kNibbleCols + c;
          const float d = sp[row * groups + g];
          rs[c] = d;
          rs[kNibbleCols + c] = zp[row * groups + g] - 16.0f * d;  // 16 d is exact
          for (int64_t i = 0; i < kF32QGroup; ++i) {
            // GGUF's order: byte j of a group holds weight j (low nibble) and j + 16 (high)
            const uint8_t byte = q[row * row_bytes + g * 16 + i % 16];
            const uint32_t v = i < 16 ? byte & 0x0F : byte >> 4;
            const int64_t s = i / 2, j = s / 4, t = s % 4;
            uint32_t word;
            uint8_t* at = rec + (2 + j) * 64 + 4 * c;
            std::memcpy(&word, at, 4);
            word |= v << (16 * (i % 2) + 4 * t);
            std::memcpy(at, &word, 4);
          }
        }
      }
  });
  return packed;
}

// Step T's pair of each lane as bf16 (16 + q[2s], 16 + q[2s + 1]): the nibbles moved to bits
// 3-6 of their words, the rest of each word 16.0's bits
template <int T>
inline __m512i nibble_pair(__m512i z) {
  const __m512i v = T == 0 ? _mm512_slli_epi32(z, 3) : _mm512_srli_epi32(z, 4 * T - 3);
  return _mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0x00780078),
                                   _mm512_set1_epi32(0x41804180), 0xEA);  // (v & m) | c
}

// Step T's even and odd weights of each lane as float32 16 + q (q in the top four bits of
// 16.0f's mantissa)
template <int T>
inline void nibble_floats(__m512i z, __m512& even, __m512& odd) {
  const __m512i mask = _mm512_set1_epi32(0x00780000), sixteen = _mm512_set1_epi32(0x41800000);
  const __m512i e = _mm512_slli_epi32(z, 19 - 4 * T);
  const __m512i o = T == 0 ? _mm512_slli_epi32(z, 3) : _mm512_srli_epi32(z, 4 * T - 3);
  even = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(e, mask, sixteen, 0xEA));
  odd = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(o, mask, sixteen, 0xEA));
}

// Where a tile's rows come from: bf16 x for vdpbf16ps, or x widened to float32 for the FMAs
struct NibbleRows {
  const uint16_t* x;  // bf16 rows (stride xs)
  const float* xf;  // or float32 rows (stride xs)
  int64_t xs;
  const float* sums;  // each row's sum of x per group (stride `groups`)
  int64_t groups;
};

// How a tile's pair steps run: vdpbf16ps over bf16 16 + q; float32 FMAs over a panel of
// 16 + q widened once per task (for many rows); or FMAs with 16 + q widened in registers as
// the nibbles are loaded (fewer rows: no panel to store and read back)
enum class NibbleWay { kDot, kPanel, kRegisters };

// ROWS rows times NB column blocks (records at rec[b], or their panel: 512 floats per group,
// per pair step the odd inputs' 16 weights then the even ones') into out (stride 32): per
// group the pair steps' sums S, then out = fma(S, d, out) and fma(m - 16 d, X, out), with
// MXCSR's DAZ and FTZ set by the caller (nibble_rows): vdpbf16ps's own rules, so the FMAs
// give its bits.
template <NibbleWay kWay, int ROWS, int NB>
void nibble_tile(const NibbleRows& in, const uint8_t* const* rec, const float* panel,
                 float* out) {
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + r * 32 + b * 16, _mm512_setzero_ps());
  const int64_t panel_stride = in.groups * 512;
  for (int64_t g = 0; g < in.groups; ++g) {
    __m512 s[ROWS][NB];
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < NB; ++b) s[r][b] = _mm512_setzero_ps();
    const uint8_t* gr[NB];
    for (int b = 0; b < NB; ++b) gr[b] = rec[b] + g * kNibbleVectors * 64;
    for (int j = 0; j < 4; ++j) {
      __m512i z[NB];
      if constexpr (kWay != NibbleWay::kPanel)
        for (int b = 0; b < NB; ++b) z[b] = _mm512_loadu_si512(gr[b] + (2 + j) * 64);
      auto step = [&](auto t) {
        constexpr int T = decltype(t)::value;
        const int64_t k = g * kF32QGroup + 2 * (4 * j + T);
        if constexpr (kWay != NibbleWay::kDot) {
          __m512 wo[NB], we[NB];
          for (int b = 0; b < NB; ++b) {
            if constexpr (kWay == NibbleWay::kRegisters) {
              nibble_floats<T>(z[b], we[b], wo[b]);
            } else {
              const float* p = panel + b * panel_stride + (g * 16 + 4 * j + T) * 32;
              wo[b] = _mm512_loadu_ps(p);
              we[b] = _mm512_loadu_ps(p + 16);
            }
          }
          for (int r = 0; r < ROWS; ++r) {
            const __m512 xo = _mm512_set1_ps(in.xf[r * in.xs + k + 1]);
            for (int b = 0; b < NB; ++b) s[r][b] = _mm512_fmadd_ps(xo, wo[b], s[r][b]);
            const __m512 xe = _mm512_set1_ps(in.xf[r * in.xs + k]);
            for (int b = 0; b < NB; ++b) s[r][b] = _mm512_fmadd_ps(xe, we[b], s[r][b]);
          }
        } else {
          __m512bh w[NB];
          for (int b = 0; b < NB; ++b) w[b] = (__m512bh)nibble_pair<T>(z[b]);
          for (int r = 0; r < ROWS; ++r) {
            int32_t pair;
            std::memcpy(&pair, in.x + r * in.xs + k, sizeof(pair));
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < NB; ++b) s[r][b] = _mm512_dpbf16_ps(s[r][b], xv, w[b]);
          }
        }
      };
      step(std::integral_constant<int, 0>{});
      step(std::integral_constant<int, 1>{});
      step(std::integral_constant<int, 2>{});
      step(std::integral_constant<int, 3>{});
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(gr[b]));
      const __m512 c = _mm512_loadu_ps(reinterpret_cast<const float*>(gr[b] + 64));
      for (int r = 0; r < ROWS; ++r) {
        float* o = out + r * 32 + b * 16;
        const __m512 y = _mm512_fmadd_ps(s[r][b], d, _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(c, _mm512_set1_ps(in.sums[r * in.groups + g]), y));
      }
    }
  }
}

// the records at rec[0 .. nb - 1] widened to float32 (16 + q) into `panel` (see nibble_tile)
inline void widen_nibbles(const uint8_t* const* rec, int nb, int64_t groups, float* panel) {
  for (int b = 0; b < nb; ++b)
    for (int64_t g = 0; g < groups; ++g)
      for (int j = 0; j < 4; ++j) {
        const __m512i z = _mm512_loadu_si512(rec[b] + g * kNibbleVectors * 64 + (2 + j) * 64);
        float* p = panel + b * groups * 512 + (g * 16 + 4 * j) * 32;
        __m512 e, o;
        nibble_floats<0>(z, e, o), _mm512_storeu_ps(p, o), _mm512_storeu_ps(p + 16, e);
        nibble_floats<1>(z, e, o), _mm512_storeu_ps(p + 32, o), _mm512_storeu_ps(p + 48, e);
        nibble_floats<2>(z, e, o), _mm512_storeu_ps(p + 64, o), _mm512_storeu_ps(p + 80, e);
        nibble_floats<3>(z, e, o), _mm512_storeu_ps(p + 96, o), _mm512_storeu_ps(p + 112, e);
      }
}

using NibbleTile = void (*)(const NibbleRows&, const uint8_t* const*, const float*, float*);

template <NibbleWay kWay, int NB, int... R>
constexpr std::array<NibbleTile, sizeof...(R)> nibble_tiles(std::integer_sequence<int, R...>) {
  return {nibble_tile<kWay, R + 1, NB>...};
}

// nibble_tile<kWay, ROWS, NB> for 1 <= rows <= kNibbleTileRows / NB at run time
template <NibbleWay kWay, int NB>
void nibble_rows(const NibbleRows& in, int64_t rows, const uint8_t* const* rec,
                 const float* panel, float* out) {
  static constexpr auto kTiles =
      nibble_tiles<kWay, NB>(std::make_integer_sequence<int, kNibbleTileRows / NB>{});
  const DenormalsAsZero daz_ftz;  // vdpbf16ps's rules for every FMA of the tile
  kTiles[rows - 1](in, rec, panel, out);
}

// a task's rows in tiles the way `way` runs them
template <NibbleWay kWay>
void nibble_task_rows(const NibbleRows& in, int64_t rows, const uint8_t* const* rec, int nb,
                      const float* panel, int64_t groups, float* out) {
  if (nb == 2 && rows <= kNibbleTileRows / 2) {  // both blocks: each row read once
    nibble_rows<kWay, 2>(in, rows, rec, panel, out);
    return;
  }
  if (nb == 2 && kWay == NibbleWay::kPanel) {
    // FMAs over the panel: 9-16 rows as two tiles of both blocks, each broadcast of x feeding
    // two FMAs (one block of 9-16 rows loads one per FMA, and the load ports bound it); in
    // registers the nibbles would be widened twice, which costs more (16-32 rows). Tiles of
    // up to 12 rows of both blocks (as bf16_gemm.h's and bf16_q8.h's) measured no faster in
    // registers (24 / 32 rows 31.0-33.5 / 40-42 ms against 31.0 / 39-40) nor over a panel from
    // 17 rows (37-38.5 / 46): the widening's shifts and vpternlogd share the FMAs' ports
    const int64_t first = (rows + 1) / 2;
    nibble_rows<kWay, 2>(in, first, rec, panel, out);
    NibbleRows rest = in;
    rest.xf += first * in.xs;
    rest.sums += first * in.groups;
    nibble_rows<kWay, 2>(rest, rows - first, rec, panel, out + first * 32);
    return;
  }
  for (int b = 0; b < nb; ++b)  // a block at a time: 9-16 rows of sums per weight dequantized
    nibble_rows<kWay, 1>(in, rows, rec + b, panel ? panel + b * groups * 512 : nullptr,
                         out + b * 16);
}

// nibble_gemm's thread_buffer slots: the calling thread's widened rows of x and their group
// sums, a worker's panel
enum NibbleBuffer { kNibbleRowsF32, kNibbleSums, kNibblePanel };

// x W^T over a weight packed by pack_bf16_nibbles, task by task (a pair of column blocks, a
// trailing odd block alone), every row in tiles of up to kNibbleTileRows rows; from
// widen_from rows (> 0) as float32 FMAs over a panel. epilogue(row, acc, b0, nb) and
// out_at(row, b0) as packed_gemm's (bf16_gemm.h).
template <typename Epilogue, typename OutAt>
void nibble_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t widen_from,
                 const Epilogue& epilogue, const OutAt& out_at) {
  const int64_t rows = x.size(0), k_len = x.size(1), xs = x.stride(0);
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  const int64_t block_bytes = groups * kNibbleVectors * 64;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const bool wide = widen_from > 0 && rows >= widen_from;
  // each row's x as float32 (for the FMAs) and its sum per group, once per call
  float* const xf = wide ? thread_buffer<float, NibbleRows, kNibbleRowsF32>(rows * k_len)
                         : nullptr;
  float* const sums = thread_buffer<float, NibbleRows, kNibbleSums>(rows * groups);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const auto* src = reinterpret_cast<const at::BFloat16*>(xp + r * xs + g * kF32QGroup);
        const Vec lo = Vec::load(src), hi = Vec::load(src + 16);
        sums[r * groups + g] = _mm512_reduce_add_ps(Vec::add(lo, hi).v);
        if (wide) {
          lo.store(xf + r * k_len + g * kF32QGroup);
          hi.store(xf + r * k_len + g * kF32QGroup + 16);
        }
      }
  });
  const NibbleRows in_all{xp, xf, wide ? k_len : xs, sums, groups};
  const uint8_t* q = packed.data_ptr<uint8_t>();
  for_row_slices(rows, k_len, kNibbleTileRows, [&](int64_t s0, int64_t s1) {
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      float scratch[kNibbleTileRows * 32];
      // more rows than kNibbleRegisterRows share a panel; fewer widen in registers
      float* const panel = wide && rows > kNibbleRegisterRows
                               ? thread_buffer<float, NibbleRows, kNibblePanel>(2 * groups * 512)
                               : nullptr;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = 2 * t;
        const int nb = b0 + 1 < blocks ? 2 : 1;
        const uint8_t* rec[2] = {q + b0 * block_bytes, q + (b0 + nb - 1) * block_bytes};
        if (panel) widen_nibbles(rec, nb, groups, panel);
        for (int64_t r0 = s0; r0 < s1; r0 += kNibbleTileRows) {
          const int64_t rr = std::min(kNibbleTileRows, s1 - r0);
          for (int64_t r = r0; r < r0 + rr; ++r) _mm_prefetch(out_at(r, b0), _MM_HINT_ET0);
          NibbleRows in = in_all;
          in.x += r0 * xs;
          in.xf += wide ? r0 * k_len : 0;
          in.sums += r0 * groups;
          if (!wide)
            nibble_task_rows<NibbleWay::kDot>(in, rr, rec, nb, nullptr, groups, scratch);
          else if (panel)
            nibble_task_rows<NibbleWay::kPanel>(in, rr, rec, nb, panel, groups, scratch);
          else
            nibble_task_rows<NibbleWay::kRegisters>(in, rr, rec, nb, nullptr, groups, scratch);
          for (int64_t r = 0; r < rr; ++r) epilogue(r0 + r, scratch + r * 32, b0, nb);
        }
      }
    });
  });
}

}  // namespace

#endif
