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
// the products instead of before them.
//
// A weight kept in 4- or 8-bit groups of 32 along K (a GGUF's Q4_0 / Q4_1 / Q8_0 blocks, or
// --quantization int4 / int8; the formats of model/quant.py) is packed by
// pack_f32_quant_weight in the same column blocks, group by group:
//
//   [N / W column blocks][K / 32 groups][record]
//   record: W float32 scales, (4 bits) W float32 offsets, then for each of the 32 k the W
//           weights: 4 bits in W / 2 bytes (lane L in nibble L / (W / 8) of 32-bit word
//           L % (W / 8), so one broadcast and a shift per lane unpack them), or W int8
//
// and widened to float32 (scale * q, then + offset, as model/quant.py's dequantize computes
// them): for up to kF32QTileRows rows in registers by the tile that multiplies them
// (f32q_tile), for more rows once per task into a float32 panel in pack_f32_weight's layout,
// which the same row tiles as a float32 weight's then share. The sums are those of the
// dequantized float32 weight packed by pack_f32_weight, bit for bit, while a decode step reads
// 0.75 (4 bits) or 1.125 (8 bits) bytes per weight from memory instead of 4. A weight packed by
// pack_a8_weight (an int8 tensor) is multiplied with x quantized to int8 instead (a8_gemm.h).
// linear_f32_packed, which takes all of them, is in f32_linear.h.

#pragma once

#include "common.h"

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

// acc[r][b] += x[r][i] * wv[b] for a tile's rows: one step of its FMA chains over k
template <int ROWS, int NB>
inline void tile_step(Vec (&acc)[ROWS][NB], const Vec (&wv)[NB], const float* x,
                      int64_t x_stride, int64_t i) {
  for (int r = 0; r < ROWS; ++r) {
    const Vec xv = Vec::set1(x[r * x_stride + i]);
    for (int b = 0; b < NB; ++b) acc[r][b] = Vec::fma(xv, wv[b], acc[r][b]);
  }
}

// Where a tile's sums go: rows of `out` (`stride` apart), after the bias (N) is added and then,
// when `add` is set, the rows of a residual (`add_stride` apart): the eager path's
// (x W^T + b) + r, rounded in that order.
struct F32Out {
  float* out;
  int64_t stride;
  const float* bias;
  const float* add;
  int64_t add_stride;
  // the same, from row r and column c on
  F32Out at(int64_t r, int64_t c) const {
    return {out + r * stride + c, stride, bias ? bias + c : nullptr,
            add ? add + r * add_stride + c : nullptr, add_stride};
  }
};

// a tile's sums, plus the bias and the residual, into `o`
template <int ROWS, int NB>
inline void tile_store(const Vec (&acc)[ROWS][NB], const F32Out& o) {
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) {
      Vec v = o.bias ? Vec::add(acc[r][b], Vec::load(o.bias + b * Vec::W)) : acc[r][b];
      if (o.add) v = Vec::add(v, Vec::load(o.add + r * o.add_stride + b * Vec::W));
      v.store(o.out + r * o.stride + b * Vec::W);
    }
}

// ROWS rows of x times NB column blocks starting at `w` into `o`; with `prefetch`, the NB
// blocks after them are brought into L2 meanwhile.
template <int ROWS, int NB>
void f32_tile(const float* x, int64_t x_stride, int64_t k_len, const float* w,
              int64_t block_stride, const F32Out& o, bool prefetch) {
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
    tile_step(acc, wv, x, x_stride, i);
  }
  tile_store(acc, o);
}

