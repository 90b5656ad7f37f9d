// Decode-step attention over the paged KV cache on the CPU, and the store of a step's keys and
// values into it: the same ops as kernels/paged.py (`store_kv`, `paged_decode_attention`), each
// one call instead of the dozen torch ops (gathers, masks, SDPA) the torch version dispatches per
// layer. kernels/cpu_native.py builds and loads this file with group_gemm.cpp.
//
// Layout (kernels/paged.py): k_pages, v_pages [num_pages, block_size, head_dim], one KV head of one
// slot per page; a table row lists, per block of block_size tokens, the page of each KV head.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using depthserve_simd::load16;
using depthserve_simd::store16;

constexpr int64_t kMaxDim = 256;  // head_dim up to 256, a multiple of 16

// Lane i of the result: the sum of v[i]'s 16 lanes (16 horizontal sums in 43 shuffles and adds
// instead of 16 separate reductions).
inline __m512 sum_each(__m512 v[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v0[0]+v0[2], v1[0]+v1[2], v0[1]+v0[3], v1[1]+v1[3]]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of v[4i] .. v[4i + 3]
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // lanes: [v8i..+3 over lanes 0-1, over lanes 2-3, v8i+4..+7 over 0-1, over 2-3]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// exp(x) for x <= 0 (scores minus their maximum), 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by
// its Taylor series to r^7 (truncation below 6e-9, a tenth of an fp32 ulp), times 2^n. Below -87 the
// result is 0 instead of a denormal.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2's high part: n * it is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// A key's or value's row into L1 ahead of use: rows sit on pages scattered over the pool, where the
// hardware's stride prefetch does not follow them.
template <typename P>
inline void prefetch_row(const P* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < dim * static_cast<int64_t>(sizeof(P)); at += 64) _mm_prefetch(bytes + at, _MM_HINT_T0);
}

// A tile of query rows (pre-scaled, in registers) against keys t0 .. t0 + 15 (those before `end`): each
// row's 16 scores stored at rows[g * row_stride + t0]; a key at or past `end` scores 0 (masked later).
template <int Chunks, int kTile, typename P>
inline void score_16_keys(const __m512 (&query)[kTile][Chunks], const __mmask16 (&lanes)[Chunks], int tile,
                          const P* k_pages, const int64_t* offsets, int64_t t0, int64_t end, int64_t dim,
                          float* rows, int64_t row_stride) {
  __m512 products[kTile][16];
  for (int j = 0; j < 16; ++j) {
    if (t0 + j >= end) {
      for (int g = 0; g < kTile; ++g) products[g][j] = _mm512_setzero_ps();
      continue;
    }
    if (t0 + j + 16 < end) prefetch_row(k_pages + offsets[t0 + j + 16], dim);
    const P* key = k_pages + offsets[t0 + j];
    __m512 k[Chunks];
    for (int c = 0; c < Chunks; ++c) k[c] = load16(key + 16 * c, lanes[c]);
    for (int g = 0; g < kTile; ++g) {
      __m512 dot = _mm512_mul_ps(query[g][0], k[0]);
      for (int c = 1; c < Chunks; ++c) dot = _mm512_fmadd_ps(query[g][c], k[c], dot);
      products[g][j] = dot;
    }
  }
  for (int g = 0; g < tile; ++g) _mm512_storeu_ps(rows + g * row_stride + t0, sum_each(products[g]));
}

// A tile of fp32 accumulators (one per query row) plus each row's weight times value t, for keys begin .. end - 1;
// row g's weights sit at probs[g * row_stride + t].
template <int Chunks, int kTile, typename P>
inline void accumulate_values(__m512 (&sum)[kTile][Chunks], const __mmask16 (&lanes)[Chunks], int tile,
                              const P* v_pages, const int64_t* offsets, int64_t begin, int64_t end, int64_t dim,
                              const float* probs, int64_t row_stride) {
  for (int64_t t = begin; t < end; ++t) {
    if (t + 16 < end) prefetch_row(v_pages + offsets[t + 16], dim);
    const P* value = v_pages + offsets[t];
    __m512 v[Chunks];
    for (int c = 0; c < Chunks; ++c) v[c] = load16(value + 16 * c, lanes[c]);
    for (int g = 0; g < kTile; ++g) {
      if (g >= tile) break;
      const __m512 p = _mm512_set1_ps(probs[g * row_stride + t]);
      for (int c = 0; c < Chunks; ++c) sum[g][c] = _mm512_fmadd_ps(p, v[c], sum[g][c]);
    }
  }
}

