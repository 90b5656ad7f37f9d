// Weights quantized in groups of 32 along the input dimension, times activations that are
// quantized to int8 per group of 32 on the fly, summed with AVX-512 VNNI integer dot products.
// The arithmetic is the one llama.cpp uses for its Q4_1 and Q8_0 files; the weight layout is
// ours: 16 output rows side by side, so that one VPDPBUSD serves 16 rows at once and its int32
// lanes need no horizontal sums. docs/quantization.md explains the formats and
// kernels/cpu_native.py builds and loads this file.
//
// A weight row o holds unsigned codes u in groups g of 32 with an fp16 scale d[o, g] and an fp16
// offset low[o, g]:  w = d * u + low  (bits 4: u in 0..15, GGUF Q4_1 / Q4_0; bits 8: u in 0..255,
// GGUF Q8_0's signed q stored as u = q + 128 with low = -128 d). An activation row x is quantized
// per group as x ~ s * q, s = max|x| / 127, q in -127..127. Then
//   sum_k w[o, k] x[k] ~ sum_g d[o, g] s[g] (u . q)[o, g] + low[o, g] s[g] sum(q)[g],
// with (u . q) exact in int32 (VPDPBUSD multiplies unsigned by signed bytes, four per lane).
//
// Packed layout (kernels/cpu_native.py `pack`): output rows in blocks of 16 (padded with zero
// rows); per block and group, 8 "steps" of 4 inputs each, a step being 64 bytes: byte 4 i + j is
// u[16 b + i, 32 g + 4 t + j]. bits 8 stores the 8 steps (512 bytes a block-group); bits 4 stores 4
// (256 bytes), byte 4 i + j of step t holding step t in its low nibble and step t + 4 in its high one.
// Scales and offsets: fp16 [blocks, groups, 16].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using depthserve_simd::load16;
using depthserve_simd::store16;

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 16;     // output rows side by side in the packed layout
constexpr int64_t kSteps = 8;      // 4-input steps in a group
constexpr int64_t kRowTile = 8;    // activation rows that share one unpacked weight block-group

// Activations quantized per group: codes [n, k], the step s [n, G] and s * sum(q) [n, G]. Refined
// (`refine`, for the LM head, whose logits are compared across the vocabulary): the rounding error
// of each value quantized once more, with the step s / 254, into `residual` codes, so that
// x ~ s q + (s / 254) q' within s / 508 (16-bit precision instead of 8); step_times_sum then holds
// s sum(q) + (s / 254) sum(q').
struct QuantizedActivations {
  int64_t rows, width, groups;
  bool refined;
  std::vector<int8_t> codes, residual;
  std::vector<float> step;
  std::vector<float> step_times_sum;
};

constexpr float kResidualSteps = 254.0f;

inline void store_codes(int8_t* dst, __m512i a, __m512i b) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(b));
}

template <typename T>
QuantizedActivations quantize_activations(const at::Tensor& x, bool refine) {
  QuantizedActivations q{x.size(0), x.size(1), x.size(1) / kGroup, refine, {}, {}, {}, {}};
  q.codes.resize(q.rows * q.width);
  if (refine) q.residual.resize(q.rows * q.width);
  q.step.resize(q.rows * q.groups);
  q.step_times_sum.resize(q.rows * q.groups);
  const T* src = x.data_ptr<T>();
  for (int64_t i = 0; i < q.rows * q.groups; ++i) {
    const T* v = src + (i / q.groups) * x.stride(0) + (i % q.groups) * kGroup;
    const __m512 a = load16(v), b = load16(v + 16);
    const float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float inverse = peak > 0.0f ? 127.0f / peak : 0.0f;
    // rounds to nearest (even on ties), the MXCSR default
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
    store_codes(q.codes.data() + i * kGroup, qa, qb);
    const float step = peak / 127.0f;
    q.step[i] = step;
    float sums = step * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    if (refine) {
      const __m512 s = _mm512_set1_ps(step), fine = _mm512_set1_ps(peak > 0.0f ? kResidualSteps / step : 0.0f);
      const __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), s, a), fine));
      const __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fnmadd_ps(_mm512_cvtepi32_ps(qb), s, b), fine));
      store_codes(q.residual.data() + i * kGroup, ra, rb);
      sums += step / kResidualSteps * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ra, rb)));
    }
    q.step_times_sum[i] = sums;
  }
  return q;
}

