// The inputs of a recurrent layer's kernel (mamba.cpp, mamba2.cpp, gated_delta.cpp), checked as the
// layers pass them: the states [rows, ...] contiguous float32 or bfloat16, the requests' state rows
// int64 and within them, every other input float32 of its expected shape.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedserve {

inline void check_states(const at::Tensor& state, int64_t dims, const char* layout) {
  TORCH_CHECK(state.dim() == dims && state.is_contiguous() &&
                  (state.scalar_type() == at::kFloat || state.scalar_type() == at::kBFloat16),
              "state: contiguous float32 or bfloat16 ", layout);
}

// `rows` contiguous, each checked to lie in `state`'s rows (the caller keeps it alive while it reads).
inline at::Tensor checked_rows(const at::Tensor& rows, const at::Tensor& state) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows: int64 [requests]");
  auto ids = rows.contiguous();
  const int64_t* row = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < state.size(0), "rows: row ", row[i], " is past the state's ",
                state.size(0));
  }
  return ids;
}

inline at::Tensor float32_input(const at::Tensor& t, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.sizes() == shape, name, ": float32 ", shape, ", got ",
              t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

}  // namespace pagedserve
