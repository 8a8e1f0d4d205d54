// bf16 linear layers over a weight packed for vdpbf16ps (AVX512-BF16), for batches of rows.
//
// vdpbf16ps multiplies 16 pairs of bf16 and adds each pair's sum into a float32 lane. With the
// weight packed so that one 64-byte load holds, for 16 output features, the pair of weights at
// inputs 2k and 2k+1, each lane is one output feature: the input pair (x[2k], x[2k+1]) of a row
// is broadcast to all lanes and no horizontal sums are needed. Packed layout of W (N, K):
//
//   [N / 16 column blocks][K / 2 pairs][16 features][2]   (K padded to even with zeros)
//
// A tile is ROWS input rows x 32 output features (two column blocks): 2 * ROWS accumulators,
// per input pair two weight loads and ROWS broadcasts; the weights of a column block (K * 64
// bytes) stay in L2 while every row tile of the batch passes over them. Work is split over
// pairs of column blocks.
//
// A step's weights do not fit in any cache, so every column block comes from memory once.
// The first row tile of a task prefetches the next task's blocks into L2 line by line as it
// reads its own: the next task then starts on cached weights while this one computes, and
// memory reads overlap the products instead of following them. Every linear of one decode
// step of the default model (benchmarks/linear_kernels.py, 2-core Zen 4): 1 row 10.0 -> 8.4 ms,
// 4 rows 21.8 -> 8.9, 8 rows 16.3 -> 9.1, 16 rows 20.8 -> 17.6; from 32 rows on the products
// dominate and it changes little.
//
// The same packing is what AMX's TDPBF16PS takes as its B tile: 16 consecutive pairs of a
// column block are 16 rows of 64 bytes. With `amx` (a CPU with AMX-BF16, K a multiple of 32)
// the row tiles are AMX tiles of up to 16 rows instead (AmxRows, bf16_amx.h): 4-5x the packed
// kernel's pace from 256 rows (the default model's linears, 2-core Xeon), near oneDNN's. A
// tile's sums for a row depend on that row alone, in one order along K whatever the tile's
// other rows, so at every row count it is a batch-invariant GEMM (their sums are not
// vdpbf16ps's: AMX adds a tile's products in an order of its own).
//
// An 8-bit weight in groups of 32 (a GGUF's Q8_0, --quantization int8), packed by
// pack_f32_quant_weight (f32_gemm.h), goes to bf16_q8.h's float32 FMAs over its bits; a 4-bit
// one (Q4_0 / Q4_1, int4) to bf16_nibbles.h, whose nibbles vdpbf16ps reads as they are.

#pragma once

#include "bf16_amx.h"
#include "bf16_nibbles.h"
#include "bf16_q8.h"
#include "common.h"
#include "f32_gemm.h"

#if defined(__AVX512BF16__)

namespace {

constexpr int64_t kPackCols = 16;  // output features per column block (one zmm of float32)
static_assert(Vec::W == kPackCols, "a column block is one register of float32 lanes");

at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_bf16_weight: bf16 weight (N, K)");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPackCols == 0, "pack_bf16_weight: N must be a multiple of 16");
  const int64_t pairs = (k + 1) / 2;
  at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({n / kPackCols, pairs, kPackCols, 2}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, n / kPackCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kPackCols; ++c) {
        const uint16_t* row = src + (b * kPackCols + c) * k;
        uint16_t* out = dst + b * pairs * kPackCols * 2 + c * 2;
        for (int64_t i = 0; i < k; ++i) out[(i / 2) * kPackCols * 2 + (i % 2)] = row[i];
      }
  });
  return packed;
}

// One input pair p of ROWS rows times NB column blocks, into the accumulators. `last_odd`: the
// pair is the odd K's last input alone (its packed partner is zero; x has no element after it).
template <int ROWS, int NB>
inline void gemm_pair(const uint16_t* x, int64_t x_stride, int64_t p, bool last_odd,
                      const uint16_t* w, int64_t block_stride, __m512 (&acc)[ROWS][NB]) {
  __m512bh wv[NB];
  for (int b = 0; b < NB; ++b)
    wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block_stride + p * kPackCols * 2);
  for (int r = 0; r < ROWS; ++r) {
    uint32_t pair = x[r * x_stride + 2 * p];
    if (!last_odd) std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
  }
}

