// nGPT's arithmetic on the unit sphere (Dory's decoder layers), each step one call on the CPU, in
// fp32 inside and rounded once to the input's dtype. Eagerly, torch dispatches about seven ops per
// L2 normalisation (cast, square, sum, add, rsqrt, multiply, cast back) and a Dory layer runs seven
// of them besides its gates and interpolations: ~130 ops of ~8 us for one 2560-wide row, more time
// than the layer's quantized matrix products take at batch 1. layers/ngpt.py holds the torch forms
// (the same arithmetic, each op rounded in the input's dtype). kernels/cpu_native.py builds and loads
// this file with the others.
//
//   l2_normalize(x)                      x / sqrt(sum x^2 + eps) along the last dimension
//   ngpt_interpolate(h, y, rate)         h + rate * (N(y) - h), N applied to the result too if asked
//   gated_l2_normalize(x, gate, scale)   N(x * sigmoid(gate * scale))
//   swiglu_l2_normalize(g, u, sg, su)    N(silu(g * sg) * (u * su))
//   unit_rope(x, cos, sin, scale)        per head: N(x), rotated (half-split rope), times scale
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using depthserve_simd::exp_of_minus_clamped;
using depthserve_simd::load16;
using depthserve_simd::store16;
using depthserve_simd::tail_mask;

constexpr int64_t kRowsPerTask = 8;  // rows are a few thousand values: small batches stay on one thread

inline float inverse_norm(__m512 squares, double eps) {
  return 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) + static_cast<float>(eps));
}

inline __m512 sigmoid16(__m512 z) {
  return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp_of_minus_clamped(z)));
}

// The row whose lanes c .. c + 15 are value(c, mask), projected onto the unit sphere: its values computed
// once into `buffer` (fp32) while their squares are summed, then stored times the inverse of their norm.
template <typename T, typename F>
void store_normalized_row(int64_t width, double eps, std::vector<float>& buffer, T* dst, F&& value) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < width; c += 16) {
    const __mmask16 m = tail_mask(width - c);
    const __m512 v = value(c, m);
    _mm512_mask_storeu_ps(buffer.data() + c, m, v);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 factor = _mm512_set1_ps(inverse_norm(squares, eps));
  for (int64_t c = 0; c < width; c += 16) {
    const __mmask16 m = tail_mask(width - c);
    store16(dst + c, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, buffer.data() + c), factor), m);
  }
}

template <typename T>
float row_inverse_norm(const T* row, int64_t width, double eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < width; c += 16) {
    const __m512 v = load16(row + c, tail_mask(width - c));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  return inverse_norm(squares, eps);
}

// Runs row(r, buffer) for every row, a `width`-float scratch buffer per task.
template <typename F>
void for_rows(int64_t rows, int64_t width, F&& row) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(width + 16);
    for (int64_t r = begin; r < end; ++r) row(r, buffer);
  });
}

// The ops take tensors of any shape as rows of their last dimension: contiguous ones as they are, others
// copied (a Python-side reshape costs more than the arithmetic on one row).
int64_t rows_of(const at::Tensor& t) { return t.size(-1) == 0 ? 0 : t.numel() / t.size(-1); }

void check_vector(const at::Tensor& t, int64_t width, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.size(0) == width, op, ": ", name, " must be [", width, "]");
}

// ---- l2_normalize ------------------------------------------------------------------------------------
template <typename T>
void normalize_rows(const at::Tensor& x, double eps, at::Tensor& out) {
  const int64_t width = x.size(-1);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for_rows(rows_of(x), width, [&](int64_t r, std::vector<float>&) {
    const T* row = src + r * width;
    const __m512 factor = _mm512_set1_ps(row_inverse_norm(row, width, eps));
    for (int64_t c = 0; c < width; c += 16) {
      const __mmask16 m = tail_mask(width - c);
      store16(dst + r * width + c, _mm512_mul_ps(load16(row + c, m), factor), m);
    }
  });
}

at::Tensor l2_normalize(const at::Tensor& input, double eps) {
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  depthserve_simd::with_float_types(x.scalar_type(), x.scalar_type(), "l2_normalize", [&](auto t, auto) {
    normalize_rows<decltype(t)>(x, eps, out);
  });
  return out;
}

