// The ops defined outside cpu_kernels.cpp, which registers every op of the library (`pagedserve_cpu`):
// their files then need no <torch/library.h>, whose templates cost each file that includes it ~2.6 s
// of a build on 2 cores. Each op's schema is beside its registration in cpu_kernels.cpp; what it does,
// beside its definition.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace pagedserve {

// linear_amx.cpp
bool linear_amx_supported();
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor linear_argmax_amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t num_columns);

// linear_avx512.cpp
bool linear_avx512_supported();
at::Tensor pack_linear_weight_avx512(const at::Tensor& weight);
at::Tensor linear_avx512(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor linear_argmax_avx512(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                int64_t num_columns);

// decode_layers.cpp
bool decode_layers_supported();
at::Tensor decode_layers(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embedding,
                         const at::Tensor& cos_sin_cache, at::TensorList norms, at::TensorList qkv,
                         at::TensorList qkv_bias, at::TensorList qk_norms, at::TensorList o_proj,
                         at::TensorList gate_up, at::TensorList down, const at::Tensor& final_norm,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_heads,
                         int64_t num_kv_heads, double eps, double scale, const std::vector<int64_t>& windows,
                         double embedding_scale, double residual_scale, const c10::List<bool>& rotary_layers);

// mamba.cpp, mamba2.cpp, gated_delta.cpp
at::Tensor mamba_scan(at::Tensor& state, const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& x,
                      const at::Tensor& dt, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c);
at::Tensor mamba2_decode(at::Tensor& state, const at::Tensor& rows, const at::Tensor& x, const at::Tensor& dt,
                         const at::Tensor& a, const at::Tensor& b, const at::Tensor& c);
at::Tensor gated_delta_decode(at::Tensor& state, const at::Tensor& rows, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta);

}  // namespace pagedserve