// ROWS rows of x times NB column blocks (NB * 16 features) starting at `w`, into float32 `out`;
// with `prefetch`, the NB blocks after them are brought into L2 meanwhile (see the top).
template <int ROWS, int NB>
void gemm_tile(const uint16_t* x, int64_t x_stride, int64_t k_len, const uint16_t* w,
               int64_t block_stride, float* out, int64_t out_stride, bool prefetch) {
  __m512 acc[ROWS][NB];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t full_pairs = k_len / 2;
  const uint16_t* next = w + NB * block_stride;  // past the weight's end: prefetches never fault
  for (int64_t p = 0; p < full_pairs; ++p) {
    if (prefetch)
      for (int b = 0; b < NB; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(next + b * block_stride + p * kPackCols * 2),
                     _MM_HINT_T1);
    gemm_pair<ROWS, NB>(x, x_stride, p, false, w, block_stride, acc);
  }
  if (k_len % 2) gemm_pair<ROWS, NB>(x, x_stride, full_pairs, true, w, block_stride, acc);
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + r * out_stride + b * 16, acc[r][b]);
}

// Every row of x in tiles of 8 rows, then one tile of the 1-7 rows left; the first tile
// prefetches the next blocks when `prefetch`.
template <int NB>
inline void gemm_rows(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k_len,
                      const uint16_t* w, int64_t block_stride, float* out, int64_t out_stride,
                      bool prefetch) {
  using Tile = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*,
                        int64_t, bool);
  static constexpr Tile kTiles[9] = {nullptr, gemm_tile<1, NB>, gemm_tile<2, NB>,
                                     gemm_tile<3, NB>, gemm_tile<4, NB>, gemm_tile<5, NB>,
                                     gemm_tile<6, NB>, gemm_tile<7, NB>, gemm_tile<8, NB>};
  for (int64_t r = 0; r < rows; r += 8) {
    const int64_t n = std::min<int64_t>(8, rows - r);
    kTiles[n](x + r * x_stride, x_stride, k_len, w, block_stride, out + r * out_stride,
              out_stride, prefetch && r == 0);
  }
}

// The row kernels of packed_gemm: `rows` rows of x (stride xs) times NB column blocks at w
// into a float32 scratch of row stride 32; with `prefetch`, the NB blocks after them are
// brought into L2 meanwhile. One object per thread and call; prepare(x, xs, rows, k_len) runs
// once per call on the calling thread before them, and each object's begin(prepared, x, xs,
// rows) before its first run.
struct DotRows {  // vdpbf16ps, above
  static const float* prepare(const uint16_t*, int64_t, int64_t, int64_t) { return nullptr; }
  void begin(const float*, const uint16_t*, int64_t, int64_t) {}
  template <int NB>
  void run(const uint16_t* x, int64_t xs, int64_t rows, int64_t k_len, const uint16_t* w,
           int64_t block_stride, float* out, bool prefetch) {
    gemm_rows<NB>(x, xs, rows, k_len, w, block_stride, out, 32, prefetch);
  }
  static constexpr bool kAmxOrder = false;  // sums in vdpbf16ps's order
};

