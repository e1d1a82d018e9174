// Greedy sampling inside an LM head's multiply (linear_argmax_avx512, linear_argmax_amx): each row's
// best column so far, kept as the multiply produces its outputs 32 columns at a time, instead of the
// [rows, n] logits written and read back by argmax_rows; then the threads' bests taken in column order.
#pragma once

#include <ATen/Parallel.h>

#include "bf16_vec.h"
#include "panel_range.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace pagedserve {

// v rounded to bfloat16 as store_bf16 rounds it, back in float32.
inline __m512 round_to_bf16(__m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return widen_bf16(reinterpret_cast<const __m256i&>(b));
}

// A row's 32 outputs at column `col` (lo, hi: 16 each, float32 before rounding) against its best column
// so far, as argmax_rows reads a row of bfloat16 logits: the first maximum, a NaN above everything (the
// first NaN wins). Columns from `num_columns` on are left out.
inline void update_best(__m512 lo, __m512 hi, int64_t col, int64_t num_columns, float& best, int64_t& index) {
  if (std::isnan(best)) return;
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  lo = _mm512_mask_mov_ps(none, lanes_below(num_columns - col), round_to_bf16(lo));
  hi = _mm512_mask_mov_ps(none, lanes_below(num_columns - col - 16), round_to_bf16(hi));
  const __mmask16 nan_lo = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q);
  const __mmask16 nan_hi = _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
  if (nan_lo | nan_hi) {
    index = nan_lo ? col + __builtin_ctz(nan_lo) : col + 16 + __builtin_ctz(nan_hi);
    best = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
  if (!(top > best)) return;  // a tie keeps the earlier column
  const __m512 vtop = _mm512_set1_ps(top);
  const __mmask16 at_lo = _mm512_cmp_ps_mask(lo, vtop, _CMP_EQ_OQ);
  index = at_lo ? col + __builtin_ctz(at_lo) : col + 16 + __builtin_ctz(_mm512_cmp_ps_mask(hi, vtop, _CMP_EQ_OQ));
  best = top;
}

// One thread's columns from `first_column` on: each row's best value and column.
struct RowBests {
  int64_t first_column;
  std::vector<float> value;
  std::vector<int64_t> index;

  RowBests(int64_t first_column, int64_t rows)
      : first_column(first_column),
        value(rows, -std::numeric_limits<float>::infinity()),
        index(rows, first_column) {}
};

// Each row's argmax over all the threads' columns into `index` [rows]: their bests in column order,
// as one pass over the whole row would find it.
inline void take_bests(std::vector<RowBests>& bests, int64_t rows, int64_t* index) {
  std::sort(bests.begin(), bests.end(),
            [](const RowBests& a, const RowBests& b) { return a.first_column < b.first_column; });
  for (int64_t r = 0; r < rows; ++r) {
    float value = -std::numeric_limits<float>::infinity();
    for (const RowBests& best : bests) {
      if (std::isnan(value)) break;
      if (std::isnan(best.value[r]) || best.value[r] > value) value = best.value[r], index[r] = best.index[r];
    }
  }
}

// Each row's argmax into `index` [rows] over `num_panels` panels of `panel_columns` columns, split over
// at::parallel_for's threads, which take each other's panels when done with their own (panel_range.h).
// Each thread makes itself a runner, `make_run()`, and calls run(panel, prefetch_next, best) for each
// panel it takes, which multiplies that panel keeping each row's best column in `best` (update_best;
// `prefetch_next`: its next panel is panel + 1). A thread's own panels make one run of columns and each
// panel it takes from another thread one more; the runs' bests are then taken in column order.
template <typename MakeRun>
void argmax_over_panels(int64_t num_panels, int64_t panel_columns, int64_t rows, const MakeRun& make_run,
                        int64_t* index) {
  const int64_t num_shares = std::min<int64_t>(at::get_num_threads(), num_panels);
  const std::unique_ptr<PanelRange[]> shares = even_shares(num_panels, num_shares);
  std::vector<RowBests> bests;
  std::mutex mutex;
  at::parallel_for(0, num_shares, 1, [&](int64_t share0, int64_t share1) {
    auto run = make_run();
    std::vector<RowBests> found;
    for (int64_t s = share0; s < share1; ++s) {
      bool own_run = false;  // found.back() holds this share's run of columns (its own panels come first)
      take_share_then_steal(
          shares.get(), num_shares, s,
          [&](int64_t panel, bool more) {
            if (!own_run) {
              found.emplace_back(panel * panel_columns, rows);
              own_run = true;
            }
            run(panel, more, found.back());
          },
          [&](int64_t panel) {
            found.emplace_back(panel * panel_columns, rows);
            run(panel, false, found.back());
          });
    }
    const std::lock_guard<std::mutex> lock(mutex);
    for (RowBests& best : found) bests.push_back(std::move(best));
  });
  take_bests(bests, rows, index);
}

}  // namespace pagedserve

#endif
