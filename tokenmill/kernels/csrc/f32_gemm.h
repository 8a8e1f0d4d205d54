// float32 linear layers over a packed weight, for batches of rows: the GEMM of the float32
// path (`--dtype auto` picks float32 on a CPU without native bf16, e.g. an AVX2-only one).
//
// The weight is packed in column blocks of one register's width (Vec::W output features: 16
// with AVX512, 8 with AVX2), each block's K rows of W floats one after the other:
//
//   [N / W column blocks][K][W]
//
// so one load gives, for W output features, their weights at input k, and x[r][k] broadcast
// to every lane multiplies them with no horizontal sums. A tile is ROWS input rows x NB = 2
// column blocks; the blocks of a task (2 * K * W floats) stay in L2 while every row tile of
// the batch passes over them. As in bf16_gemm.h, the first row tile of a task prefetches the
// next task's blocks into L2 while it computes, so the weights stream from memory alongside
// the products instead of before them. Included by cpu_ops.cpp.

#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

namespace {

// rows per tile: 8 x 2 accumulators of the 32 AVX512 registers; 6 x 2 of AVX2's 16 (plus the
// two weight vectors and the broadcast row value). On an AVX2-only Zen 3, 6 rows against 4
// took every float32 linear of the default model from 59 to 86 GFLOP/s at 32 rows and from
// 109 to 154 at 512 (oneDNN: 122), the same sums bit for bit: 8 accumulators are just the
// FMA units' latency x throughput, so any stall left them idle.
#if defined(__AVX512F__)
constexpr int kF32TileRows = 8;
#else
constexpr int kF32TileRows = 6;
#endif

at::Tensor pack_f32_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_f32_weight: float32 weight (N, K)");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % Vec::W == 0, "pack_f32_weight: N must be a multiple of ", Vec::W);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n / Vec::W, k, Vec::W}, weight.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, n / Vec::W, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < Vec::W; ++c) {
        const float* row = src + (b * Vec::W + c) * k;
        float* out = dst + b * k * Vec::W + c;
        for (int64_t i = 0; i < k; ++i) out[i * Vec::W] = row[i];
      }
  });
  return packed;
}

// ROWS rows of x times NB column blocks starting at `w`, plus the bias, into `out`; with
// `prefetch`, the NB blocks after them are brought into L2 meanwhile.
template <int ROWS, int NB>
void f32_tile(const float* x, int64_t x_stride, int64_t k_len, const float* w,
              int64_t block_stride, const float* bias, float* out, int64_t out_stride,
              bool prefetch) {
  Vec acc[ROWS][NB];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = Vec::zero();
  const float* next = w + NB * block_stride;  // past the weight's end: prefetches never fault
  for (int64_t i = 0; i < k_len; ++i) {
    if (prefetch)
      for (int b = 0; b < NB; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(next + b * block_stride + i * Vec::W),
                     _MM_HINT_T1);
    Vec wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = Vec::load(w + b * block_stride + i * Vec::W);
    for (int r = 0; r < ROWS; ++r) {
      const Vec xv = Vec::set1(x[r * x_stride + i]);
      for (int b = 0; b < NB; ++b) acc[r][b] = Vec::fma(xv, wv[b], acc[r][b]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) {
      const Vec v = bias ? Vec::add(acc[r][b], Vec::load(bias + b * Vec::W)) : acc[r][b];
      v.store(out + r * out_stride + b * Vec::W);
    }
}

// Every row of x in as few tiles as kF32TileRows allows, of sizes that differ by one at most
// (32 rows on AVX2: 6, 6, 5, 5, 5, 5, not five of 6 and a 2-row tile that leaves most of the
// FMA units idle); the first tile prefetches the next blocks.
template <int NB, int... R>
void f32_rows(std::integer_sequence<int, R...>, const float* x, int64_t x_stride,
              int64_t rows, int64_t k_len, const float* w, int64_t block_stride,
              const float* bias, float* out, int64_t out_stride) {
  using Tile = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const float*,
                        float*, int64_t, bool);
  static constexpr Tile kTiles[] = {f32_tile<R + 1, NB>...};
  const int64_t tiles = (rows + kF32TileRows - 1) / kF32TileRows;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t n = rows / tiles + (t < rows % tiles);
    kTiles[n - 1](x + r * x_stride, x_stride, k_len, w, block_stride, bias,
                  out + r * out_stride, out_stride, t == 0);
    r += n;
  }
}

at::Tensor linear_f32_packed(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && packed.size(2) == Vec::W &&
                  packed.size(1) == x.size(1),
              "linear_f32_packed: float32 x (M, K), weight packed by pack_f32_weight");
  const int64_t rows = x.size(0), k_len = x.size(1);
  const int64_t blocks = packed.size(0), n_out = blocks * Vec::W;
  TORCH_CHECK(!bias || !bias->defined() || (bias->scalar_type() == at::kFloat &&
                                            bias->is_contiguous() && bias->numel() == n_out),
              "linear_f32_packed: float32 bias (N)");
  const int64_t block_stride = k_len * Vec::W;
  at::Tensor out = at::empty({rows, n_out}, x.options());
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const auto tiles = std::make_integer_sequence<int, kF32TileRows>();
  // pairs of column blocks per task; a trailing odd block alone
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = 2 * t;
      const float* w = wp + b0 * block_stride;
      const float* bb = bp ? bp + b0 * Vec::W : nullptr;
      float* o = op + b0 * Vec::W;
      if (b0 + 1 < blocks)
        f32_rows<2>(tiles, xp, x.stride(0), rows, k_len, w, block_stride, bb, o, n_out);
      else
        f32_rows<1>(tiles, xp, x.stride(0), rows, k_len, w, block_stride, bb, o, n_out);
    }
  });
  return out;
}

}  // namespace

#define TOKENMILL_HAS_F32_GEMM 1
#endif
