// Rotary position embedding (half-split, "rotate_half") on the CPU as one call per layer, instead of
// the dozen torch ops of layers/rotary.py's torch form (slices, dtype conversions, four products,
// a concatenation). Computed in fp32 and rounded once to x's dtype. kernels/cpu_native.py builds
// and loads this file with the others.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

#include "simd.h"

namespace {

using depthserve_simd::load16;
using depthserve_simd::store16;
using depthserve_simd::tail_mask;

template <typename T, typename C>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const T* src = x.data_ptr<T>();
  const C* cos_data = cos.data_ptr<C>();
  const C* sin_data = sin.data_ptr<C>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* c_row = cos_data + t * cos.stride(0);
      const C* s_row = sin_data + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = src + t * x.stride(0) + h * x.stride(1);
        T* o = dst + (t * heads + h) * 2 * half;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = tail_mask(half - i);
          const __m512 x1 = load16(in + i, m), x2 = load16(in + half + i, m);
          const __m512 c = load16(c_row + i, m), s = load16(s_row + i, m);
          store16(o + i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)), m);
          store16(o + half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)), m);
        }
      }
    }
  });
}

// x [tokens, heads, head_dim] (last dimension contiguous), cos and sin [tokens, head_dim / 2]:
// [x1 cos - x2 sin, x2 cos + x1 sin] for x = [x1, x2], a new contiguous tensor in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "apply_rope: x [tokens, heads, even head_dim]");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.stride(1) == 1 && sin.stride(1) == 1 &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2) / 2 && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == sin.scalar_type(),
              "apply_rope: cos and sin [tokens, head_dim / 2] of one dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  depthserve_simd::with_float_types(x.scalar_type(), cos.scalar_type(), "apply_rope", [&](auto t, auto c) {
    rotate<decltype(t), decltype(c)>(x, cos, sin, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthserve_cpu, m) {
  m.def("apply_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("apply_rope", &apply_rope);
}