// One group's integer dot products of 16 weight rows with 32 activation codes, for each of Rows
// activation rows: step by step across the rows, so that each row's sum is its own chain of 8
// VPDPBUSD and the rows' chains run side by side (one row at a time, the chain's latency, not the
// instruction's throughput, set the pace).
template <int64_t Rows>
inline void group_dots(const __m512i w[], const int8_t* const codes[], __m512 dots[]) {
  __m512i sums[Rows];
  for (int64_t r = 0; r < Rows; ++r) sums[r] = _mm512_setzero_si512();
  for (int64_t t = 0; t < kSteps; ++t)
    for (int64_t r = 0; r < Rows; ++r)
      sums[r] = _mm512_dpbusd_epi32(sums[r], w[t], _mm512_set1_epi32(reinterpret_cast<const int32_t*>(codes[r])[t]));
  for (int64_t r = 0; r < Rows; ++r) dots[r] = _mm512_cvtepi32_ps(sums[r]);
}

inline int64_t block_group_bytes(int64_t bits) { return kBlock * kGroup * bits / 8; }

// Asks for the codes, scales and offsets kPrefetchGroups block-groups ahead of `g`: a one-row decode
// step reads each weight once, from memory, in calls too short for the hardware prefetcher to get
// ahead (docs/quantization.md has the measurement).
constexpr int64_t kPrefetchGroups = 4;

inline void prefetch_ahead(const uint8_t* codes, const c10::Half* scale, const c10::Half* low, int64_t g, int64_t bits) {
  const int64_t stride = block_group_bytes(bits), ahead = g + kPrefetchGroups;
  for (int64_t line = 0; line < stride; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(codes + ahead * stride + line), _MM_HINT_T0);
  if (g % 2 == 0) {  // 32 bytes of scales and of offsets a block-group: a cache line every second one
    _mm_prefetch(reinterpret_cast<const char*>(scale + ahead * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(low + ahead * kBlock), _MM_HINT_T0);
  }
}

// One row's integer dot products with one 4-bit block-group (16 weight rows x 32 inputs), the
// instruction-lean way that a single row needs (group_dots shares the unpacking across rows instead):
// the high nibbles are masked in place, not shifted down, so they enter VPDPBUSD as 16 u and the sum
// of their products is shifted right by 4 once (exact: every product is a multiple of 16); four
// independent chains of two VPDPBUSD each, where one chain of eight would wait on each result.
inline __m512 row_dots_4bit(const uint8_t* src, const int8_t* row_codes) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_nibbles = _mm512_set1_epi8(static_cast<char>(0xF0));
  const int32_t* q = reinterpret_cast<const int32_t*>(row_codes);
  __m512i packed[kSteps / 2];
  for (int64_t t = 0; t < kSteps / 2; ++t) packed[t] = _mm512_loadu_si512(src + 64 * t);
  __m512i low[2], high[2];
  for (int64_t c = 0; c < 2; ++c) {
    low[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(packed[2 * c], low_nibbles),
                                 _mm512_set1_epi32(q[2 * c]));
    high[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(packed[2 * c], high_nibbles),
                                  _mm512_set1_epi32(q[2 * c + kSteps / 2]));
  }
  for (int64_t c = 0; c < 2; ++c) {
    low[c] = _mm512_dpbusd_epi32(low[c], _mm512_and_si512(packed[2 * c + 1], low_nibbles), _mm512_set1_epi32(q[2 * c + 1]));
    high[c] = _mm512_dpbusd_epi32(high[c], _mm512_and_si512(packed[2 * c + 1], high_nibbles),
                                  _mm512_set1_epi32(q[2 * c + 1 + kSteps / 2]));
  }
  const __m512i sixteen_times_high = _mm512_add_epi32(high[0], high[1]);
  return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(low[0], low[1]), _mm512_srai_epi32(sixteen_times_high, 4)));
}

// The 8 steps of one block-group: w[t] byte 4 i + j = u[row i of the block, input 4 t + j of the group].
inline void load_block_group(const uint8_t* src, int64_t bits, __m512i w[kSteps]) {
  if (bits == 8) {
    for (int64_t t = 0; t < kSteps; ++t) w[t] = _mm512_loadu_si512(src + 64 * t);
    return;
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t t = 0; t < kSteps / 2; ++t) {
    const __m512i packed = _mm512_loadu_si512(src + 64 * t);
    w[t] = _mm512_and_si512(packed, nibble);
    w[t + kSteps / 2] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  }
}

