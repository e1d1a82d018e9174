// bfloat16 linear layers on AMX tiles (pagedserve_kernels/cpu.py builds and loads this with
// cpu_kernels.cpp).
//
// pack_linear_weight: a weight [N, K] (nn.Linear's layout) is reordered once into the tiles the
// multiply reads: [N/16][K/32][16 pairs of k][16 n][2], so the 16 columns of an n-block over 32 k are
// one contiguous 1 KiB tile and an n-block's tiles follow each other in k order.
//
// linear_amx: out [M, N] = x [M, K] @ weight^T (+ bias), float32 accumulation, rounded to bfloat16 once
// at the end. Threads split the output columns in pairs of n-blocks; each pair runs down the rows 32
// at a time (four accumulator tiles: two row blocks x two n-blocks), so the weight is streamed from
// memory once a call and the rows come from cache. Every row is accumulated the same way whatever
// the number of rows (k-blocks in order, one tile product each), so a row's result does not depend on
// the batch it is in, and it equals oneDNN's (F.linear's) for batches of up to 32 rows.
//
// linear_argmax_amx: greedy sampling from an LM head, each row's argmax of linear_amx's outputs as
// argmax_rows reads them, kept as the tiles are stored (argmax_best.h) instead of the logits.
//
// At decode batch sizes the multiply is bound by reading the weight; oneDNN's brgemm reads its own
// packed weight at about two thirds of the rate this loop does (bench/cpu_linear.py). From ~128 rows
// on it is no faster than oneDNN, and slower on 2,048-row prefill chunks (bench/README.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "argmax_best.h"
#include "bf16_vec.h"
#include "decode_parts.h"
#include "linear_inputs.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_AMX 1
#endif

namespace {

constexpr int64_t kTileRows = 16;              // rows of an accumulator tile, pairs of k in a weight tile
constexpr int64_t kTileK = 32;                 // bfloat16 values of k in one tile row
constexpr int64_t kTileElems = kTileRows * kTileK;  // 512 bfloat16: one 1 KiB tile

#ifdef PAGEDSERVE_AMX

// Linux hands out AMX's tile data state only on request, once per process (threads share it).
bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate (row block a x n-blocks 0, 1; row block b x n-blocks 0, 1), 4 and 5 hold the
// two row blocks of x, 6 and 7 the two weight tiles. `rows_b` 0: only row block a is in use.
void configure_tiles(int rows_a, int rows_b) {
  TileConfig config;
  std::fill(config.colsb, config.colsb + 8, static_cast<uint16_t>(64));
  config.rows[0] = config.rows[1] = config.rows[4] = static_cast<uint8_t>(rows_a);
  config.rows[2] = config.rows[3] = config.rows[5] = static_cast<uint8_t>(std::max(rows_b, 1));
  config.rows[6] = config.rows[7] = kTileRows;
  _tile_loadconfig(&config);
}

// `rows` rows of a float32 accumulator tile (16 x 16, plus the 16 bfloat16 `bias` values widened)
// rounded to bfloat16 into `out`.
inline void store_rows(const float* acc, const c10::BFloat16* bias, c10::BFloat16* out, int64_t ld_out, int rows) {
  const __m512 b = bias ? pagedserve::load_bf16(bias) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) pagedserve::store_bf16(out + r * ld_out, _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b));
}

struct LinearArgs {
  const c10::BFloat16* x;
  int64_t ld_x;  // elements between rows of x
  const c10::BFloat16* weight;
  const c10::BFloat16* bias;  // [N] or nullptr
  c10::BFloat16* out;
  int64_t num_rows, n, k_blocks;
  // linear_argmax_amx: each row's best column so far (value, index) instead of `out`; columns from
  // `num_columns` on are left out
  float* best_value = nullptr;
  int64_t* best_index = nullptr;
  int64_t num_columns = 0;
};

