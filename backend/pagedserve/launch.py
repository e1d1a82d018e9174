"""The rank a launcher (torchrun, or a script setting the same variables) gave this process, read from
the environment without torch: `pagedserve serve` asks before it imports torch (seconds), so that its
signal handlers are in place at once."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    """The rank a launcher (torchrun, or a script setting the same variables) gave this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # ranks on this node


def launch_env() -> LaunchEnv | None:
    """RANK/WORLD_SIZE/LOCAL_RANK as torchrun sets them, or None when no launcher started several ranks.

    These are torch's rendezvous variables (with MASTER_ADDR/MASTER_PORT, which `env://` reads itself),
    not pagedserve settings, so they are read here, next to the only code that uses them. A bad value
    raises ValueError naming the variable (a rank outside the world would wait in the rendezvous)."""
    world_size = _int_variable("WORLD_SIZE", 1)
    if world_size <= 1:
        return None
    if "RANK" not in os.environ:
        raise ValueError(f"WORLD_SIZE={world_size} is set but RANK is not: set both (torchrun does)")
    rank = _int_variable("RANK", 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is not a rank of WORLD_SIZE={world_size} (0 to {world_size - 1})")
    local_world_size = _int_variable("LOCAL_WORLD_SIZE", world_size)
    return LaunchEnv(rank, world_size, _int_variable("LOCAL_RANK", rank), local_world_size)


def _int_variable(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
