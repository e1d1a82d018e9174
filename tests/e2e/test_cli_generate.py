"""The README's first command: `pagedserve generate` answers on the embedded default model; bad input
and failed requests get one line naming what is wrong, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def _generate(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedserve", "generate", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.slow
def test_generate_prints_json_matching_the_schema_from_a_file(default_model_dir: str, tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    result = _generate(
        "--prompt", "What is the capital of France? Answer in JSON.",
        "--json-schema", f"@{tmp_path / 'schema.json'}",
        "--max-tokens", "64",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert isinstance(answer, dict) and list(answer) == ["capital"], answer
    assert isinstance(answer["capital"], str), answer


def test_generate_prints_n_labelled_choices_cut_at_a_stop_string(tiny_llama_dir: str) -> None:
    """A random-weight model still answers one of the choices (the grammar allows nothing else), here
    cut before the stop string ","; each of the --n completions under its own label."""
    result = _generate(
        "--model", tiny_llama_dir, "--enforce-eager", "--no-chat", "--prompt", "hi",
        "--choice", "yes, sure", "--choice", "no, never", "--stop", ",",
        "--n", "2", "--temperature", "1", "--sampling-seed", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0::2] == ["### completion 1", "### completion 2"], result.stdout
    assert len(lines) == 4 and set(lines[1::2]) <= {"yes", "no"}, result.stdout


def test_generate_refuses_a_schema_the_compiler_rejects_naming_the_flag(tiny_llama_dir: str) -> None:
    """Before the model loads (the tokenizer alone compiles it): no KV cache is sized."""
    result = _generate(
        "--model", tiny_llama_dir, "--enforce-eager", "--no-chat", "--prompt", "hi",
        "--json-schema", '{"type": "nope"}',
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("pagedserve generate: error: --json-schema: does not compile: "), error
    assert "nope" in error
    assert "KV cache:" not in result.stderr, result.stderr


def test_generate_refuses_a_malformed_structural_tag_naming_the_flag(tiny_llama_dir: str) -> None:
    """JSON, so taken before the model loads; its shape is checked as the request is admitted."""
    result = _generate(
        "--model", tiny_llama_dir, "--enforce-eager", "--no-chat", "--prompt", "hi",
        "--structural-tag", '{"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {}}]}',
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith('pagedserve generate: error: --structural-tag: structures[0]: needs "end"'), error


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--json-schema", "{not json"], "--json-schema: not JSON: "),
        (["--json-schema", "@/nonexistent/schema.json"], "--json-schema: cannot read "),
        (["--regex", "a+", "--choice", "b"], "--choice: cannot be combined with --regex "),
        (["--structural-tag", "{not json"], "--structural-tag: not JSON: "),
        (["--structural-tag", "@/nonexistent/tag.json"], "--structural-tag: cannot read "),
        (["--regex", "a+", "--structural-tag", "{}"], "--structural-tag: cannot be combined with --regex "),
        (["--min-tokens", "-1"], "--min-tokens: must be an integer in [0, max_tokens]"),
        (["--n", "0"], "--n: must be an integer >= 1"),
        (["--stop", ""], "--stop: must be non-empty strings"),
    ],
)
def test_generate_rejects_a_bad_sampling_or_output_flag_by_name(flags: list[str], error: str) -> None:
    """Before the model loads: one line naming the flag."""
    result = _generate("--prompt", "hi", *flags)
    assert result.returncode == 2, result.stderr
    assert "KV cache:" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pagedserve generate: error: {error}"), line