// Rows [row, row + 32) x n-blocks 2 * pair, 2 * pair + 1; `tiles`: the configuration this thread has
// loaded, reloaded when these rows need another.
void multiply_block(const LinearArgs& a, int64_t row, int64_t pair, pagedserve::AmxTiles& tiles) {
  const int ra = static_cast<int>(std::min(kTileRows, a.num_rows - row));
  const int rb = static_cast<int>(std::clamp(a.num_rows - row - kTileRows, int64_t{0}, kTileRows));
  if (ra != tiles.rows_a || rb != tiles.rows_b) {
    configure_tiles(ra, rb);
    tiles.rows_a = ra;
    tiles.rows_b = rb;
  }
  const c10::BFloat16* w0 = a.weight + 2 * pair * a.k_blocks * kTileElems;
  const c10::BFloat16* w1 = w0 + a.k_blocks * kTileElems;
  const c10::BFloat16* xa = a.x + row * a.ld_x;
  const c10::BFloat16* xb = xa + kTileRows * a.ld_x;
  const int64_t stride_x = a.ld_x * 2;
  _tile_zero(0);
  _tile_zero(1);
  if (rb) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < a.k_blocks; ++kb) {
    _tile_loadd(4, xa + kb * kTileK, stride_x);
    _tile_loadd(6, w0 + kb * kTileElems, 64);
    _tile_loadd(7, w1 + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (rb) {
      _tile_loadd(5, xb + kb * kTileK, stride_x);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float acc[4][kTileRows * 16];
  const int64_t col = 2 * pair * 16;
  const c10::BFloat16* bias0 = a.bias ? a.bias + col : nullptr;
  const c10::BFloat16* bias1 = a.bias ? a.bias + col + 16 : nullptr;
  _tile_stored(0, acc[0], 64);
  _tile_stored(1, acc[1], 64);
  if (rb) {
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
  }
  if (a.best_value != nullptr) {
    const __m512 b0 = bias0 ? pagedserve::load_bf16(bias0) : _mm512_setzero_ps();
    const __m512 b1 = bias1 ? pagedserve::load_bf16(bias1) : _mm512_setzero_ps();
    for (int r = 0; r < ra + rb; ++r) {
      const float* lo = r < ra ? acc[0] + r * 16 : acc[2] + (r - ra) * 16;
      const float* hi = r < ra ? acc[1] + r * 16 : acc[3] + (r - ra) * 16;
      pagedserve::update_best(_mm512_add_ps(_mm512_load_ps(lo), b0), _mm512_add_ps(_mm512_load_ps(hi), b1), col,
                              a.num_columns, a.best_value[row + r], a.best_index[row + r]);
    }
    return;
  }
  c10::BFloat16* out = a.out + row * a.n + col;
  store_rows(acc[0], bias0, out, a.n, ra);
  store_rows(acc[1], bias1, out + 16, a.n, ra);
  if (rb) {
    store_rows(acc[2], bias0, out + kTileRows * a.n, a.n, rb);
    store_rows(acc[3], bias1, out + kTileRows * a.n + 16, a.n, rb);
  }
}

// Every row, 32 at a time, x n-blocks 2 * pair, 2 * pair + 1.
void multiply_pair(const LinearArgs& a, int64_t pair, pagedserve::AmxTiles& tiles) {
  for (int64_t row = 0; row < a.num_rows; row += 2 * kTileRows) multiply_block(a, row, pair, tiles);
}

// The rows of `in` (at least one) times `packed`, into `out` (nullptr for linear_argmax_amx).
LinearArgs linear_args(const pagedserve::LinearInputs& in, const at::Tensor& packed, c10::BFloat16* out) {
  const int64_t k_blocks = packed.size(1);
  return LinearArgs{in.rows.data_ptr<c10::BFloat16>(),
                    in.rows.size(0) > 1 ? in.rows.stride(0) : k_blocks * kTileK,
                    packed.data_ptr<c10::BFloat16>(),
                    in.bias.defined() ? in.bias.data_ptr<c10::BFloat16>() : nullptr,
                    out,
                    in.rows.size(0),
                    packed.size(0) * kTileRows,
                    k_blocks};
}

#endif  // PAGEDSERVE_AMX

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16,
              "linear_amx: the weight must be a bfloat16 CPU tensor, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "linear_amx: the weight must be [out_features, in_features], got ",
              weight.sizes());
  TORCH_CHECK(weight.size(0) % (2 * kTileRows) == 0 && weight.size(1) % kTileK == 0,
              "linear_amx: out_features must be a multiple of 32 and in_features of 32, got ", weight.sizes());
}

// What both multiplies refuse: a build or CPU without AMX, a `packed` not in its tiles.
void check_tiles(const char* kernel, const at::Tensor& packed) {
  TORCH_CHECK(pagedserve::linear_amx_supported(), kernel,
              ": this build or CPU has no AMX bfloat16 (check linear_amx_supported() first)");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 5 &&
                  packed.size(0) % 2 == 0 && packed.size(2) == kTileRows && packed.size(3) == 16 &&
                  packed.size(4) == 2 && packed.is_contiguous(),
              kernel, ": `packed` must come from pack_linear_weight, got ", packed.sizes());
}

#ifdef PAGEDSERVE_AMX
// One thread's pairs of n-blocks for linear_argmax_amx, on its tile configuration (given back at the end).
struct ArgmaxPairs {
  const LinearArgs& args;
  int64_t num_columns;
  pagedserve::AmxTiles tiles;

