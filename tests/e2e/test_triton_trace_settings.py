"""Triton's trace extension through real tritonclient clients (gRPC and HTTP) against a spawned
`pagedserve serve --traces-exporter console` (spans written as JSON to the server's log): the settings
read, trace_level, trace_rate and trace_count changed while serving and deciding which requests' spans
are written, each back to its start with no value; every bad update refused naming the setting,
nothing changed; a server without an exporter cannot turn tracing on."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from grpc_helpers import ServerProcess
from triton_helpers import http_json, refusal, served_model

pytestmark = pytest.mark.slow

STARTED = {
    "trace_file": [],
    "trace_level": ["TIMESTAMPS"],
    "trace_rate": ["1"],
    "trace_count": ["-1"],
    "log_frequency": ["0"],
    "trace_mode": ["opentelemetry"],
}
SPAN = '"name": "llm_request"'  # the console exporter's JSON of a request's span


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ("--model", tiny_llama_dir, "--dtype", "float32", "--traces-exporter", "console")
    proc = ServerProcess(*args, log=log, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[tgrpc.InferenceServerClient]:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as c:
        yield c
        c.update_trace_settings(
            settings={name: None for name in ("trace_level", "trace_rate", "trace_count")}
        )


@pytest.fixture
def name(client: tgrpc.InferenceServerClient) -> str:
    return served_model(client)


def settings(response: dict[str, Any]) -> dict[str, list[str]]:
    """tritonclient.grpc's JSON of a TraceSettingResponse -> name: values."""
    return {key: value.get("value", []) for key, value in response["settings"].items()}


def spans_of(
    server: ServerProcess, client: tgrpc.InferenceServerClient, name: str, requests: int, expected: int
) -> int:
    """How many request spans `requests` requests wrote to the server's log: waited for until
    `expected` are there (its exporter flushes every 50 ms here; at most 10 s on a loaded machine),
    then 0.5 s more for any beyond them."""
    before = server.log.read_text().count(SPAN)
    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([b'{"max_tokens": 2, "temperature": 0}'], dtype=object))
    for _ in range(requests):
        client.infer(name, [text, sampling])
    deadline = time.monotonic() + 10
    while server.log.read_text().count(SPAN) - before < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # 10 flush intervals
    return server.log.read_text().count(SPAN) - before


def test_the_settings_read_as_the_server_started_and_trace_is_an_extension(
    server: ServerProcess, client: tgrpc.InferenceServerClient, name: str
) -> None:
    assert "trace" in client.get_server_metadata(as_json=True)["extensions"]
    assert settings(client.get_trace_settings(as_json=True)) == STARTED
    assert settings(client.get_trace_settings(model_name=name, as_json=True)) == STARTED
    http = thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        assert http.get_trace_settings() == {
            "trace_file": "",
            "trace_level": ["TIMESTAMPS"],
            "trace_rate": "1",
            "trace_count": "-1",
            "log_frequency": "0",
            "trace_mode": "opentelemetry",
        }
        assert http.get_trace_settings(model_name=name)["trace_rate"] == "1"
    finally:
        http.close()
        gc.collect()


def test_trace_level_off_writes_no_spans_and_back_on_writes_them(
    server: ServerProcess, client: tgrpc.InferenceServerClient, name: str
) -> None:
    assert spans_of(server, client, name, 2, 2) == 2
    off = client.update_trace_settings(settings={"trace_level": ["OFF"]}, as_json=True)
    assert settings(off)["trace_level"] == ["OFF"]
    assert spans_of(server, client, name, 2, 0) == 0
    client.update_trace_settings(settings={"trace_level": None})  # back to its start: on
    assert spans_of(server, client, name, 2, 2) == 2