// Scores s[0 .. length) into their softmax, in place (fp32).
inline void softmax_in_place(float* s, int64_t length) {
  __m512 peaks = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < length; t += 16)
    peaks = _mm512_mask_max_ps(peaks, depthserve_simd::tail_mask(length - t), peaks, _mm512_loadu_ps(s + t));
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(peaks));
  __m512 totals = _mm512_setzero_ps();
  for (int64_t t = 0; t < length; t += 16) {
    const __mmask16 m = depthserve_simd::tail_mask(length - t);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), peak)));
    _mm512_storeu_ps(s + t, e);
    totals = _mm512_add_ps(totals, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(totals));
  for (int64_t t = 0; t < length; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inverse));
}

// One (sequence, KV head): its group of query heads over its keys, softmax in fp32 in two passes
// (scores, then the weighted sum of values). Scores are computed 16 keys at a time.
//
// Chunks is dim / 16 rounded up to a power of two (the lanes past dim masked off), a compile-time
// count so that a key, a value and the group tile's accumulators stay in registers: with run-time
// counts they lived on the stack, and each value's multiply-add waited on the previous one's store.
// The query heads are taken kTile at a time (12 accumulator registers for a 64-wide head).
template <int Chunks, typename Q, typename P>
void attend_one(const Q* q, int64_t q_head_stride, int64_t group, const P* k_pages, const P* v_pages,
                const int64_t* offsets, int64_t length, int64_t dim, float scale, Q* out, int64_t out_head_stride,
                std::vector<float>& scores) {
  constexpr int kTile = Chunks >= 8 ? 1 : 12 / Chunks > 8 ? 8 : 12 / Chunks;
  __mmask16 lanes[Chunks];
  for (int c = 0; c < Chunks; ++c) lanes[c] = depthserve_simd::tail_mask(std::max<int64_t>(0, dim - 16 * c));
  if (length <= 0) {  // nothing visible (a padding row): zeros, as a fully masked row has no weights
    for (int64_t g = 0; g < group; ++g)
      for (int c = 0; c < Chunks; ++c) store16(out + g * out_head_stride + 16 * c, _mm512_setzero_ps(), lanes[c]);
    return;
  }
  const int64_t padded = (length + 15) / 16 * 16;
  scores.resize(kTile * padded);
  for (int64_t g0 = 0; g0 < group; g0 += kTile) {
    const int tile = static_cast<int>(std::min<int64_t>(kTile, group - g0));
    __m512 query[kTile][Chunks];
    for (int g = 0; g < kTile; ++g)
      for (int c = 0; c < Chunks; ++c)
        query[g][c] = g < tile ? _mm512_mul_ps(load16(q + (g0 + g) * q_head_stride + 16 * c, lanes[c]),
                                               _mm512_set1_ps(scale))
                               : _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < length; t0 += 16)
      score_16_keys<Chunks, kTile, P>(query, lanes, tile, k_pages, offsets, t0, length, dim, scores.data(), padded);
    for (int g = 0; g < tile; ++g) softmax_in_place(scores.data() + g * padded, length);
    __m512 acc[kTile][Chunks];
    for (int g = 0; g < kTile; ++g)
      for (int c = 0; c < Chunks; ++c) acc[g][c] = _mm512_setzero_ps();
    accumulate_values<Chunks, kTile, P>(acc, lanes, tile, v_pages, offsets, 0, length, dim, scores.data(), padded);
    for (int g = 0; g < tile; ++g)
      for (int c = 0; c < Chunks; ++c) store16(out + (g0 + g) * out_head_stride + 16 * c, acc[g][c], lanes[c]);
  }
}

// One (sequence, KV head, run of `queries` consecutive queries of a prompt chunk): query i sits at
// position start + i and sees keys 0 .. start + i. Rows are (query, head of the group) pairs. The
// keys are taken kKeyBlock at a time for every query of the run, so that a block read from memory
// serves them all from cache (one decode-style pass per query would read the whole context once per
// query: at thousands of cached positions that traffic, not the arithmetic, set a chunk's time).
// Two passes as in attend_one: every row's scores, softmax per row, then the weighted sum of values,
// whose fp32 accumulators live in `acc` between blocks.
constexpr int64_t kKeyBlock = 256;

