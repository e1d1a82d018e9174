"""`pagedserve serve` with `--tokenizer` and with a GGUF file as `--model`, the engine in a process of
its own (the default; the front end and the engine process each load the tokenizer): a model directory
without a tokenizer served with `--tokenizer`, and the embedded GGUF file served as `--model`, each
stream the default model's tokens over real gRPC; each bad path stops the server (and `pagedserve
generate`) with exit 2 and one line naming the flag, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_helpers import ServerProcess, request
from model_files import model_without_tokenizer, write_gguf
from pagedserve import LLM, SamplingParams
from pagedserve.default_model import default_gguf_path
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

ENGINE_PROCESS = "pagedserve.engine.core_process"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def expected(default_model_dir: str) -> tuple[list[int], str]:
    """The default model's greedy tokens and text, offline."""
    offline = LLM(model=default_model_dir, dtype="float32", num_kv_blocks=64)
    [out] = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return list(out.outputs[0].token_ids), out.outputs[0].text


def streamed(proc: ServerProcess) -> tuple[tuple[list[int], str], str]:
    """The greedy tokens and text of PROMPT over gRPC, and the served model's name."""
    try:
        proc.wait_ready()
        assert proc.processes_running(ENGINE_PROCESS)
        replies = list(proc.stub.Generate(request(PROMPT, max_tokens=16), timeout=120))
        name = proc.stub.ModelInfo(pb.ModelInfoRequest()).model_name
    finally:
        proc.stop()
    return ([t for r in replies for t in r.token_ids], "".join(r.text for r in replies)), name


def test_a_server_with_tokenizer_streams_the_plain_models_tokens(
    default_model_dir: str, expected: tuple[list[int], str], tmp_path: Path
) -> None:
    bare = model_without_tokenizer(default_model_dir, tmp_path / "bare")
    args = ("--model", bare, "--tokenizer", default_model_dir, "--dtype", "float32")
    got, name = streamed(ServerProcess(*args, log=tmp_path / "server.log"))
    assert got == expected and name == "bare"


def test_a_server_on_the_embedded_gguf_file_streams_the_default_models_tokens(
    gguf_cache_dir: str, expected: tuple[list[int], str], tmp_path: Path
) -> None:
    """The session converted it already: the server finds it in the cache, converting nothing."""
    args = ("--model", str(default_gguf_path()), "--dtype", "float32")
    env = {"PAGEDSERVE_CACHE_DIR": gguf_cache_dir}
    got, name = streamed(ServerProcess(*args, env=env, log=tmp_path / "server.log"))
    assert got == expected and name == "SmolLM2-135M-Instruct.Q4_1"
    assert "converting" not in (tmp_path / "server.log").read_text()


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
        (["--model", str(tmp_path / "no.gguf")], "--model: ", "no such file or directory"),
        (["--model", f"{bare}/config.json"], "--model: ", "is not a GGUF file"),
        (["--model", str(write_gguf(tmp_path / "gpt2.gguf", "gpt2", [0.0]))], "--model: ", "a 'gpt2' model"),
    ]
    for command, (args, flag, says) in [("serve", case) for case in cases] + [("generate", cases[1])]:
        prompt = ["--prompt", "Hello"] if command == "generate" else []
        result = run(tmp_path / "cache", command, *args, *prompt)
        assert result.returncode == 2, (command, args, result.stderr[-2000:])
        error = result.stderr.strip().splitlines()[-1]
        assert error.startswith(f"pagedserve {command}: error: {flag}") and says in error, error
        assert "Traceback" not in result.stderr, result.stderr
