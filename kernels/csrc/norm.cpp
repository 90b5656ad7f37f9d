// RMSNorm of each row on the CPU as one call: y = x / sqrt(mean(x^2) + eps) * weight, in fp32 inside
// and rounded once to x's dtype, as F.rms_norm computes it (which on the CPU dispatches about ten
// ops per call: ~20 us for one 576-wide bf16 row, 61 calls in a SmolLM2 decode step).
// kernels/cpu_native.py builds and loads this file with the others.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstdint>

namespace {

using depthserve_simd::load16;
using depthserve_simd::store16;
using depthserve_simd::tail_mask;

template <typename T, typename W>
void normalize(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* src = x.data_ptr<T>();
  const W* w = weight.data_ptr<W>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = src + r * x.stride(0);
      __m512 squares = _mm512_setzero_ps();
      for (int64_t c = 0; c < width; c += 16) {
        const __m512 v = load16(row + c, tail_mask(width - c));
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float inverse = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(width) +
                                              static_cast<float>(eps));
      const __m512 factor = _mm512_set1_ps(inverse);
      for (int64_t c = 0; c < width; c += 16) {
        const __mmask16 m = tail_mask(width - c);
        store16(dst + r * width + c, _mm512_mul_ps(_mm512_mul_ps(load16(row + c, m), factor), load16(w + c, m)), m);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, width], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), "rms_norm: weight [width]");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  depthserve_simd::with_float_types(x.scalar_type(), weight.scalar_type(), "rms_norm", [&](auto t, auto w) {
    normalize<decltype(t), decltype(w)>(x, weight, eps, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
