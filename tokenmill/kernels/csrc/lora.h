// Batched LoRA (model/lora/slots.py): one step's rows grouped by adapter slot, and each group's
// delta, (x A^T) B, added to a linear's output rows -- every adapter with its own rank, none
// padded to the largest.
//
// LoRABank holds the adapters' weights per slot, decoder layer and role (qkv, o, gate_up, down:
// model/lora/weights.py's LORA_ROLES, in that order) and, between set_step and clear_step, the
// step's groups. The fused step (decoder_step.h) and the eager path both call add_: one call
// per layer and role covers every slot's rows, so a step costs 4 calls per layer however many
// adapters it mixes.
//
// A module's B comes as one (R, N) matrix, each PEFT slice's block (its ranks, its output
// features) filled and zero elsewhere; the product walks segments instead of B's zeros. A
// segment (rank start, ranks, B column, y column, width) adds t[:, ranks] B[ranks, columns] to y's
// columns from `y column` on; a fused linear has one per slice, and a gate/up product whose
// column blocks are interleaved (linear_bf16_packed_silu's weight) takes a second table, the
// slices cut into the blocks where the product holds their features (`alt`).
//
// Per task, up to kLoRATile rows of one group: x's rows widened to float32 once, the shrink t =
// x A^T as dot products over the inputs in Vec lanes, then the expand t B in Vec columns, both in
// float32; y = dtype(y + delta), one rounding. Each row's sums run in the same order whatever
// tile or batch it is in, so a row's result does not depend on the rows beside it.
#pragma once

#include <torch/csrc/utils/pybind.h>  // pybind11 and at::Tensor's caster

#include "common.h"
#include "layer_ops.h"

