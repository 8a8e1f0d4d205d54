// paged_attention: causal attention of a flat batch that reads K/V through the block tables
// in place (kv_cache.h's layout). One work item is (request, KV head, tile of query tokens);
// the query heads that share the KV head are computed together, so every K/V row is loaded
// once per tile and never repeated per query head. Softmax is computed online (flash-attention
// style) block by block, and the log-sum-exp of every (token, head) is returned, so partial
// results over different key ranges (cascade attention: a shared prefix attended once for many
// sequences, then each sequence's own blocks) merge exactly. K is stored transposed inside each
// block (store_kv). The cache is in q's dtype or int8 with a float16 scale per (token, head),
// read in place: the K scale multiplies each score, the V scale each probability (no
// dequantized copy). The scores of kChunk blocks are laid side by side and take one softmax
// step (max, exp, rescale) together. bf16 queries with a bf16 cache on AVX512-BF16 multiply on
// vdpbf16ps (see kBf16Dot). K/V rows are read in their own dtype and widened to float32 in
// registers (attention_tiles.h).
//
// Sliding windows: a query token may also have a lower key bound (key_low, its position -
// window + 1): a work item's block loop starts at the first block any of its tokens sees, and
// each row's scores below its bound are masked, so blocks wholly behind the window are never
// read (the scheduler may have freed them: their table entries then hold the padding block 0).
// Attention sinks (gpt-oss): a per-head logit that joins every softmax's denominator and
// adds no value; the online softmax starts from it (m = sink, l = 1) instead of (-inf, 0).
//
// A shared prefix's pass can also hand its online-softmax state over instead of a normalised
// result to merge (kSaveState, then kResume): the main pass then continues each row's softmax
// where the shared pass left it, step for step as one pass over all its keys would have gone
// (the shared blocks a whole number of kChunk-block steps), so the result is that pass's, bit
// for bit: cascade attention in the batch-invariant mode.
#pragma once

#include <atomic>
#include <optional>

#include "attention_tiles.h"
#include "attention_wide.h"
#include "common.h"
#include "kv_cache.h"