template <int Chunks, typename Q, typename P>
void attend_chunk(const Q* q, int64_t q_token_stride, int64_t q_head_stride, int64_t queries, int64_t group,
                  int64_t start, const P* k_pages, const P* v_pages, const int64_t* offsets, int64_t dim, float scale,
                  Q* out, int64_t out_token_stride, std::vector<float>& scores, std::vector<float>& acc) {
  constexpr int kTile = Chunks >= 8 ? 1 : 12 / Chunks > 8 ? 8 : 12 / Chunks;
  __mmask16 lanes[Chunks];
  for (int c = 0; c < Chunks; ++c) lanes[c] = depthserve_simd::tail_mask(std::max<int64_t>(0, dim - 16 * c));
  const int64_t keys = start + queries, padded = (keys + 15) / 16 * 16, rows = queries * group;
  scores.resize(rows * padded);
  acc.assign(rows * dim, 0.0f);
  auto length_of = [&](int64_t i) { return start + i + 1; };
  for (int64_t block = 0; block < keys; block += kKeyBlock) {
    for (int64_t i = 0; i < queries; ++i) {
      const int64_t end = std::min(block + kKeyBlock, length_of(i));
      if (end <= block) continue;
      for (int64_t g0 = 0; g0 < group; g0 += kTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kTile, group - g0));
        __m512 query[kTile][Chunks];
        for (int g = 0; g < kTile; ++g)
          for (int c = 0; c < Chunks; ++c)
            query[g][c] = g < tile ? _mm512_mul_ps(load16(q + i * q_token_stride + (g0 + g) * q_head_stride + 16 * c,
                                                          lanes[c]), _mm512_set1_ps(scale))
                                   : _mm512_setzero_ps();
        for (int64_t t0 = block; t0 < end; t0 += 16)
          score_16_keys<Chunks, kTile, P>(query, lanes, tile, k_pages, offsets, t0, end, dim,
                                          scores.data() + (i * group + g0) * padded, padded);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) softmax_in_place(scores.data() + r * padded, length_of(r / group));
  for (int64_t block = 0; block < keys; block += kKeyBlock) {
    for (int64_t i = 0; i < queries; ++i) {
      const int64_t end = std::min(block + kKeyBlock, length_of(i));
      if (end <= block) continue;
      for (int64_t g0 = 0; g0 < group; g0 += kTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kTile, group - g0));
        float* row_acc = acc.data() + (i * group + g0) * dim;
        const float* row_p = scores.data() + (i * group + g0) * padded;
        __m512 sum[kTile][Chunks];
        for (int g = 0; g < kTile; ++g)
          for (int c = 0; c < Chunks; ++c)
            sum[g][c] = g < tile ? _mm512_maskz_loadu_ps(lanes[c], row_acc + g * dim + 16 * c) : _mm512_setzero_ps();
        accumulate_values<Chunks, kTile, P>(sum, lanes, tile, v_pages, offsets, block, end, dim, row_p, padded);
        for (int g = 0; g < tile; ++g)
          for (int c = 0; c < Chunks; ++c) _mm512_mask_storeu_ps(row_acc + g * dim + 16 * c, lanes[c], sum[g][c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < Chunks; ++c)
      store16(out + (r / group) * out_token_stride + (r % group) * dim + 16 * c,
              _mm512_maskz_loadu_ps(lanes[c], acc.data() + r * dim + 16 * c), lanes[c]);
}

// Each key's element offset into the pages, keys first .. length - 1 (offsets[0] is key first's),
// walked page by page (an integer division per key and pass cost more than the key's arithmetic).
// The pages of keys before `first` are never read: a sliding window's may have been given back.
template <typename I>
void key_offsets(const I* pages, int64_t page_stride, int64_t first, int64_t length, int64_t block_size, int64_t dim,
                 std::vector<int64_t>& offsets) {
  offsets.resize(std::max<int64_t>(length - first, 0));
  for (int64_t t = first; t < length;) {
    const int64_t b = t / block_size, page_end = std::min(length, (b + 1) * block_size);
    const int64_t base = (static_cast<int64_t>(pages[b * page_stride]) - b) * block_size * dim;
    for (; t < page_end; ++t) offsets[t - first] = base + t * dim;
  }
}

template <typename Q, typename P, typename I>
void decode_attention(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                      const at::Tensor& table, const std::vector<int64_t>& lengths, double scale, int64_t window,
                      at::Tensor& out) {
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2), kv_heads = table.size(1);
  const int64_t blocks = table.size(2), block_size = k_pages.size(1), group = q_heads / kv_heads;
  const Q* q_data = q.data_ptr<Q>();
  Q* out_data = out.data_ptr<Q>();
  const P* k_data = k_pages.data_ptr<P>();
  const P* v_data = v_pages.data_ptr<P>();
  const I* table_data = table.data_ptr<I>();  // read through its strides: the caller's view is transposed
  const int64_t chunks = (dim + 15) / 16;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      const int64_t length = std::min(lengths[b], blocks * block_size);
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t first_head = h * group;
      key_offsets(table_data + b * table.stride(0) + h * table.stride(1), table.stride(2), first_key, length,
                  block_size, dim, offsets);
      const Q* q_first = q_data + b * q.stride(0) + first_head * q.stride(1);
      Q* out_first = out_data + (b * q_heads + first_head) * dim;
      auto attend = [&](auto chunk_count) {
        attend_one<decltype(chunk_count)::value, Q, P>(q_first, q.stride(1), group, k_data, v_data, offsets.data(),
                                                      length - first_key, dim, static_cast<float>(scale), out_first,
                                                      dim, scores);
      };
      if (chunks <= 1) attend(std::integral_constant<int, 1>{});
      else if (chunks <= 2) attend(std::integral_constant<int, 2>{});
      else if (chunks <= 4) attend(std::integral_constant<int, 4>{});
      else if (chunks <= 8) attend(std::integral_constant<int, 8>{});
      else attend(std::integral_constant<int, 16>{});
    }
  });
}