def test_trace_rate_and_trace_count_pick_the_requests_traced(
    server: ServerProcess, client: tgrpc.InferenceServerClient, name: str
) -> None:
    client.update_trace_settings(model_name=name, settings={"trace_rate": "3"})
    assert spans_of(server, client, name, 6, 2) == 2  # one of every three
    client.update_trace_settings(settings={"trace_rate": "1", "trace_count": "2"})
    assert spans_of(server, client, name, 4, 2) == 2  # then tracing stops
    now = settings(client.get_trace_settings(as_json=True))
    assert now["trace_count"] == ["0"] and now["trace_level"] == ["TIMESTAMPS"]
    http = thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        assert http.update_trace_settings(settings={"trace_count": None})["trace_count"] == "-1"
    finally:
        http.close()
        gc.collect()
    assert spans_of(server, client, name, 1, 1) == 1


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"trace_rate": "0"}, "trace_rate: must be >= 1, got 0"),
        ({"trace_rate": "often"}, "trace_rate: must be an integer, got 'often'"),
        ({"trace_rate": ["1", "2"]}, "trace_rate: one value, got 2"),
        ({"trace_count": "-2"}, "trace_count: must be >= -1, got -2"),
        ({"trace_level": "TENSORS"}, "trace_level: TENSORS are not traced here (TIMESTAMPS or OFF)"),
        ({"trace_level": "LOUD"}, "trace_level: 'LOUD' is not one of OFF, TIMESTAMPS, TENSORS"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, "trace_level: OFF with TIMESTAMPS"),
        ({"trace_file": "/tmp/trace.json"}, "trace_file: '' here, and it cannot be changed"),
        ({"log_frequency": "10"}, "log_frequency: '0' here, and it cannot be changed"),
        ({"trace_mode": "triton"}, "trace_mode: 'opentelemetry' here, and it cannot be changed"),
        ({"trace_rates": "2"}, "unknown trace setting 'trace_rates'; the settings are trace_file"),
        ({"trace_rate": "2", "trace_count": "x"}, "trace_count: must be an integer"),  # nothing changed
    ],
)
def test_a_bad_update_is_refused_naming_the_setting_and_changes_nothing(
    server: ServerProcess, client: tgrpc.InferenceServerClient, changes: dict[str, Any], says: str
) -> None:
    status, message = refusal(lambda: client.update_trace_settings(settings=changes))
    assert status == "StatusCode.INVALID_ARGUMENT" and message.startswith(says), (status, message)
    status_code, answer = http_json(server, "/v2/trace/setting", json.dumps(changes).encode())
    assert status_code == 400 and answer["error"].startswith(says), (status_code, answer)
    assert settings(client.get_trace_settings(as_json=True)) == STARTED


def test_another_model_and_a_bad_body_are_refused(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    status, message = refusal(lambda: client.get_trace_settings(model_name="nope"))
    assert status == "StatusCode.NOT_FOUND" and message.startswith("model_name: unknown model 'nope'")
    status_code, answer = http_json(server, "/v2/models/nope/trace/setting", b"{}")
    assert status_code == 404, answer
    for body, says in [
        (b"[]", "request: must be a JSON object"),
        (b'{"trace_rate": 2}', "trace_rate: must be a string, a list of strings or null"),
        (b"{", "request: body is not valid JSON"),
    ]:
        status_code, answer = http_json(server, "/v2/trace/setting", body)
        assert status_code == 400 and answer["error"].startswith(says), (body, answer)


def test_a_server_without_an_exporter_cannot_turn_tracing_on(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("untraced") / "server.log"
    plain = ServerProcess("--model", tiny_llama_dir, "--dtype", "float32", log=log).wait_ready()
    try:
        with tgrpc.InferenceServerClient(f"127.0.0.1:{plain.port}") as client:
            assert settings(client.get_trace_settings(as_json=True))["trace_level"] == ["OFF"]
            status, message = refusal(
                lambda: client.update_trace_settings(settings={"trace_level": "TIMESTAMPS"})
            )
            assert status == "StatusCode.FAILED_PRECONDITION", (status, message)
            assert "start the server with --otlp-traces-endpoint or --traces-exporter" in message
            assert settings(client.update_trace_settings(settings={"trace_rate": "5"}, as_json=True))[
                "trace_rate"
            ] == ["5"]  # the others still change
    finally:
        plain.stop()