namespace {

// blocks whose scores take one online-softmax step together (fewer rescales and reductions)
constexpr int64_t kChunk = 8;

// What a call does with what out / lse / state hold: write its result over them, merge it into
// the partial result there (another key range's), or, for a shared prefix's pass and the main
// pass after it, save each row's online-softmax state (raw float32 accumulators in out, (m, l)
// in state) and resume from it.
enum Combine : int64_t { kWrite = 0, kMerge = 1, kSaveState = 2, kResume = 3 };

struct WorkItem {
  int64_t req, kv_head, t0, t1;
};

// bf16 products (kDot) of work items of at least this many rows (query tokens x heads per KV
// head) run as float32 FMAs with vdpbf16ps's bits (attention_wide.h); 0: on vdpbf16ps always.
// Process-wide: the two routes differ in pace only, and the engine sets it from the load's
// trial (attention/cpu_trial.py's choose_widen_rows).
std::atomic<int64_t> g_attention_widen_from{0};

void set_attention_widen_from(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_attention_widen_from: rows >= 0 (0: never)");
  g_attention_widen_from.store(rows, std::memory_order_relaxed);
}

int64_t attention_widen_from() { return g_attention_widen_from.load(std::memory_order_relaxed); }

// An int8 cache's scales of one block for one head, as float32: K's (all block_size of them,
// after the block's transposed keys) and V's (the first nvalid, each after its token's row).
inline void block_scales(const int8_t* kt, const int8_t* vblock, int64_t head_dim,
                         int64_t v_stride, int64_t block_size, int64_t nvalid, float* ks,
                         float* vs) {
  const int8_t* kscales = kt + head_dim * block_size;
  for (int64_t s = 0; s < block_size; ++s) ks[s] = half_at(kscales + 2 * s);
  for (int64_t s = 0; s < nvalid; ++s) vs[s] = half_at(vblock + s * v_stride + head_dim);
}

// T: q's dtype; C: the cache's (T, or int8 with scales); O: out's (T or float32)
template <typename T, typename C, typename O, int64_t N>
void attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& query_start,
                    const at::Tensor& key_start_block, const at::Tensor& key_limit,
                    const at::Tensor& key_low, const at::Tensor& rows, const at::Tensor& sinks,
                    at::Tensor& out, at::Tensor& lse, at::Tensor& state, double scale,
                    int64_t combine, int64_t tile) {
  constexpr int64_t head_dim = N * Vec::W;
  const int64_t num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_reqs = query_start.size(0) - 1;
  const int64_t table_width = block_tables.size(1);

  constexpr bool kInt8 = std::is_same<C, int8_t>::value;
  constexpr int64_t row_len = head_dim + kScaleBytes<C>;  // one (token, head) in the cache
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* kstart = key_start_block.data_ptr<int64_t>();
  const int64_t* klimit = key_limit.data_ptr<int64_t>();
  const int64_t* row_of = rows.numel() ? rows.data_ptr<int64_t>() : nullptr;
  const int64_t* klow = key_low.numel() ? key_low.data_ptr<int64_t>() : nullptr;
  const float* sink = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  O* op = out.data_ptr<O>();
  float* lp = lse.data_ptr<float>();
  float* stp = state.numel() ? state.data_ptr<float>() : nullptr;  // (T, H, 2): m, l
  constexpr bool kState = std::is_same<O, float>::value;  // save / resume: float32 out only
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t v_stride = num_kv_heads * row_len;  // one token's V in the cache
  constexpr int64_t kLine = 64 / sizeof(C);  // elements per cache line
  // bf16 queries and cache with AVX512-BF16, head_dim a multiple of 32: vdpbf16ps products
  constexpr bool kDot = kBf16Dot && std::is_same<T, at::BFloat16>::value &&
                        std::is_same<C, at::BFloat16>::value && N % 2 == 0;

  std::vector<WorkItem> items;
  for (int64_t r = 0; r < num_reqs; ++r)
    for (int64_t t0 = qs[r]; t0 < qs[r + 1]; t0 += tile)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({r, h, t0, std::min(t0 + tile, qs[r + 1])});

  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t widen_from = kDot ? attention_widen_from() : 0;
  share_tasks(num_items, [&](const auto& take) {  // items differ in cost
    const int64_t span = kChunk * block_size;  // keys of one softmax step
    std::vector<float> qbuf, acc, m, l, sc, tmp(head_dim), ks(span), vs(span);
    std::vector<uint16_t> qb, pb;  // kDot: the queries and probabilities in bf16
    // kDot: 16 keys' K or a softmax step's V in vdpbf16ps pairs, made once for many row tiles
    std::vector<uint16_t> kv_pairs(kDot ? kChunk * block_size * head_dim : 0);
    std::vector<const uint16_t*> v_rows(kDot ? span / 2 : 0);
    // the FMA route's queries and probabilities, and its widened K or V (attention_wide.h)
    std::vector<float> qf, pf, kv_wide(widen_from > 0 ? span * head_dim : 0);
    for (int64_t it; take(it);) {
      const WorkItem& w = items[it];
      const int64_t nrows = (w.t1 - w.t0) * group;
      const bool wide = widen_from > 0 && nrows >= widen_from;
#if defined(__AVX512BF16__)
      std::optional<DenormalsAsZero> daz_ftz;  // vdpbf16ps's denormal rules, both routes
      if constexpr (kDot) daz_ftz.emplace();
#endif
      if constexpr (!kDot) qbuf.assign(nrows * head_dim, 0.0f);
      acc.assign(nrows * head_dim, 0.0f);
      m.assign(nrows, kNegInf);
      l.assign(nrows, 0.0f);
      if (sink != nullptr)  // the sink as a key already seen: its exp is l's first term
        for (int64_t row = 0; row < nrows; ++row) {
          m[row] = sink[w.kv_head * group + row % group];
          l[row] = 1.0f;
        }
      if constexpr (kState)
        if (combine == kResume)  // each row's softmax where the shared pass left it
          for (int64_t row = 0; row < nrows; ++row) {
            const int64_t t = w.t0 + row / group, head = w.kv_head * group + row % group;
            const int64_t at = (row_of ? row_of[t] : t) * num_heads + head;
            std::memcpy(&acc[row * head_dim], op + at * head_dim, head_dim * sizeof(float));
            m[row] = stp[2 * at];
            l[row] = stp[2 * at + 1];
          }
      sc.assign(nrows * span, 0.0f);
      if constexpr (kDot) {
        qb.resize(nrows * head_dim);
        pb.resize(nrows * span);
        if (wide) pf.resize(nrows * span);
      }
      int64_t kmax = 0, kmin = klow ? klow[w.t0] : 0;
      for (int64_t t = w.t0; t < w.t1; ++t) {
        const int64_t src = row_of ? row_of[t] : t;
        kmax = std::max(kmax, klimit[t]);
        if (klow) kmin = std::min(kmin, klow[t]);
        if constexpr (kDot) {  // as they are (the scale multiplies the scores)
          std::memcpy(&qb[(t - w.t0) * group * head_dim],
                      qp + src * q_stride + w.kv_head * group * head_dim,
                      group * head_dim * sizeof(T));
          continue;
        }
        for (int64_t g = 0; g < group; ++g) {
          float* dst = &qbuf[((t - w.t0) * group + g) * head_dim];
          load_row(qp + src * q_stride + (w.kv_head * group + g) * head_dim, dst, head_dim);
          for (int64_t d = 0; d < head_dim; ++d) dst[d] *= static_cast<float>(scale);
        }
      }
      if (wide) {  // kDot's queries widened for the FMAs
        qf.resize(nrows * head_dim);
        load_row(reinterpret_cast<const T*>(qb.data()), qf.data(), nrows * head_dim);
      }
      const int64_t* table = tables + w.req * table_width;
      // kChunk blocks at a time: their scores side by side in sc, one softmax step over all
      const int64_t kend = std::min(table_width, (kmax + block_size - 1) / block_size);
      const int64_t kfirst = std::max(kstart[w.req], kmin / block_size);
      // Each softmax step ends at a multiple of kChunk blocks wherever the item starts (a
      // window's first block, a cascade's first own block): a row's steps then cover the same
      // keys, so its sums round alike, whatever other rows share its tile (batch invariance)
      for (int64_t b0 = kfirst, nb = 0; b0 < kend; b0 += nb) {
        nb = std::min(kChunk - b0 % kChunk, kend - b0);
        const int64_t base = b0 * block_size;
        const int64_t nkeys = std::min(nb * block_size, kmax - base);
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t b = b0 + i;
          const int64_t nvalid = std::min(block_size, kmax - b * block_size);
          const C* kt = kp + k_offset(table[b], w.kv_head, num_kv_heads, row_len, block_size);
          const C* vblock = vp + table[b] * block_size * v_stride + w.kv_head * row_len;
          if (b + 1 < kend) {
            // blocks lie anywhere in the cache: fetch the next one while this one is computed
            const C* knext = kp + k_offset(table[b + 1], w.kv_head, num_kv_heads, row_len,
                                           block_size);
            for (int64_t e = 0; e < row_len * block_size; e += kLine)
              __builtin_prefetch(knext + e);
            const C* vnext = vp + table[b + 1] * block_size * v_stride + w.kv_head * row_len;
            for (int64_t s = 0; s < block_size; ++s)
              for (int64_t d = 0; d < row_len; d += kLine)
                __builtin_prefetch(vnext + s * v_stride + d);
          }
          float* sblock = sc.data() + i * block_size;
          if constexpr (kInt8)
            block_scales(kt, vblock, head_dim, v_stride, block_size, nvalid,
                         ks.data() + i * block_size, vs.data() + i * block_size);
#if defined(__AVX512BF16__)
          if constexpr (kDot) {
            const auto* keys = reinterpret_cast<const uint16_t*>(kt);
            if (wide)
              block_scores_pairs<N, true>(qf.data(), keys, static_cast<float>(scale), sblock,
                                          span, nrows, nvalid, block_size, kv_wide.data());
            else
              block_scores_pairs<N, false>(qb.data(), keys, static_cast<float>(scale), sblock,
                                           span, nrows, nvalid, block_size, kv_pairs.data());
          } else
#endif
            block_scores<N>(qbuf.data(), kt, ks.data() + i * block_size, sblock, span, nrows,
                            nvalid, block_size);
        }
        // online softmax, row by row
        for (int64_t row = 0; row < nrows; ++row) {
          const int64_t t = w.t0 + row / group;
          const int64_t vis = std::min(nkeys, klimit[t] - base);
          const int64_t low = klow ? klow[t] - base : 0;  // keys before it lie behind the window
          float* srow = &sc[row * span];
          if (vis <= low) {  // no key of these blocks is this row's
            for (int64_t s = 0; s < span; ++s) srow[s] = 0.0f;
#if defined(__AVX512BF16__)
            if constexpr (kDot) {
              std::fill_n(&pb[row * span], span, uint16_t{0});
              if (wide) std::fill_n(&pf[row * span], span, 0.0f);
            }
#endif
            continue;
          }
          for (int64_t s = 0; s < low; ++s) srow[s] = kNegInf;
          const float m_new = std::max(m[row], block_max(srow, vis));
          const float alpha = exp_clamped(m[row] - m_new);
          const float psum = block_exp(srow, vis, nb * block_size, m_new);
          l[row] = l[row] * alpha + psum;
          m[row] = m_new;
          if constexpr (kInt8)  // fold V's scale into the probability: (p_t * scale_v) * v_t
            for (int64_t s = 0; s < vis; ++s) srow[s] *= vs[s];
          if (alpha != 1.0f) {
            float* arow = &acc[row * head_dim];
            const Vec av = Vec::set1(alpha);  // head_dim = N whole registers
            for (int64_t d = 0; d < head_dim; d += Vec::W)
              Vec::mul(Vec::load(arow + d), av).store(arow + d);
          }
#if defined(__AVX512BF16__)
          if constexpr (kDot) {
            if (wide)
              probs_to_wide(srow, &pf[row * span], nb * block_size);
            else
              probs_to_bf16(srow, &pb[row * span], nb * block_size);
          }
#endif
        }
#if defined(__AVX512BF16__)
        if constexpr (kDot) {  // each row tile over all of the step's keys
          for (int64_t i = 0, s = 0; i < nb; ++i) {  // block_size even: a pair in one block
            const C* v = vp + table[b0 + i] * block_size * v_stride + w.kv_head * row_len;
            for (int64_t j = 0; j < block_size && s < nkeys; j += 2, s += 2)
              v_rows[s / 2] = reinterpret_cast<const uint16_t*>(v + j * v_stride);
          }
          const ValuePairsInPlace pairs{v_rows.data(), v_stride, nkeys};
          if (wide)
            block_values_wide<N>(pf.data(), span, pairs, acc.data(), nrows, kv_wide.data());
          else
            block_values_bf16<N>(pb.data(), span, pairs, acc.data(), nrows, kv_pairs.data());
          continue;
        }
#endif
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t b = b0 + i;
          const int64_t nvalid = std::min(block_size, kmax - b * block_size);
          const C* vblock = vp + table[b] * block_size * v_stride + w.kv_head * row_len;
          block_values<N>(sc.data() + i * block_size, span, vblock, v_stride, acc.data(), nrows,
                          nvalid);
        }
      }
      for (int64_t row = 0; row < nrows; ++row) {
        const int64_t t = w.t0 + row / group;
        const int64_t dst = row_of ? row_of[t] : t;
        const int64_t head = w.kv_head * group + row % group;
        float* arow = &acc[row * head_dim];
        if constexpr (kState)
          if (combine == kSaveState) {  // as it stands (accumulators unscrambled at the end)
            const int64_t at = dst * num_heads + head;
            std::memcpy(op + at * head_dim, arow, head_dim * sizeof(float));
            stp[2 * at] = m[row];
            stp[2 * at + 1] = l[row];
            continue;
          }
#if defined(__AVX512BF16__)
        if constexpr (kDot) unscramble_bf16(arow, tmp.data(), head_dim);
#endif
        float new_lse = l[row] > 0.0f ? m[row] + std::log(l[row]) : kNegInf;
        const float inv = l[row] > 0.0f ? 1.0f / l[row] : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) arow[d] *= inv;
        O* orow = op + dst * out_stride + head * head_dim;
        float* lrow = lp + dst * num_heads + head;
        if (combine == kMerge && *lrow != kNegInf) {
          // combine with the partial result already there (another key range)
          const float old_lse = *lrow;
          const float top = std::max(old_lse, new_lse);
          const float w_old = std::exp(old_lse - top), w_new = std::exp(new_lse - top);
          const float denom = w_old + w_new;
          load_row(orow, tmp.data(), head_dim);
          for (int64_t d = 0; d < head_dim; ++d)
            arow[d] = (tmp[d] * w_old + arow[d] * w_new) / denom;
          new_lse = top + std::log(denom);
        }
        write_row(arow, orow, head_dim);
        *lrow = new_lse;
      }
    }
  });
}

