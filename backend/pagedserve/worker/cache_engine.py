"""The KV cache tensors, one (key, value) pair per layer, on one device:

    kv_cache  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

Block `b` of every layer holds the same tokens, so block ids from the block manager index all layers.
"""

from __future__ import annotations

import torch


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        # zeros, not empty: a block's unwritten slots are read (then masked) by attention, and
        # uninitialised memory could hold NaN, which a zero attention weight does not cancel.
        self.kv_cache = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self.kv_cache]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
