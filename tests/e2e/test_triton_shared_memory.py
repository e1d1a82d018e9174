"""Triton's system shared memory extension through real tritonclient clients (gRPC and HTTP) against
a spawned `pagedserve serve --allow-client-shm`: a prompt read from a client's POSIX shared memory
object and the completion written into another gives what the same request gives in the messages,
unary and streamed; the regions' status and unregistering; every bad registration and tensor refused
naming the field; and nothing registered by a server started without the flag.

The shared memory objects are made here (a file under /dev/shm, mapped), as tritonclient's
utils.shared_memory makes them: that module of the tritonclient installed needs pkg_resources."""

from __future__ import annotations

import gc
import json
import mmap
import os
import queue
import struct
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from grpc_helpers import ServerProcess
from triton_helpers import http_json, refusal, served_model

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


class ShmObject:
    """A POSIX shared memory object of `size` bytes, as a client makes one (shm_open's /dev/shm)."""

    def __init__(self, size: int) -> None:
        self.key = f"/pagedserve-test-{uuid.uuid4().hex[:12]}"
        self.path = f"/dev/shm{self.key}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        self.mapping = mmap.mmap(fd, size)
        os.close(fd)

    def write(self, data: bytes, offset: int = 0) -> None:
        self.mapping[offset : offset + len(data)] = data

    def read(self, size: int, offset: int = 0) -> bytes:
        return self.mapping[offset : offset + size]

    def remove(self) -> None:
        self.mapping.close()
        os.unlink(self.path)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ("--model", tiny_llama_dir, "--dtype", "float32", "--allow-client-shm")
    proc = ServerProcess(*args, log=log).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture
def objects() -> Iterator[Callable[[int], ShmObject]]:
    made: list[ShmObject] = []

    def make(size: int) -> ShmObject:
        made.append(ShmObject(size))
        return made[-1]

    yield make
    for obj in made:
        obj.remove()


@pytest.fixture
def grpc_client(server: ServerProcess) -> Iterator[tgrpc.InferenceServerClient]:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        yield client
        client.unregister_system_shared_memory()  # every region: each test starts with none


@pytest.fixture
def http_client(server: ServerProcess) -> Iterator[thttp.InferenceServerClient]:
    client = thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield client
    client.unregister_system_shared_memory()
    client.close()
    gc.collect()  # (its gevent pool freed on this thread: see test_triton_adapter)


@pytest.fixture
def name(grpc_client: tgrpc.InferenceServerClient) -> str:
    return served_model(grpc_client)


def prompt_bytes(prompt: str = PROMPT) -> bytes:
    """A BYTES tensor of one element as raw data: its 4-byte little-endian length, then its bytes."""
    return struct.pack("<I", len(prompt.encode())) + prompt.encode()


def inputs(module: Any, prompt: str | None = PROMPT, stream: bool = False, max_tokens: int = 8) -> list[Any]:
    """text_input (given in the message unless `prompt` is None), sampling_parameters (greedy,
    `max_tokens`), and the stream switch when `stream`."""
    made = []
    if prompt is not None:
        text = module.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
        made.append(text)
    params = module.InferInput("sampling_parameters", [1], "BYTES")
    sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens}).encode()
    params.set_data_from_numpy(np.array([sampling], dtype=object))
    made.append(params)
    if stream:
        switch = module.InferInput("stream", [1], "BOOL")
        switch.set_data_from_numpy(np.array([True]))
        made.append(switch)
    return made


def shm_prompt_input(module: Any, region: str, size: int, offset: int = 0) -> Any:
    text = module.InferInput("text_input", [1], "BYTES")
    text.set_shared_memory(region, size, offset)
    return text


def text_from(obj: ShmObject, result: Any, offset: int = 0) -> str:
    """text_output, a BYTES tensor of the one element the response's shape says, read from the object
    at `offset`: its 4-byte little-endian length, then its bytes."""
    output = result.get_output("text_output")
    assert list(output.shape if hasattr(output, "shape") else output["shape"]) == [1]
    (length,) = struct.unpack("<I", obj.read(4, offset))
    return obj.read(length, offset + 4).decode()


