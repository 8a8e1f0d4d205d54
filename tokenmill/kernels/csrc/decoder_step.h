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
// one, or in the batch-invariant mode handing its softmax state to the main pass; a
// sliding-window layer: its window's plan, without that pass), o_proj, RMSNorm with
// the residual, gate/up with SiLU·mul in its epilogue, down, every linear packed for
// vdpbf16ps (bf16_gemm.h).
//
// float32 (the dtype `auto` picks on a CPU without native bf16) computes what the float32 eager
// path computes, rounding for rounding, which is what keeps it token-exact against
// transformers: PyTorch's silu(gate) * up, called from here; rms_norm as PyTorch computes it
// (rms_norm_f32, with PyTorch's own mean); RoPE by rope_, whose multiplies, subtraction and
// addition round as the eager path's separate ops do (the kernels are built with
// -ffp-contract=off); the residual adds in the epilogue of the o_proj and down GEMMs
// (linear_f32_packed_add: the linear's sum, then + residual), every linear on the packed
// float32 GEMM (f32_gemm.h; with --quantization, on int8 rows of x: a8_gemm.h, as the eager
// path does too).
//
// Where the load-time trial found oneDNN faster from some number of rows
// (model/linear/setup.py, choose_onednn_rows: bf16 on a CPU with AMX), a batch of that many
// rows or more multiplies on the dense weights through at::linear, the op the eager path's
// F.linear calls (OneDnnRouted), and the gate/up then SiLU·mul as the eager path does, so the
// step stays fused and its results the eager path's, bit for bit.
//
// The weights come by name (LayerWeights), filled from each linear's kernel; the two dtypes
// share one layer loop (DecoderStack::run), what differs between them in Bf16Step / F32Step.
//
// Tensor parallelism: each rank holds its heads' rows of qkv and its share of gate/up, and
// the matching columns of o_proj and down (whose outputs are then partial sums); given an
// all-reduce (shm_allreduce.h), those two outputs are summed over the ranks before the
// residual add, as LlamaDecoderLayer does it with one: the GEMM without the residual, the
// all-reduce, then y + residual and the norm (sum_norm), each rounding as the eager ops do.
// Pipeline parallelism: a stage after the first starts from the previous stage's (h,
// residual), its first layer's input norm then joining them (sum_norm) as the next layer's
// would have.
//
// LoRA (lora.h): given the adapters' LoRABank (set_lora), a step whose rows it groups by
// adapter adds each group's delta to the output of the linears its adapter adapts, one add_
// per layer and linear for all adapters, after the base GEMM. Those linears then run unfused
// from their epilogues, so base rows keep their bits: o_proj and down as their product, the
// delta, then + residual (linear_f32_packed_add's order); bf16 gate/up as its plain product
// over the interleaved weight, the delta, then SiLU·mul over the interleaved blocks. A step
// without LoRA rows runs the code above unchanged.
//
// A mixture-of-experts layer (Mixtral) has a MoEExperts (moe.h) instead of gate/up and down:
// its router and grouped experts give the MLP's output, which the next input norm (or the
// caller's final norm) adds to the residual, as the eager layer's norm does (sum_norm).

#pragma once

#include <ATen/TensorOperators.h>  // tensor + tensor, tensor * scalar
#include <torch/csrc/utils/pybind.h>  // pybind11 and at::Tensor's caster

#include "bf16_gemm.h"
#include "common.h"
#include "f32_linear.h"
#include "kv_cache.h"
#include "layer_ops.h"
#include "lora.h"
#include "moe.h"
#include "paged_attention.h"
#include "shm_allreduce.h"

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

// One decoder layer's weights, by name (runner/cpu_step.py fills them from each linear's
// kernel, model/linear/). The packed weights are all bf16 (pack_bf16_weight; gate_up's column
// blocks interleaved for linear_bf16_packed_silu, and no bias) or all for the float32 GEMM
// (pack_f32_weight, pack_f32_quant_weight for weights kept in 4 or 8 bits, pack_a8_weight for
// int8 rows of x); the norm weights in the compute dtype. A linear's `_dense` weight, (out, in)
// in the compute dtype, is what a batch of dense_from_rows rows or more multiplies through
// oneDNN, as its kernel does on the eager path; none where it keeps no dense weight.
struct LayerWeights {
  at::Tensor input_norm, post_norm;
  at::Tensor qkv, o, gate_up, down;
  c10::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
  c10::optional<at::Tensor> qkv_dense, o_dense, gate_up_dense, down_dense;
  // a mixture-of-experts layer's router and experts (moe.h), run instead of gate_up / down
  std::shared_ptr<MoEExperts> moe;
  int64_t window = 0;  // sliding-window attention over this many keys; 0: every key
  bool amx = false;  // bf16: its linears on AMX tiles (bf16_gemm.h's AmxRows)
  int64_t widen_from = 0;  // bf16: from this many rows (> 0) on WidenRows' float32 FMAs
};

