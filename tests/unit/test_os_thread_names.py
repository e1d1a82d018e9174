"""The server's threads carry their Python names in the operating system (Linux), where `top -H`,
perf and bench/serving.py's --engine-cores find the engine's torch thread and the threads it starts."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pagedserve.threads import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names read from /proc")


def os_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_pool_thread_and_the_threads_it_starts_carry_its_name() -> None:
    def names() -> tuple[str, str]:
        started: list[str] = []  # a thread started by the pool's, as libgomp starts its workers
        worker = threading.Thread(target=lambda: started.append(os_name(threading.get_native_id())))
        worker.start()
        worker.join()
        return os_name(threading.get_native_id()), started[0]

    with ThreadPoolExecutor(1, "pagedserve-torch", name_os_thread) as pool:
        own, child = pool.submit(names).result()
    assert own == "pagedserve-torc"  # "pagedserve-torch_0", cut to Linux's 15 bytes
    assert child == "pagedserve-torc"


def test_the_engines_pools_are_named() -> None:
    from pagedserve.engine import async_engine

    thread_id = async_engine._TORCH_THREAD.submit(threading.get_native_id).result()
    assert os_name(thread_id) == "pagedserve-torc"
