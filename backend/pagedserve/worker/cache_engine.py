"""The KV cache tensors of one rank: one (key, value) pair per layer on the device, and a CPU pool
of the same layout that preempted requests are swapped to:

    kv_cache   [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (device)
    cpu_cache  [num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim]  (CPU)

Block `b` of every layer holds the same tokens, so block ids from the block manager index all
layers, and each swap or copy is one indexed copy over all layers at once.

Where the values are the keys' entries (`values_in_keys`: DeepSeek's latent attention reads one
latent as both) the second dimension is 1, and each layer's pair is that one cache twice.
"""

from __future__ import annotations

import torch

from pagedserve.worker import huge_pages


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
        num_cpu_blocks: int = 0,
        values_in_keys: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        shape = (num_layers, 1 if values_in_keys else 2, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: a block's unwritten slots are read (then masked) by attention, and
        # uninitialised memory could hold NaN, which a zero attention weight does not cancel. On the
        # CPU in huge pages: a decode step reads blocks scattered over the whole cache.
        if torch.device(device).type == "cpu":
            self.kv_cache = huge_pages.zeros(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        # empty is safe here: a CPU block is read (swap in) only after a swap out wrote it
        pin = torch.device(device).type == "cuda"
        self.cpu_cache = torch.empty((*shape[:2], num_cpu_blocks, *shape[3:]), dtype=dtype, pin_memory=pin)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs."""
        src, dst = _columns(pairs, self.kv_cache.device)
        self.cpu_cache[:, :, dst.cpu()] = self.kv_cache[:, :, src].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs."""
        src, dst = _columns(pairs, self.kv_cache.device)
        self.kv_cache[:, :, dst] = self.cpu_cache[:, :, src.cpu()].to(self.kv_cache.device, non_blocking=True)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """(source, destination) device block pairs, for copy-on-write."""
        src, dst = _columns(pairs, self.kv_cache.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[-1]) for layer in self.kv_cache]

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        values_in_keys: bool = False,
    ) -> int:
        caches = 1 if values_in_keys else 2
        return caches * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def _columns(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.tensor(pairs, dtype=torch.int64, device=device)
    return table[:, 0], table[:, 1]
