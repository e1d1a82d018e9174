// Every decoder layer of a Llama-family model for one decode step, in one call (pagedserve_kernels/cpu.py
// builds and loads this with cpu_kernels.cpp, linear_amx.cpp and linear_avx512.cpp).
//
// A decode step of a small model on a CPU spends as much time between its kernels as in its small ones:
// the compiled forward pass calls ~8 ops a layer from Python (inductor's wrapper), each a few
// microseconds of dispatch, and its fused elementwise kernels are tiny at decode batch sizes. Here a
// layer is: residual add + RMSNorm, the qkv multiply, (Qwen3: RMSNorm of each q and k head,) rotary on
// q and k (over the first rotary_dim values of each head: Phi-3's partial rotary; none in SmolLM3's NoPE
// layers), the KV write and decode attention (cpu_kernels.cpp, under the layer's sliding window if it
// has one), the o multiply, residual add + RMSNorm, the gate_up multiply, SiLU(gate) * up, the down
// multiply (Granite: the embeddings, and the o and down outputs before their residual adds, multiplied
// by its constants, each product rounded to bfloat16 as the eager model rounds it). The multiplies and
// attention are the same kernels the compiled pass calls; the elementwise parts are written here in
// float32, rounded to bfloat16 once per output as inductor's fused kernels do, but with each residual
// add rounded as the eager model rounds it (inductor sums several adds in float32 first), so greedy
// bfloat16 tokens can part from the compiled pass's where two logits are within rounding of each other.
//
// With the weights in AMX tiles or AVX512-BF16 panels the whole step is one parallel region
// (decode_layers_team): its threads run each part on their share (rows, or panels of output columns)
// and meet at a spin barrier where the next part reads another thread's output. Opening an ATen
// region for each part and dispatching each op, on the 2-core Zen 4 machine, made a 16-sequence step
// take 1.14x as long and a 64-sequence one 1.08x, and a chat round 1.10x (bench/README.md, "one
// parallel region"). Weights in oneDNN's layout call the ops, each with its own region.
//
// bfloat16 only, on CPUs with AVX512-BF16, with the linear weights packed (for AMX tiles where the CPU
// has them, else in AVX512-BF16 panels, or for oneDNN), NeoX-layout rotary over an even part of each head
// or none, no biases but an optional qkv bias, optional query and key head norms: the model runner
// checks that before using it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>

#include "bf16_vec.h"
#include "decode_parts.h"
#include "ops.h"
#include "paged_checks.h"
#include "panel_range.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define PAGEDSERVE_DECODE_LAYERS 1
#ifndef CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY_AVX512  // ATen's vectorized exp (Sleef), as inductor's kernels use it
#endif
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <omp.h>
// Products and sums rounded one at a time, as inductor compiles its kernels (-ffp-contract=off).
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

#ifdef PAGEDSERVE_DECODE_LAYERS

using BF16 = c10::BFloat16;

using pagedserve::lanes_below;
using pagedserve::load_bf16;
using pagedserve::store_bf16;

// Rows go to the threads a few at a time: a parallel region costs about a microsecond, a row of these
// loops a fraction of one.
template <typename F>
void for_rows(int64_t rows, const F& fn) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

// v rounded to bfloat16 and widened back: what a bfloat16 tensor holding v holds.
inline __m512 round_bf16(__m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return pagedserve::widen_bf16(reinterpret_cast<const __m256i&>(b));
}

// x's 16 values from p, times `x_scale` rounded to bfloat16 where kScaled (Granite's residual
// multiplier, as the eager model's `hidden * residual_multiplier` on its bfloat16 tensor: one float32
// product, rounded once).
template <bool kScaled>
inline __m512 load_scaled(const BF16* p, __m512 x_scale) {
  return kScaled ? round_bf16(_mm512_mul_ps(load_bf16(p), x_scale)) : load_bf16(p);
}

