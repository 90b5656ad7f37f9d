// Dense bf16 weights times fp32 or bf16 activations, for decode-sized row counts. torch's bf16 GEMM
// streams a [out, in] weight at 15-20 GB/s on the 2-core AMD EPYC where a plain read streams 31-47
// (docs/benchmarks.md, "Dory throughput"); a decode step reads every weight once, so its time is
// that rate. Here each weight row is read once per tile of activation rows, at the read bandwidth.
//
// The weight stays in its own row-major [out, in] layout (prefill's many-row GEMMs read it as it
// is): four weight rows are streamed side by side, 32 inputs a step (16 bf16 widen exactly to 16 fp32
// lanes), each against up to four activation rows, one accumulator per (activation row, weight row)
// summed across its lanes at the end. AVX-512F only, so the same instructions (and bits) on every
// CPU the kernels build on.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cstdint>

namespace {

using depthserve_simd::load16;

constexpr int64_t kWeightRows = 4;  // weight rows streamed side by side
constexpr int64_t kRowTile = 4;     // activation rows that share each weight load
constexpr int64_t kStep = 32;       // inputs a step
constexpr int64_t kPrefetchSteps = 8;  // 512 bytes ahead in each weight row

// y[r, o .. o + W - 1] for R activation rows (fp32, contiguous [rows, in]) and W weight rows from o.
template <int64_t R, int64_t W, typename T>
void tile(const at::BFloat16* w, int64_t width, const float* x, T* y, int64_t out_stride) {
  __m512 acc[R][W];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < W; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < width; k += kStep) {
    __m512 lo[W], hi[W];
    for (int64_t j = 0; j < W; ++j) {
      const at::BFloat16* row = w + j * width + k;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchSteps * kStep), _MM_HINT_T0);
      lo[j] = load16(row);
      hi[j] = load16(row + 16);
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xa = _mm512_loadu_ps(x + r * width + k), xb = _mm512_loadu_ps(x + r * width + k + 16);
      for (int64_t j = 0; j < W; ++j) acc[r][j] = _mm512_fmadd_ps(hi[j], xb, _mm512_fmadd_ps(lo[j], xa, acc[r][j]));
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < W; ++j) y[r * out_stride + j] = static_cast<T>(_mm512_reduce_add_ps(acc[r][j]));
}

template <int64_t W, typename T>
void weight_rows(const at::BFloat16* w, int64_t width, const float* x, int64_t rows, T* y, int64_t out_stride) {
  int64_t r = 0;
  for (; r + kRowTile <= rows; r += kRowTile)
    tile<kRowTile, W>(w, width, x + r * width, y + r * out_stride, out_stride);
  // the last 1-3 rows in one tile: each tile streams the weight rows once
  const float* rest = x + r * width;
  T* out = y + r * out_stride;
  if (rows - r == 3) tile<3, W>(w, width, rest, out, out_stride);
  else if (rows - r == 2) tile<2, W>(w, width, rest, out, out_stride);
  else if (rows - r == 1) tile<1, W>(w, width, rest, out, out_stride);
}

template <typename T>
void multiply(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1), out_features = weight.size(0);
  // the activations once as contiguous fp32 (rows x in: a few KB)
  const at::Tensor activations = x.to(at::kFloat).contiguous();
  const float* a = activations.data_ptr<float>();
  const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
  T* y = out.data_ptr<T>();
  const int64_t groups = (out_features + kWeightRows - 1) / kWeightRows;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o = g * kWeightRows;
      if (o + kWeightRows <= out_features) {
        weight_rows<kWeightRows>(w + o * width, width, a, rows, y + o, out_features);
      } else {
        for (int64_t last = o; last < out_features; ++last) weight_rows<1>(w + last * width, width, a, rows, y + last, out_features);
      }
    }
  });
}

// y [n, out] = x [n, in] times the bf16 weight [out, in] transposed, in x's dtype (fp32 sums, rounded
// once); in a multiple of 32.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "bf16_gemm: x must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "bf16_gemm: x must be fp32 or bf16");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) % kStep == 0,
              "bf16_gemm: the weight must be contiguous bf16 [out, in], in a multiple of ", kStep);
  TORCH_CHECK(x.size(1) == weight.size(1), "bf16_gemm: x has ", x.size(1), " inputs, the weight ", weight.size(1));
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat) multiply<float>(x, weight, out);
  else multiply<at::BFloat16>(x, weight, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthserve_cpu, m) {
  m.def("bf16_gemm(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("bf16_gemm", &bf16_gemm);
}
