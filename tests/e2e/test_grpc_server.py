"""The gRPC service end to end: a real server process on loopback, real grpc clients."""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_helpers import (
    IDLE_AFTER_ABORT_S,
    LONG_CONTEXT,
    LONG_MAX_TOKENS,
    LONG_NUM_KV_BLOCKS,
    ServerProcess,
    long_context_copy,
    request,
    wait_until,
)
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

SERVED_NAME = "tiny"


@pytest.fixture(scope="module")
def long_llama_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return long_context_copy(tiny_llama_dir, tmp_path_factory.mktemp("long-llama"))


def long_server(model_dir: str, log: Path, *args: str) -> ServerProcess:
    """A ready server on the long-context tiny model, room for one LONG_MAX_TOKENS request."""
    flags = ["--model", model_dir, "--dtype", "float32", "--block-size", "16"]
    flags += ["--num-kv-blocks", str(LONG_NUM_KV_BLOCKS)]
    return ServerProcess(*flags, *args, log=log).wait_ready()


@pytest.fixture(scope="module")
def server(long_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = long_server(long_llama_dir, log, "--max-num-seqs", "64", "--served-model-name", SERVED_NAME)
    yield proc
    proc.stop()


def test_the_start_up_heap_is_frozen_before_the_server_is_ready(server: ServerProcess) -> None:
    """What start-up built is out of the garbage collector's scans (a full collection of it holds the
    GIL, every stream and the engine stopped, ~0.3-0.5 s on the default model), frozen before the
    server says it is ready."""
    # (the line comes just after health turns SERVING, which is what the fixture waited for)
    assert wait_until(lambda: "pagedserve ready" in server.log.read_text(), 10)
    log = server.log.read_text()
    frozen = re.search(r"start-up heap frozen: (\d+) objects", log)
    assert frozen is not None, log[-3000:]
    # (the front end's: transformers', gRPC's, the tokenizer's; torch and the model are the engine process's)
    assert int(frozen.group(1)) > 100_000, frozen.group(0)
    assert frozen.start() < log.index("pagedserve ready")


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

    async def run_all() -> tuple[list[tuple[str, list[int]]], int]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def one(r: pb.GenerateRequest) -> tuple[str, list[int]]:
                text, ids = "", []
                async for response in stub.Generate(r, timeout=120):
                    text += response.text
                    ids.extend(response.token_ids)
                return text, ids

            streams = asyncio.gather(*(one(r) for r in reqs))
            peak = await peak_num_running(stub, streams)
            return await streams, peak

    outputs, peak = asyncio.run(run_all())
    assert outputs == alone
    # Overlapped, not served one after another: the engine ran many of them in one batch. All 64
    # are sent at once and the longest runs 16 steps, so the batch is wide for most of the run.
    assert peak > 1, peak
    assert server.engine_idle()


async def peak_num_running(stub: pb_grpc.GenerationStub, until: asyncio.Future) -> int:
    """The most requests the engine had running at once (our Health RPC), sampled until `until` is done."""
    peak = 0
    while not until.done():
        peak = max(peak, (await stub.Health(pb.HealthRequest(), timeout=10)).num_running)
        await asyncio.sleep(0.005)
    return peak


class EngineCounters:
    """/metrics counters read before an action, for the deltas the action caused."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.before = self.read()

    def read(self) -> dict[str, float]:
        name = SERVED_NAME
        return {
            cause: self.server.metric("pagedserve:request_aborts_total", cause=cause, model_name=name)
            for cause in ("client_cancel", "deadline", "abort_rpc")
        } | {
            "generated": self.server.metric("vllm:generation_tokens_total", model_name=name),
            "finished": sum(
                self.server.metric("vllm:request_success_total", finished_reason=reason, model_name=name)
                for reason in ("length", "stop", "eos")
            ),
        }

    def deltas(self) -> dict[str, float]:
        return {key: value - self.before[key] for key, value in self.read().items()}


def assert_aborted_early(counters: EngineCounters, *causes: str) -> None:
    """The engine dropped the request (idle at once, one abort counted under one of `causes`) long
    before it could have finished: far fewer tokens generated than asked for, none finished normally."""
    assert counters.server.engine_idle(timeout=IDLE_AFTER_ABORT_S)
    deltas = counters.deltas()
    assert sum(deltas[cause] for cause in causes) == 1, deltas
    assert deltas["generated"] < LONG_MAX_TOKENS // 10 and deltas["finished"] == 0, deltas


def test_cancel_mid_stream_frees_blocks_and_the_id_is_reusable(server: ServerProcess) -> None:
    counters = EngineCounters(server)
    call = server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS, request_id="cancel-me"))
    for _ in range(3):
        next(call)
    call.cancel()
    assert_aborted_early(counters, "client_cancel")
    text, ids, reason = stream_text(server.stub, request(max_tokens=5, request_id="cancel-me"))
    assert len(ids) == 5 and reason == pb.LENGTH


def test_expired_deadline_returns_deadline_exceeded_and_frees_blocks(server: ServerProcess) -> None:
    counters = EngineCounters(server)
    with pytest.raises(grpc.RpcError) as info:
        for _ in server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS, request_id="late"), timeout=0.5):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # A deadline, also when the client's own deadline timer cancels the call a moment before the
    # server's copy expires (rpc/server.py DEADLINE_SLACK_S).
    assert_aborted_early(counters, "deadline")
    assert len(stream_text(server.stub, request(max_tokens=3, request_id="late"))[1]) == 3


def test_abort_ends_the_stream_with_finish_reason_aborted(server: ServerProcess) -> None:
    counters = EngineCounters(server)
    call = server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS, request_id="to-abort"), timeout=60)
    first = next(call)
    assert first.request_id == "to-abort"
    reply = server.stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]))
    assert list(reply.aborted_request_ids) == ["to-abort"]
    rest = list(call)
    assert rest[-1].finish_reason == pb.ABORTED and rest[-1].error
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) < LONG_MAX_TOKENS // 10
    assert_aborted_early(counters, "abort_rpc")


def _sp(**kwargs: object) -> pb.SamplingParameters:
    return pb.SamplingParameters(**kwargs)


INVALID = [
    ("temperature", pb.GenerateRequest(text="hi", sampling=_sp(temperature=-1))),
    ("temperature", pb.GenerateRequest(text="hi", sampling=_sp(temperature=math.nan))),
    ("top_p", pb.GenerateRequest(text="hi", sampling=_sp(top_p=0))),
    ("top_p", pb.GenerateRequest(text="hi", sampling=_sp(top_p=1.5))),
    ("top_k", pb.GenerateRequest(text="hi", sampling=_sp(top_k=-3))),
    ("max_tokens", pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=0))),
    ("min_tokens", pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=2, min_tokens=5))),
    ("presence_penalty", pb.GenerateRequest(text="hi", sampling=_sp(presence_penalty=3))),
    ("logprobs", pb.GenerateRequest(text="hi", sampling=_sp(logprobs=50))),
    ("stop", pb.GenerateRequest(text="hi", sampling=_sp(stop=[""]))),
    ("text", pb.GenerateRequest(text="")),
    ("input", pb.GenerateRequest()),
    ("token_ids.ids[1]", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999999]))),
    ("prompt", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]))),
    ("prompt", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * LONG_CONTEXT))),
    ("max_tokens", pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=LONG_CONTEXT))),
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
    call = server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS, request_id="dup"))
    next(call)
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub.Generate(request(request_id="dup"), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(
        "request_id:"
    )
    call.cancel()
    assert server.engine_idle()


def test_a_cancelled_id_sent_again_at_once_gets_a_stream_of_its_own(server: ServerProcess) -> None:
    """A retry with the id of a call just cancelled is refused while the old request may still be in
    a step (INVALID_ARGUMENT naming request_id), then served whole: never the old request's tokens,
    never a call that hangs."""
    call = server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS, request_id="again"))
    next(call)
    call.cancel()
    for _ in range(200):
        try:
            responses = list(server.stub.Generate(request(max_tokens=3, request_id="again"), timeout=30))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.details().startswith("request_id:")
            time.sleep(0.02)
    else:
        pytest.fail("the id stayed refused for 4 s after its call was cancelled")
    # responses that queued while the writer was behind come merged ([1, 3] in CI once): each says
    # how many tokens the stream has carried so far, 3 in all, none of the old request's
    with_tokens = [r for r in responses if r.token_ids]
    carried = list(itertools.accumulate(len(r.token_ids) for r in with_tokens))
    assert [r.completion_tokens for r in with_tokens] == carried and carried[-1] == 3, responses
    assert server.engine_idle()


def test_tokenize_detokenize_model_info_health_and_reflection(server: ServerProcess) -> None:
    ids = list(server.stub.Tokenize(pb.TokenizeRequest(text="Hello world")).token_ids)
    assert server.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "Hello world"
    info = server.stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.model_name, info.num_kv_blocks, info.block_size, info.tensor_parallel_size) == (
        SERVED_NAME,
        LONG_NUM_KV_BLOCKS,
        16,
        1,
    )
    assert info.kv_capacity_tokens == LONG_NUM_KV_BLOCKS * 16 and info.max_context_length == LONG_CONTEXT
    assert server.stub.Health(pb.HealthRequest(deep=True)).ready
    live = server.health.Check(health_pb2.HealthCheckRequest(service=""))
    assert live.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {
        "pagedserve.rpc.v1.Generation",
        "grpc.health.v1.Health",
        "inference.GRPCInferenceService",
    } <= names
    # grpcurl's `describe`: every listed service's file, the adapter's (kept in a pool of its own) too
    for name in names:
        (reply,) = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=name)])
        )
        assert not reply.HasField("error_response"), (name, reply.error_response)
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in reply.file_descriptor_response.file_descriptor_proto
        ]
        assert name.rsplit(".", 1)[1] in {s.name for f in files for s in f.service}, name


def test_metrics_endpoint_counts_requests(server: ServerProcess) -> None:
    import urllib.request

    labels = {"finished_reason": "length", "model_name": SERVED_NAME}
    before = server.metric("vllm:request_success_total", **labels)
    stream_text(server.stub, request(max_tokens=3))
    assert server.metric("vllm:request_success_total", **labels) == before + 1
    ready = urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/v2/health/ready")
    assert ready.status == 200


def test_stream_interval_sends_tokens_n_to_a_response_after_the_first(
    long_llama_dir: str, server: ServerProcess, tmp_path: Path
) -> None:
    req = request("Count with me", max_tokens=10)
    text, ids, reason = stream_text(server.stub, req)  # one response a token
    proc = long_server(long_llama_dir, tmp_path / "server.log", "--stream-interval", "4", "--enforce-eager")
    try:
        responses = list(proc.stub.Generate(req, timeout=60))
    finally:
        proc.stop()
    # [1, 4, 4, 1] tokens a response; where the server's writer fell behind the engine (a loaded
    # host), the responses that queued meanwhile come merged, so a response may end after 5 or 9
    # tokens but never elsewhere: the interval holds the engine's deltas, the merge only joins them
    ends = [r.completion_tokens for r in responses]
    assert set(ends) <= {1, 5, 9, 10} and ends == sorted(set(ends)) and ends[-1] == 10, ends
    assert [len(r.token_ids) for r in responses] == [b - a for a, b in zip([0, *ends], ends)]
    assert [t for r in responses for t in r.token_ids] == ids
    assert "".join(r.text for r in responses) == text
    assert responses[-1].finish_reason == reason == pb.LENGTH


def test_bounded_queue_answers_resource_exhausted(long_llama_dir: str, tmp_path: Path) -> None:
    proc = long_server(
        long_llama_dir,
        tmp_path / "server.log",
        *("--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--max-queued-requests", "1"),
    )
    try:
        running = proc.stub.Generate(request(max_tokens=LONG_MAX_TOKENS, request_id="running"))
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
        assert wait_until(lambda: proc.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
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


SHUTDOWN_TIMEOUT_S = 2.0


def test_sigterm_drain_aborts_a_stream_that_outlives_the_shutdown_timeout(
    long_llama_dir: str, tmp_path: Path
) -> None:
    proc = long_server(long_llama_dir, tmp_path / "server.log", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        call = proc.stub.Generate(request(max_tokens=LONG_MAX_TOKENS), timeout=60)
        num_before = len(next(call).token_ids)
        proc.proc.terminate()
        signalled = time.monotonic()
        rest = list(call)  # the call ends with OK status: its last message carries the abort
        waited = time.monotonic() - signalled
        assert rest[-1].finish_reason == pb.ABORTED and rest[-1].error, rest[-1]
        num_after = sum(len(r.token_ids) for r in rest)
        assert num_after > 0  # it kept generating through the grace period...
        assert 0.9 * SHUTDOWN_TIMEOUT_S <= waited < SHUTDOWN_TIMEOUT_S + 15, waited  # ...for about that long
        assert num_before + num_after < LONG_MAX_TOKENS
        assert proc.proc.wait(timeout=30) == 0, proc.log.read_text()[-2000:]
    finally:
        proc.stop()