template <typename Q, typename P>
void decode_attention_indexed(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                              const at::Tensor& table, const std::vector<int64_t>& lengths, double scale,
                              int64_t window, at::Tensor& out) {
  if (table.scalar_type() == at::kInt)
    decode_attention<Q, P, int32_t>(q, k_pages, v_pages, table, lengths, scale, window, out);
  else
    decode_attention<Q, P, int64_t>(q, k_pages, v_pages, table, lengths, scale, window, out);
}

std::vector<int64_t> as_lengths(const at::Tensor& context_lens) {
  std::vector<int64_t> lengths(context_lens.numel());
  if (context_lens.scalar_type() == at::kInt) {
    const auto values = context_lens.accessor<int32_t, 1>();
    for (int64_t i = 0; i < context_lens.numel(); ++i) lengths[i] = values[i];
  } else {
    const auto values = context_lens.accessor<int64_t, 1>();
    for (int64_t i = 0; i < context_lens.numel(); ++i) lengths[i] = values[i];
  }
  return lengths;
}

// `window`: a query sees only the last `window` keys, its own included (a sliding-window layer); none: all.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                                  const at::Tensor& page_table, const at::Tensor& context_lens, double scale,
                                  c10::optional<int64_t> window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode_attention: q must be [batch, heads, dim], dim contiguous");
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous() && k_pages.dtype() == v_pages.dtype(),
              "paged_decode_attention: contiguous K and V pages of one dtype");
  const int64_t dim = q.size(2), kv_heads = page_table.size(1);
  TORCH_CHECK(dim % 16 == 0 && dim <= kMaxDim, "paged_decode_attention: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.size(1) % kv_heads == 0 && q.size(1) / kv_heads <= 8,
              "paged_decode_attention: at most 8 query heads per KV head");
  TORCH_CHECK(k_pages.size(2) == dim, "paged_decode_attention: pages of head_dim ", k_pages.size(2));
  TORCH_CHECK(page_table.dim() == 3 && (page_table.scalar_type() == at::kInt || page_table.scalar_type() == at::kLong),
              "paged_decode_attention: an int32 or int64 page table [batch, kv_heads, blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && (context_lens.scalar_type() == at::kInt || context_lens.scalar_type() == at::kLong),
              "paged_decode_attention: int32 or int64 context lengths [batch]");
  const std::vector<int64_t> lengths = as_lengths(context_lens);
  at::Tensor out = at::empty({q.size(0), q.size(1), dim}, q.options());
  depthserve_simd::with_float_types(q.scalar_type(), k_pages.scalar_type(), "paged_decode_attention",
                                    [&](auto query, auto page) {
    decode_attention_indexed<decltype(query), decltype(page)>(q, k_pages, v_pages, page_table, lengths, scale,
                                                              window.value_or(0), out);
  });
  return out;
}

