// The decoder layers of a Llama-family model in one call (runner/cpu_step.py), bf16 or float32.
//
// Run from Python, a layer is ~10 kernel calls wrapped in ~40 small tensor operations and
// module calls: ~100 us of interpreter time per layer, 3 ms of a 13 ms single-sequence decode
// step of the default model. This runs the same kernels in the same order from C++ (so its
// results are the eager path's, bit for bit) with the GIL released for the whole stack, which
// also leaves the interpreter to the server's event loop meanwhile.
//
// Per layer, as LlamaDecoderLayer does it: RMSNorm (with the residual add from the second
// layer on), the fused qkv projection, RoPE of the q and k heads in place, K/V stored at their
// slots, paged attention (and the shared-prefix pass, merged in float32, when the step has
// one), o_proj, RMSNorm with the residual, gate/up with SiLU·mul in its epilogue, down, every
// linear packed for vdpbf16ps (bf16_gemm.h).
//
// float32 (the dtype `auto` picks on a CPU without native bf16) computes what the float32 eager
// path computes, rounding for rounding, which is what keeps it token-exact against
// transformers: PyTorch's silu(gate) * up, called from here; rms_norm as PyTorch computes it
// (rms_norm_f32, with PyTorch's own mean); RoPE by rope_, whose multiplies, subtraction and
// addition round as the eager path's separate ops do (the kernels are built with
// -ffp-contract=off); the residual adds in the epilogue of the o_proj and down GEMMs
// (linear_f32_packed_add: the linear's sum, then + residual), every linear on the packed
// float32 GEMM (f32_gemm.h; with --quantization, on int8 rows of x: a8_gemm.h, as the eager
// path does too). Included by cpu_ops.cpp after the GEMM headers.
//
// Where the load-time trial found oneDNN faster from some number of rows (model/loader.py,
// choose_onednn_rows: bf16 on a CPU with AMX), a batch of that many rows or more multiplies on
// the dense weights through at::linear, the op the eager path's F.linear calls, and the gate/up
// then SiLU·mul as the eager path does, so the step stays fused and its results the eager
// path's, bit for bit.

#pragma once

#if defined(TOKENMILL_HAS_BF16_GEMM) || defined(TOKENMILL_HAS_F32_GEMM)

namespace {

// PyTorch's float32 rms_norm (x (T, N), weight (N)), rounding for rounding, in three calls
// instead of ~8 dispatched ops: on the CPU, torch runs it as rms_norm_composite (x^2, its mean,
// + eps, rsqrt, x * that, then * weight). The squares and the scaling are computed here, IEEE
// operation for operation (rsqrt as 1 / sqrt, which is what torch.rsqrt returns for float32;
// no FMA contraction); the mean is PyTorch's own, for its summation order.
at::Tensor rms_norm_f32(const at::Tensor& x_in, const at::Tensor& weight, double eps_d) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == x_in.size(1),
              "rms_norm_f32: float32 x (T, N) and weight (N)");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  at::Tensor sq = at::empty_like(x), out = at::empty_like(x);
  if (x.numel() == 0) return out;
  float* sp = sq.data_ptr<float>();
  at::parallel_for(0, rows * n, 32768, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) sp[i] = xp[i] * xp[i];
  });
  const at::Tensor mean = at::mean(sq, {1}, true);
  const float* mp = mean.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float eps = static_cast<float>(eps_d);
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float inv = 1.0f / std::sqrt(mp[r] + eps);
      for (int64_t i = 0; i < n; ++i) op[r * n + i] = (xp[r * n + i] * inv) * wp[i];
    }
  });
  return out;
}

class DecoderStack {
 public:
  // Per layer, in this order (an empty tensor for a missing bias): input norm weight, packed
  // qkv, qkv bias, packed o, o bias, post-attention norm weight, packed gate/up (bf16: column
  // blocks interleaved, see linear_bf16_packed_silu, and no bias), gate/up bias, packed down,
  // down bias, then the dense qkv, o, gate/up and down weights for oneDNN (empty where a linear
  // keeps none: a weight kept in 4 or 8 bits). All packed weights bf16 (packed by
  // pack_bf16_weight), or all for the float32 GEMM (pack_f32_weight, or pack_f32_quant_weight
  // for weights kept in 4 or 8 bits); the norm and dense weights are in the compute dtype.
  // dense_from_rows: from this many rows a batch multiplies on each dense weight there is, as
  // each Linear does on the eager path (0: never).
  static constexpr size_t kPerLayer = 14;

