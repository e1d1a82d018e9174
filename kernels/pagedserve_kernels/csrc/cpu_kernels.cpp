// C++ kernels for CPU runs (pagedserve_kernels/cpu.py builds and loads them); layouts as in
// pagedserve_kernels/reference.py.
//
// paged_attention_decode: one query token a row (a decoding sequence's, or one prompt token's with the
// context up to it: reference.prefill_rows), read straight from the paged KV cache (no gathered copy
// of the context), softmax in float32. Threads take runs of rows of about equal work (context
// tokens). Two paths:
// - bfloat16 with head size 64, 96, 128 or 256 where the compiler targets AVX512-BF16
//   (decode_kernel_avx512_bf16): tiles of up to 256 tokens, K rows scored in bf16 by vdpbf16ps, 16
//   tokens' scores reduced into one vector, softmax weights over the tile, V accumulated in registers;
// - everything else (decode_kernel): an online softmax over chunks of 16 tokens; the chunk's K slots
//   (every KV head) are widened to float32 once and scored against every query head, then its V
//   slots are widened and accumulated.
// Both trust the block ids they read: check_block_tables (paged_checks.h) has checked them first.
// Under a sliding window of W tokens (`window` > 0) a row reads only its context's last W slots: its
// key loop starts at the first of them, so a long context costs only the window.
// Under soft-capping (`softcap` c > 0, Gemma 2's attention logit soft-capping) each score s (already
// times the scale) becomes c * tanh(s / c) before the softmax (tanh_float, tanh16: within 2e-7 of
// tanh); without it the score loops run as before, past one branch a chunk (generic) or tile (AVX512).
// Under attention sinks (`sinks`, GPT-OSS's: one float32 logit a query head, no value) each head's
// online softmax starts from its sink (running max sinks[h], running sum exp(0) = 1, accumulator 0);
// without them (a null pointer) it starts from -inf and 0 as before: a branch a row, none in the loops.
// Under ALiBi (`alibi_slopes`, BLOOM's and MPT's: one float32 slope a query head) each score (after
// any softcap) gains slope * (key position - query position); without them, a branch a chunk or tile.
//
// paged_attention_prefill: causal attention of packed prompt chunks (bfloat16, head size 64, 96, 128
// or 256, AVX512-BF16 builds only), the engine's bf16 prefill path: tiles of query tokens times the
// heads of a KV head's group, 16 lanes, scores and P V both by vdpbf16ps (prefill_kernel_avx512_bf16).
// Each K/V row is read once a tile, not once a query token as the decode kernel over prefill rows
// reads it.
// Under a window a tile's keys start at the first its earliest token sees; under a softcap the scores
// are capped as decode caps them, before the mask; under sinks each lane starts from its head's sink;
// under ALiBi each lane's scores gain its head's slope times the key's distance from its token.
//
// write_kv_cache: this step's K/V rows copied into their slots, one call per layer.
//
// argmax_rows: greedy sampling's argmax over each row of the logits, as torch's max(dim).indices
// picks it (the first maximum; a NaN beats everything, the first NaN wins), read in the logits' own
// dtype: a vectorized pass for the maximum, then one for its first position.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "decode_parts.h"
#include "ops.h"
#include "paged_checks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PAGEDSERVE_AVX512 1
#endif
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_AVX512_BF16 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kChunk = 16;

inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;  // bf16 = top half of a float
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// kDim > 0: the head size known at compile time (loops fully unrolled); 0: `dim` at run time.
// s[t] = q . rows[t] for the n rows of a chunk (`stride` floats apart).
template <int64_t kDim>
inline void score_chunk(const float* __restrict q, const float* __restrict rows, int64_t stride, int64_t n,
                        float* __restrict s, int64_t dim) {
  const int64_t size = kDim > 0 ? kDim : dim;
  for (int64_t t = 0; t < n; ++t) {
    const float* __restrict row = rows + t * stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < size; ++i) sum += q[i] * row[i];
    s[t] = sum;
  }
}

// acc += sum over t of p[t] * rows[t] for the n rows of a chunk.
template <int64_t kDim>
inline void accumulate_chunk(const float* __restrict p, const float* __restrict rows, int64_t stride, int64_t n,
                             float* __restrict acc, int64_t dim) {
  const int64_t size = kDim > 0 ? kDim : dim;
  for (int64_t t = 0; t < n; ++t) {
    const float* __restrict row = rows + t * stride;
    const float w = p[t];
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) acc[i] += w * row[i];
  }
}

template <int64_t kDim>
inline void scale_by(float alpha, float* y, int64_t dim) {
  const int64_t n = kDim > 0 ? kDim : dim;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

// exp(x) for x <= 0 (scores minus their running max), written so that a loop of it vectorizes:
// 2^n * p(r) with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2], p a degree-6 Taylor
// polynomial (relative error below 2e-7, about one float32 ulp). Below -87 it returns exp(-87), ~1.6e-38.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 split in two for precision
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;  // times 2^n
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// tanh(x) within 2e-7 (measured against float64 tanh over [-30, 30]: 1.2e-7 absolute, 2.5e-7
// relative, libm's tanhf 1.0e-7), written so that a loop of it vectorizes: below |x| = 0.5 the odd
// Taylor polynomial to x^15 (truncation below 1e-8, relative precision near 0), from there
// (1 - e) / (1 + e) with e = exp(-2|x|), whose non-positive argument exp_nonpositive takes (nothing
// overflows: past |x| ~ 43, e ~ 1e-38 and the result 1), the sign put back. NaN stays NaN (it takes
// the polynomial's side of the compare).
constexpr float kTanhTaylorBelow = 0.5f;
constexpr float kTanhTaylor[7] = {-1.0f / 3, 2.0f / 15, -17.0f / 315, 62.0f / 2835, -1382.0f / 155925,
                                  21844.0f / 6081075, -929569.0f / 638512875};  // x^3, x^5, .. x^15

inline float tanh_float(float x) {
  const float ax = std::fabs(x), x2 = ax * ax;
  float p = kTanhTaylor[6];
  for (int i = 5; i >= 0; --i) p = p * x2 + kTanhTaylor[i];
  const float small = ax + ax * x2 * p;
  const float e = exp_nonpositive(-2.0f * ax);
  const float large = (1.0f - e) / (1.0f + e);
  return std::copysign(ax >= kTanhTaylorBelow ? large : small, x);
}

// s = c * tanh(s / c) for n scores (inv_cap = 1 / c), as the reference soft-caps them.
inline void softcap_scores(float* __restrict s, int64_t n, float cap, float inv_cap) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] = cap * tanh_float(s[t] * inv_cap);
}

#ifdef PAGEDSERVE_AVX512
// exp_nonpositive on 16 lanes
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // times 2^n
}

// tanh_float on 16 lanes
inline __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x), x2 = _mm512_mul_ps(ax, ax);
  __m512 p = _mm512_set1_ps(kTanhTaylor[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(kTanhTaylor[i]));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(ax, x2), p, ax);
  const __m512 e = exp_nonpositive16(_mm512_mul_ps(ax, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 large = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __mmask16 above = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(kTanhTaylorBelow), _CMP_GE_OQ);  // not NaN
  const __m512 r = _mm512_mask_mov_ps(small, above, large);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}

// c * tanh(s / c) on 16 scores (inv_cap = 1 / c)
inline __m512 softcap16(__m512 s, __m512 cap, __m512 inv_cap) {
  return _mm512_mul_ps(cap, tanh16(_mm512_mul_ps(s, inv_cap)));
}
#endif

// softcap: 0 (none) or positive and finite, as the ops take it
void check_softcap(const char* op, double softcap) {
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), op, ": softcap must be 0 (none) or positive and finite, got ",
              softcap);
}

// sinks or ALiBi's slopes (`name`): none, or one float32 value a query head ([num_heads], contiguous,
// on the CPU), as the ops take them; their data, or null for none
const float* head_floats(const char* op, const char* name, const std::optional<at::Tensor>& values,
                         int64_t num_heads) {
  if (!values.has_value()) return nullptr;
  const at::Tensor& s = *values;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == num_heads && s.is_contiguous() &&
                  s.device().is_cpu(),
              op, ": ", name, " must be float32 [", num_heads, "] (one a query head), contiguous, on the CPU; got ",
              s.scalar_type(), " ", s.sizes(), " on ", s.device());
  return s.data_ptr<float>();
}

// What both decode kernels read: sizes, data pointers and strides of one call's tensors (checked by
// paged_attention_decode), the sliding window (0: none), the softcap (0: none), the sinks and ALiBi's
// slopes (null: none), and the slot arithmetic of the paged layout.
template <typename scalar_t>
struct DecodeArgs {
  DecodeArgs(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
             double softcap, const float* sinks = nullptr, const float* alibi = nullptr)
      : num_seqs(query.size(0)),
        num_heads(query.size(1)),
        dim(query.size(2)),
        block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)),
        group(num_heads / num_kv_heads),
        max_blocks(block_tables.size(1)),
        slot_size(num_kv_heads * dim),
        q_seq_stride(query.stride(0)),
        q_head_stride(query.stride(1)),
        o_seq_stride(out.stride(0)),
        o_head_stride(out.stride(1)),
        scale(static_cast<float>(scale)),
        window(window),
        softcap(static_cast<float>(softcap)),
        inv_softcap(softcap > 0.0 ? static_cast<float>(1.0 / softcap) : 0.0f),
        sinks(sinks),
        alibi(alibi),
        q(query.data_ptr<scalar_t>()),
        k_cache(k_cache.data_ptr<scalar_t>()),
        v_cache(v_cache.data_ptr<scalar_t>()),
        tables(block_tables.data_ptr<int32_t>()),
        lens(context_lens.data_ptr<int32_t>()),
        out(out.data_ptr<scalar_t>()) {}

  int64_t num_seqs, num_heads, dim, block_size, num_kv_heads, group, max_blocks;
  int64_t slot_size;  // one cache slot: every KV head of one token
  int64_t q_seq_stride, q_head_stride, o_seq_stride, o_head_stride;
  float scale;
  int64_t window;  // > 0: a row sees its context's last `window` tokens; 0: all of them
  float softcap, inv_softcap;  // > 0: each score s becomes softcap * tanh(s * inv_softcap); 0: as it is
  const float* sinks;          // [num_heads]: each head's sink logit, in the scores' units; null: none
  const float* alibi;          // [num_heads]: each head's ALiBi slope; null: none
  const scalar_t *q, *k_cache, *v_cache;
  const int32_t *tables, *lens;
  scalar_t* out;

  int64_t context_len(int64_t seq) const { return lens[seq]; }  // within its table row: checked
  // the first position row `seq` sees: its query sits at context_len - 1, and under a window of W sees
  // positions from context_len - W on (transformers' kv > q - W)
  int64_t first_visible(int64_t seq) const { return window > 0 ? std::max<int64_t>(0, lens[seq] - window) : 0; }
  // the offset of the slot holding token `pos` of sequence `seq`, in either cache (its block id: checked)
  int64_t slot_offset(int64_t seq, int64_t pos) const {
    const int32_t block = tables[seq * max_blocks + pos / block_size];
    return (block * block_size + pos % block_size) * slot_size;
  }
  const scalar_t* query_head(int64_t seq, int64_t head) const { return q + seq * q_seq_stride + head * q_head_stride; }
  // out[seq, head] = acc / sum (0 where sum is 0)
  void store(int64_t seq, int64_t head, const float* acc, float sum) const {
    scalar_t* dst = out + seq * o_seq_stride + head * o_head_stride;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
  }
};

