"""Every torch.distributed call goes through here. Without an initialized process group the
tensor-parallel size is 1 and every collective is the identity."""

from __future__ import annotations

import torch
import torch.distributed as dist


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension, in rank order."""
    size = get_tp_size()
    if size == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x.contiguous())
    return torch.cat(shards, dim=-1)
