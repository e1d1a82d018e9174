"""The server's log as an operator sets it (pagedserve/logs.py), over real processes: `--log-format
json` makes every line of the server, its engine process and its tensor-parallel rank one JSON object,
a finished request's line with its fields; PAGEDSERVE_LOG_LEVEL=warning and
PAGEDSERVE_LOG_REQUESTS=false silence every process's info lines and the request lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grpc_helpers import ServerProcess, request

pytestmark = pytest.mark.slow


def serve(tiny_llama_dir: str, log: Path, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
    model = ["--model", tiny_llama_dir, "--dtype", "float32", "--num-kv-blocks", "128", "--enforce-eager"]
    return ServerProcess(*model, *flags, log=log, env=env).wait_ready()


def generate(proc: ServerProcess, request_id: str) -> int:
    return sum(len(r.token_ids) for r in proc.stub.Generate(request(request_id=request_id), timeout=60))


def test_json_lines_from_every_process(tiny_llama_dir: str, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = serve(tiny_llama_dir, log, "--log-format", "json", "--tensor-parallel-size", "2")
    try:
        assert generate(proc, "logged-1") == 8
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, log.read_text()[-3000:]
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]  # each one JSON
    assert {entry.get("process", "server") for entry in entries} == {"server", "engine", "rank 1"}
    (finished,) = [e for e in entries if e.get("request_id") == "logged-1"]
    assert finished["logger"] == "pagedserve.requests" and finished["level"] == "INFO"
    assert (finished["num_output_tokens"], finished["finish_reason"]) == (8, "length")
    assert finished["num_prompt_tokens"] > 0 and finished["e2e_s"] >= finished["ttft_s"] > 0


def test_warning_level_and_no_request_lines_from_the_environment(tiny_llama_dir: str, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    env = {"PAGEDSERVE_LOG_LEVEL": "warning", "PAGEDSERVE_LOG_REQUESTS": "false"}
    proc = serve(tiny_llama_dir, log, env=env)
    try:
        assert generate(proc, "quiet-1") == 8
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert " INFO " not in text and "quiet-1" not in text, text[-3000:]
