"""KServe v2 / Triton compatibility: real `tritonclient` (gRPC and HTTP) and plain HTTP against a real
`pagedserve serve` on the default model, on loopback. The server's own adapter stubs are never
imported here: they define the same `inference.*` protobuf symbols as tritonclient."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from grpc_helpers import ServerProcess, request
from pagedserve.rpc.v1 import generate_pb2 as pb
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess("--model", default_model_dir, "--dtype", "float32", log=log).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture()
def client(server: ServerProcess) -> tgrpc.InferenceServerClient:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as c:
        yield c


def our_text(server: ServerProcess, prompt: str = PROMPT, max_tokens: int = 12) -> str:
    """The greedy completion from pagedserve's own Generate RPC."""
    req = request(prompt, max_tokens=max_tokens, ignore_eos=False)
    return "".join(r.text for r in server.stub.Generate(req, timeout=60))


def grpc_inputs(
    prompt: str | None = PROMPT, stream: bool | None = None, **params: Any
) -> list[tgrpc.InferInput]:
    inputs = []
    if prompt is not None:
        text = tgrpc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
        inputs.append(text)
    if stream is not None:
        flag = tgrpc.InferInput("stream", [1], "BOOL")
        flag.set_data_from_numpy(np.array([stream]))
        inputs.append(flag)
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(
        np.array([json.dumps({"temperature": 0, "max_tokens": 12, **params}).encode()], dtype=object)
    )
    return [*inputs, sampling]


def collect(responses: queue.Queue[Any], until_final: int, timeout: float = 60) -> list[Any]:
    """(result, error) pairs from a stream callback until `until_final` responses flagged final."""
    got, finals, deadline = [], 0, time.monotonic() + timeout
    while finals < until_final:
        result, error = responses.get(timeout=max(0.1, deadline - time.monotonic()))
        got.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            finals += 1
    return got


# -- health, metadata, config ---------------------------------------------------------------------


