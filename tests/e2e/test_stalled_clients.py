"""Clients that keep their stream open but stop reading (a stuck consumer, a paused process, a proxy
that buffers nothing), on every streaming front end: our gRPC `Generate`, Triton's `ModelStreamInfer`
and KServe's REST `/generate_stream`. Once the transport's buffers are full a write cannot complete;
after --stream-write-timeout the request is aborted (KV blocks freed, counted under
`pagedserve:request_aborts{cause="stalled_client"}`) and the stream ends: a gRPC client that reads
on gets DEADLINE_EXCEEDED naming the setting, a REST connection is reset. Without the limit the
handler waited for that write until shutdown while the engine generated the request to max_tokens
into an unbounded queue (and a drain waited its whole --shutdown-timeout for it). A concurrent
client's stream is unaffected, and a client that reads slowly but keeps reading is never cut: the
limit is per write, not per stream.

gRPC keepalive does not find these clients: their transport answers pings. The gRPC clients here
turn off BDP probing, so their flow-control window stays at 64 KiB and they stall within a second
(with it, a client buffers a few MB first); the REST client shrinks its receive buffer, and asks
for top-20 logprobs so that the server's send buffer (up to 4 MB) fills within seconds."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_helpers import (
    IDLE_AFTER_ABORT_S,
    LONG_MAX_TOKENS,
    LONG_NUM_KV_BLOCKS,
    long_context_copy,
    metric_sample,
    request,
    wait_until,
)
from inprocess_server import InProcessServer, abort_leftovers, is_idle, wait_for
from pagedserve.rpc.cli import ServeSettings
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc
from pagedserve_adapters import tensors
from pagedserve_adapters.v2 import inference_pb2 as ipb
from pagedserve_adapters.v2 import inference_pb2_grpc as ipb_grpc
from pydantic import ValidationError

MODEL = "tiny"
WRITE_TIMEOUT_S = 1.5  # the server's --stream-write-timeout
# The transport's buffers fill within seconds, then the write waits WRITE_TIMEOUT_S: a bound with room
# for a busy machine, well short of a LONG_MAX_TOKENS request's own run time.
CUT_WITHIN_S = 60.0
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]  # the client's flow-control window stays at 64 KiB
GOOD_PROMPT, GOOD_MAX_TOKENS = "Once upon a time", 48
CALL_TIMEOUT_S = 300.0  # bounds every gRPC call here


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    model = long_context_copy(tiny_llama_dir, tmp_path_factory.mktemp("long-llama"))
    srv = InProcessServer(
        model,
        None,
        dtype="float32",
        served_model_name=MODEL,
        block_size=16,
        num_kv_blocks=LONG_NUM_KV_BLOCKS,
        stream_write_timeout=WRITE_TIMEOUT_S,
    ).start()
    yield srv
    srv.stop()


def counter(srv: InProcessServer, name: str, **labels: str) -> float:
    return metric_sample(srv.http_port, name, model_name=MODEL, **labels)


def counts(srv: InProcessServer) -> dict[str, float]:
    return {
        "stalled_client": counter(srv, "pagedserve:request_aborts_total", cause="stalled_client"),
        "client_cancel": counter(srv, "pagedserve:request_aborts_total", cause="client_cancel"),
        "length": counter(srv, "vllm:request_success_total", finished_reason="length"),
    }


def check_stalled_client_is_cut(srv: InProcessServer, before: dict[str, float]) -> None:
    """The stalled client's request was aborted as stalled_client, its blocks and stream are gone,
    and it was counted nowhere else (only the concurrent well-behaved client's request finished)."""
    assert wait_until(lambda: counts(srv)["stalled_client"] == before["stalled_client"] + 1, CUT_WITHIN_S), (
        counts(srv),
        srv.llm.stats(),
    )
    assert wait_until(lambda: is_idle(srv), IDLE_AFTER_ABORT_S), srv.llm.stats()
    assert counts(srv) == {
        **before,
        "stalled_client": before["stalled_client"] + 1,
        "length": before["length"] + 1,
    }


# -- our gRPC Generate -----------------------------------------------------------------------------------


def generate_tokens(srv: InProcessServer) -> list[int]:
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        responses = pb_grpc.GenerationStub(channel).Generate(
            request(GOOD_PROMPT, GOOD_MAX_TOKENS), timeout=CALL_TIMEOUT_S
        )
        return [token for response in responses for token in response.token_ids]


@pytest.mark.slow
def test_a_generate_stream_that_stops_being_read_is_given_up(server: InProcessServer) -> None:
    wait_for(lambda: is_idle(server), what="an idle engine")
    alone = generate_tokens(server)
    before = counts(server)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=SMALL_WINDOW)
    call = pb_grpc.GenerationStub(channel).Generate(request("Hello", LONG_MAX_TOKENS), timeout=CALL_TIMEOUT_S)
    try:
        next(call)  # streaming; then it reads no further response
        assert generate_tokens(server) == alone
        check_stalled_client_is_cut(server, before)
        with pytest.raises(grpc.RpcError) as ended:  # reading on: what was sent, then why it ended
            for _ in call:
                pass
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--stream-write-timeout" in ended.value.details()
    finally:
        call.cancel()
        channel.close()
        abort_leftovers(server)


# -- Triton's ModelStreamInfer ---------------------------------------------------------------------------


def infer_request(prompt: str, max_tokens: int) -> ipb.ModelInferRequest:
    sampling = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    tensor, contents = ipb.ModelInferRequest.InferInputTensor, ipb.InferTensorContents
    return ipb.ModelInferRequest(
        model_name=MODEL,
        inputs=[
            tensor(
                name="text_input",
                datatype="BYTES",
                shape=[1],
                contents=contents(bytes_contents=[prompt.encode()]),
            ),
            tensor(
                name="sampling_parameters",
                datatype="BYTES",
                shape=[1],
                contents=contents(bytes_contents=[sampling.encode()]),
            ),
            tensor(name="stream", datatype="BOOL", shape=[1], contents=contents(bool_contents=[True])),
        ],
    )


