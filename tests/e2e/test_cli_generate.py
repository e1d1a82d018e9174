"""The README's first command: `pagedserve generate` answers on the embedded default model; bad input
and failed requests get one line naming what is wrong, never a traceback."""

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


def test_generate_refuses_a_prompt_too_long_for_the_context_in_one_line(tiny_llama_dir: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve",
            "generate",
            "--model",
            tiny_llama_dir,
            "--enforce-eager",
            "--max-model-len",
            "32",
            "--no-chat",
            "--prompt",
            "word " * 100,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("pagedserve generate: error: --prompt: "), error
    assert "leave no room to generate within the context length 32 (prompts[0])" in error