// Row r: residual = x + residual (skipped when `x` is null: the first layer), then
// out = weight * (residual * rsqrt(mean(residual^2) + eps)), each rounded to bfloat16 once. Where
// kScaled, x is first multiplied by `x_scale` and rounded to bfloat16 (load_scaled).
template <bool kScaled>
void add_rms_norm_row(const BF16* x, BF16* residual, const BF16* weight, BF16* out, int64_t r, int64_t dim,
                      float eps, __m512 x_scale) {
  BF16* res = residual + r * dim;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t j = 0; j < dim; j += 32) {
    __m512 a = load_bf16(res + j), b = load_bf16(res + j + 16);
    if (x != nullptr) {
      a = _mm512_add_ps(load_scaled<kScaled>(x + r * dim + j, x_scale), a);
      b = _mm512_add_ps(load_scaled<kScaled>(x + r * dim + j + 16, x_scale), b);
      store_bf16(res + j, a);
      store_bf16(res + j + 16, b);
      a = load_bf16(res + j);  // the norm reads the rounded residual, as the next layer will
      b = load_bf16(res + j + 16);
    }
    acc0 = _mm512_add_ps(acc0, _mm512_mul_ps(a, a));
    acc1 = _mm512_add_ps(acc1, _mm512_mul_ps(b, b));
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) / dim + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t j = 0; j < dim; j += 16)
    store_bf16(out + r * dim + j, _mm512_mul_ps(load_bf16(weight + j), _mm512_mul_ps(load_bf16(res + j), scale)));
}

// add_rms_norm_row over rows [row0, row1), x scaled by `x_scale` where it is not 1 (one branch for the
// rows: none for Llama's 1).
void add_rms_norm_rows(const BF16* x, BF16* residual, const BF16* weight, BF16* out, int64_t row0, int64_t row1,
                       int64_t dim, float eps, float x_scale) {
  const __m512 scale = _mm512_set1_ps(x_scale);
  if (x != nullptr && x_scale != 1.0f) {
    for (int64_t r = row0; r < row1; ++r) add_rms_norm_row<true>(x, residual, weight, out, r, dim, eps, scale);
  } else {
    for (int64_t r = row0; r < row1; ++r) add_rms_norm_row<false>(x, residual, weight, out, r, dim, eps, scale);
  }
}

void add_rms_norm(const BF16* x, BF16* residual, const BF16* weight, BF16* out, int64_t rows, int64_t dim,
                  float eps, float x_scale) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    add_rms_norm_rows(x, residual, weight, out, begin, end, dim, eps, x_scale);
  });
}

// out = weight * (x * rsqrt(mean(x^2) + eps)) over one head of `dim` values, rounded to bfloat16 once.
void rms_norm_head(const BF16* x, const BF16* weight, BF16* out, int64_t dim, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 a = load_bf16(x + i, lanes_below(dim - i));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(a, a));
  }
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / dim + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = lanes_below(dim - i);
    store_bf16(out + i, _mm512_mul_ps(load_bf16(weight + i, m), _mm512_mul_ps(load_bf16(x + i, m), scale)), m);
  }
}

// q and k heads of qkv row r (its first heads_qk * dim values) rotated into row r of `out` [rows,
// heads_qk, dim]: the first `rot_dim` values of each head, NeoX layout within them (their two halves pair
// up with cos and sin of the token's position, from `cos_sin` [positions, rot_dim]: [cos | sin]); the
// rest pass through (Phi-3's partial rotary), and all of them in a layer that does not rotate (`rotate`
// false: SmolLM3's NoPE layers). With `q_norm` and `k_norm` (Qwen3), each query head is first
// RMS-normed with `q_norm` and each key head (those from `num_heads` on) with `k_norm`, into `out`, and
// rotated there (each lane is read before it is written).
void rotary_row(const BF16* qkv, int64_t ld_qkv, const int64_t* positions, const float* cos_sin, BF16* out,
                int64_t r, int64_t num_heads, int64_t heads_qk, int64_t dim, int64_t rot_dim, bool rotate,
                const BF16* q_norm, const BF16* k_norm, float eps) {
  const int64_t half = rotate ? rot_dim / 2 : 0, turned = 2 * half;  // the values that turn
  const float* cos = cos_sin + positions[r] * rot_dim;
  const float* sin = cos + rot_dim / 2;
  for (int64_t h = 0; h < heads_qk; ++h) {
    const BF16* x = qkv + r * ld_qkv + h * dim;
    BF16* y = out + (r * heads_qk + h) * dim;
    if (q_norm != nullptr) {
      rms_norm_head(x, h < num_heads ? q_norm : k_norm, y, dim, eps);
      x = y;
    } else if (turned < dim) {  // (never where whole heads turn)
      std::memcpy(y + turned, x + turned, (dim - turned) * sizeof(BF16));
    }
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = lanes_below(half - i);
      const __m512 x1 = load_bf16(x + i, m), x2 = load_bf16(x + half + i, m);
      const __m512 c = _mm512_maskz_loadu_ps(m, cos + i), s = _mm512_maskz_loadu_ps(m, sin + i);
      store_bf16(y + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)), m);
      store_bf16(y + half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)), m);
    }
  }
}

