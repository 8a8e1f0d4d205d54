// AmxRows: the packed bf16 GEMM's row kernel on AMX tiles (bf16_gemm.h's packed_gemm runs it
// like its vdpbf16ps kernels, over the same packed weight: 16 consecutive pairs of a column
// block are one B tile of 16 rows of 64 bytes), and whether this process may use the tiles.

#pragma once

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kHasAmx = true;

// Whether this process may use AMX tiles: Linux hands out their state on request, once
bool amx_usable() {
  constexpr long kReqPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  static const bool ok = syscall(SYS_arch_prctl, kReqPermission, kTileData) == 0;
  return ok;
}

// AMX tiles of up to 16 rows: C in tmm0 / tmm1 (one per column block; tmm2 / tmm3 for a
// second row tile), A (16 rows x 32 of K) in tmm4 (tmm5), B (16 pairs of a column block) in
// tmm6 / tmm7. Rows go two tiles at a time while 32 are left, each B tile then loaded once for
// both; a tile's sums for a row do not depend on its other rows, so how rows are tiled changes
// no bit. A tile configuration belongs to its thread; it is set when the tiling changes and
// released with the object.
class AmxRows {
 public:
  AmxRows() = default;
  AmxRows(const AmxRows&) = delete;
  AmxRows& operator=(const AmxRows&) = delete;
  ~AmxRows() {
    if (config_ != 0) _tile_release();
  }
  static const float* prepare(const uint16_t*, int64_t, int64_t, int64_t) { return nullptr; }
  void begin(const float*, const uint16_t*, int64_t, int64_t) {}
  static constexpr bool kAmxOrder = true;  // sums in an order of AMX's own

  template <int NB>
  void run(const uint16_t* x, int64_t xs, int64_t rows, int64_t k_len, const uint16_t* w,
           int64_t block_stride, float* out, bool prefetch) {
    int64_t r = 0;
    for (; r + 32 <= rows; r += 32) {
      configure(kPair);
      tiles<NB, 2>(x + r * xs, xs, k_len, w, block_stride, out + r * 32, prefetch && r == 0);
    }
    for (; r < rows; r += 16) {
      configure(static_cast<int>(std::min<int64_t>(16, rows - r)));
      tiles<NB, 1>(x + r * xs, xs, k_len, w, block_stride, out + r * 32, prefetch && r == 0);
    }
  }

 private:
  static constexpr int kPair = 32;  // config_ of two full row tiles

  struct Config {  // the tile configuration's memory layout (palette 1)
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };

  // rows: those of one row tile (1-16), or kPair
  void configure(int rows) {
    if (rows == config_) return;
    Config c;
    const auto rows_of = [](int n) { return static_cast<uint8_t>(n); };
    const int n = rows == kPair ? 16 : rows;
    for (int t : {0, 1, 4}) c.rows[t] = rows_of(n);  // C, C, A of the first row tile
    if (rows == kPair)
      for (int t : {2, 3, 5}) c.rows[t] = 16;  // C, C, A of the second
    for (int t : {6, 7}) c.rows[t] = 16;  // B: 16 pairs
    for (int t = 0; t < 8; ++t) c.colsb[t] = c.rows[t] ? 64 : 0;  // 16 fp32, 32 bf16, 16 pairs
    _tile_loadconfig(&c);
    config_ = rows;
  }

  // RT row tiles (16 rows each when 2) times NB column blocks
  template <int NB, int RT>
  static void tiles(const uint16_t* x, int64_t xs, int64_t k_len, const uint16_t* w,
                    int64_t block_stride, float* out, bool prefetch) {
    const uint16_t* next = w + NB * block_stride;  // past the weight's end: never faults
    _tile_zero(0);
    if constexpr (NB == 2) _tile_zero(1);
    if constexpr (RT == 2) {
      _tile_zero(2);
      if constexpr (NB == 2) _tile_zero(3);
    }
    for (int64_t k0 = 0; k0 < k_len; k0 += 32) {
      // the first row tile reads B from memory: the next task's tiles at this k into L2, this
      // task's two steps ahead into L1 (a tile load waits on each of its lines' misses)
      if (prefetch)
        for (int b = 0; b < NB; ++b)
          for (int64_t i = 0; i < 16; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(next + b * block_stride + k0 * 16 + i * 32),
                         _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(w + b * block_stride + (k0 + 64) * 16 +
                                                       i * 32), _MM_HINT_T0);
          }
      _tile_loadd(6, w + k0 * 16, 64);
      if constexpr (NB == 2) _tile_loadd(7, w + block_stride + k0 * 16, 64);
      _tile_loadd(4, x + k0, xs * 2);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (RT == 2) {
        _tile_loadd(5, x + 16 * xs + k0, xs * 2);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, out, 128);
    if constexpr (NB == 2) _tile_stored(1, out + 16, 128);
    if constexpr (RT == 2) {
      _tile_stored(2, out + 16 * 32, 128);
      if constexpr (NB == 2) _tile_stored(3, out + 16 * 32 + 16, 128);
    }
  }

  int config_ = 0;  // the tiling as configured: rows of one row tile, kPair, or 0 (none)
};
#else
constexpr bool kHasAmx = false;
bool amx_usable() { return false; }
#endif

}  // namespace