// fn(begin, end) over runs of rows, one run a thread, of about equal work: a row costs its context
// plus a few tokens' worth of its own. Equal counts of rows would leave one thread most of the work
// when contexts differ: prefill rows (one a query token) grow with their position.
template <typename scalar_t, typename F>
void parallel_over_rows(const DecodeArgs<scalar_t>& a, const F& fn) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), a.num_seqs);
  const std::vector<int64_t> bounds = pagedserve::decode_row_split(a.lens, a.num_seqs, parts, a.window);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    for (int64_t part = part_begin; part < part_end; ++part)
      if (bounds[part] < bounds[part + 1]) fn(bounds[part], bounds[part + 1]);
  });
}

// Rows [begin, end), on the calling thread: one sequence at a time, all its heads together (a slot's K,
// then V, row for every KV head is one contiguous read, widened once).
template <typename scalar_t, int64_t kDim>
void decode_rows(const DecodeArgs<scalar_t>& a, int64_t begin, int64_t end) {
  const int64_t num_heads = a.num_heads, dim = a.dim, slot_size = a.slot_size;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> qf(num_heads * dim), acc(num_heads * dim), rows(kChunk * slot_size);
  std::vector<float> scores(num_heads * kChunk), maxes(num_heads), sums(num_heads);
  int64_t offsets[kChunk];
  for (int64_t seq = begin; seq < end; ++seq) {
    const int64_t context_len = a.context_len(seq);
    for (int64_t h = 0; h < num_heads; ++h) {
      widen(a.query_head(seq, h), qf.data() + h * dim, dim);
      scale_by<kDim>(a.scale, qf.data() + h * dim, dim);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (a.sinks != nullptr) {  // each head's softmax holds its sink from the start: max sink, sum exp(0)
      std::copy(a.sinks, a.sinks + num_heads, maxes.begin());
      std::fill(sums.begin(), sums.end(), 1.0f);
    } else {
      std::fill(maxes.begin(), maxes.end(), neg_inf);
      std::fill(sums.begin(), sums.end(), 0.0f);
    }
    // from the first visible token exactly: one query a row, so nothing before it needs a mask
    for (int64_t first = a.first_visible(seq); first < context_len; first += kChunk) {
      const int64_t n = std::min(kChunk, context_len - first);
      for (int64_t t = 0; t < n; ++t) offsets[t] = a.slot_offset(seq, first + t);
      for (int64_t t = 0; t < n; ++t) widen(a.k_cache + offsets[t], rows.data() + t * slot_size, slot_size);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* key = rows.data() + (h / a.group) * dim;
        float* s = scores.data() + h * kChunk;
        score_chunk<kDim>(qf.data() + h * dim, key, slot_size, n, s, dim);
        if (a.softcap > 0.0f) softcap_scores(s, n, a.softcap, a.inv_softcap);
        if (a.alibi != nullptr) {  // the key at first + t, the query at context_len - 1
          const float slope = a.alibi[h];
          const int64_t distance = first - (context_len - 1);
          for (int64_t t = 0; t < n; ++t) s[t] += slope * static_cast<float>(distance + t);
        }
        float chunk_max = maxes[h];
        for (int64_t t = 0; t < n; ++t) chunk_max = std::max(chunk_max, s[t]);
        const float correction = std::exp(maxes[h] - chunk_max);  // 0 on the first chunk (exp(-inf))
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          s[t] = exp_nonpositive(s[t] - chunk_max);
          sum += s[t];
        }
        sums[h] = sums[h] * correction + sum;
        maxes[h] = chunk_max;
        scale_by<kDim>(correction, acc.data() + h * dim, dim);
      }
      for (int64_t t = 0; t < n; ++t) widen(a.v_cache + offsets[t], rows.data() + t * slot_size, slot_size);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* value = rows.data() + (h / a.group) * dim;
        accumulate_chunk<kDim>(scores.data() + h * kChunk, value, slot_size, n, acc.data() + h * dim, dim);
      }
    }
    for (int64_t h = 0; h < num_heads; ++h) a.store(seq, h, acc.data() + h * dim, sums[h]);
  }
}

template <typename scalar_t, int64_t kDim>
void decode_kernel(const DecodeArgs<scalar_t>& a) {
  parallel_over_rows(a, [&](int64_t begin, int64_t end) { decode_rows<scalar_t, kDim>(a, begin, end); });
}


#ifdef PAGEDSERVE_AVX512_BF16
// bfloat16 on CPUs with AVX512-BF16, head sizes 64, 96 (Phi-3's), 128 and 256 (Gemma's): any multiple
// of 32 up to 256 would do (whole vdpbf16ps operands of 32 bf16), these are the ones instantiated. A
// sequence's context goes in tiles of up to 256 tokens, each in three passes with no chain from one
// 16-token chunk to the next (an online softmax per chunk made every chunk wait on the last one's max):
// every query head's scores for the whole tile (K rows scored in their bf16 form by vdpbf16ps, bf16
// products exact in float32, 16 tokens' partial-sum vectors reduced into one vector of scores), then
// each head's softmax weights over the tile (its running max, sum and accumulator rescaled once a
// tile), then V: each row widened once per group of query heads sharing it, the heads' accumulators
// held in registers over the tile.
//
// A row's K and V come from memory in blocks scattered over the cache (a decoding request gets a new
// block every block_size steps, between other requests' blocks), too short for the hardware's
// prefetchers to follow: each block's first lines wait on memory. So while a row is scored, its thread
// prefetches the next row's blocks into L1, a few lines after each 16-token chunk, spread so that they
// end with the row. On the Zen 5 machine that took 0.55-0.83 of the time of 30 layers' attention from
// a cold cache (rows x context 64 x 50 to 16 x 170, blocks laid out as the engine lays them out);
// prefetching into L2 instead, or all of it in the first half of the row, gained less.

// r[t] = the sum of v[t]'s 16 lanes: a tree of adds over 256-bit, 128-bit, then 64- and 32-bit lanes.
inline __m512 reduce16(const __m512* v) {
  __m512 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s partial sums, 8-15: v[2i+1]'s
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane j: token 4i + j's four partial sums
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // 128-bit lane j: two partial sums of token 8i + j, two of 8i + 4 + j
    e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0xEE));
  // element 4j + i holds token 4i + j
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, f);
}

constexpr int64_t kTile = 256;  // tokens a tile, a multiple of kChunk

// scale * (q . keys[t]) for 16 K rows (past a tile's end, repeats of its last row).
template <int64_t kDim>
inline __m512 score16(const __m512bh* q, const c10::BFloat16* const* keys, __m512 scale) {
  constexpr int kPairs = kDim / 32;  // 32 bf16 per vdpbf16ps operand
  __m512 dots[kChunk];
  for (int64_t t = 0; t < kChunk; ++t) {
    dots[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(keys[t]));
    for (int i = 1; i < kPairs; ++i)
      dots[t] = _mm512_dpbf16_ps(dots[t], q[i], (__m512bh)_mm512_loadu_si512(keys[t] + 32 * i));
  }
  return _mm512_mul_ps(reduce16(dots), scale);
}

// The online-softmax state of one query head: max and sum of its weights so far, its accumulator.
template <int64_t kDim>
struct HeadState {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;
  alignas(64) float acc[kDim] = {};
};

// A tile's n scores (s: rounded up to a multiple of 16, the lanes past n repeating its last score, so
// they leave the max alone) become the weights exp(s - max), 0 past n, with the head's new max; returns
// the factor for the head's accumulator (0 on its first tile).
template <int64_t kDim>
inline float softmax_tile(float* s, int64_t n, HeadState<kDim>& state) {
  __m512 m = _mm512_set1_ps(state.max);
  for (int64_t c = 0; c < n; c += kChunk) m = _mm512_max_ps(m, _mm512_load_ps(s + c));
  const float tile_max = _mm512_reduce_max_ps(m);
  const __m512 vmax = _mm512_set1_ps(tile_max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += kChunk) {
    const __mmask16 valid = pagedserve::lanes_below(n - c);
    const __m512 w = _mm512_maskz_mov_ps(valid, exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(s + c), vmax)));
    _mm512_store_ps(s + c, w);
    sum = _mm512_add_ps(sum, w);
  }
  // exp_nonpositive would give exp(-87) ~ 1e-38 for exp(-inf), so the first tile's 0 is spelt out
  const float correction = state.sum > 0.0f ? exp_nonpositive(state.max - tile_max) : 0.0f;
  state.sum = state.sum * correction + _mm512_reduce_add_ps(sum);
  state.max = tile_max;
  return correction;
}

// acc_g = acc_g * correction_g + sum over t < n of p_g[t] * V[t] for kHeads query heads sharing the
// V rows at `values + offsets[t]` (p_g = probs + g * kTile).
template <int64_t kDim, int kHeads>
inline void accumulate_tile(const c10::BFloat16* values, const int64_t* offsets, int64_t n, const float* probs,
                            const float* corrections, HeadState<kDim>* states) {
  constexpr int kVecs = kDim / 16;  // 16 floats per register
  __m512 acc[kHeads][kVecs];
  for (int g = 0; g < kHeads; ++g) {
    const __m512 c = _mm512_set1_ps(corrections[g]);
    for (int i = 0; i < kVecs; ++i) acc[g][i] = _mm512_mul_ps(_mm512_load_ps(states[g].acc + 16 * i), c);
  }
  for (int64_t t = 0; t < n; ++t) {
    const c10::BFloat16* row = values + offsets[t];
    __m512 v[kVecs];
    for (int i = 0; i < kVecs; ++i) v[i] = pagedserve::load_bf16(row + 16 * i);
    for (int g = 0; g < kHeads; ++g) {
      const __m512 w = _mm512_set1_ps(probs[g * kTile + t]);
      for (int i = 0; i < kVecs; ++i) acc[g][i] = _mm512_fmadd_ps(w, v[i], acc[g][i]);
    }
  }
  for (int g = 0; g < kHeads; ++g)
    for (int i = 0; i < kVecs; ++i) _mm512_store_ps(states[g].acc + 16 * i, acc[g][i]);
}

// The next row's K and V blocks, prefetched a few lines at a time (`step`) over `steps` calls.
class NextRowPrefetch {
 public:
  NextRowPrefetch(const DecodeArgs<c10::BFloat16>& a, int64_t next, int64_t end, int64_t steps)
      : k_(reinterpret_cast<const char*>(a.k_cache)),
        v_(reinterpret_cast<const char*>(a.v_cache)),
        block_bytes_(a.block_size * a.slot_size * static_cast<int64_t>(sizeof(c10::BFloat16))),
        lines_per_block_((block_bytes_ + 63) / 64) {
    if (next >= end || steps <= 0) return;
    blocks_ = a.tables + next * a.max_blocks;
    block_ = a.first_visible(next) / a.block_size;  // under a window: the blocks it reads only
    num_blocks_ = std::min(a.max_blocks, (a.context_len(next) + a.block_size - 1) / a.block_size);
    lines_per_step_ = ((num_blocks_ - block_) * lines_per_block_ + steps - 1) / steps;
  }

  void step() {
    for (int64_t i = 0; i < lines_per_step_ && block_ < num_blocks_; ++i) {
      const int64_t offset = blocks_[block_] * block_bytes_ + line_ * 64;
      _mm_prefetch(k_ + offset, _MM_HINT_T0);
      _mm_prefetch(v_ + offset, _MM_HINT_T0);
      if (++line_ == lines_per_block_) line_ = 0, ++block_;
    }
  }

 private:
  const char* k_;
  const char* v_;
  int64_t block_bytes_, lines_per_block_;
  const int32_t* blocks_ = nullptr;
  int64_t num_blocks_ = 0, lines_per_step_ = 0;
  int64_t block_ = 0, line_ = 0;  // the next line to prefetch
};