void rotary(const BF16* qkv, int64_t ld_qkv, const int64_t* positions, const float* cos_sin, BF16* out,
            int64_t rows, int64_t num_heads, int64_t heads_qk, int64_t dim, int64_t rot_dim, bool rotate,
            const BF16* q_norm, const BF16* k_norm, float eps) {
  for_rows(rows, [&](int64_t r) {
    rotary_row(qkv, ld_qkv, positions, cos_sin, out, r, num_heads, heads_qk, dim, rot_dim, rotate, q_norm, k_norm,
               eps);
  });
}

// out row r [inter] = silu(gate) * up, from gate_up row r [gate | up].
void silu_and_mul_row(const BF16* gate_up, BF16* out, int64_t r, int64_t inter) {
  using Vec = at::vec::Vectorized<float>;
  const BF16* g = gate_up + r * 2 * inter;
  for (int64_t i = 0; i < inter; i += 16) {
    const __m512 gate = load_bf16(g + i);
    const __m512 e = static_cast<__m512>(Vec(_mm512_sub_ps(_mm512_setzero_ps(), gate)).exp());
    const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    store_bf16(out + r * inter + i, _mm512_mul_ps(silu, load_bf16(g + inter + i)));
  }
}

void silu_and_mul(const BF16* gate_up, BF16* out, int64_t rows, int64_t inter) {
  for_rows(rows, [&](int64_t r) { silu_and_mul_row(gate_up, out, r, inter); });
}

// A weight packed into AMX tiles (5-d, `pack_linear_weight`) multiplies on them; one packed into
// AVX512-BF16 panels (4-d, `pack_linear_weight_avx512`, on CPUs without AMX) with vdpbf16ps; one packed
// by oneDNN (`torch.ops.mkldnn._reorder_linear_weight`) through oneDNN, as torch.compile's frozen graphs
// call it.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
  if (packed.dim() == 5) {
    static const auto amx =
        c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve_cpu::linear_amx", "").typed<Linear>();
    return amx.call(x, packed, bias);
  }
  if (packed.dim() == 4) {
    static const auto avx512 =
        c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve_cpu::linear_avx512", "").typed<Linear>();
    return avx512.call(x, packed, bias);
  }
  static const auto onednn =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return onednn.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slots) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pagedserve_cpu::write_kv_cache", "")
                             .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>();
  op.call(k, v, k_cache, v_cache, slots);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve_cpu::paged_attention_decode", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, int64_t, double, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&)>();
  // no softcap, no sinks, no ALiBi: the models decode_layers runs have none
  return op.call(q, k_cache, v_cache, block_tables, context_lens, scale, window, 0.0, std::nullopt, std::nullopt);
}

// A barrier for the threads of one parallel region. Two threads meet here in a few hundred
// nanoseconds by spinning; a parallel region of ATen's costs microseconds to open and close, and a
// decode step of the default model has ~300 of them. After a long wait (threads outnumbering the
// cores) it yields the core instead.
class SpinBarrier {
 public:
  void set_threads(int threads) { threads_ = threads; }

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kSpins) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 1 << 14;
  int threads_ = 1;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> generation_{0};
};

using pagedserve::PanelRange;
using pagedserve::share;

// What decode_layers_team reads: the step's arguments, checked, and its buffers.
struct TeamStep {
  int64_t tokens, hidden, head_dim, rot_dim, num_heads, num_kv_heads, heads_qk, n_qkv, inter, layers;
  float eps, residual_scale;
  double scale;
  const int64_t* positions;
  const int64_t* slots;
  const float* cos_sin;
  at::TensorList norms, qkv, qkv_bias, qk_norms, o_proj, gate_up, down, k_caches, v_caches;
  const BF16* final_norm;
  at::Tensor tables, lens;                              // contiguous
  at::Tensor residual, normed, qkv_out, qk, q, attn, out, gu, act;  // q: the query heads of qk
  bool tiles = false;  // the weights are in AMX tiles (else in AVX512-BF16 panels)
  std::vector<int64_t> windows;  // each layer's sliding window (0: none)
  std::vector<char> rotary_layers;  // whether each layer turns q and k (SmolLM3's NoPE layers do not)
};

BF16* bf16(const at::Tensor& t) { return t.data_ptr<BF16>(); }

// Attention's rows go to the threads in runs of about equal work, this many a thread, which they
// take from each other as they take a multiply's panels: a run's few rows are what a thread that lost
// its core holds the others up by.
constexpr int64_t kAttentionRunsPerThread = 4;

