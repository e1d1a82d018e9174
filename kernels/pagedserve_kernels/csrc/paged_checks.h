// Checks of the paged-cache arguments shared by the CPU kernels that read block tables
// (cpu_kernels.cpp's paged_attention_decode, decode_layers.cpp's decode_layers), run once per call
// before any thread starts. The kernels turn a block id into a pointer without looking at it: an id
// outside the cache would read (or fault on) memory that is not the cache's, a dead process with no
// message instead of an error naming the bad entry.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedserve {

// block_tables [seqs, max_blocks] and context_lens [seqs], both contiguous int32 with one row per
// sequence (the caller checks that): every context fits its row, and the ids of the blocks holding
// it, the first ceil(context_len / block_size) of the row, name blocks of a cache of `num_blocks`.
// Entries past them are padding, never read: any value is allowed there (the engine pads rows).
inline void check_block_tables(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                               int64_t num_blocks) {
  TORCH_CHECK(block_size > 0, "the KV cache's block_size must be positive, got ", block_size);
  const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t capacity = max_blocks * block_size;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    // a context longer than its row would read slots the row does not name: refused, as the
    // reference and the Triton launcher refuse it, rather than attended over in part
    TORCH_CHECK(lens[seq] >= 0 && lens[seq] <= capacity, "context_lens: sequence ", seq, " has ", lens[seq],
                " tokens, its block table row holds ", capacity);
    const int32_t* row = tables + seq * max_blocks;
    const int64_t used = (lens[seq] + block_size - 1) / block_size;
    for (int64_t i = 0; i < used; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, "block_tables[", seq, ", ", i, "] = ", row[i],
                  " is not a block of the KV cache (ids 0 to ", num_blocks - 1, "; sequence ", seq, " has ",
                  lens[seq], " tokens, in the first ", used, " blocks of its row)");
  }
}

}  // namespace pagedserve