// Every row of x in as few tiles as kF32TileRows allows, of sizes that differ by one at most
// (32 rows on AVX2: 6, 6, 5, 5, 5, 5, not five of 6 and a 2-row tile that leaves most of the
// FMA units idle); the first tile prefetches the next blocks.
template <int NB, int... R>
void f32_rows(std::integer_sequence<int, R...>, const float* x, int64_t x_stride,
              int64_t rows, int64_t k_len, const float* w, int64_t block_stride,
              const F32Out& o, bool prefetch) {
  using Tile = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const F32Out&,
                        bool);
  static constexpr Tile kTiles[] = {f32_tile<R + 1, NB>...};
  for (int64_t r = 0, n = 0; r < rows; r += n) {
    n = even_tile_rows(rows - r, kF32TileRows);
    kTiles[n - 1](x + r * x_stride, x_stride, k_len, w, block_stride, o.at(r, 0),
                  prefetch && r == 0);
  }
}

constexpr int64_t kF32QGroup = 32;               // weights of K per scale (and offset)
constexpr int64_t kF32QWords = Vec::W / 8;       // 32-bit words of nibbles per k (4 bits)

constexpr int64_t f32_quant_record(int64_t bits) {
  return bits == 4 ? 2 * Vec::W * 4 + kF32QGroup * Vec::W / 2 : Vec::W * 4 + kF32QGroup * Vec::W;
}

// A 4- or 8-bit weight in groups of 32 (model/quant.py's formats) as a packing function
// (`name`) takes it, checked: its sizes
struct QuantWeightArgs {
  int64_t n, k, groups;
};

QuantWeightArgs quant_weight_args(const char* name, const at::Tensor& qweight,
                                  const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                                  int64_t bits, int64_t group_size, int64_t cols) {
  TORCH_CHECK(group_size == 32 && (bits == 4 || bits == 8), name,
              ": 4 or 8 bits in groups of 32");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              name, ": qweight uint8 (N, K / 2) for 4 bits, int8 (N, K) for 8");
  TORCH_CHECK(bits == 8 || (zeros && zeros->defined()), name, ": 4 bits come with offsets");
  QuantWeightArgs a;
  a.n = qweight.size(0);
  a.k = qweight.size(1) * (bits == 4 ? 2 : 1);
  a.groups = a.k / 32;
  TORCH_CHECK(a.n % cols == 0 && a.k % 32 == 0 && a.k > 0, name, ": N a multiple of ", cols,
              ", K of 32");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == a.n && scales.size(1) == a.groups, name,
              ": scales (N, K / 32)");
  TORCH_CHECK(bits == 8 || zeros->sizes() == scales.sizes(), name, ": offsets like scales");
  return a;
}

at::Tensor pack_f32_quant_weight(const at::Tensor& qweight, const at::Tensor& scales,
                                 const c10::optional<at::Tensor>& zeros, int64_t bits,
                                 int64_t group_size) {
  const QuantWeightArgs a = quant_weight_args("pack_f32_quant_weight", qweight, scales, zeros,
                                              bits, group_size, Vec::W);
  const int64_t n = a.n, groups = a.groups;
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  const at::Tensor zc = bits == 4 ? zeros->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t rec = f32_quant_record(bits);
  at::Tensor packed = at::zeros({n / Vec::W, groups, rec}, qweight.options().dtype(at::kByte));
  const uint8_t* q = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const float* sp = sc.data_ptr<float>();
  const float* zp = bits == 4 ? zc.data_ptr<float>() : nullptr;
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t row_bytes = qweight.size(1);
  at::parallel_for(0, n / Vec::W, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* r = dst + (b * groups + g) * rec;
        float* rs = reinterpret_cast<float*>(r);
        for (int64_t c = 0; c < Vec::W; ++c) {
          const int64_t row = b * Vec::W + c;
          rs[c] = sp[row * groups + g];
          if (bits == 8) {
            for (int64_t i = 0; i < kF32QGroup; ++i)
              r[Vec::W * 4 + i * Vec::W + c] = q[row * row_bytes + g * kF32QGroup + i];
            continue;
          }
          rs[Vec::W + c] = zp[row * groups + g];
          // GGUF's order: byte j of a group holds weight j (low nibble) and j + 16 (high)
          const int64_t word = c % kF32QWords, nibble = c / kF32QWords;
          for (int64_t i = 0; i < kF32QGroup; ++i) {
            const uint8_t byte = q[row * row_bytes + g * 16 + i % 16];
            const uint8_t v = i < 16 ? byte & 0x0F : byte >> 4;
            r[2 * Vec::W * 4 + i * Vec::W / 2 + word * 4 + nibble / 2] |=
                static_cast<uint8_t>(v << (4 * (nibble % 2)));
          }
        }
      }
  });
  return packed;
}