// A layer's parts that the threads take from each other, in the order run_team_thread runs them: the
// qkv multiply, attention, the o, gate_up and down multiplies. Their items: output panels of 32
// columns, or attention's runs of rows.
constexpr int64_t kSharedPartsPerLayer = 5;
std::array<int64_t, kSharedPartsPerLayer> shared_part_items(const TeamStep& s, int64_t threads) {
  return {s.n_qkv / 32, threads * kAttentionRunsPerThread, s.hidden / 32, 2 * s.inter / 32, s.hidden / 32};
}

// Every thread's share of every such part of the step: `threads` ranges a part, each thread's items
// as at::parallel_for would split them.
std::unique_ptr<PanelRange[]> panel_ranges(const TeamStep& s, int64_t threads) {
  std::unique_ptr<PanelRange[]> ranges(new PanelRange[s.layers * kSharedPartsPerLayer * threads]);
  const auto items = shared_part_items(s, threads);
  for (int64_t part = 0; part < s.layers * kSharedPartsPerLayer; ++part) {
    for (int64_t t = 0; t < threads; ++t) {
      const auto [item0, item1] = share(items[part % kSharedPartsPerLayer], t, threads);
      ranges[part * threads + t].set(item0, item1);
    }
  }
  return ranges;
}

// One thread's part of the step, `thread` of `threads`, meeting the others at `barrier` wherever the
// next part reads what another thread wrote: norms, SiLU, rotary and the KV writes by rows, attention
// by runs of rows of about equal work (`runs[l]`: their bounds in layer l, whose window changes what a
// row reads) and the multiplies by panels of output columns, the last two from `ranges` (panel_ranges),
// its own first and then any another thread has not taken yet.
void run_team_thread(const TeamStep& s, SpinBarrier& barrier, const std::vector<std::vector<int64_t>>& runs,
                     PanelRange* ranges, int64_t thread, int64_t threads) {
  const auto [row0, row1] = share(s.tokens, thread, threads);
  PanelRange* next_ranges = ranges;  // the next shared part's
  const auto take_part = [&](int64_t part_of_layer) {
    PanelRange* shares = next_ranges;
    TORCH_INTERNAL_ASSERT_DEBUG_ONLY((shares - ranges) / threads % kSharedPartsPerLayer == part_of_layer);
    next_ranges += threads;
    return shares;
  };
  pagedserve::AmxTiles tiles;  // this thread's tile configuration, where the weights are in tiles
  const auto multiply_panel = [&](const BF16* x, int64_t k, const BF16* packed, const BF16* bias, BF16* out,
                                  int64_t n, int64_t panel, bool prefetch_next) {
    if (s.tiles) {
      pagedserve::linear_amx_panel(x, k, packed, bias, out, s.tokens, n, k, panel, tiles);
    } else {
      pagedserve::linear_avx512_panel(x, k, packed, bias, out, s.tokens, n, k, panel, prefetch_next);
    }
  };
  const auto multiply = [&](int64_t part_of_layer, const BF16* x, int64_t k, const at::Tensor& packed,
                            const BF16* bias, BF16* out, int64_t n) {
    pagedserve::take_share_then_steal(
        take_part(part_of_layer), threads, thread,
        [&](int64_t panel, bool more) { multiply_panel(x, k, bf16(packed), bias, out, n, panel, more); },
        [&](int64_t panel) { multiply_panel(x, k, bf16(packed), bias, out, n, panel, false); });
  };
  const auto attend = [&](int64_t l) {
    const std::vector<int64_t>& bounds = runs[l];
    const auto run = [&](int64_t r) {
      if (bounds[r] < bounds[r + 1])
        pagedserve::decode_attention_rows_bf16(s.attn, s.q, s.k_caches[l], s.v_caches[l], s.tables, s.lens, s.scale,
                                               s.windows[l], 0.0, bounds[r], bounds[r + 1]);  // no softcap
    };
    pagedserve::take_share_then_steal(
        take_part(1), threads, thread, [&](int64_t r, bool) { run(r); }, run);
  };
  const int64_t slot_size = s.num_kv_heads * s.head_dim;
  BF16 *residual = bf16(s.residual), *normed = bf16(s.normed), *qkv_out = bf16(s.qkv_out), *qk = bf16(s.qk);
  BF16 *attn = bf16(s.attn), *out = bf16(s.out), *gu = bf16(s.gu), *act = bf16(s.act);
  for (int64_t l = 0; l < s.layers; ++l) {
    const BF16* added = l == 0 ? nullptr : out;  // the last layer's down multiply
    const BF16* input_norm = bf16(s.norms[2 * l]);
    add_rms_norm_rows(added, residual, input_norm, normed, row0, row1, s.hidden, s.eps, s.residual_scale);
    barrier.wait();
    multiply(0, normed, s.hidden, s.qkv[l], s.qkv_bias.empty() ? nullptr : bf16(s.qkv_bias[l]), qkv_out, s.n_qkv);
    barrier.wait();
    BF16* k_cache = bf16(s.k_caches[l]);
    BF16* v_cache = bf16(s.v_caches[l]);
    const BF16* q_norm = s.qk_norms.empty() ? nullptr : bf16(s.qk_norms[2 * l]);
    const BF16* k_norm = s.qk_norms.empty() ? nullptr : bf16(s.qk_norms[2 * l + 1]);
    for (int64_t r = row0; r < row1; ++r) {
      rotary_row(qkv_out, s.n_qkv, s.positions, s.cos_sin, qk, r, s.num_heads, s.heads_qk, s.head_dim, s.rot_dim,
                 s.rotary_layers[l] != 0, q_norm, k_norm, s.eps);
      if (s.slots[r] < 0) continue;  // a padding row: no cache slot
      const BF16* k = qk + (r * s.heads_qk + s.num_heads) * s.head_dim;
      const BF16* v = qkv_out + r * s.n_qkv + s.heads_qk * s.head_dim;
      std::memcpy(k_cache + s.slots[r] * slot_size, k, slot_size * sizeof(BF16));
      std::memcpy(v_cache + s.slots[r] * slot_size, v, slot_size * sizeof(BF16));
    }
    barrier.wait();  // a draft row attends to the rows before it, which another thread may have written
    attend(l);
    barrier.wait();
    multiply(2, attn, s.num_heads * s.head_dim, s.o_proj[l], nullptr, out, s.hidden);
    barrier.wait();
    const BF16* post_norm = bf16(s.norms[2 * l + 1]);
    add_rms_norm_rows(out, residual, post_norm, normed, row0, row1, s.hidden, s.eps, s.residual_scale);
    barrier.wait();
    multiply(3, normed, s.hidden, s.gate_up[l], nullptr, gu, 2 * s.inter);
    barrier.wait();
    for (int64_t r = row0; r < row1; ++r) silu_and_mul_row(gu, act, r, s.inter);
    barrier.wait();
    multiply(4, act, s.inter, s.down[l], nullptr, out, s.hidden);
    barrier.wait();
  }
  add_rms_norm_rows(out, residual, s.final_norm, normed, row0, row1, s.hidden, s.eps, s.residual_scale);
  pagedserve::release_amx_tiles(tiles);
}

