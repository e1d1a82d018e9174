// The parts of the C++ decode kernels that decode_layers.cpp runs on its own threads: a linear
// layer's panels, one at a time (linear_avx512.cpp, linear_amx.cpp), and decode attention's rows over
// a range the caller picks (cpu_kernels.cpp), with no parallel region of their own. The ops built on
// them (linear_avx512, linear_amx, paged_attention_decode) split the same work over at::parallel_for.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace pagedserve {

// out [rows, n] (row stride n) = x [rows, k] (row stride ld_x) @ W^T (+ bias), for the output panel
// `panel` of W packed by pack_linear_weight_avx512 (32 columns a panel); `prefetch_next`: the next
// panel's weights are fetched meanwhile (the caller multiplies it next). Needs a build with
// AVX512-BF16; the caller has checked the shapes.
void linear_avx512_panel(const c10::BFloat16* x, int64_t ld_x, const c10::BFloat16* packed,
                         const c10::BFloat16* bias, c10::BFloat16* out, int64_t rows, int64_t n, int64_t k,
                         int64_t panel, bool prefetch_next);

// The AMX tile configuration a thread has loaded for linear_amx_panel (-1: none yet): its two row
// blocks' heights.
struct AmxTiles {
  int rows_a = -1;
  int rows_b = -1;
};

// Whether this build and CPU can multiply on AMX tiles (the process is granted their state).
bool amx_tiles_usable();

// As linear_avx512_panel, for W packed by pack_linear_weight (AMX tiles): `panel` is 32 output
// columns (two n-blocks of 16), every row multiplied as linear_amx multiplies it, the same bits.
// `tiles`: this thread's configuration, loaded here when the rows need another; the thread ends with
// release_amx_tiles. Only where amx_tiles_usable(); the caller has checked the shapes.
void linear_amx_panel(const c10::BFloat16* x, int64_t ld_x, const c10::BFloat16* packed,
                      const c10::BFloat16* bias, c10::BFloat16* out, int64_t rows, int64_t n, int64_t k,
                      int64_t panel, AmxTiles& tiles);

// Gives the thread's tile state back (after its last linear_amx_panel), if it loaded any.
void release_amx_tiles(AmxTiles& tiles);

// The first row of each of `parts` runs of rows of about equal work (a row costs its context, at most
// `window` tokens of it under a window (> 0), plus a few tokens' worth of its own), then `num_rows`:
// parts + 1 bounds. As paged_attention_decode splits its rows over threads.
std::vector<int64_t> decode_row_split(const int32_t* context_lens, int64_t num_rows, int64_t parts,
                                      int64_t window);

// Decode attention (paged_attention_decode, under `window` and `softcap`, 0 for none) of rows [begin,
// end) into `out` [rows, heads, head_dim], bfloat16, on the path paged_attention_decode would take (head
// sizes 64, 96, 128 and 256 on AVX512-BF16 where the build has it, the generic loops otherwise), every
// argument checked by the caller as paged_attention_decode checks it (the block tables and context
// lengths contiguous).
void decode_attention_rows_bf16(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                                int64_t begin, int64_t end);

}  // namespace pagedserve