  DecoderStack(const std::vector<at::Tensor>& weights, int64_t heads, int64_t kv_heads,
               int64_t head_dim, double eps, double scale, int64_t tile, int64_t cascade_tile,
               int64_t dense_from_rows)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        tile_(tile), cascade_tile_(cascade_tile), dense_from_rows_(dense_from_rows) {
    TORCH_CHECK(!weights.empty() && weights.size() % kPerLayer == 0,
                "DecoderStack: ", kPerLayer, " tensors per layer");
    dtype_ = weights[0].scalar_type();  // the norm's: a float32 GEMM's weights may be 4/8-bit
    TORCH_CHECK(dtype_ == at::kBFloat16 || dtype_ == at::kFloat,
                "DecoderStack: a bf16 or float32 model, got ", dtype_);
#ifndef TOKENMILL_HAS_BF16_GEMM
    TORCH_CHECK(dtype_ == at::kFloat, "DecoderStack: bf16 weights need AVX512-BF16");
#endif
#ifndef TOKENMILL_HAS_F32_GEMM
    TORCH_CHECK(dtype_ != at::kFloat, "DecoderStack: float32 weights need AVX2 or AVX512");
#endif
    auto bias = [](const at::Tensor& t) {
      return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
    };
    for (size_t i = 0; i < weights.size(); i += kPerLayer) {
      const at::Tensor* w = weights.data() + i;
      layers_.push_back({w[0], w[1], bias(w[2]), w[3], bias(w[4]), w[5], w[6], bias(w[7]),
                         w[8], bias(w[9]), {w[10], w[11], w[12], w[13]}});
      for (const at::Tensor& d : layers_.back().dense)
        TORCH_CHECK(d.numel() == 0 || (d.dim() == 2 && d.scalar_type() == dtype_),
                    "DecoderStack: dense weights (out, in) in the compute dtype, or empty");
    }
  }

  // h: the embeddings (T, hidden) in the weights' dtype. cos/sin: float32 (T, head_dim / 2).
  // The caches: one per layer. The attention arguments as paged_attention takes them for the
  // main pass; `shared`: empty, or the shared-prefix pass's (block tables, query starts, key
  // start blocks, key limits, rows). Returns (h, residual) after the last layer, before the
  // final norm.
  std::vector<at::Tensor> forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                  const std::vector<at::Tensor>& k_caches,
                                  const std::vector<at::Tensor>& v_caches,
                                  const at::Tensor& slots, const at::Tensor& block_tables,
                                  const at::Tensor& query_start, const at::Tensor& key_start,
                                  const at::Tensor& key_limit, const at::Tensor& no_rows,
                                  const std::vector<at::Tensor>& shared) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "DecoderStack: one K and one V cache per layer");
    TORCH_CHECK(shared.empty() || shared.size() == 5, "DecoderStack: shared pass arguments");
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == dtype_,
                "DecoderStack: hidden states (T, hidden) in the weights' dtype");
    const Step step{cos, sin, k_caches, v_caches, slots, block_tables, query_start,
                    key_start, key_limit, no_rows, shared};
    return dtype_ == at::kFloat ? forward_f32(std::move(h), step)
                                : forward_bf16(std::move(h), step);
  }

 private:
  struct Step {  // forward's arguments after h
    const at::Tensor &cos, &sin;
    const std::vector<at::Tensor>&k_caches, &v_caches;
    const at::Tensor &slots, &block_tables, &query_start, &key_start, &key_limit, &no_rows;
    const std::vector<at::Tensor>& shared;
  };

  // Layer i's new K/V stored at their slots, then its attention into `out`: the main pass and,
  // when the step has one, the shared-prefix pass merged into it.
  void attend(size_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              at::Tensor& out, const Step& a) const {
    store_kv(k, v, a.k_caches[i], a.v_caches[i], a.slots);
    const at::Tensor lse = at::empty({q.size(0), heads_}, q.options().dtype(at::kFloat));
    paged_attention(q, a.k_caches[i], a.v_caches[i], a.block_tables, a.query_start,
                    a.key_start, a.key_limit, a.no_rows, out, lse, scale_, false, tile_);
    if (!a.shared.empty())
      paged_attention(q, a.k_caches[i], a.v_caches[i], a.shared[0], a.shared[1], a.shared[2],
                      a.shared[3], a.shared[4], out, lse, scale_, true, cascade_tile_);
  }

  std::vector<at::Tensor> forward_bf16(at::Tensor h, const Step& a) const {
#ifdef TOKENMILL_HAS_BF16_GEMM
    const int64_t n = h.size(0), qk = (heads_ + kv_heads_) * head_dim_;
    const at::Tensor no_residual = at::empty({0}, h.options());
    const auto out_options = h.options().dtype(a.shared.empty() ? at::kBFloat16 : at::kFloat);
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (!residual.defined()) {
        residual = h;
        h = rms_norm(h, no_residual, l.in_norm, eps_)[0];
      } else {
        std::vector<at::Tensor> r = rms_norm(h, residual, l.in_norm, eps_);
        h = r[0];
        residual = r[1];
      }
      const at::Tensor qkv = dense(l, 0, n) ? at::linear(h, l.dense[0], l.qkv_bias)
                                            : linear_bf16_packed(h, l.qkv, l.qkv_bias);
      const at::Tensor qk_heads = qkv.narrow(1, 0, qk).view({n, heads_ + kv_heads_, head_dim_});
      rope_(qk_heads, a.cos, a.sin);
      at::Tensor out = at::empty({n, heads_, head_dim_}, out_options);
      attend(i, qk_heads.narrow(1, 0, heads_), qk_heads.narrow(1, heads_, kv_heads_),
             qkv.narrow(1, qk, kv_heads_ * head_dim_).view({n, kv_heads_, head_dim_}), out, a);
      if (!a.shared.empty()) out = out.to(at::kBFloat16);
      const at::Tensor attended = out.view({n, heads_ * head_dim_});
      const at::Tensor o = dense(l, 1, n) ? at::linear(attended, l.dense[1], l.o_bias)
                                          : linear_bf16_packed(attended, l.o, l.o_bias);
      std::vector<at::Tensor> r = rms_norm(o, residual, l.post_norm, eps_);
      residual = r[1];
      const at::Tensor act =
          dense(l, 2, n) ? silu_and_mul(at::linear(r[0], l.dense[2], l.gate_up_bias))
                         : linear_bf16_packed_silu(r[0], l.gate_up, l.gate_up_bias);
      h = dense(l, 3, n) ? at::linear(act, l.dense[3], l.down_bias)
                         : linear_bf16_packed(act, l.down, l.down_bias);
    }
    return {h, residual};