// decode_layers with weights packed in AMX tiles or AVX512-BF16 panels: the whole step in one parallel region, its
// threads meeting at a spin barrier between the parts (norms, multiplies, attention) instead of
// opening a region of ATen's for each, and with no tensor made or op dispatched inside it (the
// buffers are made first). Each part computes what the per-op path computes, in the same order: the
// same bits.
void decode_layers_team(const TeamStep& s) {
  SpinBarrier barrier;
  std::vector<std::vector<int64_t>> runs(s.layers);
  std::unique_ptr<PanelRange[]> ranges;
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp single
    {  // the team OpenMP gives, which may be smaller than asked for
      const int threads = omp_get_num_threads();
      barrier.set_threads(threads);
      for (int64_t l = 0; l < s.layers; ++l)
        runs[l] = pagedserve::decode_row_split(s.lens.data_ptr<int32_t>(), s.tokens, threads * kAttentionRunsPerThread,
                                               s.windows[l]);
      ranges = panel_ranges(s, threads);
    }  // (every thread waits here, then sees them)
    run_team_thread(s, barrier, runs, ranges.get(), omp_get_thread_num(), omp_get_num_threads());
  }
}

// Whether every weight of `weights` is packed with `dims` dimensions: 4 for AVX512-BF16 panels
// (pack_linear_weight_avx512), 5 for AMX tiles (pack_linear_weight).
bool all_packed(at::TensorList weights, int64_t dims) {
  return std::all_of(weights.begin(), weights.end(), [dims](const at::Tensor& w) { return w.dim() == dims; });
}

