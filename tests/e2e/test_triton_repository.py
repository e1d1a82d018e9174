"""Triton's model repository extension, load and unload, through real tritonclient clients (gRPC and
HTTP) and KServe's in-tree message layout, against a spawned `pagedserve serve`: a load of the served
model is done, an unload of it refused while it keeps serving, another model not found, a load's
parameters refused naming them; every refusal with the status Triton's clients read."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from grpc_health.v1 import health_pb2
from grpc_helpers import ServerProcess, wait_until
from triton_helpers import http_json, refusal, served_model
from tritonclient.grpc import service_pb2

pytestmark = pytest.mark.slow


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


@pytest.fixture
def http_client(server: ServerProcess) -> Iterator[thttp.InferenceServerClient]:
    client = thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield client
    client.close()
    gc.collect()  # (its gevent pool freed on this thread: see test_triton_adapter)


@pytest.fixture
def name(grpc_client: tgrpc.InferenceServerClient) -> str:
    return served_model(grpc_client)


def completion(client: tgrpc.InferenceServerClient, name: str) -> str:
    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([b'{"max_tokens": 3, "temperature": 0}'], dtype=object))
    result = client.infer(name, [text, sampling])
    return str(result.as_numpy("text_output")[0].decode())


def raw_call(server: ServerProcess, method: str, request: Any) -> bytes:
    """A repository RPC with tritonclient's request message, its answer's bytes undecoded (tritonclient's
    response messages have no fields to read them into)."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        return bytes(call(request.SerializeToString(), timeout=10))


def test_model_repository_is_an_extension_and_kserve_lists_the_model(
    server: ServerProcess, grpc_client: tgrpc.InferenceServerClient, name: str
) -> None:
    assert "model_repository" in grpc_client.get_server_metadata(as_json=True)["extensions"]
    assert http_json(server, "/v2/models", method="GET") == (200, {"models": [name]})


def test_a_load_of_the_served_model_is_done_and_it_serves_on(
    server: ServerProcess,
    grpc_client: tgrpc.InferenceServerClient,
    http_client: thttp.InferenceServerClient,
    name: str,
) -> None:
    before = completion(grpc_client, name)
    grpc_client.load_model(name)
    http_client.load_model(name)
    assert grpc_client.is_model_ready(name) and http_client.is_model_ready(name)
    assert http_json(server, f"/v2/repository/models/{name}/load") == (200, {"name": name, "load": True})
    assert http_json(server, f"/v2/repository/models/{name}/load", b'{"parameters": {}}')[0] == 200
    assert completion(grpc_client, name) == before  # nothing was reloaded under it


def test_an_unload_of_the_served_model_is_refused_and_it_serves_on(
    server: ServerProcess,
    grpc_client: tgrpc.InferenceServerClient,
    http_client: thttp.InferenceServerClient,
    name: str,
) -> None:
    status, message = refusal(lambda: grpc_client.unload_model(name))
    assert status == "StatusCode.FAILED_PRECONDITION", (status, message)
    assert f"model {name!r} is the one model this server serves" in message
    assert "only by stopping the server" in message
    _, message = refusal(lambda: http_client.unload_model(name, unload_dependents=True))
    assert "only by stopping the server" in message
    status, answer = http_json(server, f"/v2/repository/models/{name}/unload")
    assert status == 400 and "only by stopping the server" in answer["error"], (status, answer)
    assert grpc_client.is_model_ready(name)
    assert completion(grpc_client, name)
    [index] = grpc_client.get_model_repository_index(as_json=True)["models"]
    assert index["state"] == "READY"


def test_another_model_is_not_found_by_either_call(
    server: ServerProcess,
    grpc_client: tgrpc.InferenceServerClient,
    http_client: thttp.InferenceServerClient,
    name: str,
) -> None:
    for call in (grpc_client.load_model, grpc_client.unload_model):
        status, message = refusal(lambda call=call: call("nope"))
        assert status == "StatusCode.NOT_FOUND", (status, message)
        assert message == f"model_name: unknown model 'nope'; this server serves {name!r}"
    for path in ("load", "unload"):
        status, answer = http_json(server, f"/v2/repository/models/nope/{path}")
        assert status == 404 and "unknown model 'nope'" in answer["error"], (status, answer)
    _, message = refusal(lambda: http_client.load_model("nope"))
    assert "unknown model 'nope'" in message