// Rows [begin, end), on the calling thread.
template <int64_t kDim>
void decode_rows_avx512_bf16(const DecodeArgs<c10::BFloat16>& a, int64_t begin, int64_t end) {
  using bf16 = c10::BFloat16;
  static_assert(kDim % 32 == 0 && kDim <= 256, "whole vdpbf16ps operands; one head's accumulators in 16 registers");
  constexpr int kPairs = kDim / 32;
  // accumulators of this many heads fit in 16 registers: 4 for head size 64, 2 for 96 and 128, 1 for 256
  constexpr int kHeadsPerPass = 256 / kDim;
  const int64_t group = a.group;
  const __m512 vscale = _mm512_set1_ps(a.scale);
  const __m512 vcap = _mm512_set1_ps(a.softcap), vinv_cap = _mm512_set1_ps(a.inv_softcap);
  std::vector<HeadState<kDim>> states(a.num_heads);
  std::vector<__m512> score_storage(group * kTile / 16);  // aligned: [group][kTile] floats
  float* scores = reinterpret_cast<float*>(score_storage.data());
  float corrections[kHeadsPerPass];
  int64_t offsets[kTile];
  const bf16* keys[kChunk];
  for (int64_t seq = begin; seq < end; ++seq) {
    const int64_t context_len = a.context_len(seq), start = a.first_visible(seq);
    std::fill(states.begin(), states.end(), HeadState<kDim>());
    if (a.sinks != nullptr)  // each head's softmax holds its sink from the start: max sink, sum exp(0)
      for (int64_t h = 0; h < a.num_heads; ++h) states[h].max = a.sinks[h], states[h].sum = 1.0f;
    const int64_t chunks = a.num_kv_heads * group * ((context_len - start + kChunk - 1) / kChunk);  // scored below
    NextRowPrefetch prefetch(a, seq + 1, end, chunks);
    // from the first visible token exactly: one query a row, so nothing before it needs a mask
    for (int64_t first = start; first < context_len; first += kTile) {
      const int64_t n = std::min(kTile, context_len - first);
      const int64_t padded = (n + kChunk - 1) / kChunk * kChunk;  // past n: the last slot again
      for (int64_t t = 0; t < padded; ++t) offsets[t] = a.slot_offset(seq, first + std::min(t, n - 1));
      for (int64_t kv = 0; kv < a.num_kv_heads; ++kv) {
        HeadState<kDim>* group_states = states.data() + kv * group;
        for (int64_t g = 0; g < group; ++g) {
          __m512bh q[kPairs];
          const bf16* qh = a.query_head(seq, kv * group + g);
          for (int i = 0; i < kPairs; ++i) q[i] = (__m512bh)_mm512_loadu_si512(qh + 32 * i);
          float* s = scores + g * kTile;
          for (int64_t c = 0; c < n; c += kChunk) {
            for (int64_t t = 0; t < kChunk; ++t) keys[t] = a.k_cache + offsets[c + t] + kv * kDim;
            _mm512_store_ps(s + c, score16<kDim>(q, keys, vscale));
            prefetch.step();
          }
          if (a.softcap > 0.0f)  // the tile's scores capped in place (the padding's too: still its last)
            for (int64_t c = 0; c < n; c += kChunk)
              _mm512_store_ps(s + c, softcap16(_mm512_load_ps(s + c), vcap, vinv_cap));
          if (a.alibi != nullptr) {  // the key at first + t (the padding's: its last), the query at context_len - 1
            const __m512 slope = _mm512_set1_ps(a.alibi[kv * group + g]);
            const __m512i last = _mm512_set1_epi32(static_cast<int32_t>(n - 1));
            const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            const __m512 distance = _mm512_set1_ps(static_cast<float>(first - (context_len - 1)));
            for (int64_t c = 0; c < n; c += kChunk) {
              const __m512i t = _mm512_min_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(c))), last);
              const __m512 bias = _mm512_mul_ps(slope, _mm512_add_ps(distance, _mm512_cvtepi32_ps(t)));
              _mm512_store_ps(s + c, _mm512_add_ps(_mm512_load_ps(s + c), bias));
            }
          }
        }
        for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
          const int64_t count = std::min<int64_t>(kHeadsPerPass, group - g0);
          for (int64_t g = 0; g < count; ++g)
            corrections[g] = softmax_tile<kDim>(scores + (g0 + g) * kTile, n, group_states[g0 + g]);
          const bf16* values = a.v_cache + kv * kDim;
          const float* probs = scores + g0 * kTile;
          // count <= kHeadsPerPass (only the passes a head size can take are instantiated: 2 heads of
          // 256 would need 32 accumulator registers)
          if (count == 1) {
            accumulate_tile<kDim, 1>(values, offsets, n, probs, corrections, group_states + g0);
          } else if constexpr (kHeadsPerPass >= 2) {
            if (count == 2) {
              accumulate_tile<kDim, 2>(values, offsets, n, probs, corrections, group_states + g0);
            } else if constexpr (kHeadsPerPass == 4) {
              if (count == 3) {
                accumulate_tile<kDim, 3>(values, offsets, n, probs, corrections, group_states + g0);
              } else {
                accumulate_tile<kDim, 4>(values, offsets, n, probs, corrections, group_states + g0);
              }
            }
          }
        }
      }
    }
    for (int64_t h = 0; h < a.num_heads; ++h) a.store(seq, h, states[h].acc, states[h].sum);
  }
}

template <int64_t kDim>
void decode_kernel_avx512_bf16(const DecodeArgs<c10::BFloat16>& a) {
  parallel_over_rows(a, [&](int64_t begin, int64_t end) { decode_rows_avx512_bf16<kDim>(a, begin, end); });
}

// The lane indices of transpose16's stages (b = 8, 4, 2, 1), for vpermt2d / vpermt2ps of rows i and i + b:
// lo, row i's: its own lanes where bit b is clear, row i + b's before them; hi, row i + b's: row i's
// lanes past them, then its own.
struct TransposeLanes {
  alignas(64) int32_t lo[4][16];
  alignas(64) int32_t hi[4][16];
  constexpr TransposeLanes() : lo(), hi() {
    for (int s = 0, b = 8; s < 4; ++s, b /= 2)
      for (int c = 0; c < 16; ++c) {
        lo[s][c] = c & b ? 16 + c - b : c;
        hi[s][c] = c & b ? 16 + c : c + b;
      }
  }
};
constexpr TransposeLanes kTransposeLanes;

// r[i][c] <- r[c][i] for 16 vectors of 16 32-bit lanes: four stages, each swapping the off-diagonal
// b x b blocks of every 2b x 2b block, a permute a row each.
template <typename V, typename Permute>
inline void transpose16(V* r, Permute permute) {
  for (int s = 0, b = 8; s < 4; ++s, b /= 2) {
    const __m512i lo = _mm512_load_si512(kTransposeLanes.lo[s]), hi = _mm512_load_si512(kTransposeLanes.hi[s]);
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const V x = r[i], y = r[i + b];
      r[i] = permute(x, lo, y);
      r[i + b] = permute(x, hi, y);
    }
  }
}

inline void transpose16(__m512i* r) {
  transpose16(r, [](__m512i x, __m512i i, __m512i y) { return _mm512_permutex2var_epi32(x, i, y); });
}

inline void transpose16(__m512* r) {
  transpose16(r, [](__m512 x, __m512i i, __m512 y) { return _mm512_permutex2var_ps(x, i, y); });
}

// paged_attention_prefill on AVX512-BF16 (bfloat16, head sizes 64, 96, 128 and 256): causal attention
// of packed prompt chunks, flash-attention style. The 16 lanes of a vector hold 16 (query token, query
// head) pairs that read the same KV head: `rows_per_tile` consecutive tokens of one sequence times
// `heads_per_tile` heads of a KV head's group (5 x 3 for SmolLM2's 9 heads on 3 KV heads, 16 x 1 with
// no grouping). A tile walks its context in chunks of 16 keys, and for each chunk and lane group:
// - scores: 16 vectors (one a key) of vdpbf16ps over the head size, each step a pair of the query's
//   dimensions (packed once a tile) against the key's same pair broadcast: no horizontal sums, where
//   a decode row reduces 16 partial-sum vectors to one per 16 keys;
// - under a softcap, each score capped (softcap16) before the mask;
// - an online softmax per lane (running max and sum as vectors), keys past a lane's position masked
//   (and under a window, those before its first visible one);
// - P V by vdpbf16ps too, two keys a step: the weights rounded to bfloat16 (as flash attention's
//   P V product takes them), the V rows of the two keys interleaved once a chunk, accumulators float32.
// Every K and V row is read once a tile instead of once a query token.
struct PrefillArgs {
  PrefillArgs(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& context_lens,
              double scale, int64_t window, double softcap, const float* sinks, const float* alibi)
      : num_seqs(block_tables.size(0)),
        num_heads(query.size(1)),
        dim(query.size(2)),
        block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)),
        group(num_heads / num_kv_heads),
        max_blocks(block_tables.size(1)),
        slot_size(num_kv_heads * dim),
        heads_per_tile(std::min<int64_t>(group, 16)),
        rows_per_tile(16 / heads_per_tile),
        head_groups((group + heads_per_tile - 1) / heads_per_tile),
        q_token_stride(query.stride(0)),
        q_head_stride(query.stride(1)),
        o_token_stride(out.stride(0)),
        o_head_stride(out.stride(1)),
        scale(static_cast<float>(scale)),
        // lanes compare int32 positions: a window past every int32 context is as long as any
        window(std::min<int64_t>(window, std::numeric_limits<int32_t>::max())),
        softcap(static_cast<float>(softcap)),
        inv_softcap(softcap > 0.0 ? static_cast<float>(1.0 / softcap) : 0.0f),
        sinks(sinks),
        alibi(alibi),
        q(query.data_ptr<c10::BFloat16>()),
        k_cache(k_cache.data_ptr<c10::BFloat16>()),
        v_cache(v_cache.data_ptr<c10::BFloat16>()),
        tables(block_tables.data_ptr<int32_t>()),
        starts(query_start_loc.data_ptr<int32_t>()),
        lens(context_lens.data_ptr<int32_t>()),
        out(out.data_ptr<c10::BFloat16>()) {}

  int64_t num_seqs, num_heads, dim, block_size, num_kv_heads, group, max_blocks, slot_size;
  int64_t heads_per_tile, rows_per_tile, head_groups;
  int64_t q_token_stride, q_head_stride, o_token_stride, o_head_stride;
  float scale;
  int64_t window;  // > 0: a token at p sees keys p - window + 1..p; 0: keys 0..p
  float softcap, inv_softcap;  // > 0: each score s becomes softcap * tanh(s * inv_softcap); 0: as it is
  const float* sinks;          // [num_heads]: each head's sink logit, in the scores' units; null: none
  const float* alibi;          // [num_heads]: each head's ALiBi slope; null: none
  const c10::BFloat16 *q, *k_cache, *v_cache;
  const int32_t *tables, *starts, *lens;
  c10::BFloat16* out;

  int64_t slot_offset(int64_t seq, int64_t pos) const {
    const int32_t block = tables[seq * max_blocks + pos / block_size];
    return (block * block_size + pos % block_size) * slot_size;
  }
};

// One work item: rows [first_row, first_row + num_rows) of the packed query, consecutive tokens of
// sequence `seq` at positions first_pos.. (each sees the keys up to its own position, from first_key
// on: the first its first token sees, 0 without a window).
struct PrefillTile {
  int64_t seq, first_row, num_rows, first_pos, first_key;
  int32_t num_keys() const { return static_cast<int32_t>(first_pos + num_rows); }
};

