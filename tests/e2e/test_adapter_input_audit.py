"""Garbage in, a named error out: the KServe v2 / Triton adapters against requests Python's own JSON
parser, UTF-8 codec or a careless client can trip on, and against HTTP clients that hang up. Real
`tritonclient`, real gRPC stubs and raw HTTP against a real `pagedserve serve` on the tiny model."""

from __future__ import annotations

import gc
import gzip
import json
import socket
import struct
import urllib.error
import urllib.request
import zlib
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from grpc_helpers import (
    IDLE_AFTER_ABORT_S,
    LONG_MAX_TOKENS,
    LONG_NUM_KV_BLOCKS,
    ServerProcess,
    long_context_copy,
    wait_until,
)
from pagedserve.rpc.v1 import generate_pb2 as pb
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

pytestmark = pytest.mark.slow

MODEL = "tiny"
# JSON that `json.loads` refuses with something other than JSONDecodeError
HUGE_INTEGER = b'{"max_tokens": ' + b"1" * 5000 + b"}"  # ValueError: past 4300 digits
DEEP_ARRAY = b"[" * 100_000 + b"]" * 100_000  # RecursionError


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """Long context, so a request can outlive the test that abandons it."""
    model_dir = long_context_copy(tiny_llama_dir, tmp_path_factory.mktemp("long-llama"))
    flags = ["--model", model_dir, "--dtype", "float32", "--block-size", "16", "--served-model-name", MODEL]
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(*flags, "--num-kv-blocks", str(LONG_NUM_KV_BLOCKS), log=log).wait_ready()
    yield proc
    proc.stop()


def triton_inputs(sampling: bytes) -> list[tgrpc.InferInput]:
    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    params = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([sampling], dtype=object))
    return [text, params]


def stream_request(request_id: str, sampling: bytes | None, text: bool = True) -> Any:
    """A streamed ModelInferRequest in raw form, as tritonclient builds it."""
    request = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    values = {"stream": struct.pack("?", True)}
    if text:
        values["text_input"] = struct.pack("<I", 5) + b"Hello"
    if sampling is not None:
        values["sampling_parameters"] = struct.pack("<I", len(sampling)) + sampling
    for name, raw in values.items():
        request.inputs.add(name=name, datatype="BOOL" if name == "stream" else "BYTES", shape=[1])
        request.raw_input_contents.append(raw)
    return request


@pytest.mark.parametrize("sampling", [HUGE_INTEGER, DEEP_ARRAY], ids=["huge-integer", "deep-array"])
def test_unparsable_sampling_parameters_are_invalid_argument(server: ServerProcess, sampling: bytes) -> None:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, triton_inputs(sampling))
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert info.value.message().startswith("sampling_parameters: is not valid JSON")
        good = client.infer(MODEL, triton_inputs(b'{"max_tokens": 3}'))
        assert good.as_numpy("text_output")[0].decode().startswith("Hello")


def test_every_bad_request_on_a_stream_gets_an_error_with_its_id_and_the_good_one_completes(
    server: ServerProcess,
) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(server.channel)
    requests = [
        stream_request("digits", HUGE_INTEGER),
        stream_request("good", b'{"max_tokens": 6, "ignore_eos": true, "temperature": 0}'),
        stream_request("deep", DEEP_ARRAY),
        stream_request("no-text", None, text=False),
        stream_request("huge-n", b'{"n": 4611686018427387904, "max_tokens": 1}'),  # 2**62: no memory
        stream_request("empty-final", b'{"max_tokens": 1}'),
    ]
    requests[-1].parameters["triton_enable_empty_final_response"].string_param = "yes"
    # the request iterator ends, so the server closes the stream once every request is final
    replies = list(stub.ModelStreamInfer(iter(requests), timeout=60))
    errors = {r.infer_response.id: r.error_message for r in replies if r.error_message}
    assert set(errors) == {"digits", "deep", "no-text", "huge-n", "empty-final"}, errors
    assert (
        errors["empty-final"] == "parameters.triton_enable_empty_final_response: must be a boolean, got 'yes'"
    )
    assert errors["digits"].startswith("sampling_parameters: is not valid JSON")
    assert errors["deep"].startswith("sampling_parameters: is not valid JSON")
    assert errors["no-text"].startswith("inputs.text_input")
    good = [r.infer_response for r in replies if not r.error_message]
    assert {r.id for r in good} == {"good"} and good[-1].parameters["triton_final_response"].bool_param
    assert b"".join(deserialize_bytes_tensor(r.raw_output_contents[0])[0] for r in good)
    assert server.engine_idle()


