"""bench/logprobs.py on a tiny model: rounds alternate the sampler's logprob kernel and torch's path in
ABBA order on one engine, and the ratio printed is that of the rounds' medians."""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "logprobs.py"


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernels"
)
def test_rounds_alternate_the_kernel_and_torch_s_path_and_report_the_medians(tiny_llama_dir: str) -> None:
    command = [
        sys.executable,
        str(BENCH),
        *("--model", tiny_llama_dir, "--num-requests", "4", "--rounds", "1", "--logprobs", "3"),
        *("--prompt-logprobs", "1", "--temperature", "0.7"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rounds = re.findall(
        r"^round, (torch|kernel): 240 output tokens in [\d.]+ s \(([\d.]+) tok/s\)$", done.stdout, re.M
    )
    assert [name for name, _ in rounds] == ["torch", "kernel", "kernel", "torch"]
    medians = {
        side: statistics.median(float(rate) for name, rate in rounds if name == side)
        for side in ("torch", "kernel")
    }
    line = re.search(
        r"torch's path ([\d.]+), the kernel ([\d.]+): kernel / torch ([\d.]+)$", done.stdout, re.M
    )
    assert line is not None, done.stdout
    assert float(line[1]) == pytest.approx(medians["torch"], abs=0.06)
    assert float(line[2]) == pytest.approx(medians["kernel"], abs=0.06)
    assert float(line[3]) == pytest.approx(medians["kernel"] / medians["torch"], abs=2e-3)
    assert re.search(
        r"^one sampler call, 64 rows of \d+ tokens asking for 3 logprobs: torch's path", done.stdout, re.M
    )
