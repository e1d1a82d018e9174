"""bench/kernel_speed.py under Triton's interpreter: every kernel gets its row, timed against the
torch reference (and attention against SDPA). And no bench script shadows a package: `python
bench/X.py` puts bench/ first on the path, where bench/kernels.py stood in for the `kernels` package
that transformers imports, and every bench script that loaded a Hugging Face model failed."""

from __future__ import annotations

import importlib.machinery
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
KERNELS = (
    "decode",
    "prefill",
    "write_kv_cache",
    "copy_blocks",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
)


@pytest.mark.slow
def test_the_interpreter_run_times_every_kernel_against_its_references() -> None:
    command = [sys.executable, str(BENCH / "kernel_speed.py"), "--interpret"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(
        r"^\| (\w+) \| [^|]+ \| [\d.]+ \| [^|]+ \| (torch ref [\d.e+-]+x.*) \|$", done.stdout, re.M
    )
    assert {kernel for kernel, _ in rows} == set(KERNELS), done.stdout
    assert all("sdpa dense" in ratios for kernel, ratios in rows if kernel in ("decode", "prefill")), rows


def test_no_bench_script_shadows_an_installed_package() -> None:
    """Checked against every package installed here, transformers' optional ones among them."""
    bench = os.path.abspath(BENCH)
    path = [p for p in sys.path if os.path.abspath(p or ".") != bench]
    names = sorted(script.stem for script in BENCH.glob("*.py"))
    shadowed = [name for name in names if importlib.machinery.PathFinder.find_spec(name, path) is not None]
    assert names and not shadowed, shadowed
