// Routed experts of a mixture-of-experts layer, grouped (model/moe.py, MoEExperts): the
// (token, slot) pairs sorted by expert (a stable counting sort), then per expert that has
// any, its rows gathered, one gate/up GEMM and one down GEMM over all of them on the packed
// weights the experts' linears hold (f32_linear.h: float32, 4/8-bit, int8 rows of x;
// bf16_gemm.h: bf16, SiLU·mul in the epilogue), and the top-k weighted outputs summed in
// float32, expert by expert.
//
// It computes what model/moe.py's PyTorch loop (grouped_experts) computes, bit for bit: the
// same kernels in the same order, the activation as the same ATen ops or the same kernel
// (silu_and_mul), and each weighted product rounded once then added to the token's float32
// sum in ascending expert order (as index_add_ does; the kernels build with
// -ffp-contract=off, so nothing fuses into an FMA). A batch of dense_from_rows rows or more
// for one expert multiplies on its dense weights through oneDNN, as OneDnnRouted does on the
// eager path.
#pragma once

#include <ATen/TensorOperators.h>  // tensor + tensor, tensor * scalar
#include <torch/csrc/utils/pybind.h>  // pybind11 and at::Tensor's caster

#include "bf16_gemm.h"
#include "common.h"
#include "f32_linear.h"
#include "layer_ops.h"

#if defined(TOKENMILL_HAS_BF16_GEMM) || defined(TOKENMILL_HAS_F32_GEMM)

namespace {

class MoEExperts {
 public:
  // Per expert: its gate/up and down packed weights, biases and (for oneDNN routing) dense
  // weights, all from one GEMM ("f32" or "bf16"). silu_epilogue: the gate/up GEMM returns
  // silu(gate) * up (linear_bf16_packed_silu). limit > 0: gpt-oss's clamped SwiGLU with
  // alpha instead of SiLU·mul.
  std::vector<at::Tensor> gate_up, down;
  std::vector<c10::optional<at::Tensor>> gate_up_bias, down_bias, gate_up_dense, down_dense;
  bool bf16 = false, silu_epilogue = false;
  int64_t dense_from_rows = 0;
  double alpha = 1.0, limit = 0.0;
  // the router (E, H) and its bias, and how it weighs (model/moe.py route): for mlp()
  at::Tensor router;
  c10::optional<at::Tensor> router_bias;
  int64_t top_k = 1;
  bool softmax_first = true, renormalize = true;

  // The whole routed MLP of x (T, H), as SparseMoE.forward without a shared expert: the
  // router's logits by the op F.linear calls, model/moe.py's route() op for op, the experts.
  at::Tensor mlp(const at::Tensor& x) const {
    TORCH_CHECK(router.defined(), "MoEExperts: no router");
    const at::Tensor logits = at::linear(x, router, router_bias);
    at::Tensor weights, ids;
    if (softmax_first) {
      std::tie(weights, ids) = at::topk(at::softmax(logits.to(at::kFloat), -1), top_k, -1);
      if (renormalize) weights = weights / weights.sum(-1, true);
    } else {
      at::Tensor top;
      std::tie(top, ids) = at::topk(logits, top_k, -1);
      weights = at::softmax(top, -1);
    }
    return forward(x, ids, weights.to(logits.scalar_type()).to(at::kFloat));
  }