// The running state of one lane group (a tile's rows times up to 16 heads of one KV head).
template <int64_t kDim>
struct LaneGroup {
  __m512i q[kDim / 2];  // lane l's query, dimensions 2i and 2i + 1 in dword i
  __m512 acc[kDim];     // acc[d], lane l: the weighted sum of V's dimension d
  __m512 max, sum;
  __m512 slope;  // lane l's head's ALiBi slope (0 for a dead lane, and without ALiBi)
};

template <int64_t kDim>
class PrefillTileRunner {
  // a lane's query loads and the V pairs' permutes take 32 bf16 (64 bytes) at a time, the outputs'
  // transposes 16 dimensions
  static_assert(kDim % 32 == 0, "head size: a multiple of 32");

 public:
  explicit PrefillTileRunner(const PrefillArgs& a) : a_(a), groups_(a.num_kv_heads * a.head_groups) {}

  void run(const PrefillTile& tile) {
    const int64_t ht = a_.heads_per_tile;
    alignas(64) int32_t lane_pos[16];
    for (int l = 0; l < 16; ++l)  // dead lanes take the last row's position (finite scores, never stored)
      lane_pos[l] = static_cast<int32_t>(tile.first_pos + std::min<int64_t>(l / ht, tile.num_rows - 1));
    const __m512i positions = _mm512_load_si512(lane_pos);
    positions_ = _mm512_cvtepi32_ps(positions);
    // a lane sees the keys above this (its position minus the window; -1 without one: every key)
    const __m512i before = a_.window > 0
                               ? _mm512_sub_epi32(positions, _mm512_set1_epi32(static_cast<int32_t>(a_.window)))
                               : _mm512_set1_epi32(-1);
    const int64_t last_before = a_.window > 0 ? tile.first_pos + tile.num_rows - 1 - a_.window : -1;  // the last lane's
    for (int64_t kv = 0; kv < a_.num_kv_heads; ++kv)
      for (int64_t hg = 0; hg < a_.head_groups; ++hg) start_group(tile, kv, hg, groups_[kv * a_.head_groups + hg]);
    const int64_t num_keys = tile.num_keys();
    // from the first key the tile's first token sees: the keys before it are no lane's, never read
    for (int64_t k0 = tile.first_key; k0 < num_keys; k0 += 16) {
      const int64_t n = std::min<int64_t>(16, num_keys - k0);
      __mmask16 valid[16];
      // some key here is past some lane's position, or (under a window) before some lane's first
      const bool masked = k0 + 15 > tile.first_pos || k0 <= last_before;
      if (masked)
        for (int j = 0; j < 16; ++j) {
          const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(k0 + j));
          valid[j] = j < n ? _mm512_mask_cmplt_epi32_mask(_mm512_cmpge_epi32_mask(positions, key), before, key) : 0;
        }
      for (int j = 0; j < 16; ++j) slots_[j] = a_.slot_offset(tile.seq, k0 + std::min<int64_t>(j, n - 1));
      for (int64_t kv = 0; kv < a_.num_kv_heads; ++kv) {
        pack_chunk(kv);
        for (int64_t hg = 0; hg < a_.head_groups; ++hg)
          attend_chunk(groups_[kv * a_.head_groups + hg], masked ? valid : nullptr, k0);
      }
    }
    for (int64_t kv = 0; kv < a_.num_kv_heads; ++kv)
      for (int64_t hg = 0; hg < a_.head_groups; ++hg) finish_group(tile, kv, hg, groups_[kv * a_.head_groups + hg]);
  }

 private:
  // lane l of head group hg of KV head kv: row l / heads_per_tile, query head kv * group + hg *
  // heads_per_tile + l % heads_per_tile; false for a dead lane (past the tile's rows or the group's heads)
  bool lane(const PrefillTile& tile, int64_t kv, int64_t hg, int l, int64_t& row, int64_t& head) const {
    const int64_t ht = a_.heads_per_tile, in_group = hg * ht + l % ht;
    row = tile.first_row + l / ht;
    head = kv * a_.group + in_group;
    return l / ht < tile.num_rows && in_group < a_.group;
  }

  void start_group(const PrefillTile& tile, int64_t kv, int64_t hg, LaneGroup<kDim>& g) const {
    // lane l's query as dwords, 16 at a time, then transposed: dword i of every lane in g.q[i]
    for (int64_t i0 = 0; i0 < kDim / 2; i0 += 16) {
      __m512i rows[16];
      for (int l = 0; l < 16; ++l) {
        int64_t row, head;
        rows[l] = lane(tile, kv, hg, l, row, head)
                      ? _mm512_loadu_si512(a_.q + row * a_.q_token_stride + head * a_.q_head_stride + 2 * i0)
                      : _mm512_setzero_si512();
      }
      transpose16(rows);
      for (int i = 0; i < 16; ++i) g.q[i0 + i] = rows[i];
    }
    for (int64_t d = 0; d < kDim; ++d) g.acc[d] = _mm512_setzero_ps();
    g.max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    g.sum = _mm512_setzero_ps();
    if (a_.sinks != nullptr) start_at_sinks(tile, kv, hg, g);
    alignas(64) float slopes[16];
    for (int l = 0; l < 16; ++l) {
      int64_t row, head;
      slopes[l] = a_.alibi != nullptr && lane(tile, kv, hg, l, row, head) ? a_.alibi[head] : 0.0f;
    }
    g.slope = _mm512_load_ps(slopes);
  }

  // Each live lane's softmax holding its head's sink from the start: max sink, sum exp(0) = 1. Dead
  // lanes (whose head may be past the group's: no sink to read) keep -inf and 0.
  void start_at_sinks(const PrefillTile& tile, int64_t kv, int64_t hg, LaneGroup<kDim>& g) const {
    alignas(64) float max[16], sum[16];
    for (int l = 0; l < 16; ++l) {
      int64_t row, head;
      const bool live = lane(tile, kv, hg, l, row, head);
      max[l] = live ? a_.sinks[head] : -std::numeric_limits<float>::infinity();
      sum[l] = live ? 1.0f : 0.0f;
    }
    g.max = _mm512_load_ps(max);
    g.sum = _mm512_load_ps(sum);
  }

  // The chunk's 16 K rows of KV head kv, contiguous (keys_, a row's dimension pair a dword), and its V
  // rows in pairs: dword values_[p * kDim + d] holds dimension d of keys 2p (low half) and 2p + 1.
  void pack_chunk(int64_t kv) {
    const c10::BFloat16* k = a_.k_cache + kv * kDim;
    const c10::BFloat16* v = a_.v_cache + kv * kDim;
    for (int j = 0; j < 16; ++j)
      std::memcpy(keys_ + j * kDim / 2, k + slots_[j], kDim * sizeof(c10::BFloat16));
    // words 2i, 2i + 1 of the result: word i of x, word i of y (lo: i < 16, hi: 16 <= i < 32)
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                        6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int p = 0; p < 8; ++p) {
      const c10::BFloat16* x = v + slots_[2 * p];
      const c10::BFloat16* y = v + slots_[2 * p + 1];
      for (int64_t h = 0; h < kDim / 32; ++h) {
        const __m512i xs = _mm512_loadu_si512(x + 32 * h), ys = _mm512_loadu_si512(y + 32 * h);
        _mm512_store_si512(values_ + p * kDim + 32 * h, _mm512_permutex2var_epi16(xs, lo, ys));
        _mm512_store_si512(values_ + p * kDim + 32 * h + 16, _mm512_permutex2var_epi16(xs, hi, ys));
      }
    }
  }

  // The chunk of 16 keys from position k0 for lane group g (`valid`: each key's live lanes, or null
  // where every lane sees every key).
  void attend_chunk(LaneGroup<kDim>& g, const __mmask16* valid, int64_t k0) const {
    __m512 s[16];
    for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kDim / 2; ++i) {
      const __m512bh q = (__m512bh)g.q[i];
      for (int j = 0; j < 16; ++j)
        s[j] = _mm512_dpbf16_ps(s[j], q, (__m512bh)_mm512_set1_epi32(keys_[j * kDim / 2 + i]));
    }
    const __m512 vscale = _mm512_set1_ps(a_.scale);
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int j = 0; j < 16; ++j) s[j] = _mm512_mul_ps(s[j], vscale);
    if (a_.softcap > 0.0f) {
      const __m512 cap = _mm512_set1_ps(a_.softcap), inv_cap = _mm512_set1_ps(a_.inv_softcap);
      for (int j = 0; j < 16; ++j) s[j] = softcap16(s[j], cap, inv_cap);
    }
    if (a_.alibi != nullptr)  // each lane's slope times the key's distance from its token
      for (int j = 0; j < 16; ++j)
        s[j] = _mm512_fmadd_ps(g.slope, _mm512_sub_ps(_mm512_set1_ps(static_cast<float>(k0 + j)), positions_), s[j]);
    __m512 chunk_max = g.max;
    for (int j = 0; j < 16; ++j) {
      if (valid != nullptr) s[j] = _mm512_mask_mov_ps(neg_inf, valid[j], s[j]);
      chunk_max = _mm512_max_ps(chunk_max, s[j]);
    }
    // the first chunk: max was -inf, exp_nonpositive16 gives ~1e-38 for it, times acc and sum of 0
    const __m512 correction = exp_nonpositive16(_mm512_sub_ps(g.max, chunk_max));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < 16; ++j) {
      s[j] = exp_nonpositive16(_mm512_sub_ps(s[j], chunk_max));
      if (valid != nullptr) s[j] = _mm512_maskz_mov_ps(valid[j], s[j]);
      sum = _mm512_add_ps(sum, s[j]);
    }
    g.sum = _mm512_fmadd_ps(g.sum, correction, sum);
    g.max = chunk_max;
    // lane l's weights of keys 2p and 2p + 1 as the bf16 pair of dword l
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512bh weights[8];
    for (int p = 0; p < 8; ++p)
      weights[p] = (__m512bh)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * p + 1], s[2 * p]));
    for (int64_t d0 = 0; d0 < kDim; d0 += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_mul_ps(g.acc[d0 + i], correction);
      for (int p = 0; p < 8; ++p)
        for (int i = 0; i < 16; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], weights[p], (__m512bh)_mm512_set1_epi32(values_[p * kDim + d0 + i]));
      for (int i = 0; i < 16; ++i) g.acc[d0 + i] = acc[i];
    }
  }

  void finish_group(const PrefillTile& tile, int64_t kv, int64_t hg, const LaneGroup<kDim>& g) const {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), g.sum);  // every lane saw a key: sum > 0
    for (int64_t d0 = 0; d0 < kDim; d0 += 16) {  // 16 dimensions of every lane, transposed to a lane each
      __m512 dims[16];
      for (int i = 0; i < 16; ++i) dims[i] = _mm512_mul_ps(g.acc[d0 + i], inv);
      transpose16(dims);
      for (int l = 0; l < 16; ++l) {
        int64_t row, head;
        if (lane(tile, kv, hg, l, row, head))
          pagedserve::store_bf16(a_.out + row * a_.o_token_stride + head * a_.o_head_stride + d0, dims[l]);
      }
    }
  }

  const PrefillArgs& a_;
  std::vector<LaneGroup<kDim>> groups_;
  __m512 positions_;  // the tile's lanes' token positions
  int64_t slots_[16];
  alignas(64) int32_t keys_[8 * kDim];    // bf16 pairs: 16 keys of kDim / 2 dwords
  alignas(64) int32_t values_[8 * kDim];  // bf16 pairs: 8 key pairs of kDim dwords
};

