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

#pragma once

#include "common.h"

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

// x W^T over a packed W, task by task: a pair of column blocks (a trailing odd block alone),
// every row of x through a float32 scratch in chunks of kRowChunk; epilogue(row, acc, b0, nb)
// then writes that row's outputs from acc, the float32 sums of blocks b0 .. b0 + nb - 1.
// out_at(row, b0) is where they go: a chunk's lines are fetched for writing before its
// products (1-3% at 64-1024 rows: each row's outputs of a task are one line of their own).
template <typename Epilogue, typename OutAt>
void packed_gemm(const at::Tensor& x, const at::Tensor& packed, const Epilogue& epilogue,
                 const OutAt& out_at) {
  const int64_t rows = x.size(0), k_len = x.size(1), blocks = packed.size(0);
  const int64_t block_stride = packed.size(1) * kPackCols * 2;  // bf16 elements per block
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0);
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    constexpr int64_t kRowChunk = 64;  // rows per float32 scratch pass
    std::vector<float> scratch(kRowChunk * 32);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = 2 * t;
      const int nb = b0 + 1 < blocks ? 2 : 1;
      const uint16_t* w = wp + b0 * block_stride;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
        const int64_t rr = std::min(kRowChunk, rows - r0);
        // the chunk's output lines, fetched for writing while the products are computed
        for (int64_t r = r0; r < r0 + rr; ++r) _mm_prefetch(out_at(r, b0), _MM_HINT_ET0);
        if (nb == 2)
          gemm_rows<2>(xp + r0 * xs, xs, rr, k_len, w, block_stride, scratch.data(), 32,
                       r0 == 0);
        else
          gemm_rows<1>(xp + r0 * xs, xs, rr, k_len, w, block_stride, scratch.data(), 32,
                       r0 == 0);
        for (int64_t r = 0; r < rr; ++r) epilogue(r0 + r, scratch.data() + r * 32, b0, nb);
      }
    }
  });
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(2) == kPackCols &&
                  packed.size(1) == (x.size(1) + 1) / 2,
              what, ": bf16 x (M, K), weight packed by pack_bf16_weight");
}

at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias) {
  check_packed(x, packed, "linear_bf16_packed");
  const int64_t n_out = packed.size(0) * kPackCols;
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  if (x.size(0) == 0) return out;
  const at::BFloat16* bp = bias && bias->defined() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  packed_gemm(x, packed, [&](int64_t r, const float* acc, int64_t b0, int nb) {
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
                                   const c10::optional<at::Tensor>& bias) {
  check_packed(x, packed, "linear_bf16_packed_silu");
  TORCH_CHECK(packed.size(0) % 2 == 0 && !(bias && bias->defined()),
              "linear_bf16_packed_silu: interleaved gate/up blocks, no bias");
  const int64_t n_out = packed.size(0) / 2 * kPackCols;
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  if (x.size(0) == 0) return out;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  packed_gemm(x, packed, [&](int64_t r, const float* acc, int64_t b0, int) {
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