void check_weight(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& low, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "group_gemm: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(codes.dtype() == at::kByte && codes.dim() == 3 && codes.is_contiguous() &&
                  codes.size(2) == block_group_bytes(bits),
              "group_gemm: codes must be contiguous uint8 [out / 16, in / 32, ", block_group_bytes(bits), "]");
  for (const at::Tensor* t : {&scale, &low}) {
    TORCH_CHECK(t->dtype() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == codes.size(0) &&
                    t->size(1) == codes.size(1) && t->size(2) == kBlock,
                "group_gemm: scale and low must be contiguous fp16 [out / 16, in / 32, 16]");
  }
}

template <int64_t Rows, bool Refined, typename T>
void block_rows(const uint8_t* codes, const c10::Half* scale, const c10::Half* low, const QuantizedActivations& x,
                int64_t first_row, int64_t bits, T* y, int64_t out_stride) {
  __m512 acc[Rows], dots[Rows];
  for (int64_t r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  __m512i w[kSteps];
  const int8_t* row_codes[Rows];
  const int64_t stride = block_group_bytes(bits);
  for (int64_t g = 0; g < x.groups; ++g) {
    if constexpr (Rows == 1) prefetch_ahead(codes, scale, low, g, bits);  // tiles of more rows are compute-bound
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * kBlock)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + g * kBlock)));
    for (int64_t r = 0; r < Rows; ++r) row_codes[r] = x.codes.data() + (first_row + r) * x.width + g * kGroup;
    if (Rows == 1 && !Refined && bits == 4) {
      dots[0] = row_dots_4bit(codes + g * stride, row_codes[0]);
    } else {
      load_block_group(codes + g * stride, bits, w);
      group_dots<Rows>(w, row_codes, dots);
    }
    for (int64_t r = 0; r < Rows; ++r)
      acc[r] = _mm512_fmadd_ps(dots[r], _mm512_mul_ps(d, _mm512_set1_ps(x.step[(first_row + r) * x.groups + g])), acc[r]);
    if constexpr (Refined) {
      for (int64_t r = 0; r < Rows; ++r) row_codes[r] = x.residual.data() + (first_row + r) * x.width + g * kGroup;
      group_dots<Rows>(w, row_codes, dots);
      for (int64_t r = 0; r < Rows; ++r) {
        const float fine = x.step[(first_row + r) * x.groups + g] / kResidualSteps;
        acc[r] = _mm512_fmadd_ps(dots[r], _mm512_mul_ps(d, _mm512_set1_ps(fine)), acc[r]);
      }
    }
    for (int64_t r = 0; r < Rows; ++r)
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.step_times_sum[(first_row + r) * x.groups + g]), acc[r]);
  }
  for (int64_t r = 0; r < Rows; ++r) store16(y + (first_row + r) * out_stride, acc[r]);
}

template <bool Refined, typename T>
void block_column(const uint8_t* c, const c10::Half* d, const c10::Half* m, const QuantizedActivations& q,
                  int64_t bits, T* column, int64_t padded) {
  int64_t r = 0;
  for (; r + kRowTile <= q.rows; r += kRowTile) block_rows<kRowTile, Refined>(c, d, m, q, r, bits, column, padded);
  for (; r + 4 <= q.rows; r += 4) block_rows<4, Refined>(c, d, m, q, r, bits, column, padded);
  for (; r < q.rows; ++r) block_rows<1, Refined>(c, d, m, q, r, bits, column, padded);
}

template <typename T>
void multiply(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& low,
              int64_t bits, bool refine, at::Tensor& out) {
  const QuantizedActivations q = quantize_activations<T>(x, refine);
  const int64_t blocks = codes.size(0), rows = x.size(0), padded = out.size(1);
  T* y = out.data_ptr<T>();
  const uint8_t* all_codes = codes.data_ptr<uint8_t>();
  const c10::Half* all_scales = scale.data_ptr<c10::Half>();
  const c10::Half* all_lows = low.data_ptr<c10::Half>();
  const int64_t codes_per_block = q.groups * block_group_bytes(bits), scales_per_block = q.groups * kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* c = all_codes + b * codes_per_block;
      const c10::Half* d = all_scales + b * scales_per_block;
      const c10::Half* m = all_lows + b * scales_per_block;
      T* column = y + b * kBlock;
      if (q.refined) block_column<true>(c, d, m, q, bits, column, padded);
      else block_column<false>(c, d, m, q, bits, column, padded);
    }
  });
}