// Head sizes the kernels take: head_dim = N * W for these N (32..128 on AVX512 and AVX2).
#define TOKENMILL_HEAD_VECS(X) X(2) X(4) X(5) X(6) X(8) X(10) X(12) X(16)

bool supports(int64_t head_dim, int64_t block_size) {
  if (head_dim % Vec::W || block_size % Vec::W) return false;
  switch (head_dim / Vec::W) {
#define TOKENMILL_CASE(n) case n: return true;
    TOKENMILL_HEAD_VECS(TOKENMILL_CASE)
#undef TOKENMILL_CASE
    default: return false;
  }
}

template <typename T, typename C, typename O>
void attention_dispatch(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& query_start, const at::Tensor& key_start_block,
                            const at::Tensor& key_limit, const at::Tensor& key_low,
                        const at::Tensor& rows, const at::Tensor& sinks, at::Tensor& out,
                        at::Tensor& lse, at::Tensor& state, double scale, int64_t combine,
                        int64_t tile) {
  switch (q.size(2) / Vec::W) {
#define TOKENMILL_CASE(n)                                                                     \
    case n:                                                                                   \
      return attention_impl<T, C, O, n>(q, k_cache, v_cache, block_tables, query_start,      \
                                        key_start_block, key_limit, key_low, rows, sinks,     \
                                        out, lse, state, scale, combine, tile);
    TOKENMILL_HEAD_VECS(TOKENMILL_CASE)
#undef TOKENMILL_CASE
    default: TORCH_CHECK(false, "paged_attention: unsupported head_dim ", q.size(2));
  }
}