namespace {

// the linears of a layer an adapter may adapt, as LORA_ROLES orders them
constexpr int64_t kLoRAQkv = 0, kLoRAO = 1, kLoRAGateUp = 2, kLoRADown = 3, kLoRARoles = 4;
constexpr int64_t kLoRATile = 4;   // rows per task: B's vectors loaded once for four rows
// multiply-adds below which a call runs on the calling thread: a parallel region costs more
// than it saves on a decode step's few rows
constexpr int64_t kLoRASerialWork = int64_t{1} << 18;

// One adapter's LoRA on one linear: a (R, K) and b (R, N) in the compute dtype; segments
// (S, 5) int64 as above, for the product in its plain column order and, where the linear has
// one, in its interleaved order (alt_segments; undefined otherwise).
struct LoRAModule {
  at::Tensor a, b, segments, alt_segments;
};

struct LoRAGroup {  // the step's rows rows_[begin, end) run under `module`
  const LoRAModule* module;
  int64_t begin, end;
};

// ROWS rows (indices `rows`) of x (K inputs) through one module: t = x A^T, then for each
// segment y[row, cols] = dtype(y + t B).
template <typename T, int64_t ROWS>
void lora_tile(const T* x, int64_t xs, T* y, int64_t ys, const int64_t* rows,
               const LoRAModule& m, const int64_t* segs, int64_t nsegs, float* scratch) {
  const int64_t k = m.a.size(1), ranks = m.a.size(0), n = m.b.size(1);
  const T* a = m.a.data_ptr<T>();
  const T* b = m.b.data_ptr<T>();
  float* xf = scratch;              // (ROWS, k): the rows widened
  float* t = scratch + ROWS * k;    // (ROWS, ranks)
  for (int64_t r = 0; r < ROWS; ++r) load_row(x + rows[r] * xs, xf + r * k, k);
  const int64_t kv = k - k % Vec::W;
  for (int64_t j = 0; j < ranks; ++j) {
    const T* aj = a + j * k;
    Vec acc[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) acc[r] = Vec::zero();
    for (int64_t i = 0; i < kv; i += Vec::W) {
      const Vec av = Vec::load(aj + i);
      for (int64_t r = 0; r < ROWS; ++r) acc[r] = Vec::fma(Vec::load(xf + r * k + i), av, acc[r]);
    }
    for (int64_t r = 0; r < ROWS; ++r) {
      float s = lane_sum(acc[r]);
      for (int64_t i = kv; i < k; ++i) s = std::fma(xf[r * k + i], static_cast<float>(aj[i]), s);
      t[r * ranks + j] = s;
    }
  }
  for (int64_t s = 0; s < nsegs; ++s) {
    const int64_t* g = segs + s * 5;  // rank start, ranks, B column, y column, width
    const int64_t j0 = g[0], j1 = g[0] + g[1], width = g[4];
    const T* bs = b + g[2];
    int64_t c = 0;
    for (; c + Vec::W <= width; c += Vec::W) {
      Vec acc[ROWS];
      for (int64_t r = 0; r < ROWS; ++r) acc[r] = Vec::zero();
      for (int64_t j = j0; j < j1; ++j) {
        const Vec bv = Vec::load(bs + j * n + c);
        for (int64_t r = 0; r < ROWS; ++r)
          acc[r] = Vec::fma(Vec::set1(t[r * ranks + j]), bv, acc[r]);
      }
      for (int64_t r = 0; r < ROWS; ++r) {
        T* yp = y + rows[r] * ys + g[3] + c;
        store_as(Vec::add(Vec::load(yp), acc[r]), yp);
      }
    }
    for (; c < width; ++c)  // the last columns one by one, the same sums
      for (int64_t r = 0; r < ROWS; ++r) {
        float d = 0.0f;
        for (int64_t j = j0; j < j1; ++j)
          d = std::fma(t[r * ranks + j], static_cast<float>(bs[j * n + c]), d);
        T* yp = y + rows[r] * ys + g[3] + c;
        *yp = static_cast<T>(static_cast<float>(*yp) + d);
      }
  }
}

// y[rows of each group] += that group's delta; tasks of up to kLoRATile rows of one group
template <typename T>
void lora_add_impl(const at::Tensor& x, at::Tensor& y, const std::vector<int64_t>& rows,
                   const std::vector<LoRAGroup>& groups, bool alt) {
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, first row of the tile)
  int64_t work = 0, scratch = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const LoRAModule& m = *groups[g].module;
    for (int64_t r = groups[g].begin; r < groups[g].end; r += kLoRATile)
      tasks.emplace_back(static_cast<int64_t>(g), r);
    work += (groups[g].end - groups[g].begin) * m.a.size(0) * (m.a.size(1) + m.b.size(1));
    scratch = std::max(scratch, kLoRATile * (m.a.size(1) + m.a.size(0)));
  }
  const int64_t count = static_cast<int64_t>(tasks.size());
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  at::parallel_for(0, count, work < kLoRASerialWork ? count : 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(scratch);
    for (int64_t i = lo; i < hi; ++i) {
      const LoRAGroup& g = groups[tasks[i].first];
      const at::Tensor& segs = alt ? g.module->alt_segments : g.module->segments;
      const int64_t first = tasks[i].second, left = std::min(kLoRATile, g.end - first);
      const auto tile = [&](auto n, int64_t at) {
        lora_tile<T, decltype(n)::value>(xp, xs, yp, ys, rows.data() + at, *g.module,
                                         segs.data_ptr<int64_t>(), segs.size(0), buf.data());
      };
      last_tile(std::make_integer_sequence<int64_t, kLoRATile>(), left, first, tile);
    }
  });
}

// The adapters in the slots, and the current step's groups (see the top).
class LoRABank {
 public:
  LoRABank(int64_t slots, int64_t layers)
      : slots_(slots), layers_(layers), modules_(static_cast<size_t>(slots * layers * kLoRARoles)) {
    TORCH_CHECK(slots > 0 && layers > 0, "LoRABank: at least one slot and one layer");
  }

