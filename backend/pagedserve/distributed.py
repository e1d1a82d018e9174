"""Every torch.distributed call goes through here. Without `init_tensor_parallel` the tensor-parallel
size is 1 and every collective is the identity.

Three process groups span the same ranks:

    world    gloo, start-up timeout   rendezvous and start-up agreement (KV blocks): ranks may load
                                      weights at different speeds, or start on different nodes late
    tensor   gloo on CPU, NCCL on     the layers' all-reduces and gathers
             CUDA, step timeout
    control  gloo, step timeout       the pickled step plans rank 0 broadcasts

A failed call (a dead peer, a timeout) raises `CollectiveError`, an `EngineDeadError`: a process
group is unusable after one failed collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.errors import EngineDeadError
from pagedserve.launch import LaunchEnv


class CollectiveError(EngineDeadError):
    """A collective failed or timed out: a peer rank died or stopped answering."""


@dataclass
class _State:
    owns_world: bool = False  # this module initialized the default process group
    tensor_group: Any = None
    control_group: Any = None
    size: int = 1
    rank: int = 0


_state = _State()


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_tensor_parallel(
    launch: LaunchEnv,
    backend: str,
    timeout_s: float,
    startup_timeout_s: float,
    store: dist.Store | None = None,
) -> None:
    """Join the rendezvous: through `store` when given (ranks rank 0 spawned, and rank 0), else `env://`."""
    if _state.owns_world:
        raise RuntimeError(
            "tensor parallelism is already initialized in this process (one engine per process)"
        )
    kwargs: dict[str, Any] = {
        "backend": "gloo",
        "rank": launch.rank,
        "world_size": launch.world_size,
        "timeout": timedelta(seconds=startup_timeout_s),
    }
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    timeout = timedelta(seconds=timeout_s)
    with _collective("rendezvous"):
        dist.init_process_group(**kwargs)
        _state.owns_world = True
        _state.tensor_group = dist.new_group(backend=backend, timeout=timeout)
        _state.control_group = dist.new_group(backend="gloo", timeout=timeout)
    _state.size, _state.rank = launch.world_size, launch.rank


def destroy_tensor_parallel() -> None:
    """Leave the process groups (idempotent); afterwards this process is tensor-parallel size 1."""
    global _state
    owned, _state = _state.owns_world, _State()
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def create_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """A rendezvous store on a free loopback port, for ranks this process spawns itself."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def get_tp_size() -> int:
    return _state.size


def get_tp_rank() -> int:
    return _state.rank


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place."""
    if _state.size > 1:
        with _collective("all_reduce"):
            dist.all_reduce(x, group=_state.tensor_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension, in rank order."""
    if _state.size == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(_state.size)]
    with _collective("all_gather"):
        dist.all_gather(shards, x.contiguous(), group=_state.tensor_group)
    return torch.cat(shards, dim=-1)


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (e.g. the KV blocks each rank has room for). A start-up
    call: it waits as long as the start-up timeout for the slowest rank."""
    if _state.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    with _collective("all_reduce_min"):
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0 sends `obj` (picklable plain data); every other rank returns it."""
    if _state.size == 1:
        return obj
    objects = [obj]
    with _collective("broadcast"):
        dist.broadcast_object_list(objects, src=0, group=_state.control_group)
    return objects[0]


@contextlib.contextmanager
def _collective(name: str) -> Iterator[None]:
    """Turns a torch.distributed failure into `CollectiveError`. gloo raises RuntimeError (a dead peer:
    'Connection closed by peer'; a timeout: 'Timed out waiting ...'); NCCL's watchdog aborts the
    process on a timeout instead."""
    try:
        yield
    except EngineDeadError:
        raise
    except RuntimeError as exc:
        raise CollectiveError(f"tensor-parallel {name} failed: {exc}") from exc