// One linear of a layer as the loop multiplies it.
struct Proj {
  const at::Tensor& packed;
  const c10::optional<at::Tensor>& bias;
  const c10::optional<at::Tensor>& dense;
  bool amx;  // bf16: on AMX tiles
  int64_t widen_from;  // bf16: WidenRows from this many rows (0: never)
};

// What differs between the two dtypes; the layer loop (DecoderStack::run) is one.
#ifdef TOKENMILL_HAS_BF16_GEMM
// bf16: every linear on vdpbf16ps (bf16_gemm.h); the residual added inside rms_norm, one
// rounding of y + residual; gate/up with SiLU·mul in its epilogue
struct Bf16Step {
  static at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
    return rms_norm(x, at::empty({0}, x.options()), w, eps)[0];
  }
  static at::Tensor linear(const at::Tensor& x, const Proj& p) {
    return linear_bf16_packed(x, p.packed, p.bias, p.amx, p.widen_from);
  }
  // residual += the projection y of x (dense: y from oneDNN); returns the norm of the sum
  static at::Tensor add_norm(const at::Tensor& x, const Proj& p, bool dense,
                             at::Tensor& residual, const at::Tensor& w, double eps) {
    const at::Tensor y = dense ? at::linear(x, *p.dense, p.bias) : linear(x, p);
    std::vector<at::Tensor> r = rms_norm(y, residual, w, eps);
    residual = r[1];
    return r[0];
  }
  // residual += y (rounded once, in the norm); returns the norm of the sum
  static at::Tensor sum_norm(const at::Tensor& y, at::Tensor& residual, const at::Tensor& w,
                             double eps) {
    std::vector<at::Tensor> r = rms_norm(y, residual, w, eps);
    residual = r[1];
    return r[0];
  }
  static at::Tensor act(const at::Tensor& gate_up) { return silu_and_mul(gate_up); }
  static at::Tensor gated(const at::Tensor& x, const Proj& p) {
    return linear_bf16_packed_silu(x, p.packed, p.bias, p.amx, p.widen_from);
  }
  // gated's product before SiLU·mul (column blocks interleaved, as packed), and SiLU·mul of it
  static constexpr bool kInterleaved = true;
  static at::Tensor product(const at::Tensor& x, const Proj& p) { return linear(x, p); }
  static at::Tensor act_packed(const at::Tensor& y) {
    return silu_and_mul_interleaved(y, kPackCols);
  }
};
#endif

#ifdef TOKENMILL_HAS_F32_GEMM
// float32, as the eager path runs it: rms_norm_f32, the residual added in the epilogue of the
// o_proj and down GEMMs (the linear's sum rounded, then + residual), PyTorch's silu(gate) * up
struct F32Step {
  static at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
    return rms_norm_f32(x, w, eps);
  }
  static at::Tensor linear(const at::Tensor& x, const Proj& p) {
    return linear_f32_packed(x, p.packed, p.bias);
  }
  static at::Tensor add_norm(const at::Tensor& x, const Proj& p, bool dense,
                             at::Tensor& residual, const at::Tensor& w, double eps) {
    residual = dense ? at::linear(x, *p.dense, p.bias) + residual
                     : linear_f32_packed_add(x, p.packed, p.bias, residual);
    return rms_norm_f32(residual, w, eps);
  }
  static at::Tensor sum_norm(const at::Tensor& y, at::Tensor& residual, const at::Tensor& w,
                             double eps) {
    residual = y + residual;
    return rms_norm_f32(residual, w, eps);
  }
  // PyTorch's silu(gate) * up, split over threads by whole rows (layer_ops.h)
  static at::Tensor act(const at::Tensor& gate_up) { return silu_and_mul_rows(gate_up); }
  static at::Tensor gated(const at::Tensor& x, const Proj& p) { return act(linear(x, p)); }
  static constexpr bool kInterleaved = false;
  static at::Tensor product(const at::Tensor& x, const Proj& p) { return linear(x, p); }
  static at::Tensor act_packed(const at::Tensor& y) { return act(y); }
};
#endif

