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

Ranks match the tensor group's collectives by the order they enter them, so a step that raises on
some ranks only leaves the ranks out of step. Such a rank reports it in the rendezvous store
(`report_step_fault`), where the other ranks read it (`step_faults`): no collective is needed for
that, and the happy path pays only a count of the collectives entered (`num_collectives`).
"""

from __future__ import annotations

import contextlib
import json
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
    store: dist.Store | None = None  # the rendezvous store every rank reaches (step faults)
    size: int = 1
    rank: int = 0
    num_collectives: int = 0  # tensor-group collectives this rank has entered and returned from


@dataclass(frozen=True)
class StepFault:
    """A rank's report that its model step raised an ordinary exception (not a failed collective)."""

    rank: int
    step: int  # counted alike on every rank: the STEP plans rank 0 broadcast
    num_collectives: int  # tensor-group collectives the rank entered in that step before it raised
    error: str


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
        # `store` as given, or the one `env://` (torchrun) connected to, prefixed alike on every rank
        _state.store = dist.distributed_c10d._get_default_store()
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
        _state.num_collectives += 1
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension, in rank order."""
    if _state.size == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(_state.size)]
    with _collective("all_gather"):
        dist.all_gather(shards, x.contiguous(), group=_state.tensor_group)
    _state.num_collectives += 1
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


def num_collectives() -> int:
    """Tensor-group collectives this rank has entered (and returned from) so far: two ranks that entered
    different numbers would pair the wrong ones from then on."""
    return _state.num_collectives


def report_step_fault(step: int, num_collectives: int, error: str) -> None:
    """Tell the other ranks that this rank's step `step` raised `error`. One key per rank, overwritten
    by its next report: the store never holds more than one per rank."""
    assert _state.store is not None, "init_tensor_parallel() first"
    with _collective("step fault report"):
        _state.store.set(_fault_key(_state.rank), json.dumps([step, num_collectives, error]))


def step_faults() -> list[StepFault]:
    """The latest fault each rank has reported, if any, in rank order (none once the groups are gone)."""
    store, size = _state.store, _state.size  # read once: a watchdog thread may call this meanwhile
    faults: list[StepFault] = []
    if store is None:
        return faults
    with _collective("step fault lookup"):
        for rank in range(size):
            key = _fault_key(rank)
            if store.check([key]):
                step, num_collectives, error = json.loads(store.get(key))
                faults.append(StepFault(rank, step, num_collectives, error))
    return faults


def _fault_key(rank: int) -> str:
    return f"pagedserve/step-fault/{rank}"


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
