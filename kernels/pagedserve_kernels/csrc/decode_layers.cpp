// Every decoder layer of a Llama-family model for one decode step, in one call (pagedserve_kernels/cpu.py
// builds and loads this with cpu_kernels.cpp, linear_amx.cpp and linear_avx512.cpp).
//
// A decode step of a small model on a CPU spends as much time between its kernels as in its small ones:
// the compiled forward pass calls ~8 ops a layer from Python (inductor's wrapper), each a few
// microseconds of dispatch, and its fused elementwise kernels are tiny at decode batch sizes. Here a
// layer is: residual add + RMSNorm, the qkv multiply, (Qwen3: RMSNorm of each q and k head,) rotary on
// q and k, the KV write and decode attention (cpu_kernels.cpp), the o multiply, residual add +
// RMSNorm, the gate_up multiply, SiLU(gate) * up, the down multiply. The multiplies and attention are the same ops the compiled pass
// calls (through the dispatcher); the elementwise parts are written here in float32, rounded to
// bfloat16 once per output as inductor's fused kernels do, but with each residual add rounded as the
// eager model rounds it (inductor sums several adds in float32 first), so greedy bfloat16 tokens can
// part from the compiled pass's where two logits are within rounding of each other.
//
// bfloat16 only, on CPUs with AVX512-BF16, with the linear weights packed (for AMX tiles where the CPU
// has them, else in AVX512-BF16 panels, or for oneDNN), full rotary (NeoX layout), no biases but an
// optional qkv bias, optional query and key head norms: the model runner checks that before using it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "paged_checks.h"

#include <cmath>
#include <cstdint>
#include <optional>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define PAGEDSERVE_DECODE_LAYERS 1
#ifndef CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY_AVX512  // ATen's vectorized exp (Sleef), as inductor's kernels use it
#endif
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
// Products and sums rounded one at a time, as inductor compiles its kernels (-ffp-contract=off).
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

#ifdef PAGEDSERVE_DECODE_LAYERS

using BF16 = c10::BFloat16;

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

// residual = x + residual (skipped when `x` is null: the first layer), then
// out = weight * (residual * rsqrt(mean(residual^2) + eps)), each rounded to bfloat16 once.
void add_rms_norm(const BF16* x, BF16* residual, const BF16* weight, BF16* out, int64_t rows, int64_t dim,
                  float eps) {
  for_rows(rows, [&](int64_t r) {
    BF16* res = residual + r * dim;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t j = 0; j < dim; j += 32) {
      __m512 a = load_bf16(res + j), b = load_bf16(res + j + 16);
      if (x != nullptr) {
        a = _mm512_add_ps(load_bf16(x + r * dim + j), a);
        b = _mm512_add_ps(load_bf16(x + r * dim + j + 16), b);
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
  });
}

__mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// out = weight * (x * rsqrt(mean(x^2) + eps)) over one head of `dim` values, rounded to bfloat16 once.
void rms_norm_head(const BF16* x, const BF16* weight, BF16* out, int64_t dim, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 a = load_bf16(x + i, lanes(dim - i));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(a, a));
  }
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / dim + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = lanes(dim - i);
    store_bf16(out + i, _mm512_mul_ps(load_bf16(weight + i, m), _mm512_mul_ps(load_bf16(x + i, m), scale)), m);
  }
}

// q and k heads of each qkv row (the first heads_qk * dim values) rotated into `out` [rows, heads_qk,
// dim], NeoX layout: the two halves of a head pair up with cos and sin of the token's position. With
// `q_norm` and `k_norm` (Qwen3), each query head is first RMS-normed with `q_norm` and each key head
// (those from `num_heads` on) with `k_norm`, into `out`, and rotated there (each lane is read before
// it is written).
void rotary(const BF16* qkv, int64_t ld_qkv, const int64_t* positions, const float* cos_sin, BF16* out,
            int64_t rows, int64_t num_heads, int64_t heads_qk, int64_t dim, const BF16* q_norm, const BF16* k_norm,
            float eps) {
  const int64_t half = dim / 2;
  for_rows(rows, [&](int64_t r) {
    const float* cos = cos_sin + positions[r] * dim;
    const float* sin = cos + half;
    for (int64_t h = 0; h < heads_qk; ++h) {
      const BF16* x = qkv + r * ld_qkv + h * dim;
      BF16* y = out + (r * heads_qk + h) * dim;
      if (q_norm != nullptr) {
        rms_norm_head(x, h < num_heads ? q_norm : k_norm, y, dim, eps);
        x = y;
      }
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = lanes(half - i);
        const __m512 x1 = load_bf16(x + i, m), x2 = load_bf16(x + half + i, m);
        const __m512 c = _mm512_maskz_loadu_ps(m, cos + i), s = _mm512_maskz_loadu_ps(m, sin + i);
        store_bf16(y + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)), m);
        store_bf16(y + half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)), m);
      }
    }
  });
}