class DecoderStack {
 public:
  // layers: each layer's weights (see LayerWeights), bf16 or float32 as their norms are.
  // dense_from_rows: from this many rows a batch multiplies on each dense weight there is, as
  // each linear does on the eager path (0: never). all_reduce: null, or the tensor-parallel
  // group's, which sums the o_proj and down outputs over the ranks (the binding keeps it
  // alive as long as the stack).
  DecoderStack(const std::vector<LayerWeights>& layers, int64_t heads, int64_t kv_heads,
               int64_t head_dim, double eps, double scale, int64_t tile, int64_t cascade_tile,
               int64_t dense_from_rows, ShmAllReduce* all_reduce)
      : layers_(layers), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), tile_(tile), cascade_tile_(cascade_tile),
        dense_from_rows_(dense_from_rows), all_reduce_(all_reduce) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: no layers");
    dtype_ = layers_[0].input_norm.scalar_type();  // a float32 GEMM's weights may be 4/8-bit
    TORCH_CHECK(dtype_ == at::kBFloat16 || dtype_ == at::kFloat,
                "DecoderStack: a bf16 or float32 model, got ", dtype_);
#ifndef TOKENMILL_HAS_BF16_GEMM
    TORCH_CHECK(dtype_ == at::kFloat, "DecoderStack: bf16 weights need AVX512-BF16");
#endif
#ifndef TOKENMILL_HAS_F32_GEMM
    TORCH_CHECK(dtype_ != at::kFloat, "DecoderStack: float32 weights need AVX2 or AVX512");
#endif
    for (const LayerWeights& l : layers_)
      for (const c10::optional<at::Tensor>* d :
           {&l.qkv_dense, &l.o_dense, &l.gate_up_dense, &l.down_dense})
        TORCH_CHECK(!d->has_value() || ((*d)->dim() == 2 && (*d)->scalar_type() == dtype_),
                    "DecoderStack: dense weights (out, in) in the compute dtype, or none");
    int64_t window = 0;
    for (const LayerWeights& l : layers_) {  // forward takes one windowed plan per step
      TORCH_CHECK(l.window >= 0 && (l.window == 0 || window == 0 || l.window == window),
                  "DecoderStack: one sliding window for every windowed layer");
      if (l.window != 0) window = l.window;
    }
  }

  // LoRA from now on: the adapters' bank (lora.h), whose step groups forward reads; null: none
  // (the binding keeps it alive as long as the stack)
  void set_lora(LoRABank* lora) {
    TORCH_CHECK(lora == nullptr || all_reduce_ == nullptr,
                "DecoderStack: LoRA under tensor parallelism");
    lora_ = lora;
  }

  // h: the embeddings (T, hidden) in the weights' dtype. cos/sin: float32 (T, head_dim / 2).
  // The caches: one per layer run. The attention arguments as paged_attention takes them for
  // the main pass; `shared`: empty, or the shared-prefix pass's (block tables, query starts,
  // key start blocks, key limits, rows); `resume`: that pass runs first and the main pass
  // resumes its softmax state (paged_attention.h; the batch-invariant mode) rather than being
  // merged after it; `windowed`: empty (no windowed layer, or the
  // window hides no key this step), or the windowed layers' (key start blocks, key lows),
  // their plan taking no shared pass. num_layers: run the first that many layers (an early
  // exit, for layer-skip drafting). residual: a pipeline stage's input beside h (the previous
  // stage's output), or none. Returns (h, residual) after the last layer run, before the final
  // norm (h all-reduced, with an all-reduce).
  std::vector<at::Tensor> forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                  const std::vector<at::Tensor>& k_caches,
                                  const std::vector<at::Tensor>& v_caches,
                                  const at::Tensor& slots, const at::Tensor& block_tables,
                                  const at::Tensor& query_start, const at::Tensor& key_start,
                                  const at::Tensor& key_limit, const at::Tensor& no_rows,
                                  const std::vector<at::Tensor>& shared, bool resume,
                                  const std::vector<at::Tensor>& windowed, int64_t num_layers,
                                  const c10::optional<at::Tensor>& residual) const {
    TORCH_CHECK(num_layers >= 1 && num_layers <= static_cast<int64_t>(layers_.size()),
                "DecoderStack: 1 to ", layers_.size(), " layers, not ", num_layers);
    const size_t count = static_cast<size_t>(num_layers);
    TORCH_CHECK(k_caches.size() == count && v_caches.size() == count,
                "DecoderStack: one K and one V cache per layer run");
    TORCH_CHECK(shared.empty() || shared.size() == 5, "DecoderStack: shared pass arguments");
    TORCH_CHECK(windowed.empty() || windowed.size() == 2, "DecoderStack: windowed plan");
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == dtype_,
                "DecoderStack: hidden states (T, hidden) in the weights' dtype");
    TORCH_CHECK(!residual || (residual->sizes() == h.sizes() &&
                              residual->scalar_type() == dtype_ && residual->stride(1) == 1),
                "DecoderStack: a residual like h");
    const at::Tensor res = residual ? *residual : at::Tensor();
    const Step step{cos, sin, k_caches, v_caches, slots, block_tables, query_start,
                    key_start, key_limit, no_rows, shared, windowed, resume};