// 32 weights of W lanes packed in 4 bits (one k of a record), as float32 values 0..15
inline Vec f32q_nibbles(const uint8_t* p) {
#if defined(__AVX512F__)
  int64_t words;
  std::memcpy(&words, p, 8);
  const __m512i shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24,
                                           28, 28);
  const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi64(words), shifts),
                                     _mm512_set1_epi32(0x0F));
  return {_mm512_cvtepi32_ps(q)};
#else
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts),
                                     _mm256_set1_epi32(0x0F));
  return {_mm256_cvtepi32_ps(q)};
#endif
}

// The W float32 weights of column block `rec` (a record's start) at k = i of its group
template <int64_t BITS>
inline Vec f32q_weights(const uint8_t* rec, Vec s, Vec z, int64_t i) {
  if constexpr (BITS == 4)
    return Vec::add(Vec::mul(f32q_nibbles(rec + 2 * Vec::W * 4 + i * Vec::W / 2), s), z);
  else
    return Vec::mul(Vec::load(reinterpret_cast<const int8_t*>(rec + Vec::W * 4) + i * Vec::W), s);
}

template <int64_t BITS>
inline void f32q_scales(const uint8_t* rec, Vec& s, Vec& z) {
  s = Vec::load(reinterpret_cast<const float*>(rec));
  if constexpr (BITS == 4) z = Vec::load(reinterpret_cast<const float*>(rec) + Vec::W);
}

// One column block of a packed quantized weight, widened to float32 in pack_f32_weight's
// layout ([K][W]) at `dst`: the panel that several row tiles then share.
template <int64_t BITS>
void f32q_block(const uint8_t* rec, int64_t groups, float* dst) {
  for (int64_t g = 0; g < groups; ++g, rec += f32_quant_record(BITS), dst += kF32QGroup * Vec::W) {
    Vec s, z;
    f32q_scales<BITS>(rec, s, z);
    for (int64_t i = 0; i < kF32QGroup; ++i)
      f32q_weights<BITS>(rec, s, z, i).store(dst + i * Vec::W);
  }
}

// f32_tile over NB column blocks of a packed quantized weight, widened in registers as they are
// multiplied: for a batch that one tile holds (decode at small batch), which then reads the
// weight's bits and nothing else.
template <int ROWS, int NB, int64_t BITS>
void f32q_tile(const float* x, int64_t x_stride, int64_t groups, const uint8_t* rec,
               int64_t block_bytes, const F32Out& o) {
  Vec acc[ROWS][NB];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = Vec::zero();
  for (int64_t g = 0; g < groups; ++g, rec += f32_quant_record(BITS), x += kF32QGroup) {
    Vec s[NB], z[NB];
    for (int b = 0; b < NB; ++b) f32q_scales<BITS>(rec + b * block_bytes, s[b], z[b]);
    for (int64_t i = 0; i < kF32QGroup; ++i) {
      Vec wv[NB];
      for (int b = 0; b < NB; ++b)
        wv[b] = f32q_weights<BITS>(rec + b * block_bytes, s[b], z[b], i);
      tile_step(acc, wv, x, x_stride, i);
    }
  }
  tile_store(acc, o);
}

