// 16 fp32 lanes loaded from and stored to fp32 or bf16 memory (AVX-512), shared by the native CPU
// kernels. bf16 stores round to nearest even (finite values: what these kernels store is finite).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace depthserve_simd {

inline __m512 load16(const float* p, __mmask16 m = 0xFFFF) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const at::BFloat16* p, __mmask16 m = 0xFFFF) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}

inline void store16(float* p, __m512 v, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, v); }

inline void store16(at::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, round_to_bf16(v));
}

// e^x in fp32 lanes for x in [-87.4, 88.7]: 2^n * p(r), x = n ln2 + r with |r| <= ln2 / 2, p Cephes'
// degree-6 polynomial for expf (relative error ~1e-7), 2^n applied with VSCALEFPS. Outside that range
// the result flushes towards 0 or overflows to inf (callers clamp where they need more).
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: n * the first is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// e^-z with -z clamped to [-88, 88] (e^88 ~ 1.7e38), so that 1 + e^-z stays finite (SiLU's and the
// sigmoid's denominator); a NaN z stays NaN
inline __m512 exp_of_minus_clamped(__m512 z) {
  const __m512 minus = _mm512_max_ps(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), _mm512_set1_ps(88.0f)),
                                     _mm512_set1_ps(-88.0f));
  return exp16(minus);
}

// the lanes of the last 16-wide chunk of a row that `left` values remain in
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// Calls f(A{}, B{}) with A and B each float or at::BFloat16, as `first` and `second` are fp32 or bf16
// (the kernels' two element types); any other dtype is an error naming `op`.
template <typename F>
void with_float_types(at::ScalarType first, at::ScalarType second, const char* op, F&& f) {
  for (const at::ScalarType t : {first, second})
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, op, ": fp32 or bf16 tensors, got ", t);
  auto with_second = [&](auto a) {
    if (second == at::kBFloat16) f(a, at::BFloat16{});
    else f(a, float{});
  };
  if (first == at::kBFloat16) with_second(at::BFloat16{});
  else with_second(float{});
}

}  // namespace depthserve_simd