#ifdef TOKENMILL_HAS_F32_GEMM
    if (dtype_ == at::kFloat) return run<F32Step>(std::move(h), res, step, count);
#endif
#ifdef TOKENMILL_HAS_BF16_GEMM
    if (dtype_ == at::kBFloat16) return run<Bf16Step>(std::move(h), res, step, count);
#endif
    TORCH_CHECK(false, "DecoderStack: no GEMM for ", dtype_);
  }

 private:
  struct Step {  // forward's arguments after h
    const at::Tensor &cos, &sin;
    const std::vector<at::Tensor>&k_caches, &v_caches;
    const at::Tensor &slots, &block_tables, &query_start, &key_start, &key_limit, &no_rows;
    const std::vector<at::Tensor>&shared, &windowed;
    bool resume;  // the shared pass first, its softmax state resumed
  };

  // The layer loop, as LlamaDecoderLayer runs it. Each layer's down projection is joined to
  // the residual by the next layer's input norm (join); the last one's is returned with the
  // residual for the final norm (or the next pipeline stage). residual: undefined, or the
  // previous stage's, which the first input norm adds h to.
  template <class K>
  std::vector<at::Tensor> run(at::Tensor h, at::Tensor residual, const Step& a,
                              size_t count) const {
    const int64_t n = h.size(0);
    at::Tensor act;
    if (residual.defined()) {
      h = K::sum_norm(h, residual, layers_[0].input_norm, eps_);
    } else {
      residual = h;
      h = K::norm(h, layers_[0].input_norm, eps_);
    }
    for (size_t i = 0; i < count; ++i) {
      const LayerWeights& l = layers_[i];
      if (i > 0) h = layers_[i - 1].moe ? K::sum_norm(act, residual, l.input_norm, eps_)
                                        : join<K>(act, down_of(layers_[i - 1]), n, residual,
                                                  l.input_norm, i - 1, kLoRADown);
      const Proj qkv{l.qkv, l.qkv_bias, l.qkv_dense, l.amx, l.widen_from},
          o{l.o, l.o_bias, l.o_dense, l.amx, l.widen_from};
      const at::Tensor attended = attention(i, lora_project<K>(h, qkv, n, i, kLoRAQkv), a);
      h = join<K>(attended, o, n, residual, l.post_norm, i, kLoRAO);
      act = l.moe ? l.moe->mlp(h) : gate_up<K>(h, l, n, i);  // MoE: the MLP's output
    }
    at::Tensor out = layers_[count - 1].moe
                         ? act
                         : lora_project<K>(act, down_of(layers_[count - 1]), n, count - 1,
                                           kLoRADown);
    if (all_reduce_ != nullptr) all_reduce_->all_reduce_(out);
    return {out, residual};
  }

  // residual += the projection of x (summed over the ranks, with an all-reduce; LoRA rows'
  // deltas added first); returns the norm of the sum. Without either,
  // float32 adds the residual in the GEMM's epilogue (add_norm).
  template <class K>
  at::Tensor join(const at::Tensor& x, const Proj& p, int64_t rows, at::Tensor& residual,
                  const at::Tensor& w, size_t layer, int64_t role) const {
    const bool lora = lora_on(layer, role);
    if (all_reduce_ == nullptr && !lora)
      return K::add_norm(x, p, dense(p, rows), residual, w, eps_);
    at::Tensor y = project<K>(x, p, rows);
    if (lora) lora_->add_(static_cast<int64_t>(layer), role, x, y, false);
    if (all_reduce_ != nullptr) all_reduce_->all_reduce_(y);
    return K::sum_norm(y, residual, w, eps_);
  }

  // the projection of x, plus LoRA rows' deltas where the step's adapters adapt the linear
  template <class K>
  at::Tensor lora_project(const at::Tensor& x, const Proj& p, int64_t rows, size_t layer,
                          int64_t role) const {
    at::Tensor y = project<K>(x, p, rows);
    if (lora_on(layer, role)) lora_->add_(static_cast<int64_t>(layer), role, x, y, false);
    return y;
  }

  // silu(gate) * up of layer i's gate/up projection of h: in the GEMM's epilogue, or
  // with LoRA rows, from the product with their deltas added (interleaved as packed, for bf16)
  template <class K>
  at::Tensor gate_up(const at::Tensor& h, const LayerWeights& l, int64_t rows, size_t i) const {
    const Proj p{l.gate_up, l.gate_up_bias, l.gate_up_dense, l.amx, l.widen_from};
    const bool d = dense(p, rows);
    if (!lora_on(i, kLoRAGateUp))
      return d ? K::act(at::linear(h, *p.dense, p.bias)) : K::gated(h, p);
    at::Tensor y = d ? at::linear(h, *p.dense, p.bias) : K::product(h, p);
    const bool interleaved = K::kInterleaved && !d;
    lora_->add_(static_cast<int64_t>(i), kLoRAGateUp, h, y, interleaved);
    return interleaved ? K::act_packed(y) : K::act(y);
  }

  bool lora_on(size_t layer, int64_t role) const {
    return lora_ != nullptr && lora_->touches(static_cast<int64_t>(layer), role);
  }

  static Proj down_of(const LayerWeights& l) {
    return {l.down, l.down_bias, l.down_dense, l.amx, l.widen_from};
  }

  template <class K>
  at::Tensor project(const at::Tensor& x, const Proj& p, int64_t rows) const {
    return dense(p, rows) ? at::linear(x, *p.dense, p.bias) : K::linear(x, p);
  }

  // whether a batch of `rows` rows multiplies on the linear's dense weight through oneDNN:
  // from dense_from_rows rows, where it kept one
  bool dense(const Proj& p, int64_t rows) const {
    return dense_from_rows_ > 0 && rows >= dense_from_rows_ && p.dense.has_value() &&
           p.dense->numel() > 0;
  }

  // Layer i's attention from its qkv projection (T, (heads + 2 kv_heads) head_dim): RoPE of
  // the q and k heads in place, the new K/V stored at their slots, the main pass and, when the
  // step has one, the shared-prefix pass merged into it (in float32). Returns (T, heads
  // head_dim) in the compute dtype.
  at::Tensor attention(size_t i, const at::Tensor& qkv, const Step& a) const {
    const int64_t n = qkv.size(0), qk = (heads_ + kv_heads_) * head_dim_;
    const at::Tensor qk_heads = qkv.narrow(1, 0, qk).view({n, heads_ + kv_heads_, head_dim_});
    // x1 c - x2 s, x2 c + x1 s: the eager ops' roundings; over each head's leading rotary dims
    // (all of them but under partial rotary: Phi-4-mini)
    rope_(qk_heads.narrow(2, 0, 2 * a.cos.size(1)), a.cos, a.sin);
    const at::Tensor q = qk_heads.narrow(1, 0, heads_);
    store_kv(qk_heads.narrow(1, heads_, kv_heads_),
             qkv.narrow(1, qk, kv_heads_ * head_dim_).view({n, kv_heads_, head_dim_}),
             a.k_caches[i], a.v_caches[i], a.slots);
    // a windowed layer whose window hides keys this step: its own plan, no shared pass
    const bool windowed = layers_[i].window != 0 && !a.windowed.empty();
    const bool shared = !windowed && !a.shared.empty();
    if (shared && a.resume) return resumed_attention(i, q, a);
    at::Tensor out = at::empty({n, heads_, head_dim_},
                               qkv.options().dtype(shared ? at::kFloat : dtype_));
    const at::Tensor lse = at::empty({n, heads_}, qkv.options().dtype(at::kFloat));
    const at::Tensor no_state = at::empty({0}, lse.options());
    paged_attention(q, a.k_caches[i], a.v_caches[i], a.block_tables, a.query_start,
                    windowed ? a.windowed[0] : a.key_start, a.key_limit,
                    windowed ? a.windowed[1] : a.no_rows, a.no_rows, a.no_rows, out, lse, no_state,
                    scale_, kWrite, tile_);
    if (shared)
      paged_attention(q, a.k_caches[i], a.v_caches[i], a.shared[0], a.shared[1], a.shared[2],
                      a.shared[3], a.no_rows, a.shared[4], a.no_rows, out, lse, no_state, scale_,
                      kMerge, cascade_tile_);
    return out.to(dtype_).view({n, heads_ * head_dim_});
  }

  // The shared-prefix pass first, saving each row's softmax state (rows it does not cover keep
  // the initial one: acc 0, m -inf, l 0), then the main pass resuming from it: one pass's bits
  at::Tensor resumed_attention(size_t i, const at::Tensor& q, const Step& a) const {
    const int64_t n = q.size(0);
    const at::TensorOptions f32 = q.options().dtype(at::kFloat);
    at::Tensor out = at::zeros({n, heads_, head_dim_}, f32);
    const at::Tensor lse = at::empty({n, heads_}, f32);
    at::Tensor state = at::empty({n, heads_, 2}, f32);
    state.select(2, 0).fill_(-std::numeric_limits<float>::infinity());
    state.select(2, 1).zero_();
    paged_attention(q, a.k_caches[i], a.v_caches[i], a.shared[0], a.shared[1], a.shared[2],
                    a.shared[3], a.no_rows, a.shared[4], a.no_rows, out, lse, state, scale_,
                    kSaveState, cascade_tile_);
    paged_attention(q, a.k_caches[i], a.v_caches[i], a.block_tables, a.query_start,
                    a.key_start, a.key_limit, a.no_rows, a.no_rows, a.no_rows, out, lse, state,
                    scale_, kResume, tile_);
    return out.to(dtype_).view({n, heads_ * head_dim_});
  }

  std::vector<LayerWeights> layers_;
  at::ScalarType dtype_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t tile_, cascade_tile_;
  int64_t dense_from_rows_;
  ShmAllReduce* all_reduce_;  // null: one rank
  LoRABank* lora_ = nullptr;  // null: no LoRA
};

