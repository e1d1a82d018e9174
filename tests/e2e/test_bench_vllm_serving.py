"""bench/vllm_serving.py, the serving bar measured on vLLM: its options are checked before anything
starts, and, where an environment with vLLM is named (PAGEDSERVE_BENCH_VLLM_PYTHON), a short run
streams every forced token through vLLM's server and compares it with vLLM's offline engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vllm_serving.py"
VLLM_PYTHON = os.environ.get("PAGEDSERVE_BENCH_VLLM_PYTHON")

pytestmark = pytest.mark.slow


def run(*extra: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *extra], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "the following arguments are required: --vllm-python"),
        (["--vllm-python", "/nonexistent/python"], "--vllm-python: no executable at '/nonexistent/python'"),
        (["--vllm-python", sys.executable, "--rounds", "0"], "--rounds: at least 1, got 0"),
        (["--vllm-python", sys.executable, "--vllm-env", "X"], "--vllm-env: KEY=VALUE, got 'X'"),
        (
            ["--vllm-python", sys.executable, "--vllm-arg", "a=b"],
            "--vllm-arg: the value of 'a=b' is not JSON",
        ),
    ],
)
def test_bad_options_are_refused_before_anything_starts(extra: list[str], message: str) -> None:
    done = run(*extra)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "spawning" not in done.stdout


@pytest.mark.skipif(
    not VLLM_PYTHON,
    reason="PAGEDSERVE_BENCH_VLLM_PYTHON names no Python with vLLM (bench/README.md: the vllm peer)",
)
def test_vllm_s_server_streams_every_forced_token_and_is_compared_with_its_offline_engine(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.json"
    done = run(
        "--vllm-python",
        str(VLLM_PYTHON),
        "--num-requests",
        "8",
        "--rounds",
        "2",
        "--json-out",
        str(out),
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["num_completed"] == 8 and summary["num_failed_all_rounds"] == 0
    assert summary["num_output_tokens"] == 2 * (16 + 32 + 64 + 128)  # every token, counted by id
    assert len(summary["rounds_output_tokens_per_s"]) == len(summary["offline_rounds_tokens_per_s"]) == 2
    share = summary["output_tokens_per_s"] / summary["offline_tokens_per_s"]
    assert summary["share_of_offline"] == pytest.approx(share)
    assert f"= {100 * share:.1f}%" in done.stdout
    # the offline engine's CPU while the server's rounds ran, so a reader sees what it took from them
    assert done.stdout.count(" CPU-s while idle before this round)") == 2
