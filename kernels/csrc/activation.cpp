// SwiGLU's gating, SiLU(gate) * up, of each row [gate | up] on the CPU as one call: in fp32 inside and
// rounded once to x's dtype. The eager form (at::silu, then at::mul, on two column halves) makes two
// passes and rounds twice in bf16; in a 32-sequence decode step of SmolLM2 it took ~1.8 ms of ~45.
// kernels/cpu_native.py builds and loads this file with the others.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cstdint>

namespace {

using depthserve_simd::exp_of_minus_clamped;
using depthserve_simd::load16;
using depthserve_simd::store16;
using depthserve_simd::tail_mask;

template <typename T>
void gate(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = src + r * x.stride(0);
      const T* u = g + width;
      for (int64_t c = 0; c < width; c += 16) {
        const __mmask16 m = tail_mask(width - c);
        const __m512 gv = load16(g + c, m);
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_of_minus_clamped(gv)));
        store16(dst + r * width + c, _mm512_mul_ps(silu, load16(u + c, m)), m);
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [rows, 2 * width] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "silu_and_mul: fp32 or bf16");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) gate<float>(x, out);
  else gate<at::BFloat16>(x, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthserve_cpu, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
}