// The Python names: LayerWeights, DecoderStack, rms_norm_f32 (cpu_ops.cpp's module calls this).
inline void register_decoder_step(pybind11::module_& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<LayerWeights>(m, "LayerWeights", "a decoder layer's weights, by name")
      .def(pybind11::init<>())
      .def_readwrite("input_norm", &LayerWeights::input_norm)
      .def_readwrite("post_norm", &LayerWeights::post_norm)
      .def_readwrite("qkv", &LayerWeights::qkv)
      .def_readwrite("o", &LayerWeights::o)
      .def_readwrite("gate_up", &LayerWeights::gate_up)
      .def_readwrite("down", &LayerWeights::down)
      .def_readwrite("qkv_bias", &LayerWeights::qkv_bias)
      .def_readwrite("o_bias", &LayerWeights::o_bias)
      .def_readwrite("gate_up_bias", &LayerWeights::gate_up_bias)
      .def_readwrite("down_bias", &LayerWeights::down_bias)
      .def_readwrite("qkv_dense", &LayerWeights::qkv_dense)
      .def_readwrite("o_dense", &LayerWeights::o_dense)
      .def_readwrite("gate_up_dense", &LayerWeights::gate_up_dense)
      .def_readwrite("down_dense", &LayerWeights::down_dense)
      .def_readwrite("moe", &LayerWeights::moe)
      .def_readwrite("window", &LayerWeights::window)
      .def_readwrite("amx", &LayerWeights::amx)
      .def_readwrite("widen_from", &LayerWeights::widen_from);
  pybind11::class_<DecoderStack>(m, "DecoderStack",
                                 "the decoder layers of a bf16 or float32 model, run in one call")
      .def(pybind11::init<const std::vector<LayerWeights>&, int64_t, int64_t, int64_t, double,
                          double, int64_t, int64_t, int64_t, ShmAllReduce*>(),
           pybind11::keep_alive<1, 11>())  // the stack keeps its all-reduce alive
      .def("forward", &DecoderStack::forward, release())
      .def("set_lora", &DecoderStack::set_lora,
           pybind11::keep_alive<1, 2>());  // the stack keeps the bank alive
  m.def("rms_norm_f32", &rms_norm_f32,
        "float32 rms_norm with PyTorch's roundings (its own mean), in three calls", release());
}

}  // namespace

#else

inline void register_decoder_step(pybind11::module_&) {}  // neither GEMM: nothing to bind

#endif