// out [rows, inter] = silu(gate) * up, from gate_up rows [gate | up].
void silu_and_mul(const BF16* gate_up, BF16* out, int64_t rows, int64_t inter) {
  using Vec = at::vec::Vectorized<float>;
  for_rows(rows, [&](int64_t r) {
    const BF16* g = gate_up + r * 2 * inter;
    for (int64_t i = 0; i < inter; i += 16) {
      const __m512 gate = load_bf16(g + i);
      const __m512 e = static_cast<__m512>(Vec(_mm512_sub_ps(_mm512_setzero_ps(), gate)).exp());
      const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      store_bf16(out + r * inter + i, _mm512_mul_ps(silu, load_bf16(g + inter + i)));
    }
  });
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
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve_cpu::paged_attention_decode", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double)>();
  return op.call(q, k_cache, v_cache, block_tables, context_lens, scale);
}

#endif  // PAGEDSERVE_DECODE_LAYERS

bool is_bf16_cpu(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kBFloat16; }

// input_ids, positions [T] int64; embedding [vocab, hidden]; cos_sin_cache [positions, head_dim] float32
// ([cos | sin] halves); per layer L: norms[2L] (input, post-attention), qkv[L], qkv_bias[L] or empty,
// qk_norms[2L] (query, key head norms [head_dim]) or empty, o_proj[L], gate_up[L], down[L] (packed); final_norm [hidden]; the layers' caches; the step's slot
// mapping, decode block tables and context lengths. Returns the final-normed hidden states [T, hidden].
at::Tensor decode_layers(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embedding,
                         const at::Tensor& cos_sin_cache, at::TensorList norms, at::TensorList qkv,
                         at::TensorList qkv_bias, at::TensorList qk_norms, at::TensorList o_proj,
                         at::TensorList gate_up,
                         at::TensorList down, const at::Tensor& final_norm, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                         double scale) {
  const int64_t layers = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(layers > 0 && norms.size() == 2 * qkv.size() && o_proj.size() == qkv.size() &&
                  gate_up.size() == qkv.size() && down.size() == qkv.size() && k_caches.size() == qkv.size() &&
                  v_caches.size() == qkv.size() && (qkv_bias.empty() || qkv_bias.size() == qkv.size()) &&
                  (qk_norms.empty() || qk_norms.size() == 2 * qkv.size()),
              "decode_layers: one qkv, o_proj, gate_up, down, k and v cache and two norms a layer (and one qkv bias "
              "and two head norms, if any)");
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong && positions.sizes() == input_ids.sizes() &&
                  positions.scalar_type() == at::kLong && input_ids.is_contiguous() && positions.is_contiguous(),
              "decode_layers: input_ids and positions must be contiguous int64 [tokens]");
  TORCH_CHECK(is_bf16_cpu(embedding) && embedding.dim() == 2 && embedding.is_contiguous(),
              "decode_layers: embedding must be a contiguous bfloat16 [vocab, hidden] CPU tensor");
  const int64_t tokens = input_ids.size(0), hidden = embedding.size(1);
  const int64_t head_dim = cos_sin_cache.size(1), heads_qk = num_heads + num_kv_heads;
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() &&
                  head_dim % 2 == 0,
              "decode_layers: cos_sin_cache must be contiguous float32 [positions, head_dim], head_dim even");
  TORCH_CHECK(hidden % 32 == 0 && final_norm.numel() == hidden && is_bf16_cpu(final_norm) && final_norm.is_contiguous(),
              "decode_layers: hidden size a multiple of 32, final_norm contiguous bfloat16 [hidden]");
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
  // every layer shares (each layer's attention call checks them again: a pass over a few ids).
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.size(0) == tokens &&
                  context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt && context_lens.size(0) == tokens,
              "decode_layers: block_tables [tokens, max_blocks] and context_lens [tokens] must be int32");
  for (int64_t l = 0; l < layers; ++l)
    TORCH_CHECK(k_caches[l].dim() == 4 && k_caches[l].sizes() == k_caches[0].sizes() &&
                    v_caches[l].sizes() == k_caches[0].sizes(),
                "decode_layers: every layer's k and v cache must be [blocks, block_size, kv_heads, head_dim], one "
                "shape for all");
  pagedserve::check_block_tables(block_tables.contiguous(), context_lens.contiguous(), k_caches[0].size(1),
                                 k_caches[0].size(0));