// Rows of x up to which a quantized weight is widened in registers by the tile that multiplies
// it, one column block at a time (a tile of ROWS x 1 block: as many FMA chains as rows, one
// widening per weight); more rows share a widened panel. Up to 2 rows, tiles take 4 blocks, so
// that 4-8 independent chains hide the FMA latency.
#if defined(__AVX512F__)
constexpr int kF32QTileRows = 16;
#else
constexpr int kF32QTileRows = 8;
#endif

// f32q_tile<ROWS, NB> for ROWS = rows at run time (the table's R + 1)
template <int NB, int64_t BITS, int... R>
void f32q_rows(std::integer_sequence<int, R...>, const float* x, int64_t x_stride, int64_t rows,
               int64_t groups, const uint8_t* rec, int64_t block_bytes, const F32Out& o) {
  using Tile = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, const F32Out&);
  static constexpr Tile kTiles[] = {f32q_tile<R + 1, NB, BITS>...};
  kTiles[rows - 1](x, x_stride, groups, rec, block_bytes, o);
}

// `nb` column blocks (at most 4) of a packed quantized weight starting at `rec`, times every row
// of x, into `o`
template <int64_t BITS>
void f32q_blocks(const float* x, int64_t x_stride, int64_t rows, int64_t k_len, const uint8_t* rec,
                 int64_t nb, int64_t block_bytes, const F32Out& o) {
  const int64_t groups = k_len / kF32QGroup;
  if (rows <= 2) {
    const auto two = std::make_integer_sequence<int, 2>();
    switch (nb) {
      case 4: return f32q_rows<4, BITS>(two, x, x_stride, rows, groups, rec, block_bytes, o);
      case 3: return f32q_rows<3, BITS>(two, x, x_stride, rows, groups, rec, block_bytes, o);
      case 2: return f32q_rows<2, BITS>(two, x, x_stride, rows, groups, rec, block_bytes, o);
      default: return f32q_rows<1, BITS>(two, x, x_stride, rows, groups, rec, block_bytes, o);
    }
  }
  if (rows <= kF32QTileRows) {
    for (int64_t b = 0; b < nb; ++b)
      f32q_rows<1, BITS>(std::make_integer_sequence<int, kF32QTileRows>(), x, x_stride, rows,
                         groups, rec + b * block_bytes, block_bytes, o.at(0, b * Vec::W));
    return;
  }
  const int64_t block_stride = k_len * Vec::W;
  float* const panel = thread_buffer<float, struct F32QBlocksPanel>(2 * block_stride);
  const auto tiles = std::make_integer_sequence<int, kF32TileRows>();
  for (int64_t b = 0; b < nb; b += 2) {
    const int64_t pair = std::min<int64_t>(2, nb - b);
    for (int64_t i = 0; i < pair; ++i)
      f32q_block<BITS>(rec + (b + i) * block_bytes, groups, panel + i * block_stride);
    if (pair == 2)
      f32_rows<2>(tiles, x, x_stride, rows, k_len, panel, block_stride, o.at(0, b * Vec::W),
                  false);
    else
      f32_rows<1>(tiles, x, x_stride, rows, k_len, panel, block_stride, o.at(0, b * Vec::W),
                  false);
  }
}

// linear_f32_packed's bias (N) and residual (M, N) for M rows and N outputs, when given
inline void check_bias_residual(const c10::optional<at::Tensor>& bias, const at::Tensor& residual,
                                int64_t rows, int64_t n_out) {
  TORCH_CHECK(!bias || !bias->defined() || (bias->scalar_type() == at::kFloat &&
                                            bias->is_contiguous() && bias->numel() == n_out),
              "linear_f32_packed: float32 bias (N)");
  TORCH_CHECK(!residual.defined() || (residual.scalar_type() == at::kFloat &&
                                      residual.dim() == 2 && residual.size(0) == rows &&
                                      residual.size(1) == n_out && residual.stride(1) == 1),
              "linear_f32_packed_add: float32 residual (M, N) with unit inner stride");
}

}  // namespace

#endif