// The same sums as DotRows, bit for bit, by float32 FMAs: vdpbf16ps adds, per lane, the odd
// input's product and then the even one's, each as one FMA rounded to nearest, denormal inputs
// read as zero and denormal results flushed (the instruction's definition). WidenRows widens
// every row of x into float32 once per call (prepare) and each pair of weights in registers
// (the odd inputs' 16 weights, then the even ones': an AND and a shift per 32 weights) or, for
// many rows, once per task into a panel (kRegisterRows), then runs the two FMAs per pair in
// that order with MXCSR's DAZ and FTZ set. Where vdpbf16ps issues at half the rate of the FMA
// units (a Xeon with AVX512-BF16 but no AMX exposed: float32's packed GEMM took 143 ms for
// every linear at 128 rows against bf16's 213), rows go through it from the rows the load's
// trial picks (model/linear/routed.py) without changing a bit.
class WidenRows {
 public:
  // every row of x as float32, each 2 * pairs long (an odd K's last pair ends in zero), in the
  // calling thread's buffer, which every thread of the call then reads
  static const float* prepare(const uint16_t* x, int64_t xs, int64_t rows, int64_t k_len) {
    const int64_t pairs = (k_len + 1) / 2;
    float* const xf = thread_buffer<float, WidenRows, kRows>(rows * 2 * pairs);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const uint16_t* src = x + r * xs;
        float* dst = xf + r * 2 * pairs;
        int64_t i = 0;
        for (; i + 16 <= k_len; i += 16)
          Vec::load(reinterpret_cast<const at::BFloat16*>(src + i)).store(dst + i);
        for (; i < k_len; ++i) dst[i] = bits_to_float(static_cast<uint32_t>(src[i]) << 16);
        if (k_len % 2) dst[k_len] = 0.0f;
      }
    });
    return xf;
  }
  void begin(const float* prepared, const uint16_t* x, int64_t xs, int64_t rows) {
    xf_ = prepared, x_of_ = x, xs_ = xs, use_panel_ = rows > kRegisterRows;
  }

  template <int NB>
  void run(const uint16_t* x, int64_t xs, int64_t rows, int64_t k_len, const uint16_t* w,
           int64_t block_stride, float* out, bool prefetch) {
    const int64_t pairs = (k_len + 1) / 2;
    const float* xf = xf_ + (x - x_of_) / xs_ * 2 * pairs;  // x's rows among the call's
    const DenormalsAsZero daz_ftz;
    if (use_panel_) {
      float* const panel = thread_buffer<float, WidenRows, kPanel>(NB * pairs * 32);
      if (w != panel_of_ || NB != panel_nb_) widen_panel<NB>(w, block_stride, pairs, panel);
      rows_of<true, NB>(xf, rows, pairs, panel, pairs * 32, out, static_cast<float*>(nullptr));
    } else {  // the first row tile brings the task's next blocks into L2 (see the top)
      rows_of<false, NB>(xf, rows, pairs, w, block_stride, out,
                         prefetch ? w + NB * block_stride : nullptr);
    }
  }
  static constexpr bool kAmxOrder = false;  // vdpbf16ps's sums

 private:
  // Calls of more rows widen each task's weights once into a panel that their row tiles share;
  // fewer rows widen them in registers, as they are loaded (an AND and a shift per 32 weights),
  // which saves the panel's stores and loads: every linear of a decode step of the default
  // model (2-core Xeon) 16 rows 25.6 -> 20.9 ms, 32 rows 39.0 -> 35.8; from 128 rows the panel
  // is 4-7% ahead.
  static constexpr int64_t kRegisterRows = 32;

  // every row of widened x in tiles of up to kTileRows rows of the NB blocks, the rows shared
  // out evenly among the fewest tiles (16 rows: two of 8); the first tile prefetches the blocks
  // at `next` (none: nullptr). 12 rows of 2 blocks (24 accumulators, 4 weight registers) load
  // 0.6 floats per FMA where 16 rows of one block loaded 1.06: one core's float32 peak
  // 94% against 76% (a 2-core Xeon, K 576 and 1,536, the panel in L2)
  static constexpr int64_t kTileRows = 12;

  template <bool kPanel, int NB, typename W>
  void rows_of(const float* xf, int64_t rows, int64_t pairs, const W* w, int64_t block_stride,
               float* out, const W* next) {
    for (int64_t r = 0; r < rows;) {
      const int64_t n = even_tile_rows(rows - r, kTileRows);
      kTiles<kPanel, NB>[n](xf + r * 2 * pairs, 2 * pairs, pairs, w, block_stride, out + r * 32,
                            r == 0 ? next : nullptr);
      r += n;
    }
  }

  template <int NB>
  void widen_panel(const uint16_t* w, int64_t block_stride, int64_t pairs, float* panel) {
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int b = 0; b < NB; ++b)
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512i v = _mm512_loadu_si512(w + b * block_stride + p * kPackCols * 2);
        float* dst = panel + (b * pairs + p) * 32;
        _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_and_si512(v, high)));  // odd
        _mm512_storeu_ps(dst + 16, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));  // even
      }
    panel_of_ = w;
    panel_nb_ = NB;
  }

  // ROWS rows of widened x (stride xs floats) times NB column blocks into out (stride 32): the
  // panel's (kPanel; per pair the odd inputs' 16 weights, then the even ones', blocks
  // block_stride floats apart) or the packed bf16 blocks at w, each pair widened in registers
  // (the NB blocks at `next`, unless nullptr, brought into L2 meanwhile)
  template <bool kPanel, int ROWS, int NB>
  static void tile(const float* x, int64_t xs, int64_t pairs,
                   const std::conditional_t<kPanel, float, uint16_t>* w, int64_t block_stride,
                   float* out, const std::conditional_t<kPanel, float, uint16_t>* next) {
    __m512 acc[ROWS][NB];
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t p = 0; p < pairs; ++p) {
      __m512 wo[NB], we[NB];
      for (int b = 0; b < NB; ++b) {
        if constexpr (kPanel) {
          wo[b] = _mm512_loadu_ps(w + b * block_stride + p * 32);
          we[b] = _mm512_loadu_ps(w + b * block_stride + p * 32 + 16);
        } else {
          if (next)  // past the weight's end at its last blocks: prefetches never fault
            _mm_prefetch(reinterpret_cast<const char*>(next + b * block_stride + p * 32),
                         _MM_HINT_T1);
          const __m512i v = _mm512_loadu_si512(w + b * block_stride + p * kPackCols * 2);
          wo[b] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
          we[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m512 xo = _mm512_set1_ps(x[r * xs + 2 * p + 1]);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(xo, wo[b], acc[r][b]);
        const __m512 xe = _mm512_set1_ps(x[r * xs + 2 * p]);
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(xe, we[b], acc[r][b]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + r * 32 + b * 16, acc[r][b]);
  }

  template <bool kPanel>
  using Tile = void (*)(const float*, int64_t, int64_t,
                        const std::conditional_t<kPanel, float, uint16_t>*, int64_t, float*,
                        const std::conditional_t<kPanel, float, uint16_t>*);
  template <bool kPanel, int NB>  // 1 .. kTileRows rows of NB blocks
  static constexpr Tile<kPanel> kTiles[kTileRows + 1] = {
      nullptr,
      tile<kPanel, 1, NB>,  tile<kPanel, 2, NB>,  tile<kPanel, 3, NB>,  tile<kPanel, 4, NB>,
      tile<kPanel, 5, NB>,  tile<kPanel, 6, NB>,  tile<kPanel, 7, NB>,  tile<kPanel, 8, NB>,
      tile<kPanel, 9, NB>,  tile<kPanel, 10, NB>, tile<kPanel, 11, NB>, tile<kPanel, 12, NB>};

  // thread_buffer slots: the calling thread's widened rows, a worker's panel
  enum Buffer { kRows, kPanel };
  const float* xf_ = nullptr;  // the call's rows widened (prepare), of x_of_'s (stride xs_)
  const uint16_t* x_of_ = nullptr;
  int64_t xs_ = 0;
  bool use_panel_ = false;  // the call's rows > kRegisterRows
  const uint16_t* panel_of_ = nullptr;  // the blocks the panel holds (and how many)
  int panel_nb_ = 0;
};

// Where a task's column blocks come from (packed_gemm's Source): blocks(b0, nb) is the address
// of blocks b0 .. b0 + nb - 1 of the packed bf16 weight, `stride` bf16 elements apart
struct PackedPanel {
  const uint16_t* w;
  int64_t stride;
  const uint16_t* blocks(int64_t b0, int /*nb*/) const { return w + b0 * stride; }
};

// x W^T over a packed W, task by task: a pair of column blocks (a trailing odd block alone)
// from `src`, every row of x through a float32 scratch in chunks of kRowChunk, by the row
// kernel Rows; epilogue(row, acc, b0, nb) then writes that row's outputs from acc, the float32
// sums of blocks b0 .. b0 + nb - 1. out_at(row, b0) is where they go: a chunk's lines are
// fetched for writing before its products (1-3% at 64-1024 rows: each row's outputs of a task
// are one line of their own). Many rows go in slices (common.h's for_row_slices), every task
// over one before the next (a task's weights widened again per slice: a 1/128th or less of
// its FMAs): every linear of the default model at 1,024 / 2,048 rows, float32 FMAs, medians of
// 4 runs alternated 1,156 / 2,408 -> 1,087 / 2,244 ms (4-bit blocks 1,231 / 2,545 -> 1,203 /
// 2,446; 2-core Xeon, 2 MiB L2 a core; 512 rows alike either way).
template <typename Rows, typename Source, typename Epilogue, typename OutAt>
void packed_gemm(const at::Tensor& x, const Source& src, int64_t blocks,
                 const Epilogue& epilogue, const OutAt& out_at) {
  const int64_t rows = x.size(0), k_len = x.size(1);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0);
  const float* prepared = Rows::prepare(xp, xs, rows, k_len);
  constexpr int64_t kRowChunk = 64;  // rows per float32 scratch pass
  for_row_slices(rows, k_len, kRowChunk, [&](int64_t s0, int64_t s1) {
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(kRowChunk * 32);
      Rows kernel;
      kernel.begin(prepared, xp, xs, rows);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = 2 * t;
        const int nb = b0 + 1 < blocks ? 2 : 1;
        const uint16_t* w = src.blocks(b0, nb);
        for (int64_t r0 = s0; r0 < s1; r0 += kRowChunk) {
          const int64_t rr = std::min(kRowChunk, s1 - r0);
          // the chunk's output lines, fetched for writing while the products are computed
          for (int64_t r = r0; r < r0 + rr; ++r) _mm_prefetch(out_at(r, b0), _MM_HINT_ET0);
          // the next blocks come from memory: prefetched by the chunk's first tile
          const bool prefetch = r0 == s0;
          if (nb == 2)
            kernel.template run<2>(xp + r0 * xs, xs, rr, k_len, w, src.stride, scratch.data(),
                                   prefetch);
          else
            kernel.template run<1>(xp + r0 * xs, xs, rr, k_len, w, src.stride, scratch.data(),
                                   prefetch);
          for (int64_t r = 0; r < rr; ++r) epilogue(r0 + r, scratch.data() + r * 32, b0, nb);
        }
      }
    });
  });
}

