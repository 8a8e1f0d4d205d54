// The paged K/V cache of the cpu attention backend (attention/cpu_paged.py): its layout inside
// a block, an int8 cache's quantization, and store_kv, which writes new K/V at their slots.
// paged_attention.h reads it in place.
#pragma once

#include "common.h"

namespace {

// Cache layout of this backend (the block table and slot mapping are the contract; the layout
// inside a block is the backend's own): V as (num_blocks, block_size, KVH, D) like the
// reference, K transposed per block and head, (num_blocks, KVH, D, block_size), stored by
// store_kv. A block's keys for one head are then 2-4 KB of contiguous memory, and the scores
// of one query row for W keys at once are D register FMAs with no horizontal sums.
//
// int8 cache (tensors (num_blocks, block_size, KVH, D + 2)): each (token, head) has a float16
// scale, x ~= q * scale. V: a token's row per head is D int8 then its scale's 2 bytes. K: per
// block and head, D rows of block_size int8 (transposed as above), then the block's
// block_size scales (2 * block_size bytes), (num_blocks, KVH, D + 2, block_size) bytes in all.
// The scores are score_t = scale_k[t] * sum_d q_d k_d and the values
// acc += (p_t * scale_v[t]) * v_t, read from the int8 rows in place.

template <typename C>  // bytes of scale after each (token, head)'s values: float16 for int8
constexpr int64_t kScaleBytes = std::is_same<C, int8_t>::value ? 2 : 0;

// row: elements per (token, head) in the cache, head_dim + kScaleBytes<C>
inline int64_t k_offset(int64_t block, int64_t head, int64_t num_kv_heads, int64_t row,
                        int64_t block_size) {
  return (block * num_kv_heads + head) * row * block_size;
}

inline float half_at(const int8_t* p) {  // the float16 stored at p (any alignment)
  at::Half h;
  std::memcpy(&h.x, p, sizeof(h.x));
  return static_cast<float>(h);
}

// the smallest float16 >= s >= 0, saturating at 65504 (so |x| / scale <= 127: nothing clips)
inline at::Half round_up_half(float s) {
  at::Half h(s);
  if (static_cast<float>(h) < s) h.x = static_cast<uint16_t>(h.x + 1);
  if (h.x > 0x7BFF) h.x = 0x7BFF;
  return h;
}

// q[i * q_stride] = clamp(round(x[i] / scale), -127, 127), scale = absmax / 127 rounded up to
// float16 (0 for a zero vector, whose q are 0); the same bytes as attention/kv_quant.py
template <typename T>
inline at::Half quantize_row(const T* x, int8_t* q, int64_t n, int64_t q_stride) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(static_cast<float>(x[i])));
  const at::Half scale = round_up_half(absmax / 127.0f);
  const float s = static_cast<float>(scale) > 0.0f ? static_cast<float>(scale) : 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(static_cast<float>(x[i]) / s);
    q[i * q_stride] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return scale;
}

template <typename C>
struct TypeTag {
  using type = C;
};

// What a cache holds beside queries / new K/V of dtype T: T itself, int8 with scales, or
// bfloat16 under float32 (`--kv-cache-dtype bfloat16`: half the bytes, widened as read).
enum class CacheKind { kSame, kInt8, kBf16 };

// The kind of `cache` for K/V or queries of dtype `t`, checked: int8 caches are read for
// float32 / bfloat16 / float16, bfloat16 ones for float32 too.
CacheKind cache_kind(const at::Tensor& cache, at::ScalarType t, const char* op) {
  const at::ScalarType c = cache.scalar_type();
  if (c == t) return CacheKind::kSame;
  if (c == at::kChar) return CacheKind::kInt8;
  if (c == at::kBFloat16 && t == at::kFloat) return CacheKind::kBf16;
  TORCH_CHECK(false, op, ": a ", c, " cache does not hold ", t, " K/V (the same dtype, int8, "
              "or bfloat16 under float32)");
}

// f(TypeTag<C>{}) with C the cache's element type for T: T, int8_t or at::BFloat16
template <typename T, typename F>
void with_cache_type(CacheKind kind, F&& f) {
  if (kind == CacheKind::kInt8) {
    f(TypeTag<int8_t>{});
  } else if constexpr (std::is_same<T, float>::value) {
    if (kind == CacheKind::kBf16)
      f(TypeTag<at::BFloat16>{});
    else
      f(TypeTag<T>{});
  } else {
    f(TypeTag<T>{});
  }
}

// Store new K/V at their slots in this backend's layout (K transposed per block and head;
// an int8 cache's values quantized, with their scales, see above).
template <typename T, typename C>
void store_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t block_size = k_cache.size(1), row_len = head_dim + kScaleBytes<C>;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0), khs = k.stride(1), vhs = v.stride(1);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t block = sp[t] / block_size, off = sp[t] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      C* kblock = kc + k_offset(block, h, kv_heads, row_len, block_size);
      C* vdst = vc + (sp[t] * kv_heads + h) * row_len;
      const T* ksrc = kp + t * ks + h * khs;
      const T* vsrc = vp + t * vs + h * vhs;
      if constexpr (std::is_same<C, int8_t>::value) {
        const at::Half k_scale = quantize_row(ksrc, kblock + off, head_dim, block_size);
        std::memcpy(kblock + head_dim * block_size + 2 * off, &k_scale.x, 2);
        const at::Half v_scale = quantize_row(vsrc, vdst, head_dim, 1);
        std::memcpy(vdst + head_dim, &v_scale.x, 2);
      } else {  // a bfloat16 cache under float32: rounded to nearest even, as torch's .to()
        for (int64_t d = 0; d < head_dim; ++d) kblock[off + d * block_size] = ksrc[d];
        if constexpr (std::is_same<C, T>::value)
          std::memcpy(vdst, vsrc, head_dim * sizeof(T));
        else
          for (int64_t d = 0; d < head_dim; ++d) vdst[d] = vsrc[d];
      }
    }
  }
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv: k, v (T, KVH, D) with unit inner stride");
  const CacheKind kind = cache_kind(k_cache, k.scalar_type(), "store_kv");
  const bool int8 = kind == CacheKind::kInt8;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) &&
                  k_cache.size(3) == k.size(2) + (int8 ? kScaleBytes<int8_t> : 0) &&
                  v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: cache shapes/dtypes (int8 ones with room for the scales)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == k.size(0), "store_kv: one int64 slot per token");
  TOKENMILL_DISPATCH_MODEL_TYPES(k.scalar_type(), "store_kv", [&] {
    with_cache_type<scalar_t>(kind, [&](auto cache_type) {
      using C = typename decltype(cache_type)::type;
      store_kv_impl<scalar_t, C>(k, v, k_cache, v_cache, slots);
    });
  });
}

}  // namespace
