"""The gRPC service end to end: a real server process on loopback, real grpc clients."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_helpers import ServerProcess, request
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(
        "--model",
        tiny_llama_dir,
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "256",
        "--max-num-seqs",
        "64",
        "--served-model-name",
        "tiny",
        log=log,
    ).wait_ready()
    yield proc
    proc.stop()


def stream_text(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> tuple[str, list[int], int]:
    text, ids, reason = "", [], 0
    for response in stub.Generate(req, timeout=60):
        text += response.text
        ids.extend(response.token_ids)
        reason = response.finish_reason or reason
    return text, ids, reason


def test_stream_matches_unary_and_reports_counts(server: ServerProcess) -> None:
    req = request("Tell me a story", max_tokens=12)
    text, ids, reason = stream_text(server.stub, req)
    whole = server.stub.Complete(req).completions[0]
    assert (whole.text, list(whole.token_ids)) == (text, ids) and len(ids) == 12
    assert reason == pb.LENGTH and whole.finish_reason == pb.LENGTH
    assert whole.prompt_tokens > 0 and whole.completion_tokens == 12 and whole.time_to_first_token_s > 0


def test_64_concurrent_streams_equal_their_one_at_a_time_outputs(server: ServerProcess) -> None:
    reqs = [request(f"Prompt number {i} " * (1 + i % 5), max_tokens=4 + i % 13) for i in range(64)]
    alone = [stream_text(server.stub, r)[:2] for r in reqs]

    async def run_all() -> list[tuple[str, list[int]]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def one(r: pb.GenerateRequest) -> tuple[str, list[int]]:
                text, ids = "", []
                async for response in stub.Generate(r, timeout=120):
                    text += response.text
                    ids.extend(response.token_ids)
                return text, ids

            return await asyncio.gather(*(one(r) for r in reqs))

    assert asyncio.run(run_all()) == alone
    assert server.engine_idle()


def test_cancel_mid_stream_frees_blocks_and_the_id_is_reusable(server: ServerProcess) -> None:
    call = server.stub.Generate(request(max_tokens=900, request_id="cancel-me"))
    for _ in range(3):
        next(call)
    call.cancel()
    assert server.engine_idle()
    text, ids, reason = stream_text(server.stub, request(max_tokens=5, request_id="cancel-me"))
    assert len(ids) == 5 and reason == pb.LENGTH


def test_expired_deadline_returns_deadline_exceeded_and_frees_blocks(server: ServerProcess) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stream_text_with_timeout = server.stub.Generate(
            request(max_tokens=900, request_id="late"), timeout=0.3
        )
        for _ in stream_text_with_timeout:
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.engine_idle()
    assert len(stream_text(server.stub, request(max_tokens=3, request_id="late"))[1]) == 3


def test_abort_ends_the_stream_with_finish_reason_aborted(server: ServerProcess) -> None:
    call = server.stub.Generate(request(max_tokens=900, request_id="to-abort"))
    first = next(call)
    assert first.request_id == "to-abort"
    reply = server.stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]))
    assert list(reply.aborted_request_ids) == ["to-abort"]
    last = list(call)[-1]
    assert last.finish_reason == pb.ABORTED and last.error
    assert server.engine_idle()


def _sp(**kwargs: object) -> pb.SamplingParameters:
    return pb.SamplingParameters(**kwargs)


INVALID = [
    ("temperature", pb.GenerateRequest(text="hi", sampling=_sp(temperature=-1))),
    ("temperature", pb.GenerateRequest(text="hi", sampling=_sp(temperature=math.nan))),
    ("top_p", pb.GenerateRequest(text="hi", sampling=_sp(top_p=0))),
    ("top_p", pb.GenerateRequest(text="hi", sampling=_sp(top_p=1.5))),
    ("top_k", pb.GenerateRequest(text="hi", sampling=_sp(top_k=0))),
    ("max_tokens", pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=0))),
    ("min_tokens", pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=2, min_tokens=5))),
    ("presence_penalty", pb.GenerateRequest(text="hi", sampling=_sp(presence_penalty=3))),
    ("logprobs", pb.GenerateRequest(text="hi", sampling=_sp(logprobs=50))),
    ("stop", pb.GenerateRequest(text="hi", sampling=_sp(stop=[""]))),
    ("text", pb.GenerateRequest(text="")),
    ("input", pb.GenerateRequest()),
    ("prompt_token_ids", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999999]))),
    ("prompt", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]))),
    ("prompt", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 2000))),
    ("max_tokens", pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=5000))),
    ("messages", pb.GenerateRequest(messages=pb.ChatMessages())),
    (
        "messages[0].role",
        pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="robot")])),
    ),
    ("model", pb.GenerateRequest(text="hi", model="gpt-17")),
    ("request_id", pb.GenerateRequest(text="hi", request_id="x" * 300)),
]


@pytest.mark.parametrize(("field", "req"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_request_names_the_field_and_the_next_call_succeeds(
    server: ServerProcess, field: str, req: pb.GenerateRequest
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub.Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:"), info.value.details()
    assert len(stream_text(server.stub, request(max_tokens=2))[1]) == 2


def test_invalid_utf8_in_text_is_invalid_argument(server: ServerProcess) -> None:
    raw = server.channel.unary_stream(
        "/pagedserve.rpc.v1.Generation/Generate",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    text_field = b"\x12\x03\xff\xfe\xfd"  # field 2 (text), 3 bytes that are not UTF-8
    with pytest.raises(grpc.RpcError) as info:
        list(raw(text_field, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("text:")
    assert len(stream_text(server.stub, request(max_tokens=2))[1]) == 2


def test_duplicate_live_request_id_is_rejected(server: ServerProcess) -> None:
    call = server.stub.Generate(request(max_tokens=900, request_id="dup"))
    next(call)
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub.Generate(request(request_id="dup"), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(
        "request_id:"
    )
    call.cancel()
    assert server.engine_idle()


def test_tokenize_detokenize_model_info_health_and_reflection(server: ServerProcess) -> None:
    ids = list(server.stub.Tokenize(pb.TokenizeRequest(text="Hello world")).token_ids)
    assert server.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "Hello world"
    info = server.stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.model_name, info.num_kv_blocks, info.block_size, info.tensor_parallel_size) == (
        "tiny",
        256,
        16,
        1,
    )
    assert info.kv_capacity_tokens == 256 * 16 and info.max_context_length == 1024
    assert server.stub.Health(pb.HealthRequest(deep=True)).ready
    live = server.health.Check(health_pb2.HealthCheckRequest(service=""))
    assert live.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"pagedserve.rpc.v1.Generation", "grpc.health.v1.Health"} <= names


def test_metrics_endpoint_counts_requests(server: ServerProcess) -> None:
    import urllib.request

    before = _metric(server, 'vllm:request_success_total{finished_reason="length",model_name="tiny"}')
    stream_text(server.stub, request(max_tokens=3))
    after = _metric(server, 'vllm:request_success_total{finished_reason="length",model_name="tiny"}')
    assert after == before + 1
    ready = urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/health/ready")
    assert ready.status == 200


def _metric(server: ServerProcess, name: str) -> float:
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics").read().decode()
    return next(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def test_bounded_queue_answers_resource_exhausted(tiny_llama_dir: str, tmp_path: Path) -> None:
    proc = ServerProcess(
        "--model",
        tiny_llama_dir,
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        "64",
        "--max-queued-requests",
        "1",
        log=tmp_path / "server.log",
    ).wait_ready()
    try:
        running = proc.stub.Generate(request(max_tokens=900, request_id="running"))
        next(running)
        waiting = proc.stub.Generate(request(max_tokens=5, request_id="waiting"))
        waiter = threading.Thread(target=lambda: list(waiting), daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while proc.stub.Health(pb.HealthRequest()).num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as info:
            list(proc.stub.Generate(request(max_tokens=2), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        running.cancel()
        waiter.join(timeout=30)  # the queued request runs once the slot frees; then the queue is empty
        assert not waiter.is_alive()
        assert len(stream_text(proc.stub, request(max_tokens=2))[1]) == 2
    finally:
        proc.stop()


def test_not_ready_while_loading_then_drain_on_sigterm(default_model_dir: str, tmp_path: Path) -> None:
    proc = ServerProcess("--dtype", "float32", "--shutdown-timeout", "60", log=tmp_path / "server.log")
    try:
        statuses = []
        while proc.readiness() != health_pb2.HealthCheckResponse.SERVING:
            status = proc.readiness()
            if status is not None and (not statuses or statuses[-1] != status):
                statuses.append(status)
            assert proc.proc.poll() is None, proc.log.read_text()[-2000:]
            time.sleep(0.05)
        assert statuses and statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING  # live, still loading
        call = proc.stub.Generate(request("Count to fifty:", max_tokens=48))
        first = next(call)
        proc.proc.terminate()  # SIGTERM while the request is in flight
        time.sleep(0.5)
        assert proc.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            list(proc.stub.Generate(request(max_tokens=2), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(call)
        assert (
            rest[-1].finish_reason == pb.LENGTH
            and len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 48
        )
        assert proc.proc.wait(timeout=60) == 0
    finally:
        proc.stop()