def test_an_n_past_what_a_list_can_hold_is_invalid_argument_naming_n(server: ServerProcess) -> None:
    """The engine refuses an n above --max-num-seqs; nothing is sized by n before it has (a MemoryError,
    an UNKNOWN, and for an n that fits, seconds of the event loop allocating it)."""
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        for inputs, parameters in (
            (triton_inputs(b'{"n": 4611686018427387904, "max_tokens": 2}'), None),
            (triton_inputs(b'{"max_tokens": 2}')[:1], {"n": 2**62}),  # a request parameter
        ):
            with pytest.raises(InferenceServerException) as info:
                client.infer(MODEL, inputs, parameters=parameters)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert info.value.message().startswith("n: must be at most 128"), info.value
    assert server.engine_idle()


def test_a_refusal_echoing_a_long_input_stays_a_refusal_over_grpc(server: ServerProcess) -> None:
    """Echoed whole, a 10 kB model name, input name, datatype, sampling key or output name made the
    refusal larger than a client's 8 KiB of trailers: the client got RESOURCE_EXHAUSTED ("Stream
    removed") instead of the status naming the field. The details are cut to 2 kB; a model name is
    echoed cut to 256 characters."""
    long = "x" * 100_000
    stub = service_pb2_grpc.GRPCInferenceServiceStub(server.channel)
    tensor = service_pb2.ModelInferRequest.InferInputTensor
    text = tensor(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"Hello")
    sampling = tensor(name="sampling_parameters", datatype="BYTES", shape=[1])
    sampling.contents.bytes_contents.append(json.dumps({long: 1}).encode())
    output = service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=long)
    text_long = tensor(name="text_input", datatype=long, shape=[1])  # a datatype of 100 kB
    infer = service_pb2.ModelInferRequest
    unknown = "model_name: unknown model 'xxx"
    calls = (
        ("NOT_FOUND", unknown, stub.ModelInfer, infer(model_name=long)),
        (
            "NOT_FOUND",
            unknown,
            stub.RepositoryModelLoad,
            service_pb2.RepositoryModelLoadRequest(model_name=long),
        ),
        ("NOT_FOUND", unknown, stub.TraceSetting, service_pb2.TraceSettingRequest(model_name=long)),
        (
            "INVALID_ARGUMENT",
            "inputs.xxx",
            stub.ModelInfer,
            infer(model_name=MODEL, inputs=[tensor(name=long)]),
        ),
        (
            "INVALID_ARGUMENT",
            "inputs.text_input",
            stub.ModelInfer,
            infer(model_name=MODEL, inputs=[text_long]),
        ),
        (
            "INVALID_ARGUMENT",
            "sampling_parameters",
            stub.ModelInfer,
            infer(model_name=MODEL, inputs=[text, sampling]),
        ),
        (
            "INVALID_ARGUMENT",
            "outputs",
            stub.ModelInfer,
            infer(model_name=MODEL, inputs=[text], outputs=[output]),
        ),
    )
    for code, start, call, request in calls:
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=30)
        assert info.value.code().name == code and info.value.details().startswith(start), info.value
        assert len(info.value.details().encode()) <= 2048


def test_an_output_requested_twice_is_invalid_argument(server: ServerProcess) -> None:
    """As Triton refuses it; it came back twice over gRPC (and once over REST)."""
    twice = [tgrpc.InferRequestedOutput("text_output"), tgrpc.InferRequestedOutput("text_output")]
    with (
        tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client,
        pytest.raises(InferenceServerException) as info,
    ):
        client.infer(MODEL, triton_inputs(b'{"max_tokens": 2}'), outputs=twice)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert info.value.message() == "outputs.text_output: requested twice"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v2/models/", 404),
        ("POST", f"/v2/models/{MODEL}/versions//generate", 404),
        ("GET", f"/v2/models/{MODEL}/infer", 405),
    ],
)
def test_a_path_or_method_without_a_route_gets_a_json_error(
    server: ServerProcess, method: str, path: str, status: int
) -> None:
    """aiohttp answered these in text, which tritonclient.http fails to parse as the error it expects."""
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", method=method, data=None)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == status
    assert json.loads(info.value.read())["error"].endswith(f"{method} {path}")
    if status == 405:
        assert info.value.headers["Allow"] == "POST"


def test_a_body_past_the_size_limit_gets_a_json_413(server: ServerProcess) -> None:
    status, reply = post(server, "infer", b" " * (64 * 1024 * 1024 + 1))
    assert status == 413
    assert "Maximum request body size 67108864 exceeded" in json.loads(reply)["error"]


