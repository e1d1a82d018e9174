"""The server's lifecycle and observability at their edges: settings an operator gets wrong stop
`pagedserve serve` with exit code 2 and the flag named (no traceback, nothing left bound); a second
SIGTERM ends the drain at once (an engine failure's spans: test_observability_audit.py); `/metrics`
counts neither the warm-up nor deep health checks as requests, and counts every completion of an
n > 1 request in `vllm:request_generation_tokens`; a server stopped in a process that goes on frees its
engine."""

from __future__ import annotations

import gc
import signal
import socket
import subprocess
import sys
import weakref
from concurrent import futures
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2
from grpc_helpers import (
    LONG_MAX_TOKENS,
    LONG_NUM_KV_BLOCKS,
    ServerProcess,
    long_context_copy,
    request,
    wait_until,
)
from inprocess_server import InProcessServer, post_generate, scrape
from pagedserve.__main__ import build_parser
from pagedserve.rpc.cli import ServeSettings
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.settings import SettingsError, settings_from_args

MODEL = "tiny"

# -- settings: a bad value names its flag, before anything is bound or loaded ------------------------

BAD_SETTINGS = [
    (["--port", "99999"], "--port"),  # gRPC would silently serve on 99999 % 65536
    (["--http-port", "70000"], "--http-port"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
    (["--swap-space", "nan"], "--swap-space"),
    (["--swap-space", "inf"], "--swap-space"),
    (["--kv-cache-memory", "1e999"], "--kv-cache-memory"),
    (["--device", "gpu"], "--device"),
    (["--device", "cuda:99"], "--device"),
]


@pytest.mark.parametrize(("flags", "named"), BAD_SETTINGS, ids=[" ".join(f) for f, _ in BAD_SETTINGS])
def test_a_bad_serve_setting_is_a_settings_error_naming_the_flag(flags: list[str], named: str) -> None:
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(SettingsError) as info:
        settings_from_args(ServeSettings, args)
    assert str(info.value).startswith(f"{named}: "), str(info.value)


def serve_once(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["port", "http-port"])
def test_a_port_in_use_exits_2_naming_the_flag(tiny_llama_dir: str, which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        ports = {"port": "0", "http-port": "0", which: port}
        done = serve_once(
            "--model", tiny_llama_dir, "--port", ports["port"], "--http-port", ports["http-port"]
        )
    assert done.returncode == 2, done.stderr[-3000:]
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pagedserve serve: error: ") and f"--{which}" in last_line, last_line
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_grpc_port_another_grpc_server_serves_exits_2_naming_the_flag(tiny_llama_dir: str) -> None:
    """A gRPC server binds with SO_REUSEPORT unless told not to: a second pagedserve on a port a first
    one serves (or any gRPC server holds) bound it beside the first, loaded its model and took half
    of the new connections, where README.md promises exit 2 for a port in use."""
    import grpc

    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # grpc's defaults: SO_REUSEPORT on
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        done = serve_once("--model", tiny_llama_dir, "--port", str(port), "--http-port", "0")
    finally:
        other.stop(None)
    assert done.returncode == 2, done.stderr[-3000:]
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pagedserve serve: error: ") and "--port" in last_line, last_line
    assert "loading the model" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_an_unknown_traces_exporter_exits_2_naming_the_flag(tiny_llama_dir: str) -> None:
    done = serve_once(
        "--model", tiny_llama_dir, "--port", "0", "--http-port", "-1", "--traces-exporter", "zipkin"
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--traces-exporter" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_context_too_short_for_any_request_exits_2_naming_the_flag(tiny_llama_dir: str) -> None:
    """Found only once the model is loaded: the warm-up (2 tokens in, 1 out) can never run."""
    done = serve_once("--model", tiny_llama_dir, "--port", "0", "--http-port", "-1", "--max-model-len", "2")
    assert done.returncode == 2, done.stderr[-3000:]
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pagedserve serve: error: --max-model-len, "), last_line
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


# -- drain: a second signal ends the grace period ---------------------------------------------------


@pytest.mark.slow
def test_a_second_sigterm_aborts_the_in_flight_streams_at_once(tiny_llama_dir: str, tmp_path: Path) -> None:
    """The grace period is far longer than the request: only the second signal can end it early."""
    model = long_context_copy(tiny_llama_dir, tmp_path / "long")
    flags = ["--model", model, "--dtype", "float32", "--block-size", "16"]
    flags += ["--num-kv-blocks", str(LONG_NUM_KV_BLOCKS), "--shutdown-timeout", "600"]
    proc = ServerProcess(*flags, log=tmp_path / "server.log").wait_ready()
    try:
        call = proc.stub.Generate(request(max_tokens=LONG_MAX_TOKENS), timeout=300)
        num_tokens = len(next(call).token_ids)
        proc.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: proc.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING, 30)
        proc.proc.send_signal(signal.SIGTERM)
        rest = list(call)
        num_tokens += sum(len(r.token_ids) for r in rest)
        assert rest[-1].finish_reason == pb.ABORTED and rest[-1].error, rest[-1]
        assert num_tokens < LONG_MAX_TOKENS
        assert proc.proc.wait(timeout=60) == 0, proc.log.read_text()[-2000:]
    finally:
        proc.stop()


# -- metrics: what clients asked for, all of it, nothing else ---------------------------------------


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(value for (n, _), value in samples.items() if n == name)


REQUEST_SERIES = (
    "vllm:request_success_total",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
    "vllm:generation_tokens_total",
)


@pytest.fixture()
def metered(tiny_llama_dir: str) -> InProcessServer:
    srv = InProcessServer(
        tiny_llama_dir, None, dtype="float32", served_model_name=MODEL, num_kv_blocks=64
    ).start()
    yield srv
    srv.stop()


@pytest.mark.slow
def test_warm_up_and_deep_health_checks_are_not_counted_as_requests(metered: InProcessServer) -> None:
    before = scrape(metered)
    assert metered.stub.Health(pb.HealthRequest(deep=True), timeout=60).ready
    after = scrape(metered)
    for name in REQUEST_SERIES:  # the warm-up generation ran before `before`, the deep check between
        assert total(before, name) == 0 and total(after, name) == 0, name
    list(metered.stub.Generate(request(max_tokens=3), timeout=60))
    assert total(scrape(metered), "vllm:request_success_total") == 1


@pytest.mark.slow
def test_every_completion_of_an_n_2_request_is_in_request_generation_tokens(metered: InProcessServer) -> None:
    before = scrape(metered)
    params = pb.SamplingParameters(max_tokens=5, temperature=0.8, seed=7, n=2, ignore_eos=True)
    responses = list(metered.stub.Generate(pb.GenerateRequest(text="Hello", sampling=params), timeout=60))
    num_tokens = sum(len(r.token_ids) for r in responses)
    assert num_tokens == 10
    after = scrape(metered)

    def diff(name: str) -> float:
        return total(after, name) - total(before, name)

    assert diff("vllm:generation_tokens_total") == num_tokens
    assert diff("vllm:request_generation_tokens_sum") == num_tokens  # one sample per completion
    assert diff("vllm:request_generation_tokens_count") == 2
    assert diff("vllm:request_success_total") == 1


@pytest.mark.slow
def test_a_stopped_server_frees_its_engine(tiny_llama_dir: str) -> None:
    """A server stopped in a process that goes on (an embedder, the tests: dozens of servers in one
    process) frees its model, also after requests on both ports (gRPC, /metrics, KServe v2 REST):
    aiohttp's cache of routes wrapped in their middlewares kept each server that had answered on its
    HTTP port, and its whole engine."""
    srv = InProcessServer(
        tiny_llama_dir, None, dtype="float32", served_model_name=MODEL, num_kv_blocks=64
    ).start()
    model = weakref.ref(srv.llm.executor.worker.model_runner.model)
    try:
        assert len(list(srv.stub.Generate(request(max_tokens=2), timeout=60))) >= 1
        assert total(scrape(srv), "vllm:request_success_total") == 1
        status, body = post_generate(srv, MODEL, {"text_input": "Hi", "parameters": {"max_tokens": 2}})
        assert status == 200, body
    finally:
        srv.stop()
    del srv
    gc.collect()
    assert model() is None
