// Mamba2's decode step (one token a request) in one pass over each request's states: every head's
// state S [head_dim, state_size] of the request's row is read once, advanced in place as
//
//     S <- exp(dt A) S + (dt x) B^T,    y = S C
//
// and written back, y returned in float32 (without D's skip, which the caller adds). The torch path
// (`pagedserve.layers.mamba2`) gathers the rows, advances them in a float32 copy and scatters them
// back: seven passes over states that a 64-request step of 24 heads x 64 x 128 holds 25 MB of. The
// states are float32 or bfloat16 (read widened, advanced in float32, stored rounded to nearest even);
// x, dt, A, B and C are float32, B and C one row a group, each shared by num_heads / num_groups heads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>

#include "bf16_vec.h"
#include "ops.h"
#include "recurrent_inputs.h"

namespace {

// One head of one request: its state [head_dim, state_size] advanced, its y [head_dim] written.
template <typename T>
void advance_head(T* state, const float* x, float dt, float decay, const float* b, const float* c, float* y,
                  int64_t head_dim, int64_t state_size) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (pagedserve::vector_state<T>) {
    const __m512 vdecay = _mm512_set1_ps(decay);
    for (int64_t p = 0; p < head_dim; ++p) {
      T* row = state + p * state_size;
      const __m512 u = _mm512_set1_ps(dt * x[p]);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t n = 0; n < state_size; n += 16) {
        const __mmask16 mask = pagedserve::lanes_below(state_size - n);
        const __m512 s = _mm512_fmadd_ps(pagedserve::load_state(row + n, mask), vdecay,
                                         _mm512_mul_ps(u, _mm512_maskz_loadu_ps(mask, b + n)));
        pagedserve::store_state(row + n, s, mask);
        acc = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mask, c + n), acc);
      }
      y[p] = _mm512_reduce_add_ps(acc);
    }
    return;
  }
#endif
  for (int64_t p = 0; p < head_dim; ++p) {
    T* row = state + p * state_size;
    const float u = dt * x[p];
    float acc = 0.0f;
    for (int64_t n = 0; n < state_size; ++n) {
      const float s = static_cast<float>(row[n]) * decay + u * b[n];
      row[n] = static_cast<T>(s);
      acc += s * c[n];
    }
    y[p] = acc;
  }
}

template <typename T>
void advance(at::Tensor& state, const int64_t* rows, const float* x, const float* dt, const float* a,
             const float* b, const float* c, float* y, int64_t num_requests, int64_t num_groups) {
  const int64_t num_heads = state.size(1), head_dim = state.size(2), state_size = state.size(3);
  const int64_t heads_per_group = num_heads / num_groups;
  T* states = state.data_ptr<T>();
  at::parallel_for(0, num_requests * num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index / num_heads, h = index % num_heads, g = h / heads_per_group;
      const float step = dt[i * num_heads + h];
      advance_head(states + (rows[i] * num_heads + h) * head_dim * state_size, x + index * head_dim, step,
                   std::exp(step * a[h]), b + (i * num_groups + g) * state_size,
                   c + (i * num_groups + g) * state_size, y + index * head_dim, head_dim, state_size);
    }
  });
}

}  // namespace

namespace pagedserve {

at::Tensor mamba2_decode(at::Tensor& state, const at::Tensor& rows, const at::Tensor& x, const at::Tensor& dt,
                         const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  pagedserve::check_states(state, 4, "[rows, heads, head_dim, state_size]");
  const int64_t num_heads = state.size(1), head_dim = state.size(2), state_size = state.size(3);
  const auto ids = pagedserve::checked_rows(rows, state);
  const int64_t* row = ids.data_ptr<int64_t>();
  const int64_t num_requests = ids.size(0);
  const auto f32 = pagedserve::float32_input;
  const auto xs = f32(x, {num_requests, num_heads, head_dim}, "x");
  const auto dts = f32(dt, {num_requests, num_heads}, "dt");
  const auto as = f32(a, {num_heads}, "a");
  TORCH_CHECK(b.dim() == 3 && b.size(0) == num_requests && b.size(2) == state_size && b.size(1) >= 1 &&
                  num_heads % b.size(1) == 0,
              "b: [requests, groups, state_size] with groups dividing the heads, got ", b.sizes());
  const int64_t num_groups = b.size(1);
  const auto bs = f32(b, {num_requests, num_groups, state_size}, "b");
  const auto cs = f32(c, {num_requests, num_groups, state_size}, "c");
  auto y = at::empty({num_requests, num_heads, head_dim}, x.options());
  const float *xp = xs.data_ptr<float>(), *dtp = dts.data_ptr<float>(), *ap = as.data_ptr<float>();
  const float *bp = bs.data_ptr<float>(), *cp = cs.data_ptr<float>();
  if (state.scalar_type() == at::kFloat) {
    advance<float>(state, row, xp, dtp, ap, bp, cp, y.data_ptr<float>(), num_requests, num_groups);
  } else {
    advance<c10::BFloat16>(state, row, xp, dtp, ap, bp, cp, y.data_ptr<float>(), num_requests, num_groups);
  }
  return y;
}

}  // namespace pagedserve