def test_a_body_declared_past_the_size_limit_gets_a_json_413_before_it_is_sent(server: ServerProcess) -> None:
    """Refused on its Content-Length: the server read 64 MiB before refusing, and a client that declared
    more than it went on to send waited for an answer until it timed out."""
    declared = 64 * 1024 * 1024 + 1
    head = f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.settimeout(10)
        sock.sendall(head.encode() + b"{}")  # 2 of the bytes it declared
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    body = reply.split(b"\r\n\r\n", 1)[1]
    assert (
        json.loads(body)["error"]
        == f"Maximum request body size 67108864 exceeded: Content-Length {declared}."
    )
    status, reply = post(server, "infer", json.dumps(infer_body()).encode())
    assert status == 200


def post(server: ServerProcess, path: str, body: bytes, headers: dict[str, str] | None = None) -> Any:
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}/{path}"
    req = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def infer_body(data: Any = "Hello", **tensor: Any) -> dict[str, Any]:
    text = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [data], **tensor}
    return {"inputs": [text], "parameters": {"max_tokens": 3}}


BINARY_HEADER = json.dumps(infer_body()).encode()
# text_input "Hello" in the binary section: a 4-byte length, then the bytes (9 in all)
BINARY_INFER_HEADER = json.dumps(
    {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 9}}
        ],
        "parameters": {"max_tokens": 3},
    }
).encode()
BAD_HTTP_REQUESTS = {
    "deep JSON": ("infer", b'{"inputs": ' + DEEP_ARRAY + b"}", {}, "request: body is not valid JSON"),
    "huge integer": (
        "generate",
        b'{"text_input": "Hello", "parameters": ' + HUGE_INTEGER + b"}",
        {},
        "request: body is not valid JSON",
    ),
    "input parameters a list": ("infer", infer_body(parameters=[1]), {}, "inputs.text_input.parameters"),
    "output parameters a string": (
        "infer",
        {**infer_body(), "outputs": [{"name": "text_output", "parameters": "binary"}]},
        {},
        "outputs.text_output.parameters",
    ),
    "lone surrogate in data": ("infer", infer_body("\ud800"), {}, "inputs.text_input: is not valid UTF-8"),
    "lone surrogate in text_input": (
        "generate",
        b'{"text_input": "\\ud800"}',
        {},
        "inputs.text_input: is not valid UTF-8",
    ),
    "id an object": ("infer", {**infer_body(), "id": {"a": 1}}, {}, "id: must be a string"),
    "generate id a list": ("generate", {"text_input": "Hello", "id": [1]}, {}, "id: must be a string"),
    "header length a superscript digit": (
        "infer",
        BINARY_HEADER,
        {"Inference-Header-Content-Length": "²".encode().decode("latin-1")},  # UTF-8 on the wire
        "Inference-Header-Content-Length",
    ),
    "header length past 4300 digits": (  # int() refuses such a string: no 500
        "infer",
        BINARY_HEADER,
        {"Inference-Header-Content-Length": "9" * 5000},
        "Inference-Header-Content-Length",
    ),
    "a body its Content-Encoding does not decode": (
        "infer",
        BINARY_HEADER,
        {"Content-Encoding": "gzip"},
        "Content-Encoding gzip: the body does not decode: Error -3",
    ),
    "a gzip body cut short": (
        "infer",
        gzip.compress(BINARY_HEADER)[:-12],
        {"Content-Encoding": "gzip"},
        "Content-Encoding gzip: the body ends before its compressed data does",
    ),
    "binary data without the header length": (  # read as one JSON document, with "Extra data"
        "infer",
        BINARY_INFER_HEADER + struct.pack("<I", 5) + b"Hello",
        {},
        f"request: body is not valid JSON: Extra data: line 1 column {len(BINARY_INFER_HEADER) + 1} "
        f"(char {len(BINARY_INFER_HEADER)}); binary tensor data after the JSON needs the "
        "Inference-Header-Content-Length header",
    ),
    "header length negative": (
        "infer",
        BINARY_INFER_HEADER + struct.pack("<I", 5) + b"Hello",
        {"Inference-Header-Content-Length": "-1"},
        "Inference-Header-Content-Length: must be the JSON header's length in bytes, a whole number, "
        "got '-1'",
    ),
    "header length past the body": (
        "infer",
        BINARY_INFER_HEADER + struct.pack("<I", 5) + b"Hello",
        {"Inference-Header-Content-Length": str(len(BINARY_INFER_HEADER) + 100)},
        f"Inference-Header-Content-Length: {len(BINARY_INFER_HEADER) + 100} bytes of JSON header, but the "
        f"body has {len(BINARY_INFER_HEADER) + 9} bytes in all",
    ),
    "header length short of the JSON": (
        "infer",
        BINARY_INFER_HEADER + struct.pack("<I", 5) + b"Hello",
        {"Inference-Header-Content-Length": str(len(BINARY_INFER_HEADER) - 1)},
        f"request: the JSON header (the body's first {len(BINARY_INFER_HEADER) - 1} bytes, "
        "Inference-Header-Content-Length) is not valid JSON",
    ),
    "an output without a name": (
        "infer",
        {**infer_body(), "outputs": [{"parameters": {"binary_data": False}}]},
        {},
        "outputs: must be a list of objects with a name",
    ),
    "lone surrogate in bad_words": (
        "generate",
        b'{"text_input": "Hello", "parameters": {"bad_words": ["ok", "a\\udfff b"]}}',
        {},
        "sampling_parameters.bad_words[1]: is not valid UTF-8",
    ),
    "lone surrogate in a choice": (
        "generate",
        b'{"text_input": "Hello", "parameters": {"structured_outputs": {"choice": ["\\ud800"]}}}',
        {},
        "sampling_parameters.structured_outputs.choice[0]: is not valid UTF-8",
    ),
    "lone surrogate in a choice, the structured outputs as text": (
        "generate",
        b'{"text_input": "Hello", "parameters": {"structured_outputs": "{\\"choice\\": [\\"\\\\ud800\\"]}"}}',
        {},
        "sampling_parameters.structured_outputs.choice[0]: is not valid UTF-8",
    ),
    "n past what a list can hold": (
        "generate",
        {"text_input": "Hello", "parameters": {"n": 2**62, "max_tokens": 2}},
        {},
        "n: must be at most 128",
    ),
    "an output requested twice": (
        "infer",
        {**infer_body(), "outputs": [{"name": "text_output"}, {"name": "text_output"}]},
        {},
        "outputs.text_output: requested twice",
    ),
    "binary_data_size a string": (
        "infer",
        infer_body(parameters={"binary_data_size": "9"}),
        {},
        "inputs.text_input.parameters.binary_data_size: must be an integer",
    ),
    "input parameters zero": ("infer", infer_body(parameters=0), {}, "inputs.text_input.parameters"),
    "binary data past the inputs' sizes": (  # Triton: "unexpected additional input data"
        "infer",
        BINARY_INFER_HEADER + struct.pack("<I", 5) + b"Hello" + struct.pack("<I", 3) + b"Bye",
        {"Inference-Header-Content-Length": str(len(BINARY_INFER_HEADER))},
        "Inference-Header-Content-Length: 7 bytes of binary data follow",
    ),
    "binary_data_output not a boolean": (
        "infer",
        {**infer_body(), "parameters": {"max_tokens": 3, "binary_data_output": "yes"}},
        {},
        "parameters.binary_data_output: must be a boolean",
    ),
    "an output's binary_data not a boolean": (
        "infer",
        {**infer_body(), "outputs": [{"name": "text_output", "parameters": {"binary_data": "true"}}]},
        {},
        "outputs.text_output.parameters.binary_data: must be a boolean",
    ),
    "sequence_id a list": (
        "infer",
        {**infer_body(), "parameters": {"max_tokens": 3, "sequence_id": [1, 2]}},
        {},
        "parameters.sequence_id: must be an unsigned integer or a string",
    ),
    "a parameter under Triton's reserved prefix": (
        "generate",
        {"text_input": "Hello", "parameters": {"triton_foo": 1}},
        {},
        "parameters.triton_foo: parameter names starting with triton_ are reserved",
    ),
    "generate: a property at the top and in parameters": (
        "generate",
        {"text_input": "Hello", "max_tokens": 2, "parameters": {"max_tokens": 3}},
        {},
        "max_tokens: given both as a top-level property and in `parameters`",
    ),
    "generate: a top-level property that is no input and no parameter": (
        "generate",
        {"text_input": "Hello", "colour": "blue"},
        {},
        "sampling_parameters.colour: unknown sampling parameter",
    ),
}


