"""`serve --uds PATH`: gRPC on a Unix domain socket (vLLM's --uds), for a client or proxy on the same
host. Every gRPC service answers there (our Generation, Triton's through tritonclient, the standard
health service); a stale socket is replaced, a path something else holds is refused before the model
loads, and the socket is gone once the server exits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import READINESS, request, wait_until
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short folder: pytest's tmp_path can be longer than a socket's path may be (107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="ps-uds-", dir="/tmp") as name:
        yield Path(name)


def serve(model_dir: str, uds: Path, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "pagedserve", "serve", "--model", model_dir, "--dtype", "float32"]
    command += ["--uds", str(uds), "--http-port", "-1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def serve_once(model_dir: str, uds: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pagedserve", "serve", "--model", model_dir, "--uds", str(uds)]
    command += ["--http-port", "-1"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def ready(channel: grpc.Channel) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=READINESS), timeout=1
        )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_ready(proc: subprocess.Popen[bytes], channel: grpc.Channel, log: Path) -> None:
    assert wait_until(lambda: proc.poll() is not None or ready(channel), 180), log.read_text()[-3000:]
    assert proc.poll() is None, log.read_text()[-3000:]


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a killed server leaves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
    assert path.is_socket()


@pytest.mark.parametrize("leftover", ["none", "stale socket"])
def test_every_grpc_service_answers_on_the_socket_and_it_goes_at_exit(
    tiny_llama_dir: str, folder: Path, leftover: str
) -> None:
    uds = folder / "pagedserve.sock"
    if leftover == "stale socket":
        stale_socket(uds)
    log = folder / "server.log"
    proc = serve(tiny_llama_dir, uds, log)
    try:
        with grpc.insecure_channel(f"unix:{uds}") as channel:
            wait_ready(proc, channel, log)
            stub = pb_grpc.GenerationStub(channel)
            complete = stub.Complete(request("Hello", max_tokens=5), timeout=60)
            streamed = list(stub.Generate(request("Hello", max_tokens=5), timeout=60))
            health = stub.Health(pb.HealthRequest(), timeout=10)
        assert len(complete.completions[0].token_ids) == 5
        assert [t for r in streamed for t in r.token_ids] == list(complete.completions[0].token_ids)
        assert health.num_running == 0
        with tgrpc.InferenceServerClient(f"unix:{uds}") as triton:  # tritonclient, unchanged
            assert triton.is_server_ready()
            text = tgrpc.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
            sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
            sampling.set_data_from_numpy(np.array([b'{"max_tokens": 3, "temperature": 0}'], dtype=object))
            result = triton.infer(proc_model_name(tiny_llama_dir), [text, sampling])
        assert result.as_numpy("text_output")[0]
        assert f"gRPC on unix:{uds}" in log.read_text()
        probe = [
            sys.executable,
            "-m",
            "pagedserve",
            "health",
            "--address",
            f"unix:{uds}",
            "--service",
            READINESS,
        ]
        checked = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=False)
        assert checked.returncode == 0, checked.stderr  # the exec probe README names for a socket
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-3000:]
    assert not uds.exists(), "the socket outlived its server"


def proc_model_name(model_dir: str) -> str:
    return Path(model_dir).name  # the served name defaults to the directory's


def test_a_socket_a_server_listens_on_exits_2_and_stays_that_servers(
    tiny_llama_dir: str, folder: Path
) -> None:
    """gRPC alone would unlink a live server's socket and bind its own: both servers then run, the first
    one unreachable for new clients, and its socket file goes when the second one exits."""
    uds = folder / "taken.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(uds))
        other.listen()
        inode = uds.stat().st_ino
        done = serve_once(tiny_llama_dir, uds)
        assert uds.is_socket() and uds.stat().st_ino == inode  # still the other server's
    assert done.returncode == 2, done.stderr[-3000:]
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line == f"pagedserve serve: error: --uds: {uds}: a server already listens on it", last_line
    assert "loading the model" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("what", ["a file", "no folder"])
def test_a_path_that_cannot_be_a_socket_exits_2_naming_the_flag(
    tiny_llama_dir: str, folder: Path, what: str
) -> None:
    if what == "a file":
        uds = folder / "notes.txt"
        uds.write_text("keep me")
        expected = f"{uds} exists and is not a socket"
    else:
        uds = folder / "missing" / "pagedserve.sock"
        expected = f"{uds}: no directory {uds.parent}"
    done = serve_once(tiny_llama_dir, uds)
    assert done.returncode == 2, done.stderr[-3000:]
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line == f"pagedserve serve: error: --uds: {expected}", last_line
    assert "Traceback" not in done.stderr and "loading the model" not in done.stderr, done.stderr[-3000:]
    if what == "a file":
        assert uds.read_text() == "keep me"