  void operator()(int64_t pair, bool, pagedserve::RowBests& best) {
    LinearArgs own = args;
    own.best_value = best.value.data();
    own.best_index = best.index.data();
    own.num_columns = num_columns;
    multiply_pair(own, pair, tiles);
  }
  ~ArgmaxPairs() { pagedserve::release_amx_tiles(tiles); }
};
#endif

}  // namespace

namespace pagedserve {

bool linear_amx_supported() {
#ifdef PAGEDSERVE_AMX
  return request_amx();
#else
  return false;
#endif
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check_weight(weight);
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n / kTileRows, k / kTileK, kTileRows, 16, 2}, w.options());
  const c10::BFloat16* src = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n / kTileRows, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      c10::BFloat16* tile = dst + nb * (k / kTileK) * kTileElems;
      for (int64_t kb = 0; kb < k / kTileK; ++kb)
        for (int64_t pair = 0; pair < kTileRows; ++pair)
          for (int64_t col = 0; col < 16; ++col)
            for (int64_t half = 0; half < 2; ++half)
              *tile++ = src[(nb * kTileRows + col) * k + kb * kTileK + pair * 2 + half];
    }
  });
  return packed;
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  check_tiles("linear_amx", packed);
  const int64_t n = packed.size(0) * kTileRows, k = packed.size(1) * kTileK;
  const pagedserve::LinearInputs in = pagedserve::linear_inputs("linear_amx", x, bias, n, k);
  at::Tensor out = at::empty({in.rows.size(0), n}, x.options());
#ifdef PAGEDSERVE_AMX
  if (in.rows.size(0) > 0) {
    const LinearArgs args = linear_args(in, packed, out.data_ptr<c10::BFloat16>());
    at::parallel_for(0, packed.size(0) / 2, 1, [&](int64_t pair0, int64_t pair1) {
      pagedserve::AmxTiles tiles;
      for (int64_t pair = pair0; pair < pair1; ++pair) multiply_pair(args, pair, tiles);
      pagedserve::release_amx_tiles(tiles);
    });
  }
#endif
  return out.view(in.out_shape);
}

// Greedy sampling from the LM head: each row's argmax over the first `num_columns` outputs of
// linear_amx(x, packed, bias), as argmax_rows reads them from its output (bfloat16, the first maximum,
// NaN first), without writing the [rows, n] logits and reading them back. Each run of pairs of n-blocks
// a thread multiplies keeps its best column a row; the runs' bests are then taken in column order
// (argmax_over_panels).
at::Tensor linear_argmax_amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t num_columns) {
  check_tiles("linear_argmax_amx", packed);
  const int64_t n = packed.size(0) * kTileRows, k = packed.size(1) * kTileK;
  TORCH_CHECK(num_columns > 0 && num_columns <= n, "linear_argmax_amx: num_columns must be in 1..", n, ", got ",
              num_columns);
  const pagedserve::LinearInputs in = pagedserve::linear_inputs("linear_argmax_amx", x, bias, n, k);
  std::vector<int64_t> out_shape(in.out_shape.begin(), in.out_shape.end() - 1);
  const int64_t num_rows = in.rows.size(0);
  at::Tensor out = at::zeros({num_rows}, x.options().dtype(at::kLong));
#ifdef PAGEDSERVE_AMX
  if (num_rows > 0) {
    const LinearArgs args = linear_args(in, packed, nullptr);
    const int64_t num_pairs = (num_columns + 2 * kTileRows - 1) / (2 * kTileRows);  // pairs wholly past: skipped
    pagedserve::argmax_over_panels(
        num_pairs, 2 * kTileRows, num_rows,
        [&] { return ArgmaxPairs{args, num_columns}; },
        out.data_ptr<int64_t>());
  }
#endif
  return out.view(out_shape);
}

}  // namespace pagedserve

bool pagedserve::amx_tiles_usable() { return linear_amx_supported(); }

#ifdef PAGEDSERVE_AMX
void pagedserve::linear_amx_panel(const c10::BFloat16* x, int64_t ld_x, const c10::BFloat16* packed,
                                  const c10::BFloat16* bias, c10::BFloat16* out, int64_t rows, int64_t n, int64_t k,
                                  int64_t panel, AmxTiles& tiles) {
  multiply_pair(LinearArgs{x, ld_x, packed, bias, out, rows, n, k / kTileK}, panel, tiles);
}

void pagedserve::release_amx_tiles(AmxTiles& tiles) {
  if (tiles.rows_a >= 0) _tile_release();
  tiles = AmxTiles{};
}
#else
void pagedserve::linear_amx_panel(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                  c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, AmxTiles&) {
  TORCH_INTERNAL_ASSERT(false, "linear_amx_panel: this build has no AMX (check amx_tiles_usable() first)");
}

void pagedserve::release_amx_tiles(AmxTiles&) {}
#endif
