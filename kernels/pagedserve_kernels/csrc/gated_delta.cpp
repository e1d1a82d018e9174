// The gated delta rule's decode step (Qwen3.5's Gated DeltaNet, Kimi Linear's KDA, one token a
// request) in two passes over each request's states: every value head's state S [head_k_dim,
// head_v_dim] of the request's row is read once to predict and read out, then advanced in place:
//
//     p = (E S)^T k,    r = (E S)^T q,    u = beta (v - p),    S <- E S + k u^T,    o = r + (k.q) u
//
// with E = diag(exp(g)), g one decay a head [requests, heads] (Gated DeltaNet's) or one a key channel
// [requests, heads, head_k_dim] (KDA's): o = S^T q of the advanced state, written out without a third
// pass. The torch path (`pagedserve.layers.gated_delta.delta_rule_step`) gathers the rows, advances
// them in a float32 copy and scatters them back. The states are float32 or bfloat16 (read widened,
// advanced in float32, stored rounded to nearest even); q, k, v, g and beta are float32, q and k one
// row a value head.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>

#include "bf16_vec.h"
#include "ops.h"
#include "recurrent_inputs.h"

namespace {

constexpr int64_t kMaxValueDim = 512;  // a value head's width, held twice on the stack
constexpr int64_t kMaxKeyDim = 512;    // a key head's width, its row decays held on the stack

// One value head of one request: its state [dk, dv] advanced (row i decayed by decay[i]), its output
// o [dv] written.
template <typename T>
void advance_head(T* state, const float* q, const float* k, const float* v, const float* decay, float beta,
                  float* o, int64_t dk, int64_t dv) {
  float predicted[kMaxValueDim], read[kMaxValueDim];
  float kq = 0.0f;
  for (int64_t i = 0; i < dk; ++i) kq += k[i] * q[i];
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (pagedserve::vector_state<T>) {
    for (int64_t n = 0; n < dv; n += 16) {
      const __mmask16 mask = pagedserve::lanes_below(dv - n);
      __m512 p = _mm512_setzero_ps(), r = _mm512_setzero_ps();
      for (int64_t i = 0; i < dk; ++i) {
        const __m512 s = pagedserve::load_state(state + i * dv + n, mask);
        p = _mm512_fmadd_ps(s, _mm512_set1_ps(k[i] * decay[i]), p);
        r = _mm512_fmadd_ps(s, _mm512_set1_ps(q[i] * decay[i]), r);
      }
      const __m512 u = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, v + n), p), _mm512_set1_ps(beta));
      _mm512_mask_storeu_ps(predicted + n, mask, u);  // (u, from here on)
      _mm512_mask_storeu_ps(o + n, mask, _mm512_fmadd_ps(u, _mm512_set1_ps(kq), r));
    }
    for (int64_t i = 0; i < dk; ++i) {
      T* row = state + i * dv;
      const __m512 ki = _mm512_set1_ps(k[i]), vdecay = _mm512_set1_ps(decay[i]);
      for (int64_t n = 0; n < dv; n += 16) {
        const __mmask16 mask = pagedserve::lanes_below(dv - n);
        const __m512 s = _mm512_fmadd_ps(ki, _mm512_maskz_loadu_ps(mask, predicted + n),
                                         _mm512_mul_ps(pagedserve::load_state(row + n, mask), vdecay));
        pagedserve::store_state(row + n, s, mask);
      }
    }
    return;
  }
#endif
  for (int64_t n = 0; n < dv; ++n) predicted[n] = read[n] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const T* row = state + i * dv;
    for (int64_t n = 0; n < dv; ++n) {
      const float s = static_cast<float>(row[n]);
      predicted[n] += s * (k[i] * decay[i]);
      read[n] += s * (q[i] * decay[i]);
    }
  }
  for (int64_t n = 0; n < dv; ++n) {
    predicted[n] = (v[n] - predicted[n]) * beta;  // (u, from here on)
    o[n] = read[n] + kq * predicted[n];
  }
  for (int64_t i = 0; i < dk; ++i) {
    T* row = state + i * dv;
    for (int64_t n = 0; n < dv; ++n) {
      row[n] = static_cast<T>(static_cast<float>(row[n]) * decay[i] + k[i] * predicted[n]);
    }
  }
}

// g: a decay a head, or (`by_channel`) head_k_dim of them a head
template <typename T>
void advance(at::Tensor& state, const int64_t* rows, const float* q, const float* k, const float* v,
             const float* g, bool by_channel, const float* beta, float* o, int64_t num_requests) {
  const int64_t num_heads = state.size(1), dk = state.size(2), dv = state.size(3);
  T* states = state.data_ptr<T>();
  at::parallel_for(0, num_requests * num_heads, 1, [&](int64_t begin, int64_t end) {
    float decay[kMaxKeyDim];
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index / num_heads, h = index % num_heads;
      if (by_channel) {
        for (int64_t d = 0; d < dk; ++d) decay[d] = std::exp(g[index * dk + d]);
      } else {
        const float e = std::exp(g[index]);
        for (int64_t d = 0; d < dk; ++d) decay[d] = e;
      }
      advance_head(states + (rows[i] * num_heads + h) * dk * dv, q + index * dk, k + index * dk, v + index * dv,
                   decay, beta[index], o + index * dv, dk, dv);
    }
  });
}

}  // namespace

namespace pagedserve {

at::Tensor gated_delta_decode(at::Tensor& state, const at::Tensor& rows, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta) {
  pagedserve::check_states(state, 4, "[rows, heads, head_k_dim, head_v_dim]");
  const int64_t num_heads = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(dv <= kMaxValueDim, "state: head_v_dim ", dv, " is past ", kMaxValueDim);
  TORCH_CHECK(dk <= kMaxKeyDim, "state: head_k_dim ", dk, " is past ", kMaxKeyDim);
  const auto ids = pagedserve::checked_rows(rows, state);
  const int64_t* row = ids.data_ptr<int64_t>();
  const int64_t num_requests = ids.size(0);
  const auto f32 = pagedserve::float32_input;
  const auto qs = f32(q, {num_requests, num_heads, dk}, "q");
  const auto ks = f32(k, {num_requests, num_heads, dk}, "k");
  const auto vs = f32(v, {num_requests, num_heads, dv}, "v");
  const bool by_channel = g.dim() == 3;  // (a decay a key channel: KDA's)
  const auto gs = by_channel ? f32(g, {num_requests, num_heads, dk}, "g") : f32(g, {num_requests, num_heads}, "g");
  const auto betas = f32(beta, {num_requests, num_heads}, "beta");
  auto o = at::empty({num_requests, num_heads, dv}, v.options());
  const float *qp = qs.data_ptr<float>(), *kp = ks.data_ptr<float>(), *vp = vs.data_ptr<float>();
  const float *gp = gs.data_ptr<float>(), *bp = betas.data_ptr<float>();
  if (state.scalar_type() == at::kFloat) {
    advance<float>(state, row, qp, kp, vp, gp, by_channel, bp, o.data_ptr<float>(), num_requests);
  } else {
    advance<c10::BFloat16>(state, row, qp, kp, vp, gp, by_channel, bp, o.data_ptr<float>(), num_requests);
  }
  return o;
}

}  // namespace pagedserve
