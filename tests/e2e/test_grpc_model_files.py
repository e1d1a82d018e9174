"""`pagedserve serve` with `--tokenizer`: a model directory without a tokenizer served with
`--tokenizer` (the front end and the engine process each load it) streams the plain model's tokens
over real gRPC; each bad path stops the server (and `pagedserve generate`) with exit 2 and one line
naming the flag, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_helpers import ServerProcess, request
from model_files import model_without_tokenizer
from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE_PROCESS = "pagedserve.engine.core_process"


def test_a_server_with_tokenizer_streams_the_plain_models_tokens(
    default_model_dir: str, tmp_path: Path
) -> None:
    prompt = "The capital of France is"
    offline = LLM(model=default_model_dir, dtype="float32", num_kv_blocks=64)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    del offline
    bare = model_without_tokenizer(default_model_dir, tmp_path / "bare")
    proc = ServerProcess(
        "--model", bare, "--tokenizer", default_model_dir, "--dtype", "float32", log=tmp_path / "server.log"
    )
    try:
        proc.wait_ready()
        assert proc.processes_running(ENGINE_PROCESS)  # the default: the engine in a process of its own
        replies = list(proc.stub.Generate(request(prompt, max_tokens=16), timeout=120))
    finally:
        proc.stop()
    assert [t for r in replies for t in r.token_ids] == list(expected.outputs[0].token_ids)
    assert "".join(r.text for r in replies) == expected.outputs[0].text


def run(cache: Path, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`pagedserve serve` (on free ports) or `generate`, expected to exit on its own, long before the
    timeout (any model it converted would go to `cache`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDSERVE_CACHE_DIR": str(cache)}
    address = ["--host", "127.0.0.1", "--port", "0", "--http-port", "0"] if command == "serve" else []
    return subprocess.run(
        [sys.executable, "-m", "pagedserve", command, *address, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_bad_model_files_stop_the_command_naming_the_flag(default_model_dir: str, tmp_path: Path) -> None:
    bare = model_without_tokenizer(default_model_dir, tmp_path / "bare")
    (tmp_path / "empty").mkdir()
    cases = [
        (["--tokenizer", str(tmp_path / "empty")], "--tokenizer: ", "holds no tokenizer"),
        (["--model", bare], "--tokenizer / PAGEDSERVE_TOKENIZER: ", "holds no tokenizer (none of"),
    ]
    for command, (args, flag, says) in [("serve", case) for case in cases] + [("generate", cases[1])]:
        prompt = ["--prompt", "Hello"] if command == "generate" else []
        result = run(tmp_path / "cache", command, *args, *prompt)
        assert result.returncode == 2, (command, args, result.stderr[-2000:])
        error = result.stderr.strip().splitlines()[-1]
        assert error.startswith(f"pagedserve {command}: error: {flag}") and says in error, error
        assert "Traceback" not in result.stderr, result.stderr
