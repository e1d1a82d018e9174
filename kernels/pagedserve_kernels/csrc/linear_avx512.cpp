// bfloat16 linear layers on AVX512-BF16 (vdpbf16ps), for CPUs without AMX tiles
// (pagedserve_kernels/cpu.py builds and loads this with cpu_kernels.cpp).
//
// pack_linear_weight_avx512: a weight [N, K] (nn.Linear's layout) is reordered once into panels of 32
// output columns: [N/32][K/2][32 n][2 k]. One k pair of a panel is 64 bfloat16 values, two zmm
// registers of 16 columns x 2 k, which is what vdpbf16ps multiplies; a panel's k pairs follow each
// other, so a panel is one contiguous stream of K x 64 bytes.
//
// linear_avx512: out [M, N] = x [M, K] @ weight^T (+ bias). Threads split the panels, and take each
// other's when done with their own (panel_range.h); each panel runs down the rows in tiles of at most
// kMaxTileRows rows (2 x rows float32 accumulators): per k pair, two weight loads feed two vdpbf16ps a
// row, each with that row's pair of x broadcast. The panel (K x 64 bytes) stays in L1/L2 while the
// next row tiles reuse it, so the weight is streamed from memory once a call. Every output sums its k
// pairs in order in float32 and is rounded to bfloat16 once (the bias added first), so a row's result
// does not depend on the batch it is in, nor on which thread multiplies it.
//
// Left to the hardware, streaming and multiplying barely overlap from 8 rows on: a panel's first tile
// waits on memory, its later tiles run from L2 while memory idles. So there every tile of a panel
// prefetches its share of the thread's next panel (tile t of T the k pairs kp with kp % T == t,
// a k pair's two cache lines each), so that the stream runs through the whole panel's multiply, and
// the first tile prefetches its own panel a few k pairs ahead into L1. On the Zen 4 machine the second
// tile alone prefetching the next panel took 0.85-0.87 of the time at 8-32 rows and 0.93 at 64
// (SmolLM2-135M's 121 weights); on Zen 5, whose multiplies run twice as fast, sharing it among the
// tiles took 0.87-0.97 of that at 16 rows (two tiles) and 0.93-0.98 at 32-64, the least where the
// machine's memory read slowest (bench/README.md, "prefetches"). Below 8 rows the stream is
// memory-bound alone and the prefetches only slowed it. The next panel's prefetch is non-temporal
// (PREFETCHNTA): the weights are read once a pass, and on Zen 5 that hint instead of L2's took 0.95-0.96
// of a decode step's time at 16-32 rows and 0.98-1.00 at 48-64 (whole engine steps, the arms swapped
// step by step; bench/README.md, "non-temporal"). What the hint does is the CPU's choice (the x86
// manuals promise only less cache pollution); here it made the multiplies themselves faster.
//
// Why not oneDNN: on a Zen 4 EPYC (2 cores, SmolLM2-135M's weights) oneDNN's packed bf16 matmul
// streams the weight at 15 GB/s at one row; this loop at 26 GB/s (the machine reads ~28), 1.75x as
// fast at one row and 1.13-1.32x at 16-128 rows. At 512-2,048 rows (prefill) it is 2-10% slower, and
// the engine's compiled pass keeps oneDNN there (bench/README.md, "linear_avx512").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "argmax_best.h"
#include "bf16_vec.h"
#include "decode_parts.h"
#include "linear_inputs.h"
#include "ops.h"
#include "panel_range.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_AVX512_BF16 1
#endif

namespace {

constexpr int64_t kPanel = 32;       // output columns of a panel: two zmm registers of 16
constexpr int kMaxTileRows = 12;     // 24 accumulators + 2 weight registers + 1 broadcast fit in 32 zmm
constexpr int64_t kPrefetchRows = 8;  // from here on the prefetches below pay
constexpr int64_t kAheadPairs = 16;   // how far ahead a panel's first tile prefetches its own k pairs

#ifdef PAGEDSERVE_AVX512_BF16

struct LinearArgs {
  const c10::BFloat16* x;
  int64_t ld_x;  // elements between rows of x
  const c10::BFloat16* weight;
  const c10::BFloat16* bias;  // [N] or nullptr
  c10::BFloat16* out;
  int64_t num_rows, n, k_pairs;
  // linear_argmax_avx512: each row's best column so far (value, index) instead of `out`; columns from
  // `num_columns` on are left out
  float* best_value = nullptr;
  int64_t* best_index = nullptr;
  int64_t num_columns = 0;
};

// x's values k, k + 1 of a row as one 32-bit lane, broadcast to all 16 (rows need not be 4-byte aligned).
inline __m512bh broadcast_pair(const c10::BFloat16* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// What a tile prefetches while it multiplies, both null for none: `ahead`, its own panel kAheadPairs k
// pairs ahead (into L1; past the last panel's end too, which is harmless: a prefetch never faults);
// `next`, the next panel's k pairs kp with kp % shares == share (non-temporal).
struct Prefetch {
  const c10::BFloat16* ahead = nullptr;
  const c10::BFloat16* next = nullptr;
  int share = 0;
  int shares = 1;
};

// The two cache lines of a panel's k pair at `p`.
template <int HINT>
inline void prefetch_pair(const c10::BFloat16* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), static_cast<_mm_hint>(HINT));
  _mm_prefetch(reinterpret_cast<const char*>(p + kPanel), static_cast<_mm_hint>(HINT));
}

