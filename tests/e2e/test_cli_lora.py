"""`pagedserve generate --lora-modules ... --lora-name NAME` (a real subprocess, tiny model, float32):
the completion is the adapter's, as the offline LLM makes it through that adapter; an adapter not
among --lora-modules stops the command with exit 2 naming --lora-name, before the model loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from lora_serving import build_adapters, lora_modules, offline

pytestmark = pytest.mark.slow

PROMPT = "Name a color."
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_adapters(tmp_path_factory.mktemp("lora"), tiny_llama_dir)


def generate(model_dir: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve",
            "generate",
            "--model",
            model_dir,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--num-kv-blocks",
            "64",
            "--no-chat",
            "--max-tokens",
            str(MAX_TOKENS),
            "--prompt",
            PROMPT,
            *flags,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def test_generate_prints_the_adapters_completion(tiny_llama_dir: str, adapters: dict[str, str]) -> None:
    cases = [(PROMPT, "sql"), (PROMPT, None)]
    sql, base = offline(tiny_llama_dir, adapters, cases, MAX_TOKENS, ignore_eos=False)  # as the CLI runs
    assert sql.text.strip() != base.text.strip()
    result = generate(tiny_llama_dir, "--lora-modules", lora_modules(adapters), "--lora-name", "sql")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == sql.text.strip()


@pytest.mark.parametrize(
    ("modules", "why"), [(True, "--lora-modules has: sql, chat"), (False, "no --lora-modules given")]
)
def test_an_unknown_lora_name_exits_2_naming_the_flag(
    tiny_llama_dir: str, adapters: dict[str, str], modules: bool, why: str
) -> None:
    flags = ["--lora-modules", lora_modules(adapters)] if modules else []
    result = generate(tiny_llama_dir, *flags, "--lora-name", "nope")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error == f"pagedserve generate: error: --lora-name: unknown adapter 'nope' ({why})", error