def test_health_metadata_and_config(client: tgrpc.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("no-such-model")
    assert client.get_server_metadata().name == "pagedserve"

    metadata = client.get_model_metadata(MODEL)
    assert metadata.name == MODEL and list(metadata.versions) == ["1"]
    inputs = {t.name: (t.datatype, list(t.shape)) for t in metadata.inputs}
    assert inputs["text_input"] == ("BYTES", [1]) and inputs["stream"] == ("BOOL", [1])
    assert {t.name for t in metadata.outputs} >= {"text_output", "finish_reason", "num_output_tokens"}

    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert config["name"] == MODEL
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert config.get("max_batch_size", 0) == 0  # proto3 JSON leaves out the zero

    index = client.get_model_repository_index().models
    assert [(m.name, m.version, m.state) for m in index] == [(MODEL, "1", "READY")]

    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no-such-model")
    assert info.value.status() == "StatusCode.NOT_FOUND" and "no-such-model" in info.value.message()


# -- unary and streaming inference over gRPC -----------------------------------------------------


def test_unary_infer_returns_the_whole_completion(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    expected = our_text(server)
    result = client.infer(
        MODEL, grpc_inputs()
    )  # not streaming: the prompt is prepended, as vLLM's backend does
    assert result.as_numpy("text_output")[0].decode() == PROMPT + expected

    flags = tgrpc.InferInput("exclude_input_in_output", [1], "BOOL")
    flags.set_data_from_numpy(np.array([True]))
    counts = tgrpc.InferInput("return_num_output_tokens", [1], "BOOL")
    counts.set_data_from_numpy(np.array([True]))
    reason = tgrpc.InferInput("return_finish_reason", [1], "BOOL")
    reason.set_data_from_numpy(np.array([True]))
    result = client.infer(MODEL, [*grpc_inputs(), flags, counts, reason], request_id="unary-1")
    assert result.as_numpy("text_output")[0].decode() == expected
    assert result.as_numpy("finish_reason")[0].decode() in ("length", "stop")
    assert result.as_numpy("num_output_tokens")[0] <= 12
    assert result.get_response().id == "unary-1"


@pytest.mark.parametrize("empty_final", [False, True])
def test_stream_pieces_concatenate_to_the_greedy_text(
    server: ServerProcess, client: tgrpc.InferenceServerClient, empty_final: bool
) -> None:
    expected = our_text(server)
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(
        MODEL, grpc_inputs(stream=True), request_id="s-1", enable_empty_final_response=empty_final
    )
    got = collect(responses, until_final=1)
    started = time.monotonic()
    client.stop_stream()
    assert time.monotonic() - started < 5.0  # the server closes the stream once the client half-closed

    assert all(error is None for _, error in got)
    replies = [result.get_response() for result, _ in got]
    assert {r.id for r in replies} == {"s-1"} and {r.model_name for r in replies} == {MODEL}
    finals = [r.parameters["triton_final_response"].bool_param for r in replies]
    assert finals == [False] * (len(finals) - 1) + [True]
    texts = [result.as_numpy("text_output") for result, _ in got]
    if empty_final:
        assert not replies[-1].outputs and texts[-1] is None  # the data-less final response
        texts = texts[:-1]
    assert len(texts) > 1 and "".join(t[0].decode() for t in texts) == expected


def test_one_stream_carries_concurrent_requests_and_a_non_streamed_one(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(MODEL, grpc_inputs(stream=True), request_id="a")
    client.async_stream_infer(MODEL, grpc_inputs("Water boils at", stream=True), request_id="b")
    client.async_stream_infer(MODEL, grpc_inputs("Water boils at", stream=False), request_id="c")
    got = collect(responses, until_final=3)
    client.stop_stream()
    pieces: dict[str, str] = {}
    for result, error in got:
        assert error is None
        rid = result.get_response().id
        pieces[rid] = pieces.get(rid, "") + result.as_numpy("text_output")[0].decode()
    assert pieces["a"] == our_text(server)
    assert pieces["b"] == our_text(server, "Water boils at")
    assert pieces["c"] == "Water boils at" + pieces["b"]  # one response with the whole text, prompt first


def test_cancelling_a_stream_aborts_its_requests_and_frees_blocks(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(
        MODEL, grpc_inputs(stream=True, max_tokens=2000, ignore_eos=True), request_id="long"
    )
    result, error = responses.get(timeout=60)
    assert error is None and not result.get_response().parameters["triton_final_response"].bool_param
    assert server.stub.Health(pb.HealthRequest()).num_running == 1
    client.stop_stream(cancel_requests=True)
    assert server.engine_idle(timeout=10), "the cancelled stream's request still holds KV blocks"


# -- malformed requests --------------------------------------------------------------------------


def _bad_requests() -> dict[str, tuple[str, list[tgrpc.InferInput], str]]:
    wrong_type = tgrpc.InferInput("text_input", [1], "INT32")
    wrong_type.set_data_from_numpy(np.array([7], dtype=np.int32))
    two = tgrpc.InferInput("text_input", [2], "BYTES")
    two.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    bad_json = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    bad_json.set_data_from_numpy(np.array([b"{not json"], dtype=object))
    return {
        "wrong datatype": (MODEL, [wrong_type], "inputs.text_input.datatype"),
        "bad shape": (MODEL, [two], "inputs.text_input.shape"),
        "invalid JSON": (MODEL, [*grpc_inputs()[:1], bad_json], "sampling_parameters"),
        "bad parameter": (MODEL, grpc_inputs(temperature=-1.0), "sampling_parameters.temperature"),
        "unknown parameter": (MODEL, grpc_inputs(beam_width=4), "sampling_parameters.beam_width"),
        "missing text_input": (MODEL, grpc_inputs(prompt=None), "inputs.text_input"),
        "unknown model": ("no-such-model", grpc_inputs(), "model_name"),
    }


@pytest.mark.parametrize("case", list(_bad_requests()))
def test_malformed_unary_request_is_rejected_by_field(
    server: ServerProcess, client: tgrpc.InferenceServerClient, case: str
) -> None:
    model, inputs, field = _bad_requests()[case]
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs)
    expected = "StatusCode.NOT_FOUND" if case == "unknown model" else "StatusCode.INVALID_ARGUMENT"
    assert info.value.status() == expected and field in info.value.message()
    assert client.infer(MODEL, grpc_inputs()).as_numpy("text_output")[0].decode() == PROMPT + our_text(server)


def test_stream_errors_arrive_as_messages_and_the_stream_stays_open(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    for model, inputs, _ in _bad_requests().values():
        client.async_stream_infer(model, inputs)
    got = collect(responses, until_final=len(_bad_requests()))
    assert all(result is None and error is not None for result, error in got)
    messages = sorted(error.message() for _, error in got)
    assert all(any(field in m for m in messages) for _, _, field in _bad_requests().values())

    client.async_stream_infer(MODEL, grpc_inputs(stream=True), request_id="after")
    after = collect(responses, until_final=1)
    client.stop_stream()
    assert "".join(r.as_numpy("text_output")[0].decode() for r, _ in after) == our_text(server)


def test_triton_grpc_error_header_ends_the_stream_with_a_status(server: ServerProcess) -> None:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        responses: queue.Queue[Any] = queue.Queue()
        client.start_stream(
            callback=lambda result, error: responses.put((result, error)),
            headers={"triton_grpc_error": "true"},
        )
        client.async_stream_infer(MODEL, grpc_inputs(prompt=None))
        result, error = responses.get(timeout=30)
        assert result is None and error.status() == "StatusCode.INVALID_ARGUMENT"
        client.stop_stream()


def test_undecodable_request_gets_invalid_argument(server: ServerProcess) -> None:
    call = server.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as info:
        call(b"\x0a\x03\xff\xfe\xfd", timeout=10)  # field 1 (model_name) holding invalid UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_name" in info.value.details()


# -- HTTP: tritonclient.http, KServe v2 REST and the generate extension ---------------------------


def http_inputs(binary: bool) -> list[thttp.InferInput]:
    text = thttp.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object), binary_data=binary)
    sampling = thttp.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(
        np.array([json.dumps({"temperature": 0, "max_tokens": 12}).encode()], dtype=object),
        binary_data=binary,
    )
    exclude = thttp.InferInput("exclude_input_in_output", [1], "BOOL")
    exclude.set_data_from_numpy(np.array([True]), binary_data=binary)
    return [text, sampling, exclude]


def post(server: ServerProcess, path: str, body: Any) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=data)
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_http_clients_get_the_same_text(server: ServerProcess) -> None:
    expected = our_text(server)
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        assert client.get_model_config(MODEL)["model_transaction_policy"] == {"decoupled": True}
        for binary in (True, False):
            outputs = [thttp.InferRequestedOutput("text_output", binary_data=binary)]
            result = client.infer(MODEL, http_inputs(binary), outputs=outputs)
            assert result.as_numpy("text_output")[0] in (expected, expected.encode())

    params = {"temperature": 0, "max_tokens": 12}
    status, body = post(server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": params})
    assert status == 200 and json.loads(body)["text_output"] == PROMPT + expected
    status, body = post(
        server,
        f"/v2/models/{MODEL}/versions/1/generate",
        {"text_input": PROMPT, "exclude_input_in_output": True, "parameters": params},
    )
    assert status == 200 and json.loads(body)["text_output"] == expected

    status, body = post(
        server, f"/v2/models/{MODEL}/generate_stream", {"text_input": PROMPT, "parameters": params}
    )
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected


def test_http_health_and_metadata(server: ServerProcess) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready", "/health/ready"):
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as reply:
            assert reply.status == 200, path
    with urllib.request.urlopen(
        f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}", timeout=10
    ) as reply:
        assert json.loads(reply.read())["name"] == MODEL


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        (f"/v2/models/{MODEL}/generate", b"{not json", 400, "request"),
        (f"/v2/models/{MODEL}/generate", {"parameters": {}}, 400, "text_input"),
        (f"/v2/models/{MODEL}/generate", {"text_input": "x", "parameters": {"top_p": 2}}, 400, "top_p"),
        (
            f"/v2/models/{MODEL}/generate_stream",
            {"text_input": "x", "parameters": {"max_tokens": 0}},
            400,
            "max_tokens",
        ),
        ("/v2/models/no-such-model/generate", {"text_input": "x"}, 404, "model_name"),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["x"]}]},
            400,
            "text_input",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "text_input", "datatype": "FP99", "shape": [1], "data": [1]}]},
            400,
            "datatype",
        ),
        (f"/v2/models/{MODEL}/infer", {"inputs": []}, 400, "inputs"),
    ],
)
def test_malformed_http_requests_get_400_and_the_next_call_succeeds(
    server: ServerProcess, path: str, body: Any, status: int, field: str
) -> None:
    got_status, got_body = post(server, path, body)
    assert got_status == status and field in json.loads(got_body)["error"]
    ok_status, ok_body = post(
        server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": {"max_tokens": 2}}
    )
    assert ok_status == 200 and json.loads(ok_body)["text_output"].startswith(PROMPT)


def test_example_triton_client_streams_the_greedy_text(server: ServerProcess) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "triton_stream_client.py"
    args = [PROMPT, "--url", f"127.0.0.1:{server.port}", "--max-tokens", "12"]
    done = subprocess.run([sys.executable, str(example), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == our_text(server) + "\n"
