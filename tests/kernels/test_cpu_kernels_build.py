"""The CPU kernels' build cache (`pagedserve_kernels.cpu.load`) survives a loader killed inside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagedserve_kernels import cpu


def test_a_lock_file_a_killed_loader_left_does_not_hold_up_the_next_load() -> None:
    """torch's builder leaves its `lock` file behind when its process is killed mid-load (a rank
    stopped while its engine failed to start): the next process to load the kernels removes it and
    loads them, where it would wait on it forever."""
    from torch.utils import cpp_extension

    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"
    name = f"pagedserve_cpu_{cpu._machine_tag()}"
    lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    lock.touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from pagedserve_kernels import cpu; print(cpu.load())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.stdout.strip() == "True", loaded.stderr[-2000:]
    assert not lock.exists()