// ---- ngpt_interpolate --------------------------------------------------------------------------------
template <typename T, typename W>
void interpolate_rows(const at::Tensor& h, const at::Tensor& y, const at::Tensor& rate, double eps, bool normalize,
                      at::Tensor& out) {
  const int64_t width = h.size(-1);
  const T* h_data = h.data_ptr<T>();
  const T* y_data = y.data_ptr<T>();
  const W* rates = rate.data_ptr<W>();
  T* dst = out.data_ptr<T>();
  for_rows(rows_of(h), width, [&](int64_t r, std::vector<float>& buffer) {
    const T* h_row = h_data + r * width;
    const T* y_row = y_data + r * width;
    T* out_row = dst + r * width;
    const __m512 y_factor = _mm512_set1_ps(row_inverse_norm(y_row, width, eps));
    auto moved = [&](int64_t c, __mmask16 m) {
      const __m512 hv = load16(h_row + c, m);
      const __m512 step = _mm512_sub_ps(_mm512_mul_ps(load16(y_row + c, m), y_factor), hv);
      return _mm512_fmadd_ps(load16(rates + c, m), step, hv);
    };
    if (normalize) {
      store_normalized_row(width, eps, buffer, out_row, moved);
      return;
    }
    for (int64_t c = 0; c < width; c += 16) {
      const __mmask16 m = tail_mask(width - c);
      store16(out_row + c, moved(c, m), m);
    }
  });
}

at::Tensor ngpt_interpolate(const at::Tensor& h_in, const at::Tensor& y_in, const at::Tensor& rate, double eps,
                            bool normalize) {
  TORCH_CHECK(h_in.sizes() == y_in.sizes() && h_in.scalar_type() == y_in.scalar_type(), "ngpt_interpolate: h and y alike");
  const at::Tensor h = h_in.contiguous(), y = y_in.contiguous();
  check_vector(rate, h.size(-1), "ngpt_interpolate", "rate");
  at::Tensor out = at::empty(h.sizes(), h.options());
  depthserve_simd::with_float_types(h.scalar_type(), rate.scalar_type(), "ngpt_interpolate", [&](auto t, auto w) {
    interpolate_rows<decltype(t), decltype(w)>(h, y, rate, eps, normalize, out);
  });
  return out;
}

// ---- gated_l2_normalize ------------------------------------------------------------------------------
template <typename T, typename W>
void gate_rows(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& scale, double eps, at::Tensor& out) {
  const int64_t width = x.size(-1);
  const T* x_data = x.data_ptr<T>();
  const T* g_data = gate.data_ptr<T>();
  const W* scales = scale.data_ptr<W>();
  T* dst = out.data_ptr<T>();
  for_rows(rows_of(x), width, [&](int64_t r, std::vector<float>& buffer) {
    const T* x_row = x_data + r * width;
    const T* g_row = g_data + r * width;
    store_normalized_row(width, eps, buffer, dst + r * width, [&](int64_t c, __mmask16 m) {
      return _mm512_mul_ps(load16(x_row + c, m), sigmoid16(_mm512_mul_ps(load16(g_row + c, m), load16(scales + c, m))));
    });
  });
}

at::Tensor gated_l2_normalize(const at::Tensor& x_in, const at::Tensor& gate_in, const at::Tensor& scale,
                              double eps) {
  TORCH_CHECK(x_in.sizes() == gate_in.sizes() && x_in.scalar_type() == gate_in.scalar_type(),
              "gated_l2_normalize: x and gate alike");
  const at::Tensor x = x_in.contiguous(), gate = gate_in.contiguous();
  check_vector(scale, x.size(-1), "gated_l2_normalize", "scale");
  at::Tensor out = at::empty(x.sizes(), x.options());
  depthserve_simd::with_float_types(x.scalar_type(), scale.scalar_type(), "gated_l2_normalize", [&](auto t, auto w) {
    gate_rows<decltype(t), decltype(w)>(x, gate, scale, eps, out);
  });
  return out;
}

// ---- swiglu_l2_normalize -----------------------------------------------------------------------------
template <typename T, typename W>
void swiglu_rows(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& gate_scale, const at::Tensor& up_scale,
                 double eps, at::Tensor& out) {
  const int64_t width = gate.size(-1);
  const T* g_data = gate.data_ptr<T>();
  const T* u_data = up.data_ptr<T>();
  const W* g_scales = gate_scale.data_ptr<W>();
  const W* u_scales = up_scale.data_ptr<W>();
  T* dst = out.data_ptr<T>();
  for_rows(rows_of(gate), width, [&](int64_t r, std::vector<float>& buffer) {
    const T* g_row = g_data + r * width;
    const T* u_row = u_data + r * width;
    store_normalized_row(width, eps, buffer, dst + r * width, [&](int64_t c, __mmask16 m) {
      const __m512 g = _mm512_mul_ps(load16(g_row + c, m), load16(g_scales + c, m));
      const __m512 u = _mm512_mul_ps(load16(u_row + c, m), load16(u_scales + c, m));
      return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid16(g)), u);
    });
  });
}