// Checks a packed weight for n x k: contiguous bfloat16, in AMX tiles [n / 16 (even), k / 32, 16, 16, 2]
// or in panels [n / 32, k / 2, 32, 2].
void check_packed(const at::Tensor& w, bool tiles, int64_t n, int64_t k, const char* name) {
  const bool fits = tiles ? w.dim() == 5 && w.size(0) * 16 == n && w.size(0) % 2 == 0 && w.size(1) * 32 == k &&
                                w.size(2) == 16 && w.size(3) == 16 && w.size(4) == 2
                          : w.dim() == 4 && w.size(0) * 32 == n && w.size(1) * 2 == k && w.size(2) == 32 &&
                                w.size(3) == 2;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && fits, "decode_layers: a ", name,
              " weight packed for ", n, " x ", k, " does not match ", w.sizes());
}

// The step's embeddings, times `scale` where it is not 1 (Granite's embedding multiplier), as the eager
// model multiplies its bfloat16 embeddings: the same op.
at::Tensor embedded(const at::Tensor& embedding, const at::Tensor& input_ids, double scale) {
  at::Tensor rows = embedding.index_select(0, input_ids);
  if (scale != 1.0) rows.mul_(scale);
  return rows;
}

#endif  // PAGEDSERVE_DECODE_LAYERS

bool is_bf16_cpu(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kBFloat16; }

}  // namespace

namespace pagedserve {

// input_ids, positions [T] int64; embedding [vocab, hidden]; cos_sin_cache [positions, rotary_dim] float32
// ([cos | sin] halves; rotary_dim even, up to head_dim: the first rotary_dim values of each q and k head
// turn); per layer L: norms[2L] (input, post-attention), qkv[L], qkv_bias[L] or empty, qk_norms[2L] (query,
// key head norms [head_dim]) or empty, o_proj[L], gate_up[L], down[L] (packed); final_norm [hidden]; the
// layers' caches [blocks, block_size, kv_heads, head_dim] (which give head_dim); the step's slot mapping,
// decode block tables and context lengths; windows[L], layer L's sliding window (0: none);
// embedding_scale, what the embeddings are multiplied by, and residual_scale, what each layer's attention
// and MLP outputs are multiplied by before they join the residual stream (Granite's multipliers: 1 for
// none; each product rounded to bfloat16 as the eager model's); rotary_layers[L], whether layer L turns q
// and k (SmolLM3's NoPE layers do not). Returns the final-normed hidden states [T, hidden].
at::Tensor decode_layers(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embedding,
                         const at::Tensor& cos_sin_cache, at::TensorList norms, at::TensorList qkv,
                         at::TensorList qkv_bias, at::TensorList qk_norms, at::TensorList o_proj,
                         at::TensorList gate_up,
                         at::TensorList down, const at::Tensor& final_norm, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                         double scale, const std::vector<int64_t>& windows, double embedding_scale,
                         double residual_scale, const c10::List<bool>& rotary_layers) {
  const int64_t layers = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(layers > 0 && norms.size() == 2 * qkv.size() && o_proj.size() == qkv.size() &&
                  gate_up.size() == qkv.size() && down.size() == qkv.size() && k_caches.size() == qkv.size() &&
                  v_caches.size() == qkv.size() && (qkv_bias.empty() || qkv_bias.size() == qkv.size()) &&
                  (qk_norms.empty() || qk_norms.size() == 2 * qkv.size()),
              "decode_layers: one qkv, o_proj, gate_up, down, k and v cache and two norms a layer (and one qkv bias "
              "and two head norms, if any)");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == layers, "decode_layers: windows: one a layer (0: none), got ",
              windows.size(), " for ", layers, " layers");
  for (int64_t l = 0; l < layers; ++l)  // here, not in the team's region, where nothing may throw
    TORCH_CHECK(windows[l] >= 0, "decode_layers: layer ", l, "'s window must be 0 (none) or positive, got ",
                windows[l]);
  TORCH_CHECK(static_cast<int64_t>(rotary_layers.size()) == layers,
              "decode_layers: rotary_layers: one a layer (whether it turns q and k), got ", rotary_layers.size(),
              " for ", layers, " layers");
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong && positions.sizes() == input_ids.sizes() &&
                  positions.scalar_type() == at::kLong && input_ids.is_contiguous() && positions.is_contiguous(),
              "decode_layers: input_ids and positions must be contiguous int64 [tokens]");
  TORCH_CHECK(is_bf16_cpu(embedding) && embedding.dim() == 2 && embedding.is_contiguous(),
              "decode_layers: embedding must be a contiguous bfloat16 [vocab, hidden] CPU tensor");
  for (int64_t l = 0; l < layers; ++l)
    TORCH_CHECK(k_caches[l].dim() == 4 && k_caches[l].sizes() == k_caches[0].sizes() &&
                    v_caches[l].sizes() == k_caches[0].sizes(),
                "decode_layers: every layer's k and v cache must be [blocks, block_size, kv_heads, head_dim], one "
                "shape for all");
  const int64_t tokens = input_ids.size(0), hidden = embedding.size(1);
  const int64_t head_dim = k_caches[0].size(3), heads_qk = num_heads + num_kv_heads;
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(),
              "decode_layers: cos_sin_cache must be contiguous float32 [positions, rotary_dim]");
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rot_dim % 2 == 0 && rot_dim <= head_dim, "decode_layers: cos_sin_cache's rotary_dim (its width) must be ",
              "even and at most head_dim ", head_dim, ", got ", rot_dim);
  TORCH_CHECK(hidden % 32 == 0 && final_norm.numel() == hidden && is_bf16_cpu(final_norm) && final_norm.is_contiguous(),
              "decode_layers: hidden size a multiple of 32, final_norm contiguous bfloat16 [hidden]");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_layers: the query heads must be a multiple of the KV heads, got ", num_heads, " and ",
              num_kv_heads);
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < embedding.size(0), "decode_layers: token id ", ids[t], " is out of the vocabulary");
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin_cache.size(0), "decode_layers: position ", pos[t],
                " is out of the rotary table");
  }
  for (const at::Tensor& w : norms) TORCH_CHECK(is_bf16_cpu(w) && w.numel() == hidden && w.is_contiguous(), "decode_layers: norm weights must be bfloat16 [hidden]");
  for (const at::Tensor& w : qk_norms)
    TORCH_CHECK(is_bf16_cpu(w) && w.numel() == head_dim && w.is_contiguous(),
                "decode_layers: query and key head norm weights must be bfloat16 [head_dim]");
  // The block tables once, before layer 0 writes a KV row or starts a thread, against the cache shape
  // every layer shares (checked above; each layer's attention call checks them again: a pass over a few
  // ids).
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.size(0) == tokens &&
                  context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt && context_lens.size(0) == tokens,
              "decode_layers: block_tables [tokens, max_blocks] and context_lens [tokens] must be int32");
  pagedserve::check_block_tables(block_tables.contiguous(), context_lens.contiguous(), k_caches[0].size(1),
                                 k_caches[0].size(0));