template <int64_t kDim>
void prefill_kernel_avx512_bf16(const PrefillArgs& a) {
  std::vector<PrefillTile> tiles;
  std::vector<int32_t> costs;  // keys a tile reads, as decode_row_split weighs a row's context
  for (int64_t seq = 0; seq < a.num_seqs; ++seq) {
    const int64_t q_len = a.starts[seq + 1] - a.starts[seq], first_pos = a.lens[seq] - q_len;
    for (int64_t r = 0; r < q_len; r += a.rows_per_tile) {
      const int64_t pos = first_pos + r, first_key = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
      tiles.push_back({seq, a.starts[seq] + r, std::min(a.rows_per_tile, q_len - r), pos, first_key});
      costs.push_back(tiles.back().num_keys() - first_key);
    }
  }
  if (tiles.empty()) return;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), tiles.size());
  const std::vector<int64_t> bounds = pagedserve::decode_row_split(costs.data(), tiles.size(), parts, 0);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    for (int64_t part = part_begin; part < part_end; ++part) {
      if (bounds[part] == bounds[part + 1]) continue;
      // the packed K and V (64 * kDim bytes: 16 KB for head size 256) and each lane group's query and
      // accumulators (96 * kDim bytes a group): on the heap
      auto runner = std::make_unique<PrefillTileRunner<kDim>>(a);
      for (int64_t t = bounds[part]; t < bounds[part + 1]; ++t) runner->run(tiles[t]);
    }
  });
}
#endif  // PAGEDSERVE_AVX512_BF16

template <typename scalar_t>
void dispatch_dim(const DecodeArgs<scalar_t>& args) {
#ifdef PAGEDSERVE_AVX512_BF16
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    switch (args.dim) {
      case 64: return decode_kernel_avx512_bf16<64>(args);
      case 96: return decode_kernel_avx512_bf16<96>(args);
      case 128: return decode_kernel_avx512_bf16<128>(args);
      case 256: return decode_kernel_avx512_bf16<256>(args);
      default: break;
    }
  }
#endif
  switch (args.dim) {
    case 64: return decode_kernel<scalar_t, 64>(args);
    case 128: return decode_kernel<scalar_t, 128>(args);
    default: return decode_kernel<scalar_t, 0>(args);
  }
}

// query [rows, heads, head_dim] against caches [blocks, block_size, kv_heads, head_dim], as both
// attention ops take them (`rows`: what a query row is, in the message).
void check_attention_shapes(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const char* rows) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "query [", rows,
              ", heads, head_dim]; k_cache, v_cache [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "query heads: a multiple of the KV heads, of the same head_dim");
}

at::Tensor paged_attention_decode(
    const at::Tensor& query,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& block_tables,
    const at::Tensor& context_lens,
    double scale,
    int64_t window,
    double softcap,
    const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& alibi_slopes) {
  check_attention_shapes(query, k_cache, v_cache, "seqs");
  TORCH_CHECK(window >= 0, "paged_attention_decode: window must be 0 (none) or positive, got ", window);
  check_softcap("paged_attention_decode", softcap);
  const float* sink_logits = head_floats("paged_attention_decode", "sinks", sinks, query.size(1));
  const float* slopes = head_floats("paged_attention_decode", "alibi_slopes", alibi_slopes, query.size(1));
  TORCH_CHECK(query.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "query rows and the caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && block_tables.size(0) == query.size(0) &&
                  context_lens.size(0) == query.size(0),
              "one block table row and context length per sequence");
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  pagedserve::check_block_tables(tables, lens, k_cache.size(1), k_cache.size(0));
  auto out = at::empty_like(query);
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_dim(
          DecodeArgs<float>(out, query, k_cache, v_cache, tables, lens, scale, window, softcap, sink_logits, slopes));
      break;
    case at::kBFloat16:
      dispatch_dim(DecodeArgs<c10::BFloat16>(out, query, k_cache, v_cache, tables, lens, scale, window, softcap,
                                             sink_logits, slopes));
      break;
    case at::kHalf:
      dispatch_dim(DecodeArgs<c10::Half>(out, query, k_cache, v_cache, tables, lens, scale, window, softcap,
                                         sink_logits, slopes));
      break;
    default: TORCH_CHECK(false, "paged_attention_decode: float32, bfloat16 or float16, not ", query.scalar_type());
  }
  return out;
}

// Causal prefill attention of packed prompt chunks read from the paged cache (their own K/V written
// there first): query [tokens, heads, head_dim], sequence s's rows query_start_loc[s] ..
// query_start_loc[s + 1], at the last positions of its context_lens[s] tokens, each over its last
// `window` positions only under a window (> 0), its scores soft-capped under a softcap (> 0), each
// head's softmax joined by its sink logit under sinks (none: nullopt), its scores biased by distance
// under alibi_slopes (none: nullopt). bfloat16,
// head sizes 64, 96, 128 and 256, on AVX512-BF16 builds (decode_isa() == "avx512_bf16"); elsewhere the
// caller keeps SDPA.
at::Tensor paged_attention_prefill(
    const at::Tensor& query,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& block_tables,
    const at::Tensor& query_start_loc,
    const at::Tensor& context_lens,
    double scale,
    int64_t window,
    double softcap,
    const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& alibi_slopes) {
  check_attention_shapes(query, k_cache, v_cache, "tokens");
  TORCH_CHECK(window >= 0, "paged_attention_prefill: window must be 0 (none) or positive, got ", window);
  check_softcap("paged_attention_prefill", softcap);
  const float* sink_logits = head_floats("paged_attention_prefill", "sinks", sinks, query.size(1));
  const float* slopes = head_floats("paged_attention_prefill", "alibi_slopes", alibi_slopes, query.size(1));
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "paged_attention_prefill: bfloat16 query and caches");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256,
              "paged_attention_prefill: head_dim 64, 96, 128 or 256, not ", head_dim);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "block_tables, query_start_loc and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && query_start_loc.dim() == 1 &&
                  block_tables.size(0) == context_lens.size(0) &&
                  query_start_loc.size(0) == context_lens.size(0) + 1,
              "one block table row and context length per sequence, and one more query start");
  const auto tables = block_tables.contiguous();
  const auto starts = query_start_loc.contiguous();
  const auto lens = context_lens.contiguous();
  const int32_t* start = starts.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  TORCH_CHECK(start[0] == 0 && start[lens.size(0)] == query.size(0),
              "query_start_loc: from 0 to the query's ", query.size(0), " tokens");
  for (int64_t seq = 0; seq < lens.size(0); ++seq)
    TORCH_CHECK(start[seq + 1] >= start[seq] && start[seq + 1] - start[seq] <= len[seq], "sequence ", seq, " has ",
                start[seq + 1] - start[seq], " query tokens and a context of ", len[seq]);
  pagedserve::check_block_tables(tables, lens, k_cache.size(1), k_cache.size(0));
  const auto q = query.stride(2) == 1 ? query : query.contiguous();  // a head's dimensions in one run
  auto out = at::empty(query.sizes(), query.options());
#ifdef PAGEDSERVE_AVX512_BF16
  const PrefillArgs args(out, q, k_cache, v_cache, tables, starts, lens, scale, window, softcap, sink_logits, slopes);
  switch (args.dim) {  // one of the sizes checked above
    case 64: prefill_kernel_avx512_bf16<64>(args); break;
    case 96: prefill_kernel_avx512_bf16<96>(args); break;
    case 128: prefill_kernel_avx512_bf16<128>(args); break;
    default: prefill_kernel_avx512_bf16<256>(args); break;
  }
#else
  (void)sink_logits, (void)slopes;
  TORCH_CHECK(false, "paged_attention_prefill: this build has no AVX512-BF16 (decode_isa() is generic)");
#endif
  return out;
}

// Scatter this step's K/V ([tokens, kv_heads, head_dim]) into their cache slots; slot -1 = skip.
void write_kv_cache(
    const at::Tensor& key,
    const at::Tensor& value,
    at::Tensor& k_cache,
    at::Tensor& v_cache,
    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "k_cache, v_cache: contiguous [blocks, block_size, kv_heads, head_dim]");
  // one dtype for all four: a row is copied as slot_size elements of the key cache's size
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "key, value and both caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "slot_mapping: int64 [tokens]");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t slot_size = k_cache.size(2) * k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  // the shape itself, not only the element count: [tokens, 1, 128] would fill a [.., 2, 64] slot
  // with its heads split in the wrong place
  TORCH_CHECK(key.dim() == 3 && key.size(0) == num_tokens && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3) && value.sizes() == key.sizes(),
              "key, value: [tokens, kv_heads, head_dim] matching the caches and slot_mapping, got ", key.sizes(),
              " and ", value.sizes(), " for caches ", k_cache.sizes(), " and ", num_tokens, " slots");
  // key and value are usually views into the fused qkv projection: rows apart, each row contiguous.
  // They are read in place then; anything else is made contiguous first.
  const auto rows = [](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  const auto k = rows(key), v = rows(value), slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t element = k_cache.element_size(), bytes = slot_size * element;
  const int64_t k_stride = k.stride(0) * element, v_stride = v.stride(0) * element;
  const char* k_src = static_cast<const char*>(k.data_ptr());
  const char* v_src = static_cast<const char*>(v.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0) continue;
    TORCH_CHECK(slot[t] < num_slots, "slot_mapping: slot ", slot[t], " is past the cache's ", num_slots);
    std::memcpy(k_dst + slot[t] * bytes, k_src + t * k_stride, bytes);
    std::memcpy(v_dst + slot[t] * bytes, v_src + t * v_stride, bytes);
  }
}

// -- greedy argmax ---------------------------------------------------------------------------------

// The first maximum of x[0, n), NaN greater than everything: one scalar pass.
template <typename scalar_t>
int64_t argmax_scalar(const scalar_t* x, int64_t n) {
  int64_t best = 0;
  float best_value = static_cast<float>(x[0]);
  for (int64_t i = 0; i < n && !std::isnan(best_value); ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v) || v > best_value) best = i, best_value = v;
  }
  return best;
}

#ifdef PAGEDSERVE_AVX512
inline __m512 load16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }

inline __m512 load16(const c10::BFloat16* x, __mmask16 m) { return pagedserve::load_bf16(x, m); }

// Two vector passes: the row's maximum (and whether it holds a NaN), then the first slot equal to it.
template <typename scalar_t>
int64_t argmax_avx512(const scalar_t* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = pagedserve::lanes_below(n - i);
    const __m512 v = _mm512_mask_mov_ps(best, m, load16(x + i, m));  // lanes past the end keep best
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (nan) return argmax_scalar(x, n);  // the first NaN: rare enough for the scalar walk
  const __m512 target = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = pagedserve::lanes_below(n - i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, load16(x + i, m), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // unreachable: the maximum is one of the row's values
}
#endif

template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
#ifdef PAGEDSERVE_AVX512
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    return argmax_avx512(x, n);
  }
#endif
  return argmax_scalar(x, n);
}

// run(base) with the data of `logits` in its own type: float32, bfloat16 or float16 (`kernel` names
// the op that refuses any other).
template <typename Run>
void with_logits(const at::Tensor& logits, const char* kernel, const Run& run) {
  switch (logits.scalar_type()) {
    case at::kFloat: return run(logits.data_ptr<float>());
    case at::kBFloat16: return run(logits.data_ptr<c10::BFloat16>());
    case at::kHalf: return run(logits.data_ptr<c10::Half>());
    default: TORCH_CHECK(false, kernel, ": float32, bfloat16 or float16 logits, not ", logits.scalar_type());
  }
}