@pytest.mark.parametrize("case", list(BAD_HTTP_REQUESTS))
def test_malformed_rest_requests_get_400_naming_the_field(server: ServerProcess, case: str) -> None:
    path, body, headers, message = BAD_HTTP_REQUESTS[case]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, reply = post(server, path, data, headers)
    assert status == 400, reply[:300]
    assert json.loads(reply)["error"].startswith(message), reply[:300]
    status, reply = post(server, "infer", json.dumps(infer_body()).encode())
    assert status == 200 and json.loads(reply)["outputs"][0]["data"][0].startswith("Hello")


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "foo", "gzip, foo"])
def test_a_content_encoding_the_server_does_not_decode_gets_a_json_415_naming_it(
    server: ServerProcess, coding: str
) -> None:
    """aiohttp answered zstd in text before any handler ran (400, "Please install backports.zstd"), br
    with a 400 about a body that "cannot be read", and read `foo` as no coding at all (200)."""
    status, reply = post(server, "infer", json.dumps(infer_body()).encode(), {"Content-Encoding": coding})
    assert status == 415, reply[:300]
    unsupported = coding.split(", ")[-1]
    assert json.loads(reply) == {
        "error": f"Content-Encoding '{unsupported}' is not supported; send gzip, deflate or identity"
    }
    status, reply = post(server, "infer", json.dumps(infer_body()).encode())
    assert status == 200 and json.loads(reply)["outputs"][0]["data"][0].startswith("Hello")