// 0: a bf16 weight packed by pack_bf16_weight; 4: a 4-bit one packed by pack_bf16_nibbles;
// 8: an 8-bit one packed by pack_f32_quant_weight; -1: none of them
int64_t packed_bits(const at::Tensor& packed) {
  if (packed.scalar_type() == at::kBFloat16) return 0;
  if (is_nibble_pack(packed)) return 4;
  return packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                 packed.size(2) == f32_quant_record(8)
             ? 8
             : -1;
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, bool amx, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, what,
              ": bf16 x (M, K) with unit inner stride");
  const int64_t bits = packed_bits(packed);
  TORCH_CHECK(packed.is_contiguous() &&
                  (bits == 0 ? packed.dim() == 4 && packed.size(2) == kPackCols &&
                                   packed.size(1) == (x.size(1) + 1) / 2
                             : bits > 0 && packed.size(1) * kF32QGroup == x.size(1)),
              what, ": a weight packed by pack_bf16_weight, pack_bf16_nibbles (4 bits) or "
              "pack_f32_quant_weight (8 bits) for x's K");
  TORCH_CHECK(!amx || (amx_usable() && x.size(1) % 32 == 0 && bits == 0), what,
              ": amx needs AMX tiles this process may use, K a multiple of 32 and a bf16 weight");
}