  // slot's LoRA on (layer, role): a (R, K), b (R, N), segments (S, 5) int64 and, for a
  // product with interleaved column blocks, alt_segments (see the top)
  void set(int64_t slot, int64_t layer, int64_t role, const at::Tensor& a, const at::Tensor& b,
           const at::Tensor& segments, const c10::optional<at::Tensor>& alt_segments) {
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0) && a.is_contiguous() &&
                    b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
                    a.device().is_cpu() && b.device().is_cpu(),
                "LoRABank.set: contiguous CPU a (R, K) and b (R, N) of one dtype");
    LoRAModule m{a, b, checked_segments(segments, a.size(0), b.size(1)), at::Tensor()};
    if (alt_segments) m.alt_segments = checked_segments(*alt_segments, a.size(0), b.size(1));
    modules_[index(slot, layer, role)] = std::move(m);
  }

  void clear(int64_t slot) {  // the slot holds no adapter
    for (int64_t l = 0; l < layers_; ++l)
      for (int64_t r = 0; r < kLoRARoles; ++r) modules_[index(slot, l, r)] = LoRAModule{};
  }

  // the next forward's groups: rows[bounds[g] .. bounds[g + 1]) run under slots[g]
  void set_step(const at::Tensor& rows, const at::Tensor& bounds,
                const std::vector<int64_t>& slots) {
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && bounds.dim() == 1 &&
                    bounds.scalar_type() == at::kLong &&
                    bounds.numel() == static_cast<int64_t>(slots.size()) + 1,
                "LoRABank.set_step: int64 rows, and one more int64 bound than slots");
    const at::Tensor r = rows.contiguous(), bd = bounds.contiguous();
    std::vector<int64_t> rv(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
    std::vector<int64_t> bv(bd.data_ptr<int64_t>(), bd.data_ptr<int64_t>() + bd.numel());
    TORCH_CHECK(bv.front() == 0 && bv.back() == r.numel() && std::is_sorted(bv.begin(), bv.end()),
                "LoRABank.set_step: bounds from 0 to the rows' count, ascending");
    TORCH_CHECK(std::all_of(rv.begin(), rv.end(), [](int64_t x) { return x >= 0; }),
                "LoRABank.set_step: negative row");
    for (int64_t s : slots) TORCH_CHECK(s >= 0 && s < slots_, "LoRABank.set_step: slot ", s);
    rows_ = std::move(rv);
    bounds_ = std::move(bv);
    step_slots_ = slots;
  }

  void clear_step() {
    rows_.clear();
    bounds_.clear();
    step_slots_.clear();
  }

  // whether the step has rows whose adapter adapts (layer, role)
  bool touches(int64_t layer, int64_t role) const {
    for (size_t g = 0; g < step_slots_.size(); ++g)
      if (bounds_[g + 1] > bounds_[g] && modules_[index(step_slots_[g], layer, role)].a.defined())
        return true;
    return false;
  }

  // y (T, N), the (layer, role) linear's output for x (T, K): += the delta of every row of the
  // step whose adapter adapts it, in y's interleaved column order when `alt`
  void add_(int64_t layer, int64_t role, const at::Tensor& x, at::Tensor y, bool alt) const {
    TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 &&
                    y.stride(1) == 1 && x.scalar_type() == y.scalar_type(),
                "LoRABank.add_: x (T, K) and y (T, N) of one dtype, unit inner strides");
    std::vector<LoRAGroup> groups;
    for (size_t g = 0; g < step_slots_.size(); ++g) {
      const LoRAModule& m = modules_[index(step_slots_[g], layer, role)];
      if (!m.a.defined() || bounds_[g + 1] == bounds_[g]) continue;
      TORCH_CHECK(m.a.size(1) == x.size(1) && m.b.size(1) == y.size(1) &&
                      m.a.scalar_type() == x.scalar_type() && (!alt || m.alt_segments.defined()),
                  "LoRABank.add_: the adapter's (", m.a.size(1), " -> ", m.b.size(1), ", ",
                  m.a.scalar_type(), ") does not fit x ", x.sizes(), " y ", y.sizes(), " ",
                  x.scalar_type(), alt ? " (interleaved)" : "");
      TORCH_CHECK(*std::max_element(rows_.begin() + bounds_[g], rows_.begin() + bounds_[g + 1]) <
                      x.size(0),
                  "LoRABank.add_: a row past the batch's ", x.size(0));
      groups.push_back({&m, bounds_[g], bounds_[g + 1]});
    }
    if (groups.empty()) return;
    TOKENMILL_DISPATCH_MODEL_TYPES(x.scalar_type(), "lora_add", [&] {
      lora_add_impl<scalar_t>(x, y, rows_, groups, alt);
    });
  }

 private:
  size_t index(int64_t slot, int64_t layer, int64_t role) const {
    TORCH_CHECK(slot >= 0 && slot < slots_ && layer >= 0 && layer < layers_ && role >= 0 &&
                    role < kLoRARoles,
                "LoRABank: slot ", slot, ", layer ", layer, ", role ", role, " out of range");
    return static_cast<size_t>((slot * layers_ + layer) * kLoRARoles + role);
  }

  static at::Tensor checked_segments(const at::Tensor& s, int64_t ranks, int64_t n) {
    TORCH_CHECK(s.dim() == 2 && s.size(1) == 5 && s.scalar_type() == at::kLong,
                "LoRABank: segments (S, 5) int64");
    const at::Tensor c = s.contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    for (int64_t i = 0; i < c.size(0); ++i) {
      const int64_t* g = p + i * 5;
      TORCH_CHECK(g[0] >= 0 && g[1] >= 0 && g[0] + g[1] <= ranks && g[2] >= 0 && g[3] >= 0 &&
                      g[4] >= 0 && g[2] + g[4] <= n && g[3] + g[4] <= n,
                  "LoRABank: segment ", i, " outside the module's ", ranks, " ranks and ", n,
                  " outputs");
    }
    return c;
  }

  int64_t slots_, layers_;
  std::vector<LoRAModule> modules_;  // (slot, layer, role)
  std::vector<int64_t> rows_, bounds_, step_slots_;
};