// [rows, n] -> [rows] int64: each row's first maximum, as max(dim=-1).indices.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits [rows, n] with n > 0");
  const auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  with_logits(x, "argmax_rows", [&](auto* base) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) index[r] = argmax_row(base + r * stride, n);
    });
  });
  return out;
}

// Inversion's first level: the first of `blocks` blocks whose cumulative sum (`cdf`, float64) reaches
// the target (1 - u) * total, and in `left` how much of the target lies in it.
int64_t target_block(const double* cdf, int64_t blocks, double u, double& left) {
  const double target = (1.0 - u) * cdf[blocks - 1];  // in (0, total]
  int64_t b = 0;
  while (b < blocks - 1 && !(cdf[b] >= target)) ++b;
  left = target - (b > 0 ? cdf[b - 1] : 0.0);  // cdf[b - 1] is below the target
  return b;
}

// Inversion's second level: the first of a block's `len` weights whose running sum in float64 reaches
// `left` (capped at the block's own sum: the block sums' order differs from this one). Its last weight
// where none does (a row of NaN: some token of the vocabulary).
int64_t token_within(const float* q, int64_t len, double left) {
  double total = 0.0;
  for (int64_t i = 0; i < len; ++i) total += static_cast<double>(q[i]);
  const double residual = std::min(left, total);
  double running = 0.0;
  for (int64_t i = 0; i < len; ++i) {
    running += static_cast<double>(q[i]);
    if (running >= residual) return i;
  }
  return len - 1;
}

// One row's draw by inversion, as the sampler's `_draw` makes it: the first token whose cumulative
// probability reaches (1 - u) * total, in two levels summed in float64 (the block of `block` tokens
// the target falls in, then the token within it). `cdf`: room for the row's block sums.
int64_t invert_row(const float* p, int64_t n, int64_t block, double u, double* cdf) {
  const int64_t blocks = (n + block - 1) / block;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* q = p + b * block;
    const int64_t len = std::min(block, n - b * block);
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < len; ++i) sum += static_cast<double>(q[i]);
    running += sum;
    cdf[b] = running;
  }
  double left;
  const int64_t b = target_block(cdf, blocks, u, left);
  return b * block + token_within(p + b * block, std::min(block, n - b * block), left);
}

// Each row of `probs` (float32 [rows, n], rows of non-negative weights) drawn by inversion at its
// uniform (float64 [rows], in [0, 1)): the sampler's `_draw`, without its float64 copy of the
// probabilities (~2 ms for 64 rows of 49,152 tokens) nor its other passes over the vocabulary.
at::Tensor invert_rows(const at::Tensor& probs, const at::Tensor& uniforms, int64_t block) {
  TORCH_CHECK(probs.dim() == 2 && probs.size(1) > 0 && probs.scalar_type() == at::kFloat,
              "invert_rows: probs must be float32 [rows, n] with n > 0, got ", probs.scalar_type(), " ",
              probs.sizes());
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == probs.size(0) && uniforms.scalar_type() == at::kDouble,
              "invert_rows: uniforms must be float64 [rows], got ", uniforms.scalar_type(), " ", uniforms.sizes());
  TORCH_CHECK(block > 0, "invert_rows: block must be positive, got ", block);
  const auto p = probs.stride(1) == 1 ? probs : probs.contiguous();
  const auto u = uniforms.contiguous();
  const int64_t rows = p.size(0), n = p.size(1), stride = p.stride(0);
  auto out = at::empty({rows}, p.options().dtype(at::kLong));
  const float* base = p.data_ptr<float>();
  const double* us = u.data_ptr<double>();
  int64_t* index = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> cdf((n + block - 1) / block);
    for (int64_t r = begin; r < end; ++r) index[r] = invert_row(base + r * stride, n, block, us[r], cdf.data());
  });
  return out;
}

// sample_rows: random rows drawn straight from the logits, as the sampler's torch path draws them
// (temperature, softmax, `_draw`) up to rounding: a row's weights are exp((x - max) / T) in float32,
// never normalized (inversion places (1 - u) * total among them, whatever their scale), summed in
// float64 in blocks, and the first token whose cumulative weight reaches the target is drawn. One pass
// finds the row's maximum, one sums the blocks' weights, and the block the target falls in is weighed
// again: no float32 copy of the logits, no tempered copy, no probabilities written. The weights are
// exp_nonpositive's, which stops at exp(-87) (~1.6e-38): below that, -inf among them (a grammar's
// mask), a weight is 0, never drawn.

constexpr float kLeastExponent = -87.0f;

#ifdef PAGEDSERVE_AVX512
// The weights of x's lanes in `m` (the others read nothing and weigh 0).
template <typename scalar_t>
inline __m512 weights16(const scalar_t* x, __mmask16 m, __m512 max, __m512 inv_t) {
  const __m512 z = _mm512_mul_ps(_mm512_sub_ps(load16(x, m), max), inv_t);
  const __mmask16 above = _mm512_cmp_ps_mask(z, _mm512_set1_ps(kLeastExponent), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(m & above, exp_nonpositive16(z));
}

// Adds w's 16 lanes, widened to float64, to two accumulators of 8.
inline void add_as_doubles(__m512 w, __m512d& lo, __m512d& hi) {
  lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(w)));
  hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1))));
}
#endif

// One row's weights [begin, end) written to `w` (float32), as the vector pass computes them.
template <typename scalar_t>
void row_weights(const scalar_t* x, int64_t begin, int64_t end, float max, float inv_t, float* w) {
#ifdef PAGEDSERVE_AVX512
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512 vmax = _mm512_set1_ps(max), vinv = _mm512_set1_ps(inv_t);
    for (int64_t i = begin; i < end; i += 16) {
      const __mmask16 m = pagedserve::lanes_below(end - i);
      _mm512_mask_storeu_ps(w + (i - begin), m, weights16(x + i, m, vmax, vinv));
    }
    return;
  }
#endif
  for (int64_t i = begin; i < end; ++i) {
    const float z = (static_cast<float>(x[i]) - max) * inv_t;
    w[i - begin] = z < kLeastExponent ? 0.0f : exp_nonpositive(z);
  }
}

// The float64 sum of the row's weights [begin, end).
template <typename scalar_t>
double weight_sum(const scalar_t* x, int64_t begin, int64_t end, float max, float inv_t, float* scratch) {
#ifdef PAGEDSERVE_AVX512
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512 vmax = _mm512_set1_ps(max), vinv = _mm512_set1_ps(inv_t);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int64_t i = begin; i < end; i += 16) add_as_doubles(weights16(x + i, pagedserve::lanes_below(end - i), vmax, vinv), lo, hi);
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
  }
#endif
  row_weights(x, begin, end, max, inv_t, scratch);
  double sum = 0.0;
  for (int64_t i = 0; i < end - begin; ++i) sum += static_cast<double>(scratch[i]);
  return sum;
}

// One row's token: its argmax at temperature <= 0 (or one so small that 1 / T is inf), else its draw
// at uniform u (see above). A row with a NaN or +inf logit draws its last token (the torch path's
// softmax of it is a row of NaN, whose draw is some token too). `cdf`: room for the row's block sums;
// `scratch`: for one block's weights.
template <typename scalar_t>
int64_t sample_row(const scalar_t* x, int64_t n, float temperature, int64_t block, double u, double* cdf,
                   float* scratch) {
  const float inv_t = 1.0f / temperature;
  if (!(temperature > 0.0f) || std::isinf(inv_t)) return argmax_row(x, n);  // T -> 0: the argmax
  const float max = static_cast<float>(x[argmax_row(x, n)]);
  if (!std::isfinite(max)) return n - 1;
  const int64_t blocks = (n + block - 1) / block;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    running += weight_sum(x, b * block, std::min(n, (b + 1) * block), max, inv_t, scratch);
    cdf[b] = running;
  }
  double left;
  const int64_t begin = target_block(cdf, blocks, u, left) * block, len = std::min(block, n - begin);
  row_weights(x, begin, begin + len, max, inv_t, scratch);  // the same weights as summed above
  return begin + token_within(scratch, len, left);
}

// Rows cut by top-k, top-p or min-p: what the sampler's `_top_cut` keeps of sample_row's weights,
// drawn by inversion most likely first, ties in id order, as `_draw_from_top` draws them (the same
// token but within rounding of an interval's edge). Each cut keeps every token of weight at least some
// least weight (ties kept), so a row needs that weight, not its tokens in order. Its likeliest tokens
// are gathered above a floor in one pass that also sums every weight (collect_candidates; the floor is
// lowered only where the cut may reach below it, kCutFloors; top-k's floor rises as the pass goes,
// raise_floor); top-k's least weight is their k-th (nth_element), top-p's the weight of the token at
// which their mass, likeliest first, reaches p (token_reaching: a selection, not a sort), min-p's is
// min_p itself, the likeliest token weighing 1. The token drawn is found among the kept ones by the
// same selection. `_draw_from_top` runs `topk` over the float32 probabilities instead.

// Where a top-p row's candidates start: 2^-13 holds most chat rows' sets, 2^-16 those of a longer tail
// (at temperature 1, p = 0.99), 2^-20 and 2^-30 nearly every set; 0: every token of positive weight.
constexpr float kCutFloors[] = {0x1p-13f, 0x1p-16f, 0x1p-20f, 0x1p-30f, 0.0f};

// A cut row's candidates: weights and token ids in id order, `count` of them (room for n + 16 each).
struct Candidates {
  float* w;
  int32_t* id;
  int64_t count;
};

// A token kept, and the order the kept ones are drawn in: the likeliest first, ties by id.
struct Kept {
  float w;
  int32_t id;
};

inline bool likelier(const Kept& a, const Kept& b) { return a.w > b.w || (a.w == b.w && a.id < b.id); }

// A thread's room for one row's candidates (n + 16), their selection (n) and the kept ones (n): one a
// thread, kept across calls (sample_rows' cut rows, logprob_rows), so that it is not faulted in anew.
struct CandidateRoom {
  std::vector<float> weights, selection;
  std::vector<int32_t> ids;
  std::vector<Kept> kept;

  // Empty candidates with room for a row of n tokens.
  Candidates fit(int64_t n) {
    if (ids.size() < static_cast<size_t>(n + 16)) {
      weights.resize(n + 16);
      ids.resize(n + 16);
      selection.resize(n);
      kept.resize(n);
    }
    return Candidates{weights.data(), ids.data(), 0};
  }
};

CandidateRoom& thread_room() {
  thread_local CandidateRoom room;
  return room;
}

// Top-k's collection: whenever `cap` candidates are held, the floor rises to the k-th largest weight
// among them and those below it go (the rest keep their order): none of them is among the row's k
// largest. `selection`: room for the candidates' weights.
void raise_floor(Candidates& c, int64_t k, float* selection, float& floor, int64_t& cap) {
  std::copy(c.w, c.w + c.count, selection);
  std::nth_element(selection, selection + k - 1, selection + c.count, std::greater<float>());
  floor = selection[k - 1];
  int64_t kept = 0;
  for (int64_t j = 0; j < c.count; ++j) {
    if (c.w[j] >= floor) {
      c.w[kept] = c.w[j];
      c.id[kept++] = c.id[j];
    }
  }
  c.count = kept;
  cap = std::max(cap, 2 * kept);  // ties of the k-th may keep many more than k
}