// packed_gemm over `src` on AMX tiles, or by vdpbf16ps, or from widen_from rows (> 0) by
// WidenRows' float32 FMAs (the same bits as vdpbf16ps)
template <typename Source, typename Epilogue, typename OutAt>
void gemm_rows_on(bool amx, int64_t widen_from, const at::Tensor& x, const Source& src,
                  int64_t blocks, const Epilogue& epilogue, const OutAt& out_at) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx) return packed_gemm<AmxRows>(x, src, blocks, epilogue, out_at);
#endif
  if (widen_from > 0 && x.size(0) >= widen_from)
    return packed_gemm<WidenRows>(x, src, blocks, epilogue, out_at);
  packed_gemm<DotRows>(x, src, blocks, epilogue, out_at);
}

// gemm_rows_on over a packed bf16 weight; a 4-bit one by nibble_gemm; an 8-bit one by q8_gemm
template <typename Epilogue, typename OutAt>
void packed_gemm_on(bool amx, int64_t widen_from, const at::Tensor& x, const at::Tensor& packed,
                    const Epilogue& epilogue, const OutAt& out_at) {
  const int64_t bits = packed_bits(packed), blocks = packed.size(0);
  if (bits == 4) return nibble_gemm(x, packed, widen_from, epilogue, out_at);
  if (bits == 0) {
    const PackedPanel src{reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                          packed.size(1) * kPackCols * 2};
    return gemm_rows_on(amx, widen_from, x, src, blocks, epilogue, out_at);
  }
  const int64_t rows = x.size(0), k_len = x.size(1);
  const float* xf = WidenRows::prepare(
      reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), rows, k_len);
  q8_gemm(xf, rows, k_len, packed, epilogue, out_at);
}

