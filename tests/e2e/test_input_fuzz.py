"""Seeded random garbage against a real server, on every surface that takes a request body: the
pagedserve gRPC API (random values in every SamplingParameters and GenerateRequest field), KServe v2 /
Triton gRPC (random tensors, datatypes, shapes, contents and parameters, unary and streamed) and the
REST routes (valid bodies with random leaves replaced, removed or added, and broken JSON). The input
audits check named mistakes one by one; this checks what nobody thought to name: each request gets an
answer or a clear refusal (a client's error, with a message), never a server error, and afterwards the
server is ready, idle (no request or KV block left behind) and has logged no traceback.

A failure names the seed's request; each surface draws from its own seed, so it reproduces alone."""

from __future__ import annotations

import copy
import http.client
import json
import math
import random
import re
import struct
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from grpc_helpers import ServerProcess
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve_adapters.v2 import inference_pb2 as v2
from pagedserve_adapters.v2 import inference_pb2_grpc as v2_grpc

pytestmark = pytest.mark.slow

MODEL = "tiny"
NUM_REQUESTS = 400
# what a refusal of a client's request may be; anything else (INTERNAL, UNKNOWN, ...) is the server's fault
CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}
FIELD_FIRST = re.compile(r"[a-z_]+(\[\d+\])?(\.[a-z_]+(\[\d+\])?)*: ")  # tools[0].name: ...
INTS = [0, 1, -1, 2, 5, 64, 2**31, -(2**31), 2**62, -(2**63), 49151, 49152, 100_000]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, math.inf, -math.inf, math.nan, 2.0, 100.0]
STRINGS = ["", "x", "<|im_end|>", "a" * 2000, "\u0000", "Hi", "{", "\ud7ff"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    flags = [
        "--model",
        tiny_llama_dir,
        "--dtype",
        "float32",
        "--served-model-name",
        MODEL,
        "--allow-client-shm",
    ]
    proc = ServerProcess(*flags, log=log).wait_ready()
    yield proc
    proc.stop()


def check_unharmed(server: ServerProcess) -> None:
    assert server.proc.poll() is None, server.log.read_text()[-3000:]
    assert server.engine_idle(), server.stub.Health(pb.HealthRequest())
    assert "Traceback" not in server.log.read_text(), server.log.read_text()[-5000:]


# -- the pagedserve gRPC API -----------------------------------------------------------------------


def random_scalar(rng: random.Random, field: Any) -> Any:
    kind = field.cpp_type
    if kind in (field.CPPTYPE_INT64, field.CPPTYPE_INT32):
        value = rng.choice(INTS)
        return max(min(value, 2**31 - 1), -(2**31)) if kind == field.CPPTYPE_INT32 else value
    if kind in (field.CPPTYPE_UINT64, field.CPPTYPE_UINT32):
        return abs(rng.choice(INTS)) % 2**32
    if kind in (field.CPPTYPE_DOUBLE, field.CPPTYPE_FLOAT):
        return rng.choice(FLOATS)
    if kind == field.CPPTYPE_BOOL:
        return rng.random() < 0.5
    return rng.choice(STRINGS) if kind == field.CPPTYPE_STRING else None


def fill(rng: random.Random, message: Message, rate: float, depth: int = 0) -> None:
    """Set about `rate` of `message`'s fields to random values, sub-messages (three deep) and map
    entries included (well-known types such as Struct left out)."""
    for field in message.DESCRIPTOR.fields:
        if rng.random() > rate:
            continue
        value = getattr(message, field.name)
        if field.message_type is None:
            scalars = [
                random_scalar(rng, field) for _ in range(rng.randint(0, 4) if field.is_repeated else 1)
            ]
            if field.is_repeated:
                value.extend(scalars)
            else:
                setattr(message, field.name, scalars[0])
        elif field.message_type.GetOptions().map_entry:
            for _ in range(rng.randint(1, 3)):
                value[rng.choice(INTS)] = rng.choice(FLOATS)
        elif depth < 3 and not field.message_type.full_name.startswith("google.protobuf"):
            for _ in range(rng.randint(1, 3) if field.is_repeated else 1):
                fill(rng, value.add() if field.is_repeated else value, rate, depth + 1)


def random_generate_request(rng: random.Random) -> pb.GenerateRequest:
    """A random GenerateRequest kept small enough to finish quickly: a few tokens, a few completions."""
    request = pb.GenerateRequest(text="Hi there", sampling=pb.SamplingParameters(max_tokens=4, temperature=0))
    rate = rng.choice([0.03, 0.1, 0.2])  # a few fields set (often all valid) or many (seldom)
    fill(rng, request, rate)
    sampling = request.sampling
    fill(rng, sampling, rate, depth=1)  # the most fields, always
    if not 0 <= sampling.max_tokens <= 16:
        sampling.max_tokens = 4
    for name, bound in (("n", 4), ("logprobs", 20), ("prompt_logprobs", 20)):
        if sampling.HasField(name) and getattr(sampling, name) > bound:
            setattr(sampling, name, bound)
    return request


def test_random_generate_requests_are_answered_or_refused_naming_a_field(server: ServerProcess) -> None:
    rng = random.Random(1)
    outcomes: Counter[str] = Counter()
    for _ in range(NUM_REQUESTS):
        request = random_generate_request(rng)
        try:
            if rng.random() < 0.5:
                responses = list(server.stub.Generate(request, timeout=60))
                assert responses and responses[-1].finish_reason != pb.ERROR, (request, responses[-1])
            else:
                server.stub.Complete(request, timeout=60)
            outcomes["ok"] += 1
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_CODES and exc.details(), (exc.code(), exc.details(), request)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # "field: why", the field as in the proto
                assert FIELD_FIRST.match(exc.details()), (exc.details(), request)
            outcomes[exc.code().name] += 1
    assert outcomes["ok"] >= 10 and outcomes["INVALID_ARGUMENT"] >= 10, outcomes  # both sides reached
    check_unharmed(server)


# -- KServe v2 / Triton gRPC -----------------------------------------------------------------------

TENSOR_NAMES = ["text_input", "sampling_parameters", "stream", "exclude_input_in_output", "max_tokens"]
TENSOR_NAMES += ["temperature", "return_logprobs", "bad_words", "stop_words", "zz", ""]
DATATYPES = ["BYTES", "BOOL", "INT32", "INT64", "FP32", "FP64", "UINT8", "BF16", "FP16", "XX", ""]
SHAPES = [[1], [1, 1], [], [2], [0], [-1], [1, 2], [2**40]]
RAW_CONTENTS = [b"", b"\x02\x00\x00\x00Hi", b"\x05\x00\x00\x00Hi", b"\x01", b"\x00" * 8, b"\xff" * 4]
RAW_CONTENTS += [struct.pack("<I", 16) + b'{"max_tokens": 3}']
TYPED_CONTENTS = {
    "bytes_contents": [b"Hi", b'{"max_tokens": 2}', b"\xff"],
    "bool_contents": [True],
    "int_contents": [3, -1, 2**31 - 1],
    "int64_contents": [2**62, 3],
    "fp32_contents": [0.5, math.nan],
    "fp64_contents": [1e300],
    "uint_contents": [2**32 - 1],
}
PARAMETER_NAMES = ["priority", "timeout", "sequence_id", "binary_data_output", "zz", "shared_memory_region"]
PARAMETER_VALUES = [("int64_param", 0), ("int64_param", -1), ("int64_param", 2**62), ("string_param", "x")]
PARAMETER_VALUES += [("bool_param", True), ("double_param", 0.5), ("uint64_param", 2**63)]


def random_tensor(rng: random.Random, request: v2.ModelInferRequest, raw: bool) -> None:
    """A tensor of a random name, datatype and shape, its data in `raw_input_contents` (`raw`) or in
    its typed contents (one time in ten the other way, which mixes the two)."""
    tensor = request.inputs.add(name=rng.choice(TENSOR_NAMES), datatype=rng.choice(DATATYPES))
    tensor.shape.extend(rng.choice(SHAPES))
    if raw != (rng.random() < 0.1):
        request.raw_input_contents.append(rng.choice(RAW_CONTENTS))
    else:
        kind, values = rng.choice(sorted(TYPED_CONTENTS.items()))
        getattr(tensor.contents, kind).extend(rng.sample(values, rng.randint(0, len(values))))


def random_infer_request(rng: random.Random) -> v2.ModelInferRequest:
    """A valid request (a prompt and its sampling parameters, as raw or typed contents) with random
    tensors, a requested output and a parameter added, and a model name or version sometimes wrong."""
    request = v2.ModelInferRequest(
        model_name=rng.choice([MODEL, MODEL, MODEL, "", "x"]),
        model_version=rng.choice(["", "", "1", "2", "x"]),
        id=rng.choice(["", "a", "\u0000"]),
    )
    raw = rng.random() < 0.5
    for name, value in (
        ("text_input", b"Hello"),
        ("sampling_parameters", b'{"max_tokens": 3, "temperature": 0}'),
    ):
        tensor = request.inputs.add(name=name, datatype="BYTES", shape=[1])
        if raw:
            request.raw_input_contents.append(struct.pack("<I", len(value)) + value)
        else:
            tensor.contents.bytes_contents.append(value)
    for _ in range(rng.randint(0, 3)):
        random_tensor(rng, request, raw)
    if rng.random() < 0.3:
        request.outputs.add(name=rng.choice(["text_output", "x", "", "finish_reason", "output_log_probs"]))
    if rng.random() < 0.3:
        kind, value = rng.choice(PARAMETER_VALUES)
        setattr(request.parameters[rng.choice(PARAMETER_NAMES)], kind, value)
    return request


def test_random_infer_requests_are_answered_or_refused(server: ServerProcess) -> None:
    stub = v2_grpc.GRPCInferenceServiceStub(server.channel)
    rng = random.Random(2)
    outcomes: Counter[str] = Counter()
    for _ in range(NUM_REQUESTS):
        request = random_infer_request(rng)
        try:
            if rng.random() < 0.5:
                stub.ModelInfer(request, timeout=60)
                outcomes["ok"] += 1
                continue
            for reply in stub.ModelStreamInfer(iter([request]), timeout=60):
                outcomes["stream error" if reply.error_message else "ok"] += 1
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_CODES and exc.details(), (exc.code(), exc.details(), request)
            outcomes[exc.code().name] += 1
    assert outcomes["ok"] >= 5 and outcomes["INVALID_ARGUMENT"] + outcomes["stream error"] >= 10, outcomes
    check_unharmed(server)


# -- REST ------------------------------------------------------------------------------------------

GENERATE = {
    "id": "a",
    "text_input": "Hi there",
    "parameters": {"max_tokens": 4, "temperature": 0, "stop": ["x"], "ignore_eos": True, "seed": 1},
}
INFER = {
    "id": "b",
    "inputs": [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]},
        {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES", "data": ['{"max_tokens": 3}']},
        {"name": "exclude_input_in_output", "shape": [1], "datatype": "BOOL", "data": [True]},
        {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [3]},
    ],
    "outputs": [{"name": "text_output", "parameters": {"binary_data": False}}],
    "parameters": {"priority": 0},
}
TRACE = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1", "log_frequency": "0"}
ROUTES = [
    (f"/v2/models/{MODEL}/generate", GENERATE),
    (f"/v2/models/{MODEL}/generate_stream", GENERATE),
    (f"/v2/models/{MODEL}/infer", INFER),
    (f"/v2/models/{MODEL}/versions/1/infer", INFER),
    ("/v2/trace/setting", TRACE),
    ("/v2/logging", {"log_info": True, "log_verbose_level": 0, "log_warning": True}),
    ("/v2/systemsharedmemory/region/r/register", {"key": "/no-such-object", "offset": 0, "byte_size": 16}),
    (f"/v2/repository/models/{MODEL}/load", {"parameters": {"unload_dependents": False}}),
    (f"/v2/repository/models/{MODEL}/unload", {"parameters": {"unload_dependents": False}}),
    ("/v2/repository/index", {"ready": True}),
]
ODD_VALUES = [None, -1, 0, 1, 2**63, -(2**63), 2**31, 1e308, 0.5, "", "x" * 5000, [], {}, True, False]
ODD_VALUES += [[[1]], {"a": {}}, "NaN", "\u0000", [None], ["Hi", 3], -0.0]
BROKEN_BODIES = [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"a":1}{']


def places(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every value in a JSON document, containers included."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from places(item, (*path, key))


def mutate(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with one to three values replaced by odd ones, removed, or a key or item added."""
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        odd = copy.deepcopy(rng.choice(ODD_VALUES))
        paths = [p for p in places(body) if p]
        if not paths:  # every key removed
            body["zz"] = odd
            continue
        path = rng.choice(paths)
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        roll = rng.random()
        if roll < 0.15 and isinstance(parent, dict):
            del parent[path[-1]]
        elif roll < 0.25:
            if isinstance(parent, dict):
                parent[f"zz{rng.randint(0, 9)}"] = odd
            else:
                parent.append(odd)
        else:
            parent[path[-1]] = odd
    return body


def post(port: int, path: str, data: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def test_random_rest_bodies_are_answered_or_refused_with_a_json_error(server: ServerProcess) -> None:
    rng = random.Random(3)
    outcomes: Counter[int] = Counter()
    for _ in range(NUM_REQUESTS):
        path, body = rng.choice(ROUTES)
        if rng.random() < 0.1:
            data = rng.choice([*BROKEN_BODIES, json.dumps(body).encode()[: rng.randint(0, 40)]])
        else:
            data = json.dumps(mutate(rng, body)).encode()
        status, answer = post(server.http_port, path, data)
        assert status < 500, (status, path, data, answer)
        if status >= 400:
            error = json.loads(answer)["error"]
            assert isinstance(error, str) and error, (status, path, data, answer)
        outcomes[status] += 1
    assert outcomes[200] >= 10 and outcomes[400] >= 10, outcomes
    check_unharmed(server)
