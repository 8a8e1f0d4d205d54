// rms_norm, rope_, silu_and_mul: the elementwise steps of a decoder layer, fused (for bfloat16
// / float16, where PyTorch runs each of them as several passes with float32 round trips). Each
// computes in float32 and rounds where the unfused PyTorch code rounds, so results match it to
// the dtype's last bit save for the order of a sum. silu_and_mul_rows: float32's PyTorch
// silu(gate) * up, split over threads by rows only.
#pragma once

#include <ATen/ThreadLocalState.h>
#include <ATen/ops/mul.h>

#include "common.h"

namespace {

// out = w * dtype(s * rsqrt(mean(s^2) + eps)), s = x (+ residual, rounded; written to res_out)
template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps, at::Tensor& out, at::Tensor& res_out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual.numel() ? residual.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = rp ? res_out.data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = rp ? residual.stride(0) : 0;
  constexpr int64_t W = Vec::W;
  const int64_t nv = n - n % W;  // whole registers, then one by one
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> v(n), wf(n);
    load_row(wp, wf.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      Vec sq = Vec::zero();
      if (rp) {
        const T* rr = rp + r * rs;
        T* sr = sp + r * n;
        for (int64_t i = 0; i < nv; i += W) {
          const Vec s = round_as<T>(Vec::add(Vec::load(xr + i), Vec::load(rr + i)));
          store_as(s, sr + i);
          s.store(v.data() + i);
          sq = Vec::fma(s, s, sq);
        }
        for (int64_t i = nv; i < n; ++i) {
          sr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          v[i] = static_cast<float>(sr[i]);
        }
      } else {
        for (int64_t i = 0; i < nv; i += W) {
          const Vec s = Vec::load(xr + i);
          s.store(v.data() + i);
          sq = Vec::fma(s, s, sq);
        }
        for (int64_t i = nv; i < n; ++i) v[i] = static_cast<float>(xr[i]);
      }
      float ss = lane_sum(sq);
      for (int64_t i = nv; i < n; ++i) ss += v[i] * v[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      T* orow = op + r * n;
      const Vec iv = Vec::set1(inv);
      for (int64_t i = 0; i < nv; i += W)
        store_as(Vec::mul(Vec::load(wf.data() + i),
                          round_as<T>(Vec::mul(Vec::load(v.data() + i), iv))),
                 orow + i);
      for (int64_t i = nv; i < n; ++i) {
        const float normed = static_cast<float>(static_cast<T>(v[i] * inv));
        orow[i] = static_cast<T>(wf[i] * normed);
      }
    }
  });
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x (T, N) with unit inner stride and a weight (N) of its dtype");
  TORCH_CHECK(residual.numel() == 0 || (residual.sizes() == x.sizes() &&
                                        residual.stride(1) == 1 &&
                                        residual.scalar_type() == x.scalar_type()),
              "rms_norm: residual must match x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor res_out = residual.numel() ? at::empty(x.sizes(), x.options()) : residual;
  TOKENMILL_DISPATCH_MODEL_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, residual, weight, eps, out, res_out);
  });
  return {out, res_out};
}

// rotate-half RoPE in place on x (T, H, D) (rows may be strided, e.g. the q/k part of a fused
// qkv projection), with float32 cos/sin (T, D/2): dtype(x1 c - x2 s), dtype(x2 c + x1 s)
template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* xp = x.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1);
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = xp + t * ts + h * hs;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
          const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
          x1[i] = static_cast<T>(ac - bs);
          x2[i] = static_cast<T>(bc + as);
        }
      }
    }
  });
}

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope_: x (T, H, D) with unit inner stride");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * x.size(2) / 2 && sin.numel() == cos.numel(),
              "rope_: float32 contiguous cos/sin of (T, D/2)");
  TOKENMILL_DISPATCH_MODEL_TYPES(x.scalar_type(), "rope_", [&] {
    rope_impl<scalar_t>(x, cos, sin);
  });
}

// out[0, n) = dtype(dtype(silu(gate)) * up) for n features of one row; g, u, y: n floats of
// scratch. silu_and_mul runs it over a whole row, silu_and_mul_interleaved (lora.h) per block.
template <typename T>
inline void silu_mul_span(const T* gate, const T* up, T* out, int64_t n, float* g, float* u,
                          float* y) {
  load_row(gate, g, n);
  load_row(up, u, n);
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(y + j, silu16(_mm512_loadu_ps(g + j)));
#endif
  for (; j < n; ++j) y[j] = g[j] / (1.0f + exp_clamped(-g[j]));
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W)
    store_as(Vec::mul(round_as<T>(Vec::load(y + i)), Vec::load(u + i)), out + i);
  for (; i < n; ++i) out[i] = static_cast<T>(static_cast<float>(static_cast<T>(y[i])) * u[i]);
}

// x (T, 2I) = [gate | up] -> dtype(dtype(silu(gate)) * up), (T, I)
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> g(n), u(n), y(n);
    for (int64_t r = begin; r < end; ++r)
      silu_mul_span(xp + r * xs, xp + r * xs + n, op + r * n, n, g.data(), u.data(), y.data());
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x (T, 2I) with unit inner stride");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  TOKENMILL_DISPATCH_MODEL_TYPES(x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(x, out); });
  return out;
}

// float32 silu(gate) * up of x (T, 2I) by PyTorch's own silu and product, each row on one
// thread. PyTorch splits an elementwise op over threads by elements: a split inside a row hands
// the row's last elements before it to the scalar loop, whose exp is not the vector one's, so
// those bits would depend on how many rows share the call; whole rows always round alike.
at::Tensor silu_and_mul_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 2 == 0,
              "silu_and_mul_rows: float32 x (T, 2I)");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  const at::ThreadLocalState caller;  // inference mode and the like, for the pool's threads
  // as many rows per task as PyTorch's grain of elements (fewer run on one thread, as there)
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard as_caller(caller);
    const at::Tensor part = x.slice(0, begin, end);  // inside the region PyTorch runs serially
    at::Tensor dst = out.slice(0, begin, end);
    at::mul_out(dst, at::silu(part.narrow(1, 0, n)), part.narrow(1, n, n));
  });
  return out;
}

}  // namespace