def test_system_shared_memory_is_an_extension(grpc_client: tgrpc.InferenceServerClient) -> None:
    assert "system_shared_memory" in grpc_client.get_server_metadata(as_json=True)["extensions"]


def test_a_prompt_read_from_and_a_completion_written_to_shared_memory_over_grpc(
    grpc_client: tgrpc.InferenceServerClient, objects: Callable[[int], ShmObject], name: str
) -> None:
    expected = grpc_client.infer(name, inputs(tgrpc)).as_numpy("text_output")[0].decode()
    data = prompt_bytes()
    source, target = objects(64 + len(data)), objects(4096)
    source.write(data, offset=64)
    grpc_client.register_system_shared_memory("in", source.key, len(data), offset=64)
    grpc_client.register_system_shared_memory("out", target.key, 4096)
    output = tgrpc.InferRequestedOutput("text_output")
    output.set_shared_memory("out", 4096)
    result = grpc_client.infer(
        name, [shm_prompt_input(tgrpc, "in", len(data)), *inputs(tgrpc, prompt=None)], outputs=[output]
    )
    reply = result.get_response()
    assert [o.name for o in reply.outputs] == ["text_output"] and reply.raw_output_contents == [b""]
    assert text_from(target, result) == expected and expected
    status = grpc_client.get_system_shared_memory_status(as_json=True)["regions"]
    assert status["in"] == {"name": "in", "key": source.key, "offset": "64", "byte_size": str(len(data))}
    assert set(status) == {"in", "out"}


def test_a_prompt_in_shared_memory_at_an_offset_and_a_completion_over_http(
    http_client: thttp.InferenceServerClient, objects: Callable[[int], ShmObject], name: str
) -> None:
    expected = http_client.infer(name, inputs(thttp)).as_numpy("text_output")[0].decode()
    data = prompt_bytes()
    shared = objects(8192)  # one object: the prompt at 16 within region "io", the output after it
    shared.write(data, offset=16)
    http_client.register_system_shared_memory("io", shared.key, 8192)
    output = thttp.InferRequestedOutput("text_output")
    output.set_shared_memory("io", 4096, offset=4096)
    result = http_client.infer(
        name, [shm_prompt_input(thttp, "io", len(data), 16), *inputs(thttp, prompt=None)], outputs=[output]
    )
    [entry] = result.get_response()["outputs"]
    assert entry["name"] == "text_output" and "data" not in entry
    assert text_from(shared, result, offset=4096) == expected
    assert http_client.get_system_shared_memory_status() == [
        {"name": "io", "key": shared.key, "offset": 0, "byte_size": 8192}
    ]


def test_a_stream_writes_each_response_over_the_last(
    grpc_client: tgrpc.InferenceServerClient, objects: Callable[[int], ShmObject], name: str
) -> None:
    def stream(outputs: list[Any] | None) -> list[Any]:
        responses: queue.Queue[Any] = queue.Queue()
        grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
        grpc_client.async_stream_infer(
            name, inputs(tgrpc, stream=True, max_tokens=32), outputs=outputs, request_id="s"
        )
        got = []
        while True:
            result, error = responses.get(timeout=60)
            assert error is None, error.message()
            got.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        grpc_client.stop_stream()
        return got

    # (a stream's responses are as many as its pieces but for deltas merged while its reader was
    # behind: the two streams' counts may differ by design, their texts may not; 32 tokens, so that
    # several responses come however many merge)
    whole = "".join(r.as_numpy("text_output")[0].decode() for r in stream(None))
    target = objects(1024)
    grpc_client.register_system_shared_memory("out", target.key, 1024)
    output = tgrpc.InferRequestedOutput("text_output")
    output.set_shared_memory("out", 1024)
    got = stream([output])
    assert len(got) > 1 and all(r.get_response().raw_output_contents == [b""] for r in got)
    last = text_from(target, got[-1])  # the last response's piece, written over the others'
    assert last and whole.endswith(last) and len(last) < len(whole)