#ifdef PAGEDSERVE_AVX512
// Appends the lanes of `v` in `keep` (tokens i to i + 15) to `c`, compressed in registers (to memory it
// is slow on some CPUs) and stored whole; once `cap` are held, raise_floor, and `vfloor` with it.
inline void add_candidates(Candidates& c, __mmask16 keep, __m512 v, int64_t i, int64_t k, float* selection,
                           float& floor, int64_t& cap, __m512& vfloor) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i id = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i)));
  _mm512_storeu_ps(c.w + c.count, _mm512_maskz_compress_ps(keep, v));
  _mm512_storeu_si512(c.id + c.count, _mm512_maskz_compress_epi32(keep, id));
  c.count += __builtin_popcount(keep);
  if (c.count >= cap) {
    raise_floor(c, k, selection, floor, cap);
    vfloor = _mm512_set1_ps(floor);
  }
}
#endif

// Gathers the row's tokens of weight >= floor (> 0 where floor is 0) into `c`, and with k > 0 none
// below the k-th largest weight it has met (raise_floor). `total`: every weight's sum in float64;
// returns the largest weight left out below the floor it started from (0: none of positive weight).
template <typename scalar_t>
float collect_candidates(const scalar_t* x, int64_t n, float max, float inv_t, float floor, int64_t k, Candidates& c,
                         double& total, float* selection, float* scratch, int64_t block) {
  floor = std::max(floor, std::numeric_limits<float>::min());  // below every positive weight (>= e^-87)
  const float start = floor;
  int64_t cap = k > 0 ? std::max<int64_t>(4 * k, 256) : n;  // with room for n + 16
  c.count = 0;
#ifdef PAGEDSERVE_AVX512
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    (void)scratch, (void)block;
    const __m512 vmax = _mm512_set1_ps(max), vinv = _mm512_set1_ps(inv_t);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    __m512 beyond = _mm512_setzero_ps();
    const __m512 vstart = _mm512_set1_ps(start);
    __m512 vfloor = vstart;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = pagedserve::lanes_below(n - i);
      const __m512 w = weights16(x + i, m, vmax, vinv);
      add_as_doubles(w, lo, hi);
      const __mmask16 keep = _mm512_mask_cmp_ps_mask(m, w, vfloor, _CMP_GE_OQ);
      beyond = _mm512_mask_max_ps(beyond, m & ~_mm512_cmp_ps_mask(w, vstart, _CMP_GE_OQ), beyond, w);
      if (keep) add_candidates(c, keep, w, i, k, selection, floor, cap, vfloor);
    }
    total = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
    return _mm512_reduce_max_ps(beyond);
  }
#endif
  total = 0.0;
  float beyond = 0.0f;
  for (int64_t begin = 0; begin < n; begin += block) {
    const int64_t end = std::min(n, begin + block);
    row_weights(x, begin, end, max, inv_t, scratch);
    for (int64_t i = begin; i < end; ++i) {
      const float w = scratch[i - begin];
      total += static_cast<double>(w);
      if (w < start) beyond = std::max(beyond, w);
      if (w >= floor) {
        c.w[c.count] = w;
        c.id[c.count++] = static_cast<int32_t>(i);
        if (c.count >= cap) raise_floor(c, k, selection, floor, cap);
      }
    }
  }
  return beyond;
}

// The float64 sum of the weights in [begin, end).
double mass(const float* begin, const float* end) {
  double sum = 0.0;
  for (const float* w = begin; w < end; ++w) sum += static_cast<double>(*w);
  return sum;
}

// The token at which the running mass of kept[0, m) (m >= 1, in any order; reordered), taken in the
// `likelier` order, first reaches `target` (> 0; the last token where it never does): top-p's least
// kept weight is its weight, and the token drawn is it. A selection: each round partitions the tokens
// still in question around one of them and keeps the side the token is on; the last few are sorted.
Kept token_reaching(Kept* kept, int64_t m, double target) {
  double above = 0.0;  // the mass of the tokens likelier than any still in question: below the target
  Kept* lo = kept;
  Kept* hi = kept + m;
  Kept last = kept[0];
  while (hi - lo > 32) {
    const Kept pivot = lo[(hi - lo) / 2];
    Kept* rest = std::partition(lo, hi, [&pivot](const Kept& a) { return likelier(a, pivot); });
    double likelier_mass = 0.0;
    for (const Kept* k = lo; k < rest; ++k) likelier_mass += static_cast<double>(k->w);
    if (above + likelier_mass >= target) {
      hi = rest;  // not empty: its mass reaches past `above`
      continue;
    }
    above += likelier_mass + static_cast<double>(pivot.w);  // the pivot is the likeliest of the rest
    last = pivot;
    if (above >= target) return pivot;
    std::swap(*rest, *std::find_if(rest, hi, [&pivot](const Kept& a) { return a.id == pivot.id; }));
    lo = rest + 1;
  }
  std::sort(lo, hi, likelier);
  for (const Kept* k = lo; k < hi; ++k) {
    above += static_cast<double>(k->w);
    last = *k;
    if (above >= target) return last;
  }
  return last;
}

// One cut row's token: its argmax at temperature <= 0 (or 1 / T inf); else what `_top_cut` keeps of
// its weights (top-k with k in [1, n), then top-p with p < 1 on what top-k keeps, then min-p), drawn
// at u in the `likelier` order. A row with a NaN or +inf logit draws its last token, as sample_row
// does. `c`: room for n + 16 candidates; `selection` and `kept`: for n; `scratch`: for `block`.
template <typename scalar_t>
int64_t sample_cut_row(const scalar_t* x, int64_t n, float temperature, int64_t k, float p, float min_p, double u,
                       Candidates c, float* selection, Kept* kept, float* scratch, int64_t block) {
  const float inv_t = 1.0f / temperature;
  if (!(temperature > 0.0f) || std::isinf(inv_t)) return argmax_row(x, n);
  const float max = static_cast<float>(x[argmax_row(x, n)]);
  if (!std::isfinite(max)) return n - 1;
  const bool has_k = k < n, uses_p = p < 1.0f;
  min_p = std::min(min_p, 1.0f);  // the likeliest token (weight 1) always stays
  double total = 0.0;             // every weight's: top-p's mass without top-k
  if (has_k || !uses_p) {  // top-k's set in one pass; min-p alone keeps exactly the weights >= min_p
    collect_candidates(x, n, max, inv_t, has_k ? 0.0f : min_p, has_k ? k : 0, c, total, selection, scratch, block);
  } else {
    for (const float floor : kCutFloors) {  // until the candidates hold top-p's mass
      const float beyond = collect_candidates(x, n, max, inv_t, floor, 0, c, total, selection, scratch, block);
      if (beyond == 0.0f || mass(c.w, c.w + c.count) >= static_cast<double>(p) * total) break;
    }
  }
  float least = 0.0f;  // the least weight kept
  float* const w = selection;
  if (has_k && k < c.count) {  // the k-th largest weight (all of them where fewer weigh anything)
    std::copy(c.w, c.w + c.count, w);
    std::nth_element(w, w + k - 1, w + c.count, std::greater<float>());
    least = w[k - 1];
  }
  // the candidates of at least `least`, and their mass
  const auto keep = [&c, kept](float at_least) {
    std::pair<int64_t, double> held{0, 0.0};
    for (int64_t j = 0; j < c.count; ++j) {
      if (c.w[j] >= at_least) {
        kept[held.first++] = Kept{c.w[j], c.id[j]};
        held.second += static_cast<double>(c.w[j]);
      }
    }
    return held;
  };
  if (uses_p) {  // on what top-k keeps, and of its mass
    const auto [m, k_mass] = keep(least);
    const double target = static_cast<double>(p) * (has_k ? k_mass : total);
    least = std::max(least, target > 0.0 ? token_reaching(kept, m, target).w : 1.0f);  // p <= 0: the likeliest
  }
  const auto [m, kept_mass] = keep(std::max(least, min_p));
  return token_reaching(kept, m, (1.0 - u) * kept_mass).id;  // the target in (0, the kept mass]
}

// A cut's per-row values, or nullptr where no row of the batch has that cut (`name` in the refusal).
template <typename T>
const T* cut_values(const std::optional<at::Tensor>& values, int64_t rows, at::ScalarType dtype, const char* name,
                    at::Tensor& held) {
  if (!values.has_value()) return nullptr;
  TORCH_CHECK(values->dim() == 1 && values->size(0) == rows && values->scalar_type() == dtype, "sample_rows: ", name,
              " must be ", dtype, " [rows], got ", values->scalar_type(), " ", values->sizes());
  held = values->contiguous();
  return held.data_ptr<T>();
}

// [rows, n] logits (float32, bfloat16 or float16), float32 temperatures [rows] (<= 0: greedy) and
// float64 uniforms [rows] in [0, 1) -> int64 tokens [rows]; `block`: tokens a block of the inversion.
// The cuts, each optional: top_ks (int64 [rows], n or more: none; below 1 taken as 1), top_ps (float32
// [rows], 1: none) and min_ps (float32 [rows], 0: none); a row with none draws as sample_row.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms,
                       int64_t block, const std::optional<at::Tensor>& top_ks, const std::optional<at::Tensor>& top_ps,
                       const std::optional<at::Tensor>& min_ps) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "sample_rows: logits [rows, n] with n > 0, got ",
              logits.sizes());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), "sample_rows: at most 2^31 - 1 tokens a row, got ", n);
  TORCH_CHECK(temperatures.dim() == 1 && temperatures.size(0) == rows && temperatures.scalar_type() == at::kFloat,
              "sample_rows: temperatures must be float32 [rows], got ", temperatures.scalar_type(), " ",
              temperatures.sizes());
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == rows && uniforms.scalar_type() == at::kDouble,
              "sample_rows: uniforms must be float64 [rows], got ", uniforms.scalar_type(), " ", uniforms.sizes());
  TORCH_CHECK(block > 0, "sample_rows: block must be positive, got ", block);
  at::Tensor held_ks, held_ps, held_min_ps;
  const int64_t* ks = cut_values<int64_t>(top_ks, rows, at::kLong, "top_ks", held_ks);
  const float* ps = cut_values<float>(top_ps, rows, at::kFloat, "top_ps", held_ps);
  const float* mps = cut_values<float>(min_ps, rows, at::kFloat, "min_ps", held_min_ps);
  const auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const auto temps = temperatures.contiguous();
  const auto u = uniforms.contiguous();
  const int64_t stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* ts = temps.data_ptr<float>();
  const double* us = u.data_ptr<double>();
  int64_t* index = out.data_ptr<int64_t>();
  with_logits(x, "sample_rows", [&](auto* base) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> cdf((n + block - 1) / block);
      std::vector<float> scratch(std::min(block, n));
      for (int64_t r = begin; r < end; ++r) {
        const int64_t k = ks ? std::clamp<int64_t>(ks[r], 1, n) : n;
        const float p = ps ? ps[r] : 1.0f, min_p = mps ? mps[r] : 0.0f;
        if (k < n || p < 1.0f || min_p > 0.0f) {
          CandidateRoom& room = thread_room();
          const Candidates c = room.fit(n);
          index[r] = sample_cut_row(base + r * stride, n, ts[r], k, p, min_p, us[r], c, room.selection.data(),
                                    room.kept.data(), scratch.data(), block);
        } else {
          index[r] = sample_row(base + r * stride, n, ts[r], block, us[r], cdf.data(), scratch.data());
        }
      }
    });
  });
  return out;
}

// logprob_rows: what the sampler reports of the raw logits, as torch.log_softmax(logits.float()) and
// its `topk` give them (up to rounding), without writing them: a row's logprobs are (x - max) - L in
// float32, L the log of sample_row's weights at temperature 1 summed in float64. Three passes over the
// row: its maximum, the sum, then each token's logprob, to count those above the given token's (its
// rank) and to gather the likeliest above a floor that rises as the pass goes (raise_floor); the k
// likeliest are then sorted among those, ties in id order. torch's log_softmax, `topk` and a count over
// a float32 copy took ~7-15 ms a step for 64 rows of 49,152 tokens, this ~1-2 (bench/logprobs.py).

