// Greedy decoding's reductions over each row of fp32 logits in two passes over the row: its first
// maximum and that maximum's index (what torch's argmax returns), and its log-normalizer
// log(sum(exp(x - max))) + max, with each exp's argument floored at `floor` (the sampler's
// EXP_FLOOR: below it exp is a denormal in fp32, which x86 computes ~20x slower). torch spends
// three reductions and a [rows, vocab] temporary on these (argmax alone ~2.7 ms for 32 rows of
// 49,152 on the 2-core Xeon). A row holding a NaN reports a NaN maximum (the caller falls back to
// torch there); a row of -inf reports -inf and index 0.
// kernels/cpu_native.py builds and loads this file with the others.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

// (first maximum, its index) of one row; NaN maximum if the row holds a NaN.
std::pair<float, int64_t> first_max(const float* row, int64_t width) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 best = _mm512_set1_ps(neg_inf);
  __m512i best_index = _mm512_setzero_si512();
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t c = 0; c < width; c += 16) {
    const __mmask16 m = depthserve_simd::tail_mask(width - c);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), m, row + c);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: a lane keeps its first
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    index = _mm512_add_epi32(index, step);
  }
  if (nan) return {std::numeric_limits<float>::quiet_NaN(), 0};
  const float peak = _mm512_reduce_max_ps(best);
  const __mmask16 at_peak = _mm512_cmp_ps_mask(best, _mm512_set1_ps(peak), _CMP_EQ_OQ);
  // the first index among the lanes holding the maximum (each lane's is its first)
  const int32_t first = _mm512_mask_reduce_min_epi32(at_peak, best_index);
  return {peak, peak == neg_inf ? 0 : static_cast<int64_t>(first)};
}

float log_normalizer(const float* row, int64_t width, float peak, float floor) {
  if (!std::isfinite(peak)) return peak;
  const __m512 shift = _mm512_set1_ps(peak), lowest = _mm512_set1_ps(floor);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < width; c += 16) {
    const __mmask16 m = depthserve_simd::tail_mask(width - c);
    const __m512 v = _mm512_maskz_loadu_ps(m, row + c);
    sum = _mm512_mask_add_ps(sum, m, sum, depthserve_simd::exp16(_mm512_max_ps(_mm512_sub_ps(v, shift), lowest)));
  }
  return std::log(_mm512_reduce_add_ps(sum)) + peak;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits, double floor) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "greedy_pick: fp32 logits [rows, vocab] with contiguous rows");
  TORCH_CHECK(floor >= -87.0 && floor < 0, "greedy_pick: floor must lie in [-87, 0)");
  const int64_t rows = logits.size(0), width = logits.size(1), stride = logits.stride(0);
  at::Tensor token = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor peak = at::empty({rows}, logits.options());
  at::Tensor log_z = at::empty({rows}, logits.options());
  const float* src = logits.data_ptr<float>();
  int64_t* token_out = token.data_ptr<int64_t>();
  float* peak_out = peak.data_ptr<float>();
  float* log_z_out = log_z.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = src + r * stride;
      const auto [top, top_index] = first_max(row, width);
      token_out[r] = top_index;
      peak_out[r] = top;
      log_z_out[r] = log_normalizer(row, width, top, static_cast<float>(floor));
    }
  });
  return {token, peak, log_z};
}

// A structured-output constraint's token bitmask applied to fp32 logits in place: row rows[i] of the
// logits gets -inf at every token t < limit whose bit (t % 32 of word t / 32 of bitmask row i) is
// clear, and at every column from limit on. One masked store per 16 tokens, nothing where a word
// allows all 32; torch's ops built a [rows, vocab] bias or bool mask first (2-6 ms for 32 rows of
// 49,152 on the 2-core Xeon).
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows, int64_t limit) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: fp32 logits [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: a contiguous int32 bitmask [rows, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: one int64 logits row per bitmask row");
  const int64_t width = logits.size(1), words = bitmask.size(1), stride = logits.stride(0);
  TORCH_CHECK(limit >= 0 && limit <= width && limit <= words * 32, "apply_token_bitmask: limit out of range");
  const int64_t* row_index = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(row_index[i] >= 0 && row_index[i] < logits.size(0), "apply_token_bitmask: row out of range");
  float* out = logits.data_ptr<float>();
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = out + row_index[i] * stride;
      const uint32_t* row_mask = mask + i * words;
      for (int64_t c = 0; c < limit; c += 32) {
        const uint32_t allowed = row_mask[c / 32];
        if (allowed == 0xFFFFFFFFu && c + 32 <= limit) continue;
        const __mmask16 low = static_cast<__mmask16>(~allowed & 0xFFFFu) & depthserve_simd::tail_mask(limit - c);
        _mm512_mask_storeu_ps(row + c, low, neg_inf);
        if (c + 16 < limit) {
          const __mmask16 high = static_cast<__mmask16>(~allowed >> 16) & depthserve_simd::tail_mask(limit - c - 16);
          _mm512_mask_storeu_ps(row + c + 16, high, neg_inf);
        }
      }
      for (int64_t c = limit; c < width; c += 16) _mm512_mask_storeu_ps(row + c, depthserve_simd::tail_mask(width - c), neg_inf);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthserve_cpu, m) {
  m.def("greedy_pick(Tensor logits, float floor) -> (Tensor, Tensor, Tensor)");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows, int limit) -> ()");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("greedy_pick", &greedy_pick);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