def test_an_output_too_large_for_its_space_is_refused_and_nothing_written(
    grpc_client: tgrpc.InferenceServerClient, objects: Callable[[int], ShmObject], name: str
) -> None:
    target = objects(64)
    target.write(b"\xab" * 64)
    grpc_client.register_system_shared_memory("out", target.key, 64)
    output = tgrpc.InferRequestedOutput("text_output")
    output.set_shared_memory("out", 6)  # 4 bytes of length leave 2 for the text
    status, message = refusal(lambda: grpc_client.infer(name, inputs(tgrpc), outputs=[output]))
    assert status == "StatusCode.INVALID_ARGUMENT", (status, message)
    assert message.startswith("outputs.text_output.parameters.shared_memory_byte_size: 6 bytes cannot hold")
    assert target.read(64) == b"\xab" * 64
    assert grpc_client.infer(name, inputs(tgrpc)).as_numpy("text_output")[0]  # it serves on


def test_bad_tensors_are_refused_naming_the_parameter(
    grpc_client: tgrpc.InferenceServerClient, objects: Callable[[int], ShmObject], name: str
) -> None:
    data = prompt_bytes()
    source = objects(len(data))
    source.write(data)
    grpc_client.register_system_shared_memory("in", source.key, len(data))

    def refused(text: Any, outputs: list[Any] | None = None) -> str:
        status, message = refusal(
            lambda: grpc_client.infer(name, [text, *inputs(tgrpc, prompt=None)], outputs=outputs)
        )
        assert status == "StatusCode.INVALID_ARGUMENT", (status, message)
        return message

    unknown = shm_prompt_input(tgrpc, "nope", len(data))
    assert refused(unknown) == (
        "inputs.text_input.parameters.shared_memory_region: no shared memory region 'nope' is registered"
    )
    past_end = shm_prompt_input(tgrpc, "in", len(data), offset=1)
    assert refused(past_end).startswith(
        f"inputs.text_input.parameters.shared_memory_byte_size: offset + byte_size ({len(data) + 1}) is past"
    )
    no_size = tgrpc.InferInput("text_input", [1], "BYTES")
    no_size._input.parameters["shared_memory_region"].string_param = "in"
    assert refused(no_size) == (
        "inputs.text_input.parameters.shared_memory_byte_size: needed with shared_memory_region"
    )
    both = shm_prompt_input(tgrpc, "in", len(data))
    both._input.contents.bytes_contents.append(PROMPT.encode())
    assert refused(both) == "inputs.text_input.contents: must not be set when the input is in shared memory"
    output = tgrpc.InferRequestedOutput("text_output")
    output.set_shared_memory("gone", 64)
    assert refused(shm_prompt_input(tgrpc, "in", len(data)), [output]) == (
        "outputs.text_output.parameters.shared_memory_region: no shared memory region 'gone' is registered"
    )


def test_bad_registrations_are_refused_naming_the_field(
    server: ServerProcess, grpc_client: tgrpc.InferenceServerClient, objects: Callable[[int], ShmObject]
) -> None:
    obj = objects(128)
    grpc_client.register_system_shared_memory("r", obj.key, 128)
    cases = [
        (("r", obj.key, 64), "StatusCode.ALREADY_EXISTS", "name: a region 'r' is already registered"),
        (("s", "/../etc/passwd", 64), "StatusCode.INVALID_ARGUMENT", "key: '/../etc/passwd' is not a shared"),
        (("s", "a/b", 64), "StatusCode.INVALID_ARGUMENT", "key: 'a/b' is not a shared memory object's name"),
        (("s", "/pagedserve-none", 8), "StatusCode.INVALID_ARGUMENT", "key: no shared memory object"),
        (("s", obj.key, 129), "StatusCode.INVALID_ARGUMENT", f"byte_size: {obj.key!r} holds 128 bytes"),
        (("", obj.key, 8), "StatusCode.INVALID_ARGUMENT", "name: must not be empty"),
        (
            ("s", obj.key, 0),
            "StatusCode.INVALID_ARGUMENT",
            "offset and byte_size: offset >= 0 and byte_size > 0",
        ),
    ]
    for args, code, says in cases:
        status, message = refusal(lambda args=args: grpc_client.register_system_shared_memory(*args))
        assert status == code and message.startswith(says), (args, status, message)
    assert list(grpc_client.get_system_shared_memory_status(as_json=True)["regions"]) == ["r"]
    status, message = refusal(lambda: grpc_client.get_system_shared_memory_status("s"))
    assert status == "StatusCode.NOT_FOUND" and message == "name: no shared memory region 's' is registered"

    base = "/v2/systemsharedmemory/region"
    assert (
        http_json(server, f"{base}/r/register", json.dumps({"key": obj.key, "byte_size": 8}).encode())[0]
        == 409
    )
    for body, says in [
        (b"{", "request: body is not valid JSON"),
        (json.dumps({"byte_size": 8}).encode(), "key: must be a string"),
        (json.dumps({"key": obj.key, "byte_size": "8"}).encode(), "byte_size: must be an integer"),
    ]:
        status, answer = http_json(server, f"{base}/t/register", body)
        assert status == 400 and answer["error"].startswith(says), (body, status, answer)
    assert http_json(server, f"{base}/t/status", method="GET") == (
        404,
        {"error": "name: no shared memory region 't' is registered"},
    )


