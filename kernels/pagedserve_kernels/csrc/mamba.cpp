// Mamba (1)'s selective scan over one step's tokens, decodes and prompts alike: each request's tokens
// in order, every channel's state h [state_size] (a decay a state: A [channels, state_size]) advanced
// as
//
//     h <- exp(dt A) h + (dt x) B,    y = h . C
//
// and y returned in float32 (without D's skip, which the caller adds). A channel's state is read from
// the request's row once, advanced in registers over the request's tokens, and written back once;
// threads take (request, channel) pairs. The torch path (`pagedserve.layers.mamba`) advances a prompt
// a token at a time from Python, six ops a token a layer. The states are float32 or bfloat16 (read
// widened, advanced in float32, stored rounded to nearest even); x, dt, A, B and C are float32.
#if defined(__AVX512F__)
#ifndef CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY_AVX512  // ATen's vectorized exp (Sleef), as torch's own exp runs on this CPU
#endif
#elif defined(__AVX2__)
#ifndef CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY_AVX2
#endif
#endif
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

#include "ops.h"
#include "recurrent_inputs.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxStateSize = 256;

// One channel of one request over its `num_tokens` tokens (x, dt and y strided by the channels; B and
// C rows of state_size): its state advanced and stored, its y written.
template <typename T>
void scan_channel(T* stored, const float* a, const float* x, const float* dt, const float* b, const float* c,
                  float* y, int64_t num_tokens, int64_t channels, int64_t state_size) {
  float h[kMaxStateSize];
  for (int64_t n = 0; n < state_size; ++n) h[n] = static_cast<float>(stored[n]);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float step = dt[t * channels];
    const Vec vstep(step), u(step * x[t * channels]);
    const float *bt = b + t * state_size, *ct = c + t * state_size;
    Vec acc(0.0f);
    for (int64_t n = 0; n < state_size; n += Vec::size()) {
      const int count = static_cast<int>(std::min<int64_t>(Vec::size(), state_size - n));
      // (lanes past state_size load zeros: their decay is 1, their state and C 0, adding nothing)
      const Vec decay = (vstep * Vec::loadu(a + n, count)).exp();
      const Vec s = Vec::loadu(h + n, count) * decay + u * Vec::loadu(bt + n, count);
      s.store(h + n, count);
      acc = acc + s * Vec::loadu(ct + n, count);
    }
    float lanes[Vec::size()];
    acc.store(lanes);
    float sum = 0.0f;
    for (int64_t i = 0; i < Vec::size(); ++i) sum += lanes[i];
    y[t * channels] = sum;
  }
  for (int64_t n = 0; n < state_size; ++n) stored[n] = static_cast<T>(h[n]);
}

template <typename T>
void scan(at::Tensor& state, const int64_t* rows, const int64_t* starts, const float* x, const float* dt,
          const float* a, const float* b, const float* c, float* y, int64_t num_requests) {
  const int64_t channels = state.size(1), state_size = state.size(2);
  T* states = state.data_ptr<T>();
  at::parallel_for(0, num_requests * channels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index / channels, d = index % channels, first = starts[i];
      scan_channel(states + (rows[i] * channels + d) * state_size, a + d * state_size,
                   x + first * channels + d, dt + first * channels + d, b + first * state_size,
                   c + first * state_size, y + first * channels + d, starts[i + 1] - first, channels,
                   state_size);
    }
  });
}

}  // namespace

namespace pagedserve {

at::Tensor mamba_scan(at::Tensor& state, const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& x,
                      const at::Tensor& dt, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  pagedserve::check_states(state, 3, "[rows, channels, state_size]");
  const int64_t channels = state.size(1), state_size = state.size(2);
  TORCH_CHECK(state_size <= kMaxStateSize, "state: at most ", kMaxStateSize, " states a channel, got ",
              state_size);
  const auto ids = pagedserve::checked_rows(rows, state);
  const int64_t num_requests = ids.size(0);
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.size(0) == num_requests + 1,
              "starts: int64 [requests + 1]");
  const auto offsets = starts.contiguous();
  const int64_t* start = offsets.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0, "starts: the first request's tokens start at 0");
  for (int64_t i = 0; i < num_requests; ++i) {
    TORCH_CHECK(start[i + 1] >= start[i], "starts: must not decrease");
  }
  const int64_t num_tokens = start[num_requests];
  const auto f32 = pagedserve::float32_input;
  const auto xs = f32(x, {num_tokens, channels}, "x");
  const auto dts = f32(dt, {num_tokens, channels}, "dt");
  const auto as = f32(a, {channels, state_size}, "a");
  const auto bs = f32(b, {num_tokens, state_size}, "b");
  const auto cs = f32(c, {num_tokens, state_size}, "c");
  auto y = at::empty({num_tokens, channels}, x.options());
  const int64_t* row = ids.data_ptr<int64_t>();
  const float *xp = xs.data_ptr<float>(), *dtp = dts.data_ptr<float>(), *ap = as.data_ptr<float>();
  const float *bp = bs.data_ptr<float>(), *cp = cs.data_ptr<float>();
  if (state.scalar_type() == at::kFloat) {
    scan<float>(state, row, start, xp, dtp, ap, bp, cp, y.data_ptr<float>(), num_requests);
  } else {
    scan<c10::BFloat16>(state, row, start, xp, dtp, ap, bp, cp, y.data_ptr<float>(), num_requests);
  }
  return y;
}

}  // namespace pagedserve