// A row with a NaN or +inf logit (or only -inf ones), whose log_softmax is NaN throughout: every
// logprob NaN, rank 1, its first k tokens as the top k.
void nan_logprob_row(int64_t token, int64_t k, float* values, int64_t* ids, int64_t& rank) {
  values[0] = std::numeric_limits<float>::quiet_NaN();
  ids[0] = token;
  for (int64_t i = 0; i < k; ++i) values[1 + i] = values[0], ids[1 + i] = i;
  rank = 1;
}

// One row: `values` and `ids` [1 + k] (the token, then the k likeliest), its token's rank. A negative
// `token`: the row's argmax, as argmax_row finds it (greedy rows' logprobs in one read of the logits).
// `c`: room for n + 16 candidates; `selection`: for n weights; `kept`: for n.
template <typename scalar_t>
void logprob_row(const scalar_t* x, int64_t n, int64_t token, int64_t k, Candidates c, float* selection, Kept* kept,
                 float* values, int64_t* ids, int64_t& rank) {
  const int64_t top = argmax_row(x, n);
  if (token < 0) token = top;
  const float max = static_cast<float>(x[top]);
  if (!std::isfinite(max)) return nan_logprob_row(token, k, values, ids, rank);
  double total = 0.0;
  float floor = -std::numeric_limits<float>::infinity();
  int64_t cap = std::max<int64_t>(4 * k, 256), above = 0;
  c.count = 0;
#ifdef PAGEDSERVE_AVX512
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512 vmax = _mm512_set1_ps(max), one = _mm512_set1_ps(1.0f);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
      add_as_doubles(weights16(x + i, pagedserve::lanes_below(n - i), vmax, one), lo, hi);
    }
    total = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
    const float log_total = static_cast<float>(std::log(total));
    const float own = (static_cast<float>(x[token]) - max) - log_total;
    const __m512 vlog = _mm512_set1_ps(log_total), vown = _mm512_set1_ps(own);
    __m512 vfloor = _mm512_set1_ps(floor);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = pagedserve::lanes_below(n - i);
      const __m512 lp = _mm512_sub_ps(_mm512_sub_ps(load16(x + i, m), vmax), vlog);
      above += __builtin_popcount(_mm512_mask_cmp_ps_mask(m, lp, vown, _CMP_GT_OQ));
      const __mmask16 keep = k > 0 ? _mm512_mask_cmp_ps_mask(m, lp, vfloor, _CMP_GE_OQ) : 0;
      if (keep) add_candidates(c, keep, lp, i, k, selection, floor, cap, vfloor);
    }
    values[0] = own;
  } else
#endif
  {
    for (int64_t i = 0; i < n; ++i) {
      const float z = static_cast<float>(x[i]) - max;
      total += z < kLeastExponent ? 0.0 : static_cast<double>(exp_nonpositive(z));
    }
    const float log_total = static_cast<float>(std::log(total));
    const float own = (static_cast<float>(x[token]) - max) - log_total;
    for (int64_t i = 0; i < n; ++i) {
      const float lp = (static_cast<float>(x[i]) - max) - log_total;
      above += lp > own;
      if (k > 0 && lp >= floor) {
        c.w[c.count] = lp;
        c.id[c.count++] = static_cast<int32_t>(i);
        if (c.count >= cap) raise_floor(c, k, selection, floor, cap);
      }
    }
    values[0] = own;
  }
  ids[0] = token;
  rank = 1 + above;
  for (int64_t j = 0; j < c.count; ++j) kept[j] = Kept{c.w[j], c.id[j]};
  std::partial_sort(kept, kept + k, kept + c.count, likelier);  // count >= k: the floor rises to the k-th at most
  for (int64_t i = 0; i < k; ++i) values[1 + i] = kept[i].w, ids[1 + i] = kept[i].id;
}

// [rows, n] logits (float32, bfloat16 or float16) and int64 tokens [rows] (none: each row's argmax) ->
// float32 logprobs and int64 ids [rows, 1 + min(k, n)] (each row's token, then its likeliest min(k, n))
// and int64 ranks [rows].
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_rows(const at::Tensor& logits,
                                                             const std::optional<at::Tensor>& tokens, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logprob_rows: logits [rows, n] with n > 0, got ",
              logits.sizes());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), "logprob_rows: at most 2^31 - 1 tokens a row, got ", n);
  TORCH_CHECK(k >= 0, "logprob_rows: k must be at least 0, got ", k);
  at::Tensor t;  // undefined: every row takes its argmax
  if (tokens.has_value()) {
    TORCH_CHECK(tokens->dim() == 1 && tokens->size(0) == rows && tokens->scalar_type() == at::kLong,
                "logprob_rows: tokens must be int64 [rows], got ", tokens->scalar_type(), " ", tokens->sizes());
    t = tokens->contiguous();
    const int64_t* token = t.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(0 <= token[r] && token[r] < n, "logprob_rows: token ", token[r], " of row ", r, " is not in [0, ",
                  n, ")");
  }
  const int64_t* token = t.defined() ? t.data_ptr<int64_t>() : nullptr;
  k = std::min(k, n);
  const auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t stride = x.stride(0);
  auto values = at::empty({rows, 1 + k}, x.options().dtype(at::kFloat));
  auto ids = at::empty({rows, 1 + k}, x.options().dtype(at::kLong));
  auto ranks = at::empty({rows}, x.options().dtype(at::kLong));
  float* value = values.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  int64_t* rank = ranks.data_ptr<int64_t>();
  with_logits(x, "logprob_rows", [&](auto* base) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      CandidateRoom& room = thread_room();
      const Candidates c = room.fit(n);
      for (int64_t r = begin; r < end; ++r) {
        logprob_row(base + r * stride, n, token != nullptr ? token[r] : -1, k, c, room.selection.data(),
                    room.kept.data(), value + r * (1 + k), id + r * (1 + k), rank[r]);
      }
    });
  });
  return {values, ids, ranks};
}

// Which decode path bfloat16 takes on this build: the AVX512-BF16 one or the generic loops.
std::string decode_isa() {
#ifdef PAGEDSERVE_AVX512_BF16
  return "avx512_bf16";
#else
  return "generic";
#endif
}

}  // namespace

std::vector<int64_t> pagedserve::decode_row_split(const int32_t* context_lens, int64_t num_rows, int64_t parts,
                                                  int64_t window) {
  constexpr int64_t kRowCost = 16;
  std::vector<int64_t> work(num_rows + 1, 0);  // work[r]: rows before r
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t read = window > 0 ? std::min<int64_t>(context_lens[r], window) : context_lens[r];
    work[r + 1] = work[r] + read + kRowCost;
  }
  std::vector<int64_t> bounds(parts + 1, num_rows);
  for (int64_t part = 0; part < parts; ++part)  // the first row whose work starts at or past part's share
    bounds[part] = std::lower_bound(work.begin(), work.end(), work.back() * part / parts) - work.begin();
  return bounds;
}

void pagedserve::decode_attention_rows_bf16(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                                            const at::Tensor& context_lens, double scale, int64_t window,
                                            double softcap, int64_t begin, int64_t end) {
  const DecodeArgs<c10::BFloat16> args(out, query, k_cache, v_cache, block_tables, context_lens, scale, window,
                                       softcap);
  switch (args.dim) {  // the paths dispatch_dim takes
#ifdef PAGEDSERVE_AVX512_BF16
    case 64: return decode_rows_avx512_bf16<64>(args, begin, end);
    case 96: return decode_rows_avx512_bf16<96>(args, begin, end);
    case 128: return decode_rows_avx512_bf16<128>(args, begin, end);
    case 256: return decode_rows_avx512_bf16<256>(args, begin, end);
#else
    case 64: return decode_rows<c10::BFloat16, 64>(args, begin, end);
    case 128: return decode_rows<c10::BFloat16, 128>(args, begin, end);
#endif
    default: return decode_rows<c10::BFloat16, 0>(args, begin, end);
  }
}

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("decode_isa() -> str", &decode_isa);
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("invert_rows(Tensor probs, Tensor uniforms, int block) -> Tensor");
  m.def(
      "sample_rows(Tensor logits, Tensor temperatures, Tensor uniforms, int block, Tensor? top_ks=None, "
      "Tensor? top_ps=None, Tensor? min_ps=None) -> Tensor");
  m.def("logprob_rows(Tensor logits, Tensor? tokens, int k) -> (Tensor, Tensor, Tensor)");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_attention_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, float softcap=0.0, Tensor? sinks=None, "
        "Tensor? alibi_slopes=None) -> Tensor");
  m.def("paged_attention_prefill(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor context_lens, float scale, int window=0, float softcap=0.0, "
        "Tensor? sinks=None, Tensor? alibi_slopes=None) -> Tensor");
  // the ops of the other files (ops.h)
  m.def("linear_amx_supported() -> bool", &pagedserve::linear_amx_supported);
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pagedserve::pack_linear_weight);
  m.def("linear_amx(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("linear_argmax_amx(Tensor x, Tensor packed, Tensor? bias, int num_columns) -> Tensor");
  m.def("linear_avx512_supported() -> bool", &pagedserve::linear_avx512_supported);
  m.def("pack_linear_weight_avx512(Tensor weight) -> Tensor", &pagedserve::pack_linear_weight_avx512);
  m.def("linear_avx512(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("linear_argmax_avx512(Tensor x, Tensor packed, Tensor? bias, int num_columns) -> Tensor");
  m.def("decode_layers_supported() -> bool", &pagedserve::decode_layers_supported);
  m.def(
      "decode_layers(Tensor input_ids, Tensor positions, Tensor embedding, Tensor cos_sin_cache, Tensor[] norms, "
      "Tensor[] qkv, Tensor[] qkv_bias, Tensor[] qk_norms, Tensor[] o_proj, Tensor[] gate_up, Tensor[] down, Tensor final_norm, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
      "int num_heads, int num_kv_heads, float eps, float scale, int[] windows, float embedding_scale, "
      "float residual_scale, bool[] rotary_layers) -> Tensor");
  m.def("mamba_scan(Tensor(a!) state, Tensor rows, Tensor starts, Tensor x, Tensor dt, Tensor a, Tensor b, "
        "Tensor c) -> Tensor");
  m.def("mamba2_decode(Tensor(a!) state, Tensor rows, Tensor x, Tensor dt, Tensor a, Tensor b, Tensor c) -> Tensor");
  m.def("gated_delta_decode(Tensor(a!) state, Tensor rows, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("paged_attention_prefill", &paged_attention_prefill);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("invert_rows", &invert_rows);
  m.impl("sample_rows", &sample_rows);
  m.impl("logprob_rows", &logprob_rows);
  m.impl("linear_amx", &pagedserve::linear_amx);
  m.impl("linear_argmax_amx", &pagedserve::linear_argmax_amx);
  m.impl("linear_avx512", &pagedserve::linear_avx512);
  m.impl("linear_argmax_avx512", &pagedserve::linear_argmax_avx512);
  m.impl("decode_layers", &pagedserve::decode_layers);
  m.impl("mamba_scan", &pagedserve::mamba_scan);
  m.impl("mamba2_decode", &pagedserve::mamba2_decode);
  m.impl("gated_delta_decode", &pagedserve::gated_delta_decode);
}

// Weights in oneDNN's layout make decode_layers' call dispatch as MkldnnCPU.
TORCH_LIBRARY_IMPL(pagedserve_cpu, MkldnnCPU, m) { m.impl("decode_layers", &pagedserve::decode_layers); }
