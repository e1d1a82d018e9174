"""A real `pagedserve serve` process on loopback, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families

READINESS = "pagedserve.rpc.v1.Generation"

# A tiny-model request this long cannot finish on its own within any check below: measured on the
# 2-core CPU machine, 16000 greedy tokens streamed in 52 s (2.5 ms per token at first, slower as the
# context grows), so a stream that ends, or an engine that goes idle, within seconds was cut short.
LONG_CONTEXT = 16384
LONG_MAX_TOKENS = 16000
LONG_NUM_KV_BLOCKS = 1280  # 20480 tokens of 16: room for one LONG_MAX_TOKENS request and then some
# An aborted request frees its blocks before the next engine step (milliseconds); this bound leaves
# room for a busy machine and is still a small fraction of a LONG_MAX_TOKENS request's run time.
IDLE_AFTER_ABORT_S = 3.0


def long_context_copy(model_dir: str, dest: Path, max_position_embeddings: int = LONG_CONTEXT) -> str:
    """The same weights with a longer context (rotary tables are computed, not stored), so one
    request can outlive any test's patience."""
    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    config = json.loads((dest / "config.json").read_text())
    config["max_position_embeddings"] = max_position_embeddings
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return str(dest)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


RANK_MODULE = "pagedserve.worker.spawned_rank"  # what a tensor-parallel rank > 0 runs


class ServerProcess:
    """`pagedserve serve` on free loopback ports. `address_from_env` passes host and ports as
    PAGEDSERVE_* variables instead of flags (as a Kubernetes pod spec would); `env` adds variables."""

    def __init__(
        self, *args: str, log: Path, env: dict[str, str] | None = None, address_from_env: bool = False
    ) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log = log
        address = {"host": "127.0.0.1", "port": str(self.port), "http_port": str(self.http_port)}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        if address_from_env:
            env.update({f"PAGEDSERVE_{name.upper()}": value for name, value in address.items()})
            address_flags = []
        else:
            address_flags = [
                arg for name, value in address.items() for arg in (f"--{name.replace('_', '-')}", value)
            ]
        command = [sys.executable, "-m", "pagedserve", "serve", *address_flags, *args]
        self.proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def processes_running(self, module: str) -> list[psutil.Process]:
        """Its descendant processes that run `module` (`python -m module ...`)."""
        found = []
        for process in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if module in process.cmdline():
                    found.append(process)
            except psutil.NoSuchProcess:  # a short-lived helper process, already gone
                pass
        return found

    def rank_processes(self) -> list[psutil.Process]:
        """The tensor-parallel ranks it started (rank 1 on): children of its engine process (the
        default) or of the server itself (--no-engine-process)."""
        return self.processes_running(RANK_MODULE)

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
        return wait_until(self._is_idle, timeout)

    def _is_idle(self) -> bool:
        h = self.stub.Health(pb.HealthRequest())
        return h.num_running == 0 and h.num_waiting == 0 and h.kv_cache_usage == 0.0

    def metric(self, name: str, **labels: str) -> float:
        """A sample of /metrics (0 when absent: a labelled counter appears on its first increment)."""
        return metric_sample(self.http_port, name, **labels)

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def metric_sample(http_port: int, name: str, **labels: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def request(
    text: str = "", max_tokens: int = 8, request_id: str = "", **sampling: object
) -> pb.GenerateRequest:
    params = pb.SamplingParameters(
        max_tokens=max_tokens, **{"temperature": 0.0, "ignore_eos": True, **sampling}
    )
    return pb.GenerateRequest(request_id=request_id, text=text or "Hello", sampling=params)
