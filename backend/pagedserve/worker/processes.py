"""The processes a pagedserve process starts (tensor-parallel ranks, the engine process): the error a
failed start raises, how one exited, and stopping them. It imports no torch: the front end of an
engine process, which starts without torch, stops its engine process with it."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# Every rank this process started, for stop_spawned_ranks(); once that has run, no more start.
_spawned: list[subprocess.Popen[bytes]] = []
# (reentrant: an engine process stops its ranks from a SIGTERM handler, which may run on the thread
# that holds it while it spawns them)
_spawn_lock = threading.RLock()
_spawning_stopped = False


class StartupError(RuntimeError):
    """Start-up failed: a tensor-parallel rank or the engine process exited, or a rank never started
    (its own error is in the log)."""


@contextlib.contextmanager
def spawning() -> Iterator[list[subprocess.Popen[bytes]]]:
    """While ranks start: the list to append each one started to, for stop_spawned_ranks. StartupError
    once that has run (this process is exiting)."""
    with _spawn_lock:
        if _spawning_stopped:
            raise StartupError("tensor-parallel start-up failed: this process is exiting")
        _spawned[:] = [proc for proc in _spawned if proc.poll() is None]
        yield _spawned


def stop_spawned_ranks() -> None:
    """Stop every rank this process started, and start no more: for a process that exits while an
    engine is still starting in another thread (nothing can interrupt it), whose ranks would
    otherwise outlive it."""
    global _spawning_stopped
    with _spawn_lock:
        _spawning_stopped = True
        procs = list(_spawned)
    stop_processes(procs, 0.0)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Wait up to `grace_s` for the processes to exit, then terminate, then kill."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            logger.warning("process %d did not stop within 5 s of SIGTERM: killed", proc.pid)
            proc.kill()
            proc.wait()