at::Tensor swiglu_l2_normalize(const at::Tensor& gate_in, const at::Tensor& up_in, const at::Tensor& gate_scale,
                               const at::Tensor& up_scale, double eps) {
  TORCH_CHECK(gate_in.sizes() == up_in.sizes() && gate_in.scalar_type() == up_in.scalar_type(),
              "swiglu_l2_normalize: gate and up alike");
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  check_vector(gate_scale, gate.size(-1), "swiglu_l2_normalize", "gate_scale");
  check_vector(up_scale, gate.size(-1), "swiglu_l2_normalize", "up_scale");
  TORCH_CHECK(gate_scale.scalar_type() == up_scale.scalar_type(), "swiglu_l2_normalize: the scales of one dtype");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  depthserve_simd::with_float_types(gate.scalar_type(), gate_scale.scalar_type(), "swiglu_l2_normalize",
                                    [&](auto t, auto w) {
                                      swiglu_rows<decltype(t), decltype(w)>(gate, up, gate_scale, up_scale, eps, out);
                                    });
  return out;
}

// ---- unit_rope -----------------------------------------------------------------------------------------
template <typename T, typename C, typename W>
void rotate_unit_heads(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const W* scales,
                       double eps, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const T* src = x.data_ptr<T>();
  const C* cos_data = cos.data_ptr<C>();
  const C* sin_data = sin.data_ptr<C>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* c_row = cos_data + t * cos.stride(0);
      const C* s_row = sin_data + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        const T* in = src + t * x.stride(0) + h * x.stride(1);
        T* o = dst + (t * heads + h) * dim;
        const W* s = scales == nullptr ? nullptr : scales + h * dim;
        const __m512 factor = _mm512_set1_ps(row_inverse_norm(in, dim, eps));
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = tail_mask(half - i);
          const __m512 x1 = _mm512_mul_ps(load16(in + i, m), factor), x2 = _mm512_mul_ps(load16(in + half + i, m), factor);
          const __m512 c = load16(c_row + i, m), sn = load16(s_row + i, m);
          __m512 first = _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, sn));
          __m512 second = _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, sn));
          if (s != nullptr) {
            first = _mm512_mul_ps(first, load16(s + i, m));
            second = _mm512_mul_ps(second, load16(s + half + i, m));
          }
          store16(o + i, first, m);
          store16(o + half + i, second, m);
        }
      }
    }
  });
}

// x [tokens, heads, head_dim] (last dimension contiguous); cos and sin [tokens, head_dim / 2]; scale
// [heads * head_dim] in x's dtype or fp32, or undefined (none). A new contiguous tensor in x's dtype.
at::Tensor unit_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const c10::optional<at::Tensor>& scale, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "unit_rope: x [tokens, heads, even head_dim]");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.stride(1) == 1 && sin.stride(1) == 1 &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2) / 2 && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == sin.scalar_type(),
              "unit_rope: cos and sin [tokens, head_dim / 2] of one dtype");
  const bool scaled = scale.has_value() && scale->defined();
  if (scaled) check_vector(*scale, x.size(1) * x.size(2), "unit_rope", "scale");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const at::ScalarType scale_type = scaled ? scale->scalar_type() : x.scalar_type();
  depthserve_simd::with_float_types(x.scalar_type(), cos.scalar_type(), "unit_rope", [&](auto t, auto c) {
    depthserve_simd::with_float_types(scale_type, scale_type, "unit_rope", [&](auto w, auto) {
      using W = decltype(w);
      rotate_unit_heads<decltype(t), decltype(c), W>(x, cos, sin, scaled ? scale->data_ptr<W>() : nullptr, eps, out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthserve_cpu, m) {
  m.def("l2_normalize(Tensor x, float eps) -> Tensor");
  m.def("ngpt_interpolate(Tensor h, Tensor y, Tensor rate, float eps, bool normalize) -> Tensor");
  m.def("gated_l2_normalize(Tensor x, Tensor gate, Tensor scale, float eps) -> Tensor");
  m.def("swiglu_l2_normalize(Tensor gate, Tensor up, Tensor gate_scale, Tensor up_scale, float eps) -> Tensor");
  m.def("unit_rope(Tensor x, Tensor cos, Tensor sin, Tensor? scale, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("l2_normalize", &l2_normalize);
  m.impl("ngpt_interpolate", &ngpt_interpolate);
  m.impl("gated_l2_normalize", &gated_l2_normalize);
  m.impl("swiglu_l2_normalize", &swiglu_l2_normalize);
  m.impl("unit_rope", &unit_rope);
}