  // x (T, H) in the compute dtype; ids (T, k) int64 expert of each slot; weights (T, k)
  // float32. Returns sum_k weights[t, k] * expert_ids[t, k](x[t]), (T, H) in x's dtype.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& ids_in,
                     const at::Tensor& weights_in) const {
    const int64_t experts = static_cast<int64_t>(gate_up.size());
    TORCH_CHECK(x.dim() == 2 && ids_in.dim() == 2 && ids_in.size(0) == x.size(0) &&
                    weights_in.sizes() == ids_in.sizes() &&
                    weights_in.scalar_type() == at::kFloat && ids_in.scalar_type() == at::kLong,
                "MoEExperts: x (T, H), int64 ids and float32 weights (T, k)");
    TORCH_CHECK(down.size() == gate_up.size() && experts > 0, "MoEExperts: no experts");
    const at::Tensor ids = ids_in.contiguous(), weights = weights_in.contiguous();
    const int64_t slots = ids.numel(), top_k = ids.size(1), hidden = x.size(1);
    std::vector<int64_t> start(experts + 1, 0);  // expert e's slots: order[start[e]..]
    const std::vector<int64_t> order = sort_slots(ids.data_ptr<int64_t>(), slots, start);
    at::Tensor out = at::zeros({x.size(0), hidden}, x.options().dtype(at::kFloat));
    const float* wp = weights.data_ptr<float>();
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t n = start[e + 1] - start[e];
      if (n == 0) continue;
      at::Tensor tokens = at::empty({n}, ids.options());
      int64_t* tp = tokens.data_ptr<int64_t>();
      for (int64_t r = 0; r < n; ++r) tp[r] = order[start[e] + r] / top_k;
      const at::Tensor y = expert(e, x.index_select(0, tokens)).to(at::kFloat).contiguous();
      add_weighted(out, y, tp, order.data() + start[e], wp);
    }
    return out.to(x.scalar_type());
  }

 private:
  // the slots in ascending expert order, each expert's in slot order (a stable counting
  // sort); start (experts + 1 zeros) gets where each expert's run begins
  static std::vector<int64_t> sort_slots(const int64_t* ids, int64_t slots,
                                         std::vector<int64_t>& start) {
    const int64_t experts = static_cast<int64_t>(start.size()) - 1;
    for (int64_t s = 0; s < slots; ++s) {
      TORCH_CHECK(ids[s] >= 0 && ids[s] < experts, "MoEExperts: expert id out of range");
      ++start[ids[s] + 1];
    }
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    std::vector<int64_t> next(start.begin(), start.end() - 1), order(slots);
    for (int64_t s = 0; s < slots; ++s) order[next[ids[s]]++] = s;
    return order;
  }

  // out[token] += float32(y[r] * w[slot]) for each of the expert's rows (tokens distinct)
  static void add_weighted(at::Tensor& out, const at::Tensor& y, const int64_t* tokens,
                           const int64_t* slots, const float* w) {
    const int64_t n = y.size(0), hidden = y.size(1);
    float* op = out.data_ptr<float>();
    const float* yp = y.data_ptr<float>();
    at::parallel_for(0, n, std::max<int64_t>(1, 16384 / hidden), [&](int64_t b, int64_t end) {
      for (int64_t r = b; r < end; ++r) {
        float* o = op + tokens[r] * hidden;
        const float* yr = yp + r * hidden;
        const float ws = w[slots[r]];
        for (int64_t i = 0; i < hidden; ++i) {
          const float p = yr[i] * ws;
          o[i] += p;
        }
      }
    });
  }

  // expert e's MLP over its rows xe (n, H): the eager path's kernels and activation
  at::Tensor expert(int64_t e, const at::Tensor& xe) const {
    const bool dense = dense_from_rows > 0 && xe.size(0) >= dense_from_rows &&
                       gate_up_dense[e].has_value() && down_dense[e].has_value();
    at::Tensor h;
    if (dense) {
      h = at::linear(xe, *gate_up_dense[e], gate_up_bias[e]);
      if (silu_epilogue) h = silu_mul(h);
    } else {
      h = linear(xe, gate_up[e], gate_up_bias[e], silu_epilogue);
    }
    if (!silu_epilogue) h = limit > 0 ? clamped_swiglu(h) : silu_mul(h);
    return dense ? at::linear(h, *down_dense[e], down_bias[e])
                 : linear(h, down[e], down_bias[e], false);
  }

  at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                    const c10::optional<at::Tensor>& bias, bool silu) const {
#ifdef TOKENMILL_HAS_BF16_GEMM
    if (bf16) return silu ? linear_bf16_packed_silu(x, packed, bias, false, 0)
                          : linear_bf16_packed(x, packed, bias, false, 0);
#endif
#ifdef TOKENMILL_HAS_F32_GEMM
    if (!bf16) return linear_f32_packed(x, packed, bias);
#endif
    TORCH_CHECK(false, "MoEExperts: no GEMM for these weights");
  }

  // silu(gate) * up as the eager path's silu_and_mul: the kernel below float32, ATen's ops
  static at::Tensor silu_mul(const at::Tensor& h) {
    if (h.scalar_type() != at::kFloat) return silu_and_mul(h);
    const std::vector<at::Tensor> halves = h.chunk(2, -1);
    return at::silu(halves[0]) * halves[1];
  }

  // gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
  at::Tensor clamped_swiglu(const at::Tensor& h) const {
    const std::vector<at::Tensor> halves = h.chunk(2, -1);
    const at::Tensor gate = at::clamp_max(halves[0], limit);
    const at::Tensor up = at::clamp(halves[1], -limit, limit);
    return (up + 1) * (gate * at::sigmoid(gate * alpha));
  }
};

// The Python name: MoEExperts (cpu_ops.cpp's module calls this)
inline void register_moe(pybind11::module_& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<MoEExperts, std::shared_ptr<MoEExperts>>(
      m, "MoEExperts", "a mixture-of-experts layer's router and experts, run grouped")
      .def(pybind11::init<>())
      .def_readwrite("gate_up", &MoEExperts::gate_up)
      .def_readwrite("down", &MoEExperts::down)
      .def_readwrite("gate_up_bias", &MoEExperts::gate_up_bias)
      .def_readwrite("down_bias", &MoEExperts::down_bias)
      .def_readwrite("gate_up_dense", &MoEExperts::gate_up_dense)
      .def_readwrite("down_dense", &MoEExperts::down_dense)
      .def_readwrite("bf16", &MoEExperts::bf16)
      .def_readwrite("silu_epilogue", &MoEExperts::silu_epilogue)
      .def_readwrite("dense_from_rows", &MoEExperts::dense_from_rows)
      .def_readwrite("alpha", &MoEExperts::alpha)
      .def_readwrite("limit", &MoEExperts::limit)
      .def_readwrite("router", &MoEExperts::router)
      .def_readwrite("router_bias", &MoEExperts::router_bias)
      .def_readwrite("top_k", &MoEExperts::top_k)
      .def_readwrite("softmax_first", &MoEExperts::softmax_first)
      .def_readwrite("renormalize", &MoEExperts::renormalize)
      .def("forward", &MoEExperts::forward, release())
      .def("mlp", &MoEExperts::mlp, release());
}

}  // namespace

#else

inline void register_moe(pybind11::module_&) {}  // neither GEMM: the PyTorch loop runs

#endif