#ifdef PAGEDSERVE_DECODE_LAYERS
  const auto options = embedding.options();
  at::Tensor residual = embedding.index_select(0, input_ids);  // the first layer's residual is its input
  at::Tensor normed = at::empty({tokens, hidden}, options);
  at::Tensor qk = at::empty({tokens, heads_qk, head_dim}, options);
  at::Tensor act;
  at::Tensor out;  // the last multiply's output, added to the residual by the next norm
  for (int64_t l = 0; l < layers; ++l) {
    add_rms_norm(out.defined() ? out.data_ptr<BF16>() : nullptr, residual.data_ptr<BF16>(),
                 norms[2 * l].data_ptr<BF16>(), normed.data_ptr<BF16>(), tokens, hidden, static_cast<float>(eps));
    const at::Tensor qkv_out = linear(normed, qkv[l], qkv_bias.empty() ? std::nullopt : std::optional<at::Tensor>(qkv_bias[l]));
    TORCH_CHECK(qkv_out.size(1) == (heads_qk + num_kv_heads) * head_dim,
                "decode_layers: layer ", l, "'s qkv weight does not match the heads");
    rotary(qkv_out.data_ptr<BF16>(), qkv_out.size(1), positions.data_ptr<int64_t>(), cos_sin_cache.data_ptr<float>(),
           qk.data_ptr<BF16>(), tokens, num_heads, heads_qk, head_dim,
           qk_norms.empty() ? nullptr : qk_norms[2 * l].data_ptr<BF16>(),
           qk_norms.empty() ? nullptr : qk_norms[2 * l + 1].data_ptr<BF16>(), static_cast<float>(eps));
    const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
    const at::Tensor v = qkv_out.narrow(1, heads_qk * head_dim, num_kv_heads * head_dim).view({tokens, num_kv_heads, head_dim});
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor attn = decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale);
    out = linear(attn.view({tokens, num_heads * head_dim}), o_proj[l], std::nullopt);
    add_rms_norm(out.data_ptr<BF16>(), residual.data_ptr<BF16>(), norms[2 * l + 1].data_ptr<BF16>(),
                 normed.data_ptr<BF16>(), tokens, hidden, static_cast<float>(eps));
    const at::Tensor gu = linear(normed, gate_up[l], std::nullopt);
    const int64_t inter = gu.size(1) / 2;
    TORCH_CHECK(inter % 16 == 0, "decode_layers: intermediate size must be a multiple of 16");
    if (!act.defined() || act.size(1) != inter) act = at::empty({tokens, inter}, options);
    silu_and_mul(gu.data_ptr<BF16>(), act.data_ptr<BF16>(), tokens, inter);
    out = linear(act, down[l], std::nullopt);
  }
  add_rms_norm(out.data_ptr<BF16>(), residual.data_ptr<BF16>(), final_norm.data_ptr<BF16>(), normed.data_ptr<BF16>(),
               tokens, hidden, static_cast<float>(eps));
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("decode_layers_supported() -> bool", &decode_layers_supported);
  m.def(
      "decode_layers(Tensor input_ids, Tensor positions, Tensor embedding, Tensor cos_sin_cache, Tensor[] norms, "
      "Tensor[] qkv, Tensor[] qkv_bias, Tensor[] qk_norms, Tensor[] o_proj, Tensor[] gate_up, Tensor[] down, Tensor final_norm, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
      "int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
// Weights in oneDNN's layout make the call dispatch as MkldnnCPU.
TORCH_LIBRARY_IMPL(pagedserve_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
