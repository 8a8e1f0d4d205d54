// 8-bit weights in groups of 32 (a GGUF's Q8_0, --quantization int8) times bf16 rows of x as
// float32 FMAs, the weights read in their bits: per k, 16 features' int8 q sign-extended and
// converted (two operations), times the group's scale d (float32: d * q is exact for a float16
// d), then one FMA per row. Every output sums x[k] * d q along K in one order, whatever the
// number of rows (tiles of 1-12 rows x 2 column blocks: each row its own accumulators), so a
// row's sums do not depend on its batch; and they are x times the weights the blocks stand
// for, not those weights rounded to bf16. x is widened to float32 once per call (exact;
// bf16_gemm.h's WidenRows::prepare, as for bf16 rows on float32 FMAs).
// The layout is pack_f32_quant_weight's 8-bit one: per column block of 16 features and group,
// 16 float32 scales then 32 x 16 int8 (k-major), 1.125 bytes per weight.
// Replaces dequantizing each task's blocks to bf16 for vdpbf16ps, which was slower than the
// bf16 weights themselves at every row count.

#pragma once

#include <array>
#include <utility>

#include "common.h"
#include "f32_gemm.h"

#if defined(__AVX512BF16__)

namespace {

constexpr int64_t kQ8Cols = 16;      // features per column block (one zmm of float32)
constexpr int64_t kQ8TileRows = 12;  // rows per tile (both column blocks)
constexpr int64_t kQ8RegisterRows = 32;  // up to this many rows the tiles widen the weights
// the weights widen as the float32 GEMM's do (f32_gemm.h's f32q_scales / f32q_weights /
// f32q_block over the same records), one Vec per column block
static_assert(kQ8Cols == Vec::W);

// Where a tile's weights come from: the records (`groups` of them per block from rec[b]),
// widened as they are read; or a panel of them widened once per task by f32q_block (for many
// rows: the same float32 values, read instead of widened again by every tile)
struct Q8Blocks {
  const uint8_t* const* rec;
  const float* panel;  // [block][k][16] float32 scale * q (f32q_block's layout), or nullptr
  int64_t k_len;
};

// ROWS rows of float32 x (stride xs) times NB column blocks into out (row stride 32)
template <int ROWS, int NB, bool kPanel>
void q8_tile(const float* x, int64_t xs, int64_t groups, const Q8Blocks& w, float* out) {
  __m512 acc[ROWS][NB];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gr[NB];  // the group's records
    Vec d[NB], z[NB];       // their scales (no offsets: z unused)
    if constexpr (!kPanel)
      for (int b = 0; b < NB; ++b) {
        gr[b] = w.rec[b] + g * f32_quant_record(8);
        f32q_scales<8>(gr[b], d[b], z[b]);
      }
    const float* xg = x + g * kF32QGroup;
    for (int i = 0; i < kF32QGroup; ++i) {
      __m512 wv[NB];
      for (int b = 0; b < NB; ++b) {
        if constexpr (kPanel)
          wv[b] = _mm512_loadu_ps(w.panel + (b * w.k_len + g * kF32QGroup + i) * kQ8Cols);
        else
          wv[b] = f32q_weights<8>(gr[b], d[b], z[b], i).v;
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m512 xv = _mm512_set1_ps(xg[r * xs + i]);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(xv, wv[b], acc[r][b]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + r * 32 + b * 16, acc[r][b]);
}

using Q8Tile = void (*)(const float*, int64_t, int64_t, const Q8Blocks&, float*);

template <int NB, bool kPanel, int... R>
constexpr std::array<Q8Tile, sizeof...(R)> q8_tiles(std::integer_sequence<int, R...>) {
  return {q8_tile<R + 1, NB, kPanel>...};
}

// a task's rows (1 <= rows <= kQ8TileRows) over its nb column blocks in one tile: each
// broadcast of x feeds an FMA per block
inline void q8_task_rows(const float* x, int64_t xs, int64_t groups, int64_t rows,
                         const Q8Blocks& w, int nb, float* out) {
  using Rows = std::make_integer_sequence<int, kQ8TileRows>;
  static constexpr auto kTwo = q8_tiles<2, false>(Rows{});
  static constexpr auto kOne = q8_tiles<1, false>(Rows{});
  static constexpr auto kTwoPanel = q8_tiles<2, true>(Rows{});
  static constexpr auto kOnePanel = q8_tiles<1, true>(Rows{});
  if (nb == 2) return (w.panel ? kTwoPanel : kTwo)[rows - 1](x, xs, groups, w, out);
  (w.panel ? kOnePanel : kOne)[rows - 1](x, xs, groups, w, out);
}

// q8_gemm's thread_buffer for a worker's panel
struct Q8Panel;

// x W^T over an 8-bit weight packed by pack_f32_quant_weight, task by task (a pair of column
// blocks, a trailing odd block alone), every row in tiles of up to kQ8TileRows rows (shared
// out evenly among the fewest tiles: 16 rows as two of 8, each broadcast of x feeding an FMA
// per block where 9-16 rows of one block loaded one per FMA: 24 rows 34.5-36.2 -> 31.7 ms, 32
// rows 45.6-46.6 -> 42.4, every linear of the default model's step in 8 bits, 2-core Xeon).
// xf: x's `rows` rows widened to float32, k_len apart (bf16_gemm.h's WidenRows::prepare).
// epilogue(row, acc, b0, nb) and out_at(row, b0) as packed_gemm's (bf16_gemm.h).
template <typename Epilogue, typename OutAt>
void q8_gemm(const float* xf, int64_t rows, int64_t k_len, const at::Tensor& packed,
             const Epilogue& epilogue, const OutAt& out_at) {
  const int64_t blocks = packed.size(0), groups = packed.size(1);
  const int64_t block_bytes = groups * packed.size(2);
  const uint8_t* q = packed.data_ptr<uint8_t>();
  for_row_slices(rows, k_len, kQ8TileRows, [&](int64_t s0, int64_t s1) {
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      float scratch[kQ8TileRows * 32];
      // more rows than kQ8RegisterRows share a panel per task; fewer widen in registers
      float* const panel = rows > kQ8RegisterRows
                               ? thread_buffer<float, Q8Panel>(2 * k_len * kQ8Cols)
                               : nullptr;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = 2 * t;
        const int nb = b0 + 1 < blocks ? 2 : 1;
        const uint8_t* rec[2] = {q + b0 * block_bytes, q + (b0 + nb - 1) * block_bytes};
        if (panel)
          for (int b = 0; b < nb; ++b) f32q_block<8>(rec[b], groups, panel + b * k_len * kQ8Cols);
        const Q8Blocks w{rec, panel, k_len};
        for (int64_t r0 = s0, rr = 0; r0 < s1; r0 += rr) {
          rr = even_tile_rows(s1 - r0, kQ8TileRows);
          for (int64_t r = r0; r < r0 + rr; ++r) _mm_prefetch(out_at(r, b0), _MM_HINT_ET0);
          q8_task_rows(xf + r0 * k_len, k_len, groups, rr, w, nb, scratch);
          for (int64_t r = 0; r < rr; ++r) epilogue(r0 + r, scratch + r * 32, b0, nb);
        }
      }
    });
  });
}

}  // namespace

#endif
