"""The default model over gRPC: streamed deltas equal offline LLM.generate, and README.md's own serve
command and example client work as written."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import READINESS, ServerProcess, free_port, wait_until
from pagedserve import LLM, SamplingParams
from pagedserve.rpc.v1 import generate_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PORTS = {"PAGEDSERVE_PORT": 8001, "PAGEDSERVE_HTTP_PORT": 8000}  # README: gRPC 8001, HTTP 8000


@pytest.mark.slow
def test_streamed_deltas_equal_offline_generate(default_model_dir: str, tmp_path: Path) -> None:
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    offline = LLM(dtype="float32").chat(question, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    proc = ServerProcess("--dtype", "float32", log=tmp_path / "server.log").wait_ready()
    try:
        messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question[0]["content"])])
        req = pb.GenerateRequest(
            messages=messages, sampling=pb.SamplingParameters(temperature=0, max_tokens=40)
        )
        responses = list(proc.stub.Generate(req, timeout=120))
    finally:
        proc.stop()
    assert "".join(r.text for r in responses) == offline.text
    assert [t for r in responses for t in r.token_ids] == offline.token_ids
    assert "Paris" in offline.text and len(responses) > 1  # streamed in pieces


def readme_commands() -> tuple[list[str], list[str]]:
    """The serve command of README.md's first bash block (what follows the install step) and its
    example client call, both as written there."""
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip()
    serve = first_block.split("&&")[-1].strip()
    client = re.search(r"^python examples/stream_client\.py .*$", readme, re.M).group(0)
    return shlex.split(serve), shlex.split(client)


def is_port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def readiness(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=READINESS), timeout=1
            )
        except grpc.RpcError:
            return None
    return int(reply.status)


@pytest.mark.slow
def test_readme_serve_command_and_example_client_work_as_written(tmp_path: Path) -> None:
    serve, client = readme_commands()
    assert serve[:2] == ["pagedserve", "serve"] and client[:2] == ["python", "examples/stream_client.py"]
    executable = shutil.which("pagedserve") or shutil.which(
        "pagedserve", path=str(Path(sys.executable).parent)
    )
    assert executable, "`pagedserve` is not on PATH: the install step puts it there"
    # The README's default ports, unless something else on this machine holds them: then free ones
    # through the documented PAGEDSERVE_* variables, and the client's --address.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # As a user runs it: the compiled pass (tests/conftest.py sets PAGEDSERVE_ENFORCE_EAGER for the suite).
    env.pop("PAGEDSERVE_ENFORCE_EAGER", None)
    ports = {name: port if is_port_free(port) else free_port() for name, port in DEFAULT_PORTS.items()}
    env.update({name: str(port) for name, port in ports.items() if port != DEFAULT_PORTS[name]})
    if ports["PAGEDSERVE_PORT"] != DEFAULT_PORTS["PAGEDSERVE_PORT"]:
        client += ["--address", f"localhost:{ports['PAGEDSERVE_PORT']}"]
    log = tmp_path / "server.log"
    server = subprocess.Popen(
        [executable, *serve[1:]], cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    try:
        address = f"localhost:{ports['PAGEDSERVE_PORT']}"
        ready = wait_until(
            lambda: server.poll() is not None or readiness(address) == health_pb2.HealthCheckResponse.SERVING,
            timeout=300,
            interval=0.2,
        )
        assert ready and server.poll() is None, log.read_text()[-3000:]
        assert "pagedserve ready" in log.read_text()  # what the README tells the user to wait for
        # `python` is this interpreter: the one the install step installed pagedserve into.
        answer = subprocess.run(
            [sys.executable, *client[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert answer.returncode == 0, answer.stderr
        assert "Tokyo" in answer.stdout, answer.stdout
        server.terminate()
        assert server.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
