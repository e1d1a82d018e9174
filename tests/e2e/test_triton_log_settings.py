"""Triton's logging extension through real tritonclient clients, gRPC and HTTP, against a spawned
`pagedserve serve` (engine process): the log switches read, changed while serving and reaching the
engine process's log at its next pass; every bad update refused naming the setting, nothing changed."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from grpc_health.v1 import health_pb2
from grpc_helpers import ServerProcess, wait_until
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow

STARTED = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "text",
}
QUEUED = "] pagedserve.engine.llm_engine: request "  # the engine's debug line, "[engine] ..." in its log
FINISHED = "INFO pagedserve.requests: request finished id="  # the front end's line a request
RANK_SWITCHED = "DEBUG [rank 1] pagedserve.worker.multiproc_executor: log switches now "


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess("--model", tiny_llama_dir, "--dtype", "float32", log=log).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture
def grpc_client(server: ServerProcess) -> Iterator[tgrpc.InferenceServerClient]:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        yield client


@pytest.fixture(autouse=True)
def started_settings(server: ServerProcess) -> Iterator[None]:
    """Each test starts from, and leaves, the settings the server started with."""
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        client.update_log_settings({k: v for k, v in STARTED.items() if k not in ("log_file", "log_format")})
        yield
        client.update_log_settings({k: v for k, v in STARTED.items() if k not in ("log_file", "log_format")})


def grpc_settings(response: dict[str, Any]) -> dict[str, Any]:
    """tritonclient.grpc's JSON of a LogSettingsResponse -> name: value."""
    return {name: next(iter(value.values())) for name, value in response["settings"].items()}


def one_request(client: tgrpc.InferenceServerClient) -> None:
    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([b'{"max_tokens": 2, "temperature": 0}'], dtype=object))
    [model] = client.get_model_repository_index(as_json=True)["models"]
    client.infer(model["name"], [text, sampling])


def lines_of_a_request(server: ServerProcess, client: tgrpc.InferenceServerClient) -> dict[str, int]:
    """How many engine debug lines and front-end request lines one request wrote to the server's log
    (its finished line is written as the response goes out: waited for)."""
    before = server.log.read_text()
    one_request(client)
    deadline = time.monotonic() + 5
    while True:
        new = server.log.read_text()[len(before) :]
        if FINISHED in new or time.monotonic() > deadline:
            time.sleep(0.2)  # (whatever else the request writes)
            new = server.log.read_text()[len(before) :]
            break
        time.sleep(0.05)
    return {"engine_debug": new.count(QUEUED), "finished": new.count(FINISHED)}


def test_the_settings_read_as_the_server_started_and_logging_is_an_extension(
    server: ServerProcess, grpc_client: tgrpc.InferenceServerClient
) -> None:
    assert grpc_settings(grpc_client.get_log_settings(as_json=True)) == STARTED
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
        assert http.get_log_settings() == STARTED
        assert "logging" in http.get_server_metadata()["extensions"]
    assert "logging" in grpc_client.get_server_metadata(as_json=True)["extensions"]


def test_verbose_and_info_switch_the_engine_process_and_front_end_lines(
    server: ServerProcess, grpc_client: tgrpc.InferenceServerClient
) -> None:
    assert lines_of_a_request(server, grpc_client) == {"engine_debug": 0, "finished": 1}
    updated = grpc_settings(grpc_client.update_log_settings({"log_verbose_level": 1}, as_json=True))
    assert updated == {**STARTED, "log_verbose_level": 1}
    # the engine process's two debug lines (queued, finished): the switch reached it
    assert lines_of_a_request(server, grpc_client) == {"engine_debug": 2, "finished": 1}
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
        updated = http.update_log_settings({"log_info": False, "log_verbose_level": 0})
    assert updated == {**STARTED, "log_info": False}
    assert lines_of_a_request(server, grpc_client) == {"engine_debug": 0, "finished": 0}
    # info off beside verbose on: debug lines, not the info ones
    grpc_client.update_log_settings({"log_verbose_level": 3})
    assert lines_of_a_request(server, grpc_client) == {"engine_debug": 2, "finished": 0}


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"log_warnings": True}, "unknown log setting 'log_warnings'; the settings are log_file, "),
        ({"log_info": None}, "log_info: no value given"),
        ({"log_format": "json"}, "log_format: the log is written to text (--log-format); it cannot be "),
        ({"log_file": "/tmp/triton.log"}, "log_file: the log is written to stderr; it cannot be changed"),
        ({"log_verbose_level": 1, "log_file": "x"}, "log_file: the log is written to stderr"),
    ],
)
def test_a_bad_grpc_update_is_invalid_argument_naming_the_setting_and_changes_nothing(
    grpc_client: tgrpc.InferenceServerClient, settings: dict[str, Any], says: str
) -> None:
    with pytest.raises(InferenceServerException) as info:
        grpc_client.update_log_settings(settings)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert says in info.value.message(), info.value.message()
    assert grpc_settings(grpc_client.get_log_settings(as_json=True)) == STARTED


def post(server: ServerProcess, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/logging", data=body)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"log_info": "false"}', "log_info: must be a boolean (true or false), got 'false'"),
        (b'{"log_verbose_level": -1}', "log_verbose_level: must be an integer >= 0, got -1"),
        (b'{"log_verbose_level": "1"}', "log_verbose_level: must be an integer >= 0, got '1'"),
        (b'{"log_verbose_level": true}', "log_verbose_level: must be an integer >= 0, got True"),
        (b'{"log_error": 0}', "log_error: must be a boolean"),
        (b'["log_info"]', "the body must be a JSON object of log settings"),
        (b'{"log_info": fal', "body is not valid JSON"),
    ],
)
def test_a_bad_rest_update_is_400_naming_the_setting_and_changes_nothing(
    server: ServerProcess, body: bytes, says: str
) -> None:
    status, answer = post(server, body)
    assert status == 400 and says in answer["error"], (status, answer)
    assert post(server, b"{}") == (200, STARTED)  # an empty update reads them


def test_an_update_while_the_model_loads_is_unavailable_and_a_read_answers(
    default_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The engine process it would reach is still starting (with the switches it was given): a change
    waits for the load, a read does not."""
    log = tmp_path_factory.mktemp("loading") / "server.log"
    proc = ServerProcess("--model", default_model_dir, "--dtype", "float32", log=log)
    try:
        assert wait_until(lambda: proc.readiness() is not None or proc.proc.poll() is not None, 120)
        assert proc.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING  # loading (compiling)
        status, answer = post(proc, b'{"log_verbose_level": 1}')
        assert status == 503 and "once the model has loaded" in answer["error"], (status, answer)
        assert post(proc, b"{}") == (200, STARTED)
    finally:
        proc.stop()


def test_the_switches_reach_the_tensor_parallel_ranks(tiny_llama_dir: str, tmp_path: Path) -> None:
    """Rank 1 (started by the engine process) takes them with the plans it is sent: turned verbose, it
    says so at debug level, which it could not write were its switches still the start's."""
    args = ("--model", tiny_llama_dir, "--dtype", "float32", "--kv-cache-memory", "1MiB")
    proc = ServerProcess(*args, "--tensor-parallel-size", "2", log=tmp_path / "server.log").wait_ready()
    try:
        with tgrpc.InferenceServerClient(f"127.0.0.1:{proc.port}") as client:
            client.update_log_settings({"log_verbose_level": 1})
            assert wait_until(lambda: RANK_SWITCHED in proc.log.read_text(), 30), proc.log.read_text()[-3000:]
            one_request(client)  # ranks that took the switches step on
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.log.read_text()[-3000:]