// Attention of the queries in ``q`` to the paged K/V (this backend's layout: kv_cache.h).
//   q               (T, H, D) float32 / bfloat16 / float16 (the cache's dtype unless that is
//                   int8); rows may be strided (the q part of a fused qkv projection)
//   k_cache/v_cache (num_blocks, block_size, KVH, D) tensors; K's blocks hold (KVH, D, bs);
//                   or int8 (num_blocks, block_size, KVH, D + 2) with float16 scales
//   block_tables    (R, W) int64; request r reads blocks key_start_block[r] .. of its row
//   query_start     (R + 1) int64: request r owns query tokens query_start[r] .. [r + 1] - 1
//   key_limit       (T') int64: query token t sees keys [key_start_block[r] * block_size,
//                   key_limit[t]) of its request (positions; causal: its own position + 1)
//   key_low         (T') int64 or empty: token t sees no key before key_low[t] either (its
//                   sliding window's first position); empty: no lower bound
//   rows            (T') int64 or empty: query token t is row rows[t] of q / out / lse
//                   (empty: row t), so a call may cover any subset of a batch's tokens
//   sinks           (H) float32 or empty: per-head logits joining every softmax's denominator
//                   (give them to one pass only when passes are merged)
//   out, lse        (T, H, D) q's dtype or float32, and (T, H) float32: written, or with
//                   kMerge combined with the partial results they hold (lse -inf: none)
//   state           (T, H, 2) float32 (m, l) for kSaveState / kResume (out then float32 and
//                   holding raw accumulators between the two; no sinks), else empty
//   combine         Combine: kWrite, kMerge, kSaveState or kResume
//   tile            query tokens of one request computed together (sharing each K/V load)
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start,
                     const at::Tensor& key_start_block, const at::Tensor& key_limit,
                     const at::Tensor& key_low, const at::Tensor& rows, const at::Tensor& sinks,
                     at::Tensor out, at::Tensor lse, at::Tensor state, double scale,
                     int64_t combine, int64_t tile) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q (T, H, D) and caches (blocks, block_size, KVH, D) expected");
  const CacheKind kind = cache_kind(k_cache, q.scalar_type(), "paged_attention");
  const bool int8 = kind == CacheKind::kInt8;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: K and V caches of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q heads must be "
              "contiguous (T, H, D)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
                  lse.is_contiguous(), "paged_attention: caches, out and lse must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 &&
                  q.size(2) + (int8 ? kScaleBytes<int8_t> : 0) == k_cache.size(3),
              "paged_attention: heads must be a multiple of KV heads, head dims equal");
  TORCH_CHECK(supports(q.size(2), k_cache.size(1)), "paged_attention: head_dim ", q.size(2),
              " / block_size ", k_cache.size(1), " not supported (see supports())");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == q.size(2) &&
                  lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                  lse.scalar_type() == at::kFloat, "paged_attention: out/lse shapes");
  for (const at::Tensor* t :
       {&block_tables, &query_start, &key_start_block, &key_limit, &key_low, &rows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int64");
  TORCH_CHECK(key_start_block.size(0) == query_start.size(0) - 1 &&
                  block_tables.size(0) == key_start_block.size(0), "paged_attention: one "
              "block table row and key start per request");
  TORCH_CHECK(rows.numel() == 0 || rows.numel() == key_limit.numel(), "paged_attention: rows");
  TORCH_CHECK(key_low.numel() == 0 || key_low.numel() == key_limit.numel(),
              "paged_attention: key_low");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.numel() == q.size(1)),
              "paged_attention: sinks (H) float32");
  TORCH_CHECK(tile >= 1 && combine >= kWrite && combine <= kResume,
              "paged_attention: tile >= 1, combine one of Combine");
  const bool stateful = combine == kSaveState || combine == kResume;
  TORCH_CHECK(!stateful || (out.scalar_type() == at::kFloat && sinks.numel() == 0 &&
                            state.scalar_type() == at::kFloat && state.is_contiguous() &&
                            state.numel() == q.size(0) * q.size(1) * 2),
              "paged_attention: save / resume take float32 out, a (T, H, 2) float32 state and "
              "no sinks");
  const bool same = out.scalar_type() == q.scalar_type();
  TORCH_CHECK(same || out.scalar_type() == at::kFloat, "paged_attention: out is q's dtype or "
              "float32");
  TOKENMILL_DISPATCH_MODEL_TYPES(q.scalar_type(), "paged_attention",
                                  [&] {
    with_cache_type<scalar_t>(kind, [&](auto cache_type) {
      using C = typename decltype(cache_type)::type;
      if (same) {
        attention_dispatch<scalar_t, C, scalar_t>(q, k_cache, v_cache, block_tables,
                                                  query_start, key_start_block, key_limit,
                                                  key_low, rows, sinks, out, lse, state, scale,
                                                  combine, tile);
      } else {
        attention_dispatch<scalar_t, C, float>(q, k_cache, v_cache, block_tables, query_start,
                                               key_start_block, key_limit, key_low, rows, sinks,
                                               out, lse, state, scale, combine, tile);
      }
    });
  });
}

}  // namespace