// y [n, out] = x [n, in] times the weight's transpose, in x's dtype (fp32 accumulation, rounded once);
// `out_features` is the unpadded number of output rows.
at::Tensor group_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& low,
                      int64_t bits, int64_t out_features, bool refine) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.stride(1) == 1, "group_gemm: x must be a 2-D CPU tensor, rows contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "group_gemm: x must be fp32 or bf16");
  check_weight(codes, scale, low, bits);
  TORCH_CHECK(x.size(1) == codes.size(1) * kGroup, "group_gemm: x has ", x.size(1), " inputs, the weight ",
              codes.size(1) * kGroup);
  const int64_t padded = codes.size(0) * kBlock;
  TORCH_CHECK(out_features <= padded && out_features > padded - kBlock, "group_gemm: out_features ", out_features,
              " does not match ", codes.size(0), " blocks of 16 rows");
  at::Tensor out = at::empty({x.size(0), padded}, x.options());
  if (x.scalar_type() == at::kFloat) multiply<float>(x, codes, scale, low, bits, refine, out);
  else multiply<at::BFloat16>(x, codes, scale, low, bits, refine, out);
  return out_features == padded ? out : out.narrow(1, 0, out_features).contiguous();
}

// The weight [out, in] = d * u + low in `dtype` (fp32 or bf16), for the prefill path's GEMM.
at::Tensor group_dequantize(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& low, int64_t bits,
                            int64_t out_features, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "group_dequantize: dtype must be float32 or bfloat16");
  check_weight(codes, scale, low, bits);
  const int64_t blocks = codes.size(0), groups = codes.size(1), width = groups * kGroup;
  // [blocks * 16, in]: row-major, each block-group a 16 x 32 tile
  at::Tensor out = at::empty({blocks * kBlock, width}, codes.options().dtype(dtype));
  float* out_float = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* out_bf16 = dtype == at::kBFloat16 ? out.data_ptr<at::BFloat16>() : nullptr;
  const uint8_t* all_codes = codes.data_ptr<uint8_t>();
  const c10::Half* all_scales = scale.data_ptr<c10::Half>();
  const c10::Half* all_lows = low.data_ptr<c10::Half>();
  // each step's bytes as 16 rows x 4 inputs -> 4 input-major lanes per row: transpose via a buffer
  at::parallel_for(0, blocks * groups, 4, [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t tile[kSteps][64];
    alignas(64) float values[kBlock][kGroup];
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / groups, g = bg % groups;
      __m512i w[kSteps];
      load_block_group(all_codes + bg * block_group_bytes(bits), bits, w);
      for (int64_t t = 0; t < kSteps; ++t) _mm512_store_si512(tile[t], w[t]);
      for (int64_t i = 0; i < kBlock; ++i) {
        const float d = static_cast<float>(all_scales[bg * kBlock + i]);
        const float m = static_cast<float>(all_lows[bg * kBlock + i]);
        for (int64_t t = 0; t < kSteps; ++t)
          for (int64_t j = 0; j < 4; ++j) values[i][4 * t + j] = d * static_cast<float>(tile[t][4 * i + j]) + m;
      }
      for (int64_t i = 0; i < kBlock; ++i) {
        const int64_t at = (b * kBlock + i) * width + g * kGroup;
        const __m512 lo = _mm512_load_ps(values[i]), hi = _mm512_load_ps(values[i] + 16);
        if (out_float != nullptr) {
          _mm512_storeu_ps(out_float + at, lo);
          _mm512_storeu_ps(out_float + at + 16, hi);
        } else {
          store16(out_bf16 + at, lo);
          store16(out_bf16 + at + 16, hi);
        }
      }
    }
  });
  return out_features == blocks * kBlock ? out : out.narrow(0, 0, out_features);
}

}  // namespace

TORCH_LIBRARY(depthserve_cpu, m) {
  m.def("group_gemm(Tensor x, Tensor codes, Tensor scale, Tensor low, int bits, int out_features, bool refine) -> Tensor");
  m.def("group_dequantize(Tensor codes, Tensor scale, Tensor low, int bits, int out_features, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("group_gemm", &group_gemm);
  m.impl("group_dequantize", &group_dequantize);
}