#ifdef PAGEDSERVE_DECODE_LAYERS
  const auto options = embedding.options();
  const auto packed_as = [&](int64_t dims) {
    return all_packed(qkv, dims) && all_packed(o_proj, dims) && all_packed(gate_up, dims) && all_packed(down, dims);
  };
  const bool tiles = packed_as(5) && pagedserve::amx_tiles_usable();
  if ((tiles || packed_as(4)) && !at::in_parallel_region()) {
    // Everything the team reads is checked here: nothing may throw inside its parallel region.
    const int64_t n_qkv = (heads_qk + num_kv_heads) * head_dim;
    // half of gate_up's columns (its n-blocks of 16 in tiles, panels of 32): a multiple of 16 once
    // check_packed has passed
    const int64_t inter = gate_up[0].size(0) * (tiles ? 8 : 16);
    for (int64_t l = 0; l < layers; ++l) {
      check_packed(qkv[l], tiles, n_qkv, hidden, "qkv");
      check_packed(o_proj[l], tiles, hidden, num_heads * head_dim, "o_proj");
      check_packed(gate_up[l], tiles, 2 * inter, hidden, "gate_up");
      check_packed(down[l], tiles, hidden, inter, "down");
      if (!qkv_bias.empty())
        TORCH_CHECK(is_bf16_cpu(qkv_bias[l]) && qkv_bias[l].numel() == n_qkv && qkv_bias[l].is_contiguous(),
                    "decode_layers: a qkv bias must be contiguous bfloat16 [", n_qkv, "]");
      for (const at::Tensor& cache : {k_caches[l], v_caches[l]})
        TORCH_CHECK(is_bf16_cpu(cache) && cache.is_contiguous() && cache.size(2) == num_kv_heads &&
                        cache.size(3) == head_dim,
                    "decode_layers: the KV caches must be contiguous bfloat16 [blocks, block_size, ", num_kv_heads,
                    ", ", head_dim, "]");
    }
    const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                    slot_mapping.size(0) == tokens && slot_mapping.is_contiguous(),
                "decode_layers: slot_mapping must be contiguous int64 [tokens]");
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slots[t] < num_slots, "slot_mapping: slot ", slots[t], " is past the cache's ", num_slots);
    TeamStep step{tokens, hidden, head_dim, rot_dim, num_heads, num_kv_heads, heads_qk, n_qkv, inter, layers,
                  static_cast<float>(eps), static_cast<float>(residual_scale), scale, pos, slots,
                  cos_sin_cache.data_ptr<float>(), norms, qkv, qkv_bias, qk_norms, o_proj, gate_up, down, k_caches,
                  v_caches, final_norm.data_ptr<BF16>(),
                  block_tables.contiguous(), context_lens.contiguous()};
    step.residual = embedded(embedding, input_ids, embedding_scale);  // the first layer's residual is its input
    step.normed = at::empty({tokens, hidden}, options);
    step.qkv_out = at::empty({tokens, n_qkv}, options);
    step.qk = at::empty({tokens, heads_qk, head_dim}, options);
    step.q = step.qk.narrow(1, 0, num_heads);
    step.attn = at::empty({tokens, num_heads, head_dim}, options);
    step.out = at::empty({tokens, hidden}, options);
    step.gu = at::empty({tokens, 2 * inter}, options);
    step.act = at::empty({tokens, inter}, options);
    step.tiles = tiles;
    step.windows = windows;
    for (const bool rotates : rotary_layers) step.rotary_layers.push_back(rotates);
    decode_layers_team(step);
    return step.normed;
  }
  at::Tensor residual = embedded(embedding, input_ids, embedding_scale);  // the first layer's residual is its input
  at::Tensor normed = at::empty({tokens, hidden}, options);
  at::Tensor qk = at::empty({tokens, heads_qk, head_dim}, options);
  at::Tensor act;
  at::Tensor out;  // the last multiply's output, added to the residual by the next norm
  for (int64_t l = 0; l < layers; ++l) {
    add_rms_norm(out.defined() ? out.data_ptr<BF16>() : nullptr, residual.data_ptr<BF16>(),
                 norms[2 * l].data_ptr<BF16>(), normed.data_ptr<BF16>(), tokens, hidden, static_cast<float>(eps),
                 static_cast<float>(residual_scale));
    const at::Tensor qkv_out = linear(normed, qkv[l], qkv_bias.empty() ? std::nullopt : std::optional<at::Tensor>(qkv_bias[l]));
    TORCH_CHECK(qkv_out.size(1) == (heads_qk + num_kv_heads) * head_dim,
                "decode_layers: layer ", l, "'s qkv weight does not match the heads");
    rotary(qkv_out.data_ptr<BF16>(), qkv_out.size(1), positions.data_ptr<int64_t>(), cos_sin_cache.data_ptr<float>(),
           qk.data_ptr<BF16>(), tokens, num_heads, heads_qk, head_dim, rot_dim, rotary_layers.get(l),
           qk_norms.empty() ? nullptr : qk_norms[2 * l].data_ptr<BF16>(),
           qk_norms.empty() ? nullptr : qk_norms[2 * l + 1].data_ptr<BF16>(), static_cast<float>(eps));
    const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
    const at::Tensor v = qkv_out.narrow(1, heads_qk * head_dim, num_kv_heads * head_dim).view({tokens, num_kv_heads, head_dim});
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor attn = decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, windows[l]);
    out = linear(attn.view({tokens, num_heads * head_dim}), o_proj[l], std::nullopt);
    add_rms_norm(out.data_ptr<BF16>(), residual.data_ptr<BF16>(), norms[2 * l + 1].data_ptr<BF16>(),
                 normed.data_ptr<BF16>(), tokens, hidden, static_cast<float>(eps), static_cast<float>(residual_scale));
    const at::Tensor gu = linear(normed, gate_up[l], std::nullopt);
    const int64_t inter = gu.size(1) / 2;
    TORCH_CHECK(inter % 16 == 0, "decode_layers: intermediate size must be a multiple of 16");
    if (!act.defined() || act.size(1) != inter) act = at::empty({tokens, inter}, options);
    silu_and_mul(gu.data_ptr<BF16>(), act.data_ptr<BF16>(), tokens, inter);
    out = linear(act, down[l], std::nullopt);
  }
  add_rms_norm(out.data_ptr<BF16>(), residual.data_ptr<BF16>(), final_norm.data_ptr<BF16>(), normed.data_ptr<BF16>(),
               tokens, hidden, static_cast<float>(eps), static_cast<float>(residual_scale));
  return normed;
#else
  TORCH_CHECK(false, "decode_layers: this build has no AVX512-BF16 (check decode_layers_supported() first)");
#endif
}

bool decode_layers_supported() {
#ifdef PAGEDSERVE_DECODE_LAYERS
  return true;
#else
  return false;
#endif
}

}  // namespace pagedserve