def test_unregistering_one_region_then_all(
    server: ServerProcess, grpc_client: tgrpc.InferenceServerClient, objects: Callable[[int], ShmObject]
) -> None:
    for region in ("a", "b", "c"):
        grpc_client.register_system_shared_memory(region, objects(16).key, 16)
    grpc_client.unregister_system_shared_memory("a")
    grpc_client.unregister_system_shared_memory("never")  # nothing to do, as Triton
    assert sorted(grpc_client.get_system_shared_memory_status(as_json=True)["regions"]) == ["b", "c"]
    assert http_json(server, "/v2/systemsharedmemory/region/b/unregister") == (200, {})
    assert [r["name"] for r in http_json(server, "/v2/systemsharedmemory/status", method="GET")[1]] == ["c"]
    assert http_json(server, "/v2/systemsharedmemory/unregister") == (200, {})
    assert grpc_client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}


def test_a_server_without_the_flag_registers_nothing(
    tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory, objects: Callable[[int], ShmObject]
) -> None:
    log = tmp_path_factory.mktemp("plain") / "server.log"
    plain = ServerProcess("--model", tiny_llama_dir, "--dtype", "float32", log=log).wait_ready()
    try:
        obj = objects(16)
        with tgrpc.InferenceServerClient(f"127.0.0.1:{plain.port}") as client:
            status, message = refusal(lambda: client.register_system_shared_memory("r", obj.key, 16))
            assert status == "StatusCode.PERMISSION_DENIED", (status, message)
            assert "start the server with --allow-client-shm" in message
        body = json.dumps({"key": obj.key, "byte_size": 16}).encode()
        status, answer = http_json(plain, "/v2/systemsharedmemory/region/r/register", body)
        assert status == 403 and "--allow-client-shm" in answer["error"]
        assert http_json(plain, "/v2/systemsharedmemory/status", method="GET") == (200, [])
    finally:
        plain.stop()


def test_an_object_shrunk_under_its_region_is_refused_not_a_crash(
    grpc_client: tgrpc.InferenceServerClient, objects: Callable[[int], ShmObject], name: str
) -> None:
    """A client that truncates its object after registering it: an access past the object's end
    would have the server killed by SIGBUS; the request is refused, and the server serves on."""
    data = prompt_bytes()
    source, target = objects(4096), objects(4096)
    source.write(data)
    grpc_client.register_system_shared_memory("in", source.key, 4096)
    grpc_client.register_system_shared_memory("out", target.key, 4096)
    os.truncate(source.path, 0)
    status, message = refusal(
        lambda: grpc_client.infer(
            name, [shm_prompt_input(tgrpc, "in", len(data)), *inputs(tgrpc, prompt=None)]
        )
    )
    assert status == "StatusCode.INVALID_ARGUMENT", (status, message)
    assert message == (
        f"inputs.text_input.parameters.shared_memory_region: the shared memory object {source.key!r} of "
        "region 'in' holds 0 bytes now, fewer than the 4096 registered"
    )
    os.truncate(target.path, 100)
    output = tgrpc.InferRequestedOutput("text_output")
    output.set_shared_memory("out", 4096)
    status, message = refusal(lambda: grpc_client.infer(name, inputs(tgrpc), outputs=[output]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "holds 100 bytes now" in message, (status, message)
    assert grpc_client.infer(name, inputs(tgrpc)).as_numpy("text_output")[0]  # alive, serving
