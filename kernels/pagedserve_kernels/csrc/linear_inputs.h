// The input checks and row view shared by the bfloat16 linear kernels (linear_amx.cpp,
// linear_avx512.cpp): x [..., k] as rows with unit stride along k, the bias as a contiguous [n], and
// the output's shape. Each message names the kernel that refused.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace pagedserve {

struct LinearInputs {
  at::Tensor rows;                 // x as [M, k]: unit stride along k, rows at least k apart
  at::Tensor bias;                 // contiguous bfloat16 [n], or undefined
  std::vector<int64_t> out_shape;  // x's shape with its last dimension n
};

inline LinearInputs linear_inputs(const char* kernel, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                  int64_t n, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, kernel,
              ": x must be a bfloat16 CPU tensor, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, kernel, ": x's last dimension must be ", k, ", got ", x.sizes());
  LinearInputs inputs;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kBFloat16, kernel,
                ": bias must be bfloat16 [", n, "], got ", bias->scalar_type(), " ", bias->sizes());
    inputs.bias = bias->contiguous();
  }
  inputs.out_shape.assign(x.sizes().begin(), x.sizes().end());
  inputs.out_shape.back() = n;
  inputs.rows = x.reshape({-1, k});
  if (inputs.rows.stride(1) != 1 || (inputs.rows.size(0) > 1 && inputs.rows.stride(0) < k))
    inputs.rows = inputs.rows.contiguous();
  return inputs;
}

}  // namespace pagedserve