#else
    TORCH_CHECK(false, "DecoderStack: bf16 weights need AVX512-BF16");
#endif
  }

  // float32, as the eager path runs it (model/llama.py, model/layers.py, CpuPagedBackend)
  std::vector<at::Tensor> forward_f32(at::Tensor h, const Step& a) const {
#ifdef TOKENMILL_HAS_F32_GEMM
    const int64_t n = h.size(0), qk = (heads_ + kv_heads_) * head_dim_;
    auto norm = [&](const at::Tensor& x, const at::Tensor& w) { return rms_norm_f32(x, w, eps_); };
    // linear j of layer l: packed, or oneDNN on the dense weight
    auto linear = [&](const at::Tensor& x, const Layer& l, int j, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias) {
      return dense(l, j, n) ? at::linear(x, l.dense[j], bias) : linear_f32_packed(x, packed, bias);
    };
    // the linear, then + residual: the sum rounded, then the add, as the eager ops do
    auto linear_add = [&](const at::Tensor& x, const Layer& l, int j, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, const at::Tensor& residual) {
      return dense(l, j, n) ? at::linear(x, l.dense[j], bias) + residual
                            : linear_f32_packed_add(x, packed, bias, residual);
    };
    at::Tensor residual = h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      h = norm(residual, l.in_norm);
      const at::Tensor qkv = linear(h, l, 0, l.qkv, l.qkv_bias);
      const at::Tensor qk_heads = qkv.narrow(1, 0, qk).view({n, heads_ + kv_heads_, head_dim_});
      rope_(qk_heads, a.cos, a.sin);  // x1 c - x2 s, x2 c + x1 s: the eager ops' roundings
      at::Tensor out = at::empty({n, heads_, head_dim_}, h.options());
      attend(i, qk_heads.narrow(1, 0, heads_), qk_heads.narrow(1, heads_, kv_heads_),
             qkv.narrow(1, qk, kv_heads_ * head_dim_).view({n, kv_heads_, head_dim_}), out, a);
      residual = linear_add(out.view({n, heads_ * head_dim_}), l, 1, l.o, l.o_bias, residual);
      const auto gate_up = linear(norm(residual, l.post_norm), l, 2, l.gate_up,
                                  l.gate_up_bias).chunk(2, -1);
      const at::Tensor act = at::silu(gate_up[0]) * gate_up[1];
      if (i + 1 == layers_.size()) {  // the last layer's sum is the final norm's
        h = linear(act, l, 3, l.down, l.down_bias);
        break;
      }
      residual = linear_add(act, l, 3, l.down, l.down_bias, residual);
    }
    return {h, residual};
#else
    TORCH_CHECK(false, "DecoderStack: float32 weights need AVX2 or AVX512");
#endif
  }

  struct Layer {
    at::Tensor in_norm, qkv;
    c10::optional<at::Tensor> qkv_bias;
    at::Tensor o;
    c10::optional<at::Tensor> o_bias;
    at::Tensor post_norm, gate_up;
    c10::optional<at::Tensor> gate_up_bias;
    at::Tensor down;
    c10::optional<at::Tensor> down_bias;
    std::array<at::Tensor, 4> dense;  // qkv, o, gate/up, down for oneDNN, or empty
  };

  // whether linear j of layer l (0 qkv, 1 o, 2 gate/up, 3 down) multiplies a batch of `rows`
  // rows on its dense weight through oneDNN: from dense_from_rows rows, where it kept one
  bool dense(const Layer& l, int j, int64_t rows) const {
    return dense_from_rows_ > 0 && rows >= dense_from_rows_ && l.dense[j].numel() > 0;
  }

  std::vector<Layer> layers_;
  at::ScalarType dtype_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t tile_, cascade_tile_;
  int64_t dense_from_rows_;
};

}  // namespace

#endif