at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, bool amx,
                              int64_t widen_from) {
  check_packed(x, packed, amx, "linear_bf16_packed");
  const int64_t n_out = packed.size(0) * kPackCols;
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  if (x.size(0) == 0) return out;
  const at::BFloat16* bp = bias && bias->defined() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  packed_gemm_on(amx, widen_from, x, packed, [&](int64_t r, const float* acc, int64_t b0, int nb) {
    for (int b = 0; b < nb; ++b) {
      const int64_t n = (b0 + b) * kPackCols;
      Vec y = Vec::load(acc + b * kPackCols);
      if (bp) y = Vec::add(y, Vec::load(bp + n));
      store_as(y, op + r * n_out + n);
    }
  }, [&](int64_t r, int64_t b0) {
    return reinterpret_cast<const char*>(op + r * n_out + b0 * kPackCols);
  });
  return out;
}

// silu(gate) * up straight from the products, for a gate/up weight whose column blocks are
// interleaved before packing (gate 0, up 0, gate 1, up 1, ...: each task then holds matching
// gate and up features); the (M, 2I) product never goes to memory. Rounded where
// linear_bf16_packed then silu_and_mul round (gate and up, silu, the product: bf16), so the
// result is theirs bit for bit.
at::Tensor linear_bf16_packed_silu(const at::Tensor& x, const at::Tensor& packed,
                                   const c10::optional<at::Tensor>& bias, bool amx,
                                   int64_t widen_from) {
  check_packed(x, packed, amx, "linear_bf16_packed_silu");
  TORCH_CHECK(packed.size(0) % 2 == 0 && !(bias && bias->defined()),
              "linear_bf16_packed_silu: interleaved gate/up blocks, no bias");
  const int64_t n_out = packed.size(0) / 2 * kPackCols;
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  if (x.size(0) == 0) return out;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  packed_gemm_on(amx, widen_from, x, packed, [&](int64_t r, const float* acc, int64_t b0, int) {
    const Vec gate = round_bf16(Vec::load(acc)), up = round_bf16(Vec::load(acc + kPackCols));
    store_as(Vec::mul(round_bf16({silu16(gate.v)}), up), op + r * n_out + b0 / 2 * kPackCols);
  }, [&](int64_t r, int64_t b0) {
    return reinterpret_cast<const char*>(op + r * n_out + b0 / 2 * kPackCols);
  });
  return out;
}

}  // namespace

#define TOKENMILL_HAS_BF16_GEMM 1
#endif