def test_a_loads_parameters_are_refused_naming_them(
    server: ServerProcess,
    grpc_client: tgrpc.InferenceServerClient,
    http_client: thttp.InferenceServerClient,
    name: str,
) -> None:
    says = "this server loads its one model at start and cannot reload it with another configuration"
    status, message = refusal(lambda: grpc_client.load_model(name, config='{"max_batch_size": 0}'))
    assert status == "StatusCode.INVALID_ARGUMENT" and message.startswith("parameters.config: " + says)
    status, message = refusal(lambda: grpc_client.load_model(name, files={"file:1/model.bin": b"x"}))
    assert status == "StatusCode.INVALID_ARGUMENT" and message.startswith("parameters.file:1/model.bin: ")
    _, message = refusal(lambda: http_client.load_model(name, config="{}"))
    assert message.startswith("parameters.config: " + says)
    assert grpc_client.is_model_ready(name)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "request: body is not valid JSON"),
        (b"[]", "request: must be a JSON object"),
        (b'{"parameters": 3}', "parameters: must be a JSON object"),
        (b'{"parameters": {"config": null}}', "parameters.config: must be a boolean, an integer or a string"),
        (b'{"parameters": {"config": {"a": 1}}}', "parameters.config: must be a boolean"),
        (b'{"parameters": {"config": "{}"}}', "parameters.config: this server loads its one model"),
    ],
)
def test_a_bad_rest_load_is_400_naming_the_field(
    server: ServerProcess, name: str, body: bytes, says: str
) -> None:
    status, answer = http_json(server, f"/v2/repository/models/{name}/load", body)
    assert status == 400 and answer["error"].startswith(says), (status, answer)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"parameters": {"unload_dependents": "yes"}}', "parameters.unload_dependents: must be a boolean"),
        (
            b'{"parameters": {"force": true}}',
            "parameters.force: unknown; an unload takes unload_dependents alone",
        ),
    ],
)
def test_a_bad_rest_unload_is_400_naming_the_field(
    server: ServerProcess, name: str, body: bytes, says: str
) -> None:
    status, answer = http_json(server, f"/v2/repository/models/{name}/unload", body)
    assert status == 400 and answer["error"].startswith(says), (status, answer)


def test_bad_grpc_parameters_are_invalid_argument_naming_them(server: ServerProcess, name: str) -> None:
    def code_and_details(method: str, request: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as caught:
            raw_call(server, method, request)
        return caught.value.code(), caught.value.details()

    unload = service_pb2.RepositoryModelUnloadRequest(model_name=name)
    unload.parameters["unload_dependents"].string_param = "yes"
    assert code_and_details("RepositoryModelUnload", unload) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "parameters.unload_dependents: must be a boolean, got 'yes'",
    )
    load = service_pb2.RepositoryModelLoadRequest(model_name=name)
    load.parameters["config"].Clear()  # named, with no value
    assert code_and_details("RepositoryModelLoad", load) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "parameters.config: no value given",
    )
    empty = service_pb2.RepositoryModelLoadRequest()
    assert code_and_details("RepositoryModelLoad", empty) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "model_name: must not be empty",
    )


def test_kserves_layout_names_the_model_in_field_one_and_reads_is_loaded(
    server: ServerProcess, name: str
) -> None:
    """KServe's in-tree RepositoryModelLoadRequest is {model_name = 1}, Triton's field 1 repository_name;
    its response {model_name = 1, isLoaded = 2}."""
    answer = raw_call(
        server, "RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest(repository_name=name)
    )
    encoded = name.encode()
    assert answer == b"\x0a" + bytes([len(encoded)]) + encoded + b"\x10\x01"  # model_name, isLoaded true


def test_both_calls_are_unavailable_while_the_model_loads(
    default_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("loading") / "server.log"
    proc = ServerProcess("--model", default_model_dir, "--dtype", "float32", log=log)
    try:
        assert wait_until(lambda: proc.readiness() is not None or proc.proc.poll() is not None, 120)
        assert proc.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING  # loading (compiling)
        with tgrpc.InferenceServerClient(f"127.0.0.1:{proc.port}") as client:
            for call in (client.load_model, client.unload_model):
                status, message = refusal(lambda call=call: call("SmolLM2-135M-Instruct"))
                assert status == "StatusCode.UNAVAILABLE", (status, message)
                assert message == "server is starting: the model is still loading"
        assert http_json(proc, "/v2/models", method="GET") == (200, {"models": []})
        for path in ("load", "unload"):
            status, answer = http_json(proc, f"/v2/repository/models/SmolLM2-135M-Instruct/{path}")
            assert status == 503 and "still loading" in answer["error"], (status, answer)
        assert proc.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING  # (still loading throughout)
    finally:
        proc.stop()
