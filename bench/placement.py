"""bench/serving.py's --engine-cores: a GPU host's layout on a CPU. On a GPU host the engine's host
work has cores of its own, apart from the front end's and the load generator's; on a small CPU the
three share every core, which hides what the front end costs the engine on such a host. Here the
engine (the engine process, or the server's torch thread, and the server's other processes: tensor-
parallel ranks) runs on the CPUs given, with as many OpenMP threads, and the rest of the server and
this client run on the others; the offline engine's rounds run on the engine's CPUs as well. Linux
only (sched_setaffinity)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

# The server's torch thread ("pagedserve-torch_0"; Linux keeps 15 characters of a thread's name) and
# the OpenMP workers it starts, which inherit its name.
_TORCH_THREAD = "pagedserve-torc"
_ENGINE_PROCESS = "pagedserve.engine.core_process"
# The CPUs this process may run on, read before it pins any of its threads.
_ALLOWED = frozenset(os.sched_getaffinity(0))


def parse_cpus(text: str) -> set[int]:
    """The CPUs a list names ("1", "2-3", "0,2-3"), each one this process may run on."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"{text!r} is no CPU list (e.g. 1, 2-3, 0,2-3)") from None
    if not cpus or not cpus < _ALLOWED:
        raise ValueError(
            f"{text!r} must name some but not all of the CPUs this process may run on "
            f"({_cpu_list(_ALLOWED)}): the front end and the client need the others"
        )
    return cpus


def split(engine_cpus: set[int]) -> tuple[set[int], set[int]]:
    """(the engine's CPUs, everyone else's)."""
    return engine_cpus, set(_ALLOWED - engine_cpus)


def pin_process(pid: int, cpus: set[int]) -> int:
    """Every thread of `pid` on `cpus`; how many (threads that end meanwhile are skipped)."""
    return sum(_pin(tid, cpus) for tid in _threads(pid))


def place_server(pid: int, engine_cpus: set[int]) -> str:
    """Put a running server's engine on `engine_cpus` and the rest of it on the other CPUs; says
    where each went."""
    engine, others = split(engine_cpus)
    children = psutil.Process(pid).children(recursive=True)
    runs_engine_process = any(_ENGINE_PROCESS in " ".join(_cmdline(child)) for child in children)
    engine_threads = sum(pin_process(child.pid, engine) for child in children)
    front_threads = 0
    for tid in _threads(pid):
        if not runs_engine_process and _thread_name(pid, tid).startswith(_TORCH_THREAD):
            engine_threads += _pin(tid, engine)
        else:
            front_threads += _pin(tid, others)
    what = "the engine process" if runs_engine_process else "the server's torch thread"
    if not engine_threads:  # a measurement of nothing apart: say so rather than print figures
        raise RuntimeError(f"found no thread of {what} in server process {pid} to place")
    return (
        f"engine ({what}; {len(children)} child process(es) of the server; {engine_threads} threads) "
        f"on CPUs {_cpu_list(engine)}, the rest of the server ({front_threads} threads) and this "
        f"client on CPUs {_cpu_list(others)}"
    )


def _pin(tid: int, cpus: set[int]) -> int:
    """1 when thread `tid` now runs on `cpus` alone (read back), 0 when it ended meanwhile."""
    try:
        os.sched_setaffinity(tid, cpus)
        placed = os.sched_getaffinity(tid)
    except ProcessLookupError:
        return 0
    if placed != cpus:
        raise RuntimeError(f"thread {tid} runs on CPUs {_cpu_list(placed)}, not {_cpu_list(cpus)}")
    return 1


def _threads(pid: int) -> list[int]:
    try:
        return [thread.id for thread in psutil.Process(pid).threads()]
    except psutil.NoSuchProcess:
        return []


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.NoSuchProcess:
        return []


def _cpu_list(cpus: set[int] | frozenset[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))
