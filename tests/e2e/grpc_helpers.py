"""A real `pagedserve serve` process on loopback, for the end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc

READINESS = "pagedserve.rpc.v1.Generation"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    def __init__(self, *args: str, log: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log = log
        command = [
            sys.executable,
            "-m",
            "pagedserve",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            *args,
        ]
        self.proc = subprocess.Popen(
            command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def readiness(self) -> int | None:
        """The readiness status, or None while the port does not answer yet."""
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service=READINESS), timeout=1)
        except grpc.RpcError:
            return None
        return int(reply.status)

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if self.readiness() == health_pb2.HealthCheckResponse.SERVING:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"server not ready:\n{self.log.read_text()[-3000:]}")

    def engine_idle(self, timeout: float = 10.0) -> bool:
        """True once no request runs or waits and no KV block is in use (our Health RPC's counters)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.stub.Health(pb.HealthRequest())
            if h.num_running == 0 and h.num_waiting == 0 and h.kv_cache_usage == 0.0:
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def request(
    text: str = "", max_tokens: int = 8, request_id: str = "", **sampling: object
) -> pb.GenerateRequest:
    params = pb.SamplingParameters(
        max_tokens=max_tokens, **{"temperature": 0.0, "ignore_eos": True, **sampling}
    )
    return pb.GenerateRequest(request_id=request_id, text=text or "Hello", sampling=params)