// Rows [row, row + ROWS) x the 32 columns of `panel`.
template <int ROWS>
void multiply_tile(const LinearArgs& a, int64_t row, int64_t panel, Prefetch prefetch) {
  __m512 acc[ROWS][2];
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const c10::BFloat16* w = a.weight + panel * a.k_pairs * 2 * kPanel;
  const c10::BFloat16* x = a.x + row * a.ld_x;
  int wait = prefetch.share;  // k pairs until this tile's next share of the next panel
  for (int64_t kp = 0; kp < a.k_pairs; ++kp) {
    if (prefetch.ahead != nullptr) prefetch_pair<_MM_HINT_T0>(prefetch.ahead + kp * 2 * kPanel);
    if (prefetch.next != nullptr && wait-- == 0) {
      prefetch_pair<_MM_HINT_NTA>(prefetch.next + kp * 2 * kPanel);
      wait = prefetch.shares - 1;
    }
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + kp * 2 * kPanel));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + kp * 2 * kPanel + kPanel));
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xr = broadcast_pair(x + r * a.ld_x + 2 * kp);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
  }
  const int64_t col = panel * kPanel;
  const __m512 b0 = a.bias ? pagedserve::load_bf16(a.bias + col) : _mm512_setzero_ps();
  const __m512 b1 = a.bias ? pagedserve::load_bf16(a.bias + col + 16) : _mm512_setzero_ps();
  if (a.best_value != nullptr) {
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r)
      pagedserve::update_best(_mm512_add_ps(acc[r][0], b0), _mm512_add_ps(acc[r][1], b1), col, a.num_columns,
                              a.best_value[row + r], a.best_index[row + r]);
    return;
  }
  c10::BFloat16* out = a.out + row * a.n + col;
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    pagedserve::store_bf16(out + r * a.n, _mm512_add_ps(acc[r][0], b0));
    pagedserve::store_bf16(out + r * a.n + 16, _mm512_add_ps(acc[r][1], b1));
  }
}

// multiply_tile for a run-time row count of 1..ROWS.
template <int ROWS>
void multiply_rows(const LinearArgs& a, int64_t row, int64_t panel, int rows, Prefetch prefetch) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return multiply_tile<ROWS>(a, row, panel, prefetch);
    multiply_rows<ROWS - 1>(a, row, panel, rows, prefetch);
  }
}

// A panel down every row, in the fewest tiles of at most kMaxTileRows, their sizes within one of each
// other (16 rows: 8 + 8, not 12 + 4). `last_panel`: the last one this thread multiplies, whose next
// panel is another thread's (or none) and is not prefetched.
void multiply_panel(const LinearArgs& a, int64_t panel, bool last_panel) {
  const int64_t num_tiles = (a.num_rows + kMaxTileRows - 1) / kMaxTileRows;
  const bool prefetches = a.num_rows >= kPrefetchRows;
  const c10::BFloat16* w = a.weight + panel * a.k_pairs * 2 * kPanel;
  int64_t row = 0;
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t left = a.num_rows - row, tiles_left = num_tiles - t;
    const int rows = static_cast<int>((left + tiles_left - 1) / tiles_left);
    Prefetch prefetch;
    if (prefetches && t == 0) prefetch.ahead = w + kAheadPairs * 2 * kPanel;
    if (prefetches && !last_panel)
      prefetch = {prefetch.ahead, w + a.k_pairs * 2 * kPanel, static_cast<int>(t), static_cast<int>(num_tiles)};
    multiply_rows<kMaxTileRows>(a, row, panel, rows, prefetch);
    row += rows;
  }
}

#endif  // PAGEDSERVE_AVX512_BF16

// What both multiplies refuse: a build or CPU without AVX512-BF16, a `packed` not in its panels.
void check_avx512_panels(const char* kernel, const at::Tensor& packed) {
  TORCH_CHECK(pagedserve::linear_avx512_supported(), kernel,
              ": this build or CPU has no AVX512-BF16 (check linear_avx512_supported() first)");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous(),
              kernel, ": `packed` must come from pack_linear_weight_avx512, got ", packed.sizes());
}

