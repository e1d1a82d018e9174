"""The gRPC server with --tensor-parallel-size 2: streams correctly, reports the tensor-parallel size
and per-rank KV capacity in ModelInfo and its startup log and rank 1's process in /metrics, and a
killed worker rank turns health NOT_SERVING, fails the in-flight request with an error naming the
rank and the cause, and ends the process non-zero."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_helpers import ServerProcess, request
from pagedserve import LLM, SamplingParams
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

KV_BUDGET = "1MiB"  # per rank


def start(tiny_llama_dir: str, tmp_path: Path) -> ServerProcess:
    return ServerProcess(
        "--model",
        tiny_llama_dir,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        KV_BUDGET,
        "--tensor-parallel-size",
        "2",
        log=tmp_path / "server.log",
    ).wait_ready()


def test_tensor_parallel_server_streams_the_single_rank_output(tiny_llama_dir: str, tmp_path: Path) -> None:
    proc = start(tiny_llama_dir, tmp_path)
    try:
        ids = [
            t
            for r in proc.stub.Generate(request("Once upon a time", max_tokens=16), timeout=60)
            for t in r.token_ids
        ]
        prompt = proc.stub.Tokenize(pb.TokenizeRequest(text="Once upon a time")).token_ids
        info = proc.stub.ModelInfo(pb.ModelInfoRequest())
        # rank 1's own process in /metrics (a child of the engine process, not of the server)
        (rank_1,) = proc.rank_processes()
        started = proc.metric("pagedserve_rank_process_start_time_seconds", rank="1")
        assert started == pytest.approx(rank_1.create_time(), abs=1)
        assert proc.metric("pagedserve_rank_process_resident_memory_bytes", rank="1") > 0
    finally:
        proc.stop()
    single = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory=KV_BUDGET)
    expected = single.generate([list(prompt)], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert ids == expected[0].outputs[0].token_ids

    # Each rank holds 1 of the 2 KV heads, so a block costs half as much and the same per-rank
    # budget holds twice the single-rank blocks.
    assert single.engine.executor.worker.num_kv_heads == 2  # type: ignore[attr-defined]
    num_blocks = 2 * single.engine.executor.num_kv_blocks
    block_size = single.engine.config.cache.block_size
    assert (info.tensor_parallel_size, info.num_kv_blocks, info.block_size) == (2, num_blocks, block_size)
    assert info.kv_capacity_tokens == num_blocks * block_size
    capacity = (
        rf"KV cache: {num_blocks} blocks of {block_size} tokens per rank \([\d.]+ GiB, "
        rf"{num_blocks * block_size} tokens, 1 KV heads, float32\); tensor-parallel size 2;"
    )
    assert re.search(capacity, (tmp_path / "server.log").read_text())


def test_killed_worker_fails_the_request_and_the_server_exits_non_zero(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    proc = start(tiny_llama_dir, tmp_path)
    try:
        workers = proc.rank_processes()
        assert workers, "the server should have started a rank-1 worker process"
        call = proc.stub.Generate(request(max_tokens=900), timeout=60)
        next(call)
        started = time.monotonic()
        os.kill(workers[0].pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        cause = rf"engine failed: .*rank 1 \(pid {workers[0].pid}\) was killed by SIGKILL"
        assert re.search(cause, info.value.details()), info.value.details()
        statuses = set()
        while proc.proc.poll() is None and time.monotonic() - started < 30:
            status = proc.readiness()
            if status is not None:
                statuses.add(status)
            try:
                live = proc.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                statuses.add(("live", live))
            except grpc.RpcError:
                pass
            time.sleep(0.02)
        assert proc.proc.wait(timeout=30) == 1
        assert time.monotonic() - started < 30
        assert ("live", health_pb2.HealthCheckResponse.NOT_SERVING) in statuses
    finally:
        proc.stop()
