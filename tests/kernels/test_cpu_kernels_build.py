"""The CPU kernels' build: one file registers every op, and the build cache
(`pagedserve_kernels.cpu.load`) survives a loader killed inside it."""

from __future__ import annotations

import re
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


def test_one_file_registers_every_op_and_no_other_includes_torchs_library() -> None:
    """<torch/library.h> and <ATen/ATen.h> cost each file that includes them seconds of a first build
    (~2.6 s and ~4.6 s on 2 cores): cpu_kernels.cpp alone registers ops, each declared in ops.h and
    defined once; the other files include neither header."""
    import torch

    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"
    csrc = Path(cpu.__file__).parent / "csrc"
    sources = {path.name: path.read_text() for path in sorted(csrc.glob("*.[ch]*"))}
    heavy = re.compile(r"#include <(torch/library\.h|ATen/ATen\.h)>")
    assert [name for name, text in sources.items() if heavy.search(text)] == ["cpu_kernels.cpp"]
    assert [name for name, text in sources.items() if "TORCH_LIBRARY" in text] == ["cpu_kernels.cpp"]
    defined = re.findall(r'm\.def\(\s*"(\w+)\(', sources["cpu_kernels.cpp"])
    assert len(defined) == len(set(defined))
    declared = re.findall(r"^\S.*?\b(\w+)\(", sources["ops.h"], re.MULTILINE)
    assert set(declared) <= set(defined), set(declared) - set(defined)
    for op in defined:  # each registered and callable through torch.ops
        assert hasattr(torch.ops.pagedserve_cpu, op), op