// A run of one prompt chunk's queries for one KV head: a unit of work of the varlen prefill.
struct ChunkWork {
  int64_t seq, head, first, count;
};

template <typename Q, typename P, typename I>
void prefill_attention(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                       const at::Tensor& tables, const std::vector<int64_t>& query_starts,
                       const std::vector<int64_t>& lengths, double scale, at::Tensor& out) {
  const int64_t seqs = tables.size(0), kv_heads = tables.size(1), blocks = tables.size(2);
  const int64_t q_heads = q.size(1), dim = q.size(2), group = q_heads / kv_heads, block_size = k_pages.size(1);
  // Runs of queries small enough that every thread gets work (a chunk of a few tokens over thousands
  // of cached keys is the case this kernel is for), large enough to share each key block widely.
  const int64_t threads = at::get_num_threads();
  std::vector<ChunkWork> work;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t count = query_starts[s + 1] - query_starts[s];
    if (count <= 0) continue;
    const int64_t parts = std::min<int64_t>(count, (2 * threads + seqs * kv_heads - 1) / (seqs * kv_heads));
    const int64_t run = (count + parts - 1) / parts;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t first = 0; first < count; first += run)
        work.push_back({s, h, first, std::min(run, count - first)});
  }
  const Q* q_data = q.data_ptr<Q>();
  Q* out_data = out.data_ptr<Q>();
  const P* k_data = k_pages.data_ptr<P>();
  const P* v_data = v_pages.data_ptr<P>();
  const I* table_data = tables.data_ptr<I>();  // through its strides: the caller's view is transposed
  const int64_t chunks = (dim + 15) / 16;
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(work.size()));
  // Work items interleaved over the threads: later runs of a chunk see more keys than earlier ones.
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    std::vector<int64_t> offsets;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (size_t w = worker; w < work.size(); w += workers) {
        const ChunkWork& item = work[w];
        const int64_t count = query_starts[item.seq + 1] - query_starts[item.seq];
        const int64_t start = lengths[item.seq] - count + item.first;  // position of the run's first query
        TORCH_CHECK(start >= 0 && start + item.count <= blocks * block_size,
                    "paged_prefill_attention_varlen: context length out of the page table's range");
        key_offsets(table_data + item.seq * tables.stride(0) + item.head * tables.stride(1), tables.stride(2), 0,
                    start + item.count, block_size, dim, offsets);
        const int64_t token = query_starts[item.seq] + item.first, first_head = item.head * group;
        const Q* q_first = q_data + token * q.stride(0) + first_head * q.stride(1);
        Q* out_first = out_data + (token * q_heads + first_head) * dim;
        auto attend = [&](auto chunk_count) {
          attend_chunk<decltype(chunk_count)::value, Q, P>(q_first, q.stride(0), q.stride(1), item.count, group, start,
                                                          k_data, v_data, offsets.data(), dim,
                                                          static_cast<float>(scale), out_first, q_heads * dim, scores,
                                                          acc);
        };
        if (chunks <= 1) attend(std::integral_constant<int, 1>{});
        else if (chunks <= 2) attend(std::integral_constant<int, 2>{});
        else if (chunks <= 4) attend(std::integral_constant<int, 4>{});
        else if (chunks <= 8) attend(std::integral_constant<int, 8>{});
        else attend(std::integral_constant<int, 16>{});
      }
    }
  });
}

