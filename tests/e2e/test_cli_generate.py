"""The README's first command: `pagedserve generate` answers on the embedded default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_generate_answers_the_capital_of_france(default_model_dir: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve", "generate", "--prompt", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "KV cache:" in result.stderr  # the startup log states the cache size


def test_generate_rejects_a_bad_parameter_by_name() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve", "generate", "--prompt", "hi", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "temperature" in result.stderr