def stream_infer(channel: grpc.Channel, prompt: str, max_tokens: int, half_closed: threading.Event) -> Any:
    """A ModelStreamInfer call with one request; the client half-closes once `half_closed` is set."""

    def requests() -> Iterator[ipb.ModelInferRequest]:
        yield infer_request(prompt, max_tokens)
        half_closed.wait(CALL_TIMEOUT_S)

    return ipb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests(), timeout=CALL_TIMEOUT_S)


def stream_infer_text(srv: InProcessServer) -> str:
    done = threading.Event()
    text = b""
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        for response in stream_infer(channel, GOOD_PROMPT, GOOD_MAX_TOKENS, done):
            assert not response.error_message, response.error_message
            (piece,) = tensors.decode_raw(
                "text_output", "BYTES", [1], response.infer_response.raw_output_contents[0]
            )
            text += piece
            if response.infer_response.parameters["triton_final_response"].bool_param:
                done.set()
    return text.decode()


@pytest.mark.slow
def test_a_model_stream_infer_stream_that_stops_being_read_is_given_up(server: InProcessServer) -> None:
    wait_for(lambda: is_idle(server), what="an idle engine")
    alone = stream_infer_text(server)
    before = counts(server)
    half_closed = threading.Event()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=SMALL_WINDOW)
    call = stream_infer(channel, "Hello", LONG_MAX_TOKENS, half_closed)
    try:
        assert not next(call).error_message  # streaming; then it reads no further response
        assert stream_infer_text(server) == alone
        check_stalled_client_is_cut(server, before)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--stream-write-timeout" in ended.value.details()
    finally:
        half_closed.set()
        call.cancel()
        channel.close()
        abort_leftovers(server)


# -- KServe REST /generate_stream ------------------------------------------------------------------------


def sse_body(prompt: str, max_tokens: int, num_logprobs: int | None = None) -> bytes:
    parameters: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    doc: dict[str, Any] = {"text_input": prompt, "parameters": parameters}
    if num_logprobs is not None:
        parameters["logprobs"] = num_logprobs
        doc["return_logprobs"] = True
    return json.dumps(doc).encode()


def open_sse(srv: InProcessServer, body: bytes, receive_buffer: int) -> socket.socket:
    """POST to /generate_stream over a socket whose receive buffer is `receive_buffer` bytes."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", srv.http_port))
    head = (
        f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """The events of a chunked SSE response (its chunk-size lines are no `data:` lines)."""
    return [json.loads(line[len(b"data: ") :]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


def sse_text(srv: InProcessServer) -> str:
    req = urllib.request.Request(
        srv.http_url(f"/v2/models/{MODEL}/generate_stream"), data=sse_body(GOOD_PROMPT, GOOD_MAX_TOKENS)
    )
    with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S) as reply:
        return "".join(event["text_output"] for event in sse_events(reply.read()))


def read_until_closed(sock: socket.socket) -> bool:
    """Read what is left; True once the server closed or reset the connection."""
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


@pytest.mark.slow
def test_a_generate_stream_sse_client_that_stops_reading_is_cut(server: InProcessServer) -> None:
    wait_for(lambda: is_idle(server), what="an idle engine")
    alone = sse_text(server)
    before = counts(server)
    sock = open_sse(server, sse_body("Hello", LONG_MAX_TOKENS, num_logprobs=20), receive_buffer=4096)
    try:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # streaming; then it reads no further
        assert sse_text(server) == alone
        check_stalled_client_is_cut(server, before)
        assert read_until_closed(sock)
    finally:
        sock.close()
        abort_leftovers(server)


@pytest.mark.slow
def test_a_client_that_reads_slowly_but_steadily_is_not_cut(server: InProcessServer) -> None:
    """It reads 16 KiB every 0.2 s, so its stream (hundreds of KB) lasts several times the write
    timeout, while each of the server's writes completes at the client's next read or so. The
    engine runs ahead of so slow a reader: the tokens that queue meanwhile come merged, fewer events
    carrying every token once."""
    wait_for(lambda: is_idle(server), what="an idle engine")
    before = counts(server)
    max_tokens = 600
    sock = open_sse(server, sse_body("Hello", max_tokens, num_logprobs=5), receive_buffer=16384)
    received = b""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    try:
        while not received.endswith(b"\r\n0\r\n\r\n") and time.monotonic() < deadline:
            chunk = sock.recv(16384)
            assert chunk, f"the server closed the connection after {len(received)} bytes"
            received += chunk
            time.sleep(0.2)
    finally:
        sock.close()
    events = sse_events(received)
    assert 1 < len(events) <= max_tokens  # one event per token, or a few merged; the last one ends it
    assert sum(len(json.loads(event["logprobs"])) for event in events) == max_tokens
    assert len(received) > 16384 * 5 * WRITE_TIMEOUT_S  # read over more than the write timeout
    assert wait_until(lambda: is_idle(server), IDLE_AFTER_ABORT_S), server.llm.stats()
    assert counts(server) == {**before, "length": before["length"] + 1}


# -- the setting -----------------------------------------------------------------------------------------


def test_a_negative_stream_write_timeout_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="stream_write_timeout"):
        ServeSettings(stream_write_timeout=-1)
    assert ServeSettings().stream_write_timeout == 60.0
    assert ServeSettings(stream_write_timeout=0).stream_write_timeout == 0  # no limit