// silu(gate) * up of a gate/up product (T, 2I) whose column blocks of `block` features are
// interleaved (gate 0, up 0, gate 1, ...: linear_bf16_packed_silu's weight), rounded where
// silu_and_mul rounds, so the same as that GEMM's epilogue bit for bit: (T, I)
template <typename T>
void silu_mul_blocks(const at::Tensor& x, at::Tensor& out, int64_t block) {
  const int64_t rows = x.size(0), n = x.size(1) / 2, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> g(block), u(block), y(block);
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < n; c += block)
        silu_mul_span(xp + r * xs + 2 * c, xp + r * xs + 2 * c + block, op + r * n + c, block,
                      g.data(), u.data(), y.data());
  });
}

at::Tensor silu_and_mul_interleaved(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && block > 0 && x.size(1) % (2 * block) == 0,
              "silu_and_mul_interleaved: x (T, 2I) with unit inner stride, I a multiple of the "
              "block");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  TOKENMILL_DISPATCH_MODEL_TYPES(x.scalar_type(),
                                  "silu_and_mul_interleaved",
                                  [&] { silu_mul_blocks<scalar_t>(x, out, block); });
  return out;
}

// The Python names: LoRABank, silu_and_mul_interleaved (cpu_ops.cpp's module calls this).
inline void register_lora(pybind11::module_& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<LoRABank>(m, "LoRABank",
                             "adapters' LoRA weights per slot, layer and role, and a step's groups")
      .def(pybind11::init<int64_t, int64_t>())
      .def("set", &LoRABank::set)
      .def("clear", &LoRABank::clear)
      .def("set_step", &LoRABank::set_step)
      .def("clear_step", &LoRABank::clear_step)
      .def("touches", &LoRABank::touches)
      .def("add_", &LoRABank::add_, release());
  m.def("silu_and_mul_interleaved", &silu_and_mul_interleaved,
        "silu(gate) * up over interleaved gate/up column blocks", release());
}

}  // namespace