def test_a_body_past_the_size_limit_once_decoded_gets_a_json_413(server: ServerProcess) -> None:
    """A gzip body of 64 KiB that decodes past the limit: refused, not decoded whole."""
    bomb = gzip.compress(b" " * (64 * 1024 * 1024 + 1))
    status, reply = post(server, "infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 413, reply[:300]
    assert json.loads(reply)["error"] == (
        "Maximum request body size 67108864 exceeded once its gzip coding is undone."
    )
    status, reply = post(server, "infer", json.dumps(infer_body()).encode())
    assert status == 200


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_http_request_compression_is_decoded(server: ServerProcess, algorithm: str) -> None:
    text = thttp.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        result = client.infer(
            MODEL, [text], parameters={"max_tokens": 2}, request_compression_algorithm=algorithm
        )
        assert result.as_numpy("text_output")[0].startswith(b"Hello")
    gc.collect()  # its gevent pool, freed on this thread (test_triton_adapter.py's _collect_http_clients)


@pytest.mark.parametrize(
    ("coding", "encode"),
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", lambda b: zlib.compress(b)[2:-4])],
    ids=["gzip", "deflate", "raw-deflate"],
)
def test_a_compressed_binary_request_is_decoded_before_its_header_length_applies(
    server: ServerProcess, coding: str, encode: Any
) -> None:
    body = encode(BINARY_INFER_HEADER + struct.pack("<I", 5) + b"Hello")
    headers = {"Content-Encoding": coding, "Inference-Header-Content-Length": str(len(BINARY_INFER_HEADER))}
    status, reply = post(server, "infer", body, headers)
    assert status == 200, reply[:300]
    assert json.loads(reply)["outputs"][0]["data"][0].startswith("Hello")


def test_requests_that_are_not_http_get_400_and_no_traceback_in_the_log(server: ServerProcess) -> None:
    """aiohttp answers what it cannot parse as HTTP itself; it logged an ERROR with a traceback for each
    (a port scanner or a broken client filled the log with them): now one info line each."""
    malformed = [
        b"GET /v2/models/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a request line past 8190 bytes
        b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    ]
    logged_before = server.log.read_text()
    for raw in malformed:
        with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
            sock.settimeout(30)
            sock.sendall(raw)
            assert sock.recv(4096).startswith(b"HTTP/1.0 400 Bad Request"), raw[:40]
    status, reply = post(server, "infer", json.dumps(infer_body()).encode())
    assert status == 200

    def logged() -> str:
        return server.log.read_text()[len(logged_before) :]

    assert wait_until(lambda: logged().count("answered a malformed HTTP request") == 3, timeout=10), logged()
    assert "Traceback" not in logged() and "ERROR" not in logged(), logged()[-2000:]


@pytest.mark.parametrize("path", ["infer", "generate"])
def test_rest_client_that_hangs_up_aborts_its_request(server: ServerProcess, path: str) -> None:
    params = {"max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    doc = infer_body() if path == "infer" else {"text_input": "Hello"}
    body = json.dumps({**doc, "parameters": params}).encode()
    head = f"POST /v2/models/{MODEL}/{path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    assert server.engine_idle()
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(head.encode() + body)
        assert wait_until(lambda: server.stub.Health(pb.HealthRequest()).num_running == 1, timeout=30)
    # the request would take most of a minute; nobody waits for it any more
    assert server.engine_idle(timeout=IDLE_AFTER_ABORT_S), "a hung-up client's request still runs"