at::Tensor paged_prefill_attention_varlen(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                                          const at::Tensor& page_tables, const at::Tensor& query_starts,
                                          const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1,
              "paged_prefill_attention_varlen: q must be [tokens, heads, dim], dim contiguous");
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous() && k_pages.dtype() == v_pages.dtype(),
              "paged_prefill_attention_varlen: contiguous K and V pages of one dtype");
  const int64_t dim = q.size(2);
  TORCH_CHECK(page_tables.dim() == 3 && (page_tables.scalar_type() == at::kInt || page_tables.scalar_type() == at::kLong),
              "paged_prefill_attention_varlen: an int32 or int64 page table [seqs, kv_heads, blocks]");
  const int64_t kv_heads = page_tables.size(1);
  TORCH_CHECK(dim % 16 == 0 && dim <= kMaxDim,
              "paged_prefill_attention_varlen: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.size(1) % kv_heads == 0, "paged_prefill_attention_varlen: query heads a multiple of KV heads");
  TORCH_CHECK(k_pages.size(2) == dim, "paged_prefill_attention_varlen: pages of head_dim ", k_pages.size(2));
  TORCH_CHECK(query_starts.dim() == 1 && query_starts.numel() == page_tables.size(0) + 1 &&
                  context_lens.dim() == 1 && context_lens.numel() == page_tables.size(0),
              "paged_prefill_attention_varlen: query_starts [seqs + 1] and context_lens [seqs]");
  const std::vector<int64_t> starts = as_lengths(query_starts), lengths = as_lengths(context_lens);
  TORCH_CHECK(starts.front() == 0 && starts.back() == q.size(0),
              "paged_prefill_attention_varlen: query_starts must run from 0 to the number of queries");
  at::Tensor out = at::empty({q.size(0), q.size(1), dim}, q.options());
  depthserve_simd::with_float_types(q.scalar_type(), k_pages.scalar_type(), "paged_prefill_attention_varlen",
                                    [&](auto query, auto page) {
    using Q = decltype(query);
    using P = decltype(page);
    if (page_tables.scalar_type() == at::kInt)
      prefill_attention<Q, P, int32_t>(q, k_pages, v_pages, page_tables, starts, lengths, scale, out);
    else prefill_attention<Q, P, int64_t>(q, k_pages, v_pages, page_tables, starts, lengths, scale, out);
  });
  return out;
}

// k, v [tokens, kv_heads, dim] into the pages at slot_index [tokens, kv_heads] (page * block_size +
// offset; -1: a padding row, not stored), converted to the pages' dtype.
template <typename S, typename P, typename I>
void store_rows(const at::Tensor& source, at::Tensor& pages, const at::Tensor& index) {
  const int64_t tokens = source.size(0), heads = source.size(1), dim = source.size(2);
  const S* src = source.data_ptr<S>();
  P* dst = pages.data_ptr<P>();
  const I* slots = index.data_ptr<I>();  // [tokens, heads] through its strides: a column slice of the step's index
  for (int64_t i = 0; i < tokens * heads; ++i) {
    const int64_t token = i / heads, head = i % heads;
    const int64_t slot = slots[token * index.stride(0) + head * index.stride(1)];
    if (slot < 0) continue;
    const S* row = src + token * source.stride(0) + head * source.stride(1);
    P* target = dst + slot * dim;
    for (int64_t c = 0; c < dim; c += 16) store16(target + c, load16(row + c));
  }
}

template <typename S, typename P>
void store_rows_indexed(const at::Tensor& source, at::Tensor& pages, const at::Tensor& index) {
  if (index.scalar_type() == at::kInt) store_rows<S, P, int32_t>(source, pages, index);
  else store_rows<S, P, int64_t>(source, pages, index);
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pages, at::Tensor& v_pages,
              const at::Tensor& slot_index) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv: k and v must be [tokens, heads, dim], dim contiguous");
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous(), "store_kv: contiguous pages");
  TORCH_CHECK(k.size(2) % 16 == 0 && k_pages.size(2) == k.size(2), "store_kv: head_dim a multiple of 16");
  TORCH_CHECK(k.dtype() == v.dtype() && k_pages.dtype() == v_pages.dtype(), "store_kv: one dtype for k and v");
  const at::Tensor index = slot_index.dim() == 2 ? slot_index : slot_index.view({k.size(0), k.size(1)});
  TORCH_CHECK(index.size(0) == k.size(0) && index.size(1) == k.size(1) &&
                  (index.scalar_type() == at::kInt || index.scalar_type() == at::kLong),
              "store_kv: an int32 or int64 slot index [tokens, heads]");
  depthserve_simd::with_float_types(k.scalar_type(), k_pages.scalar_type(), "store_kv", [&](auto row, auto page) {
    store_rows_indexed<decltype(row), decltype(page)>(k, k_pages, index);
    store_rows_indexed<decltype(row), decltype(page)>(v, v_pages, index);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor context_lens, "
        "float scale, int? window=None) -> Tensor");
  m.def("paged_prefill_attention_varlen(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_tables, "
        "Tensor query_starts, Tensor context_lens, float scale) -> Tensor");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor slot_index) -> ()");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention_varlen", &paged_prefill_attention_varlen);
  m.impl("store_kv", &store_kv);
}