#ifdef PAGEDSERVE_AVX512_BF16
// The rows of `in` (at least one) times `packed`, into `out` (nullptr for linear_argmax_avx512).
LinearArgs linear_args(const pagedserve::LinearInputs& in, const at::Tensor& packed, c10::BFloat16* out) {
  const int64_t k = packed.size(1) * 2;
  return LinearArgs{in.rows.data_ptr<c10::BFloat16>(),
                    in.rows.size(0) > 1 ? in.rows.stride(0) : k,
                    packed.data_ptr<c10::BFloat16>(),
                    in.bias.defined() ? in.bias.data_ptr<c10::BFloat16>() : nullptr,
                    out,
                    in.rows.size(0),
                    packed.size(0) * kPanel,
                    k / 2};
}
#endif

}  // namespace

namespace pagedserve {

bool linear_avx512_supported() {
#ifdef PAGEDSERVE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight_avx512(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16,
              "linear_avx512: the weight must be a bfloat16 CPU tensor, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "linear_avx512: the weight must be [out_features, in_features], got ",
              weight.sizes());
  TORCH_CHECK(weight.size(0) % kPanel == 0 && weight.size(1) % 2 == 0,
              "linear_avx512: out_features must be a multiple of 32 and in_features even, got ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.contiguous().view({n / kPanel, kPanel, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear_avx512(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  check_avx512_panels("linear_avx512", packed);
  const int64_t n = packed.size(0) * kPanel, k = packed.size(1) * 2;
  const pagedserve::LinearInputs in = pagedserve::linear_inputs("linear_avx512", x, bias, n, k);
  at::Tensor out = at::empty({in.rows.size(0), n}, x.options());
#ifdef PAGEDSERVE_AVX512_BF16
  if (in.rows.size(0) > 0) {
    const LinearArgs args = linear_args(in, packed, out.data_ptr<c10::BFloat16>());
    const int64_t num_shares = std::min<int64_t>(at::get_num_threads(), packed.size(0));
    const std::unique_ptr<pagedserve::PanelRange[]> shares = pagedserve::even_shares(packed.size(0), num_shares);
    at::parallel_for(0, num_shares, 1, [&](int64_t share0, int64_t share1) {
      for (int64_t s = share0; s < share1; ++s) {
        pagedserve::take_share_then_steal(
            shares.get(), num_shares, s, [&](int64_t panel, bool more) { multiply_panel(args, panel, !more); },
            [&](int64_t panel) { multiply_panel(args, panel, true); });
      }
    });
  }
#endif
  return out.view(in.out_shape);
}

// Greedy sampling from the LM head: each row's argmax over the first `num_columns` outputs of
// linear_avx512(x, packed, bias), as argmax_rows reads them from its output (bfloat16, the first
// maximum, NaN first), without writing the [rows, n] logits and reading them back. Each run of panels
// a thread multiplies keeps its best column a row; the runs' bests are then taken in column order
// (argmax_over_panels).
at::Tensor linear_argmax_avx512(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                int64_t num_columns) {
  check_avx512_panels("linear_argmax_avx512", packed);
  const int64_t n = packed.size(0) * kPanel, k = packed.size(1) * 2;
  TORCH_CHECK(num_columns > 0 && num_columns <= n, "linear_argmax_avx512: num_columns must be in 1..", n, ", got ",
              num_columns);
  const pagedserve::LinearInputs in = pagedserve::linear_inputs("linear_argmax_avx512", x, bias, n, k);
  std::vector<int64_t> out_shape(in.out_shape.begin(), in.out_shape.end() - 1);
  at::Tensor out = at::zeros({in.rows.size(0)}, x.options().dtype(at::kLong));
#ifdef PAGEDSERVE_AVX512_BF16
  const int64_t num_rows = in.rows.size(0);
  if (num_rows > 0) {
    const LinearArgs args = linear_args(in, packed, nullptr);
    const int64_t num_panels = (num_columns + kPanel - 1) / kPanel;  // panels wholly past them: skipped
    pagedserve::argmax_over_panels(
        num_panels, kPanel, num_rows,
        [&] {
          return [&](int64_t panel, bool prefetch_next, pagedserve::RowBests& best) {
            LinearArgs own = args;
            own.best_value = best.value.data();
            own.best_index = best.index.data();
            own.num_columns = num_columns;
            multiply_panel(own, panel, !prefetch_next);
          };
        },
        out.data_ptr<int64_t>());
  }
#endif
  return out.view(out_shape);
}

}  // namespace pagedserve

#ifdef PAGEDSERVE_AVX512_BF16
void pagedserve::linear_avx512_panel(const c10::BFloat16* x, int64_t ld_x, const c10::BFloat16* packed,
                                     const c10::BFloat16* bias, c10::BFloat16* out, int64_t rows, int64_t n,
                                     int64_t k, int64_t panel, bool prefetch_next) {
  if (rows > 0) multiply_panel(LinearArgs{x, ld_x, packed, bias, out, rows, n, k / 2}, panel, !prefetch_next);
}
#endif
