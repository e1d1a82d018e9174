"""Request spans through the real front ends: our gRPC Generate and Complete, the Triton
ModelStreamInfer adapter (real tritonclient in a child process) and KServe REST generate_stream, all
against one in-process server whose tracer provider exports to memory. Each request must yield one
SERVER span under the caller's W3C trace with the gen_ai attributes, latency attributes, child spans
tokenize, queue, prefill, decode in order, and preemption/swap events when they happen. A request
refused before it ran (every generation RPC of ours, KServe v2 gRPC and REST, Triton's stream) yields
its one SERVER span too: status ERROR with the refusal's message, and the reason
pagedserve:request_rejections counts it by."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from inprocess_server import InProcessServer, exporting_to, run_python, wait_for
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve_adapters.v2 import inference_pb2 as v2
from pagedserve_adapters.v2 import inference_pb2_grpc as v2_grpc

MODEL = "tiny"
PHASES = ["tokenize", "queue", "prefill", "decode"]
PARENT_SPAN_ID = 0x00F067AA0BA902B7
_trace_ids = iter(range(0x4BF92F3577B34DA6A3CE929D0E0E4700, 0x4BF92F3577B34DA6A3CE929D0E0E4800))


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = exporting_to(exporter)
    yield provider
    provider.shutdown()


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, provider: TracerProvider) -> InProcessServer:
    """Room for one long request: nothing is preempted here."""
    srv = InProcessServer(
        tiny_llama_dir, provider, dtype="float32", served_model_name=MODEL, num_kv_blocks=256, block_size=8
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tight_server(tiny_llama_dir: str, provider: TracerProvider) -> InProcessServer:
    """16 KV blocks of 8 tokens and a roomy CPU pool: two 80-token requests cannot run together, so
    the younger one is swapped out and back in."""
    srv = InProcessServer(
        tiny_llama_dir,
        provider,
        dtype="float32",
        served_model_name=MODEL,
        num_kv_blocks=16,
        block_size=8,
        num_cpu_kv_blocks=64,
        preemption_mode="swap",
        enable_prefix_caching=False,
    ).start()
    yield srv
    srv.stop()


def new_trace() -> tuple[int, list[tuple[str, str]]]:
    trace_id = next(_trace_ids)
    traceparent = f"00-{trace_id:032x}-{PARENT_SPAN_ID:016x}-01"
    return trace_id, [("traceparent", traceparent), ("tracestate", "vendor=v1")]


def request_spans(exporter: InMemorySpanExporter, trace_id: int, num_requests: int = 1) -> list[ReadableSpan]:
    """All spans of the trace, once its `num_requests` server spans have ended (they end just after
    the call's last response is sent)."""

    def spans() -> list[ReadableSpan] | None:
        found = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        servers = [s for s in found if s.kind is SpanKind.SERVER]
        return found if len(servers) >= num_requests else None

    return wait_for(spans, what=f"{num_requests} server spans of trace {trace_id:032x}")


def check_span_shape(spans: list[ReadableSpan], trace_id: int, **expected: Any) -> ReadableSpan:
    """Exactly one SERVER span, child of the caller's span, with the attributes in `expected`
    (gen_ai.* names without the prefix) and the four phases in order inside it."""
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(servers) == 1, [s.name for s in servers]
    span = servers[0]
    assert span.name == "llm_request"
    assert span.context.trace_id == trace_id
    assert span.parent is not None and span.parent.is_remote and span.parent.span_id == PARENT_SPAN_ID
    assert span.context.trace_state.get("vendor") == "v1"
    attrs = span.attributes
    for name, value in expected.items():
        actual = attrs[f"gen_ai.{name}"]
        assert actual == (pytest.approx(value) if isinstance(value, float) else value), name
    assert attrs["gen_ai.request.model"] == MODEL
    assert "error.type" not in attrs and span.status.status_code is not StatusCode.ERROR  # it succeeded
    latency = {k: attrs[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e")}
    assert 0 <= latency["time_in_queue"] < latency["time_to_first_token"] < latency["e2e"]
    assert latency["e2e"] <= (span.end_time - span.start_time) / 1e9 + 1e-6

    children = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id),
        key=lambda s: s.start_time,
    )
    assert [c.name for c in children] == PHASES
    assert all(c.context.trace_id == trace_id for c in children)
    assert span.start_time == children[0].start_time and children[-1].end_time == span.end_time
    for before, after in zip(children, children[1:]):
        assert before.end_time <= after.start_time, (before.name, after.name)
    queue, prefill = children[1], children[2]
    assert (queue.end_time - queue.start_time) / 1e9 == pytest.approx(latency["time_in_queue"], abs=1e-6)
    assert (prefill.end_time - queue.start_time) / 1e9 == pytest.approx(
        latency["time_to_first_token"], abs=1e-6
    )
    return span


def stream(server: InProcessServer, req: pb.GenerateRequest, metadata: Any, **kwargs: Any) -> list[Any]:
    return list(server.stub.Generate(req, metadata=metadata, timeout=60, **kwargs))


def token_request(
    prompt: list[int], max_tokens: int, request_id: str = "", **sampling: Any
) -> pb.GenerateRequest:
    params = pb.SamplingParameters(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=params)


# -- our gRPC API ------------------------------------------------------------------------------------


def test_generate_stream_span_continues_the_callers_trace(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    trace_id, metadata = new_trace()
    prompt = [1, 415, 2936, 9060, 285, 1802, 20]
    req = token_request(prompt, 12, request_id="traced-gen", temperature=0.7, top_p=0.9, seed=3)
    started = time.monotonic()
    responses = stream(server, req, metadata)
    elapsed = time.monotonic() - started
    num_tokens = sum(len(r.token_ids) for r in responses)
    assert num_tokens == 12 and responses[-1].finish_reason == pb.LENGTH

    span = check_span_shape(
        request_spans(exporter, trace_id),
        trace_id,
        **{
            "request.id": "traced-gen",
            "request.max_tokens": 12,
            "request.temperature": 0.7,
            "request.top_p": 0.9,
            "usage.prompt_tokens": len(prompt),
            "usage.completion_tokens": 12,
            "response.finish_reasons": ("length",),
        },
    )
    assert span.attributes["gen_ai.latency.e2e"] < elapsed
    assert not span.events  # nothing was preempted


def test_complete_records_the_same_span(server: InProcessServer, exporter: InMemorySpanExporter) -> None:
    trace_id, metadata = new_trace()
    prompt = [1, 2, 3, 4, 5]
    reply = server.stub.Complete(
        token_request(prompt, 6, request_id="traced-complete", temperature=0.0), metadata=metadata, timeout=60
    )
    assert len(reply.completions[0].token_ids) == 6
    check_span_shape(
        request_spans(exporter, trace_id),
        trace_id,
        **{
            "request.id": "traced-complete",
            "request.max_tokens": 6,
            "request.temperature": 0.0,
            "usage.prompt_tokens": len(prompt),
            "usage.completion_tokens": 6,
            "response.finish_reasons": ("length",),
        },
    )


def test_abort_rpc_span_has_the_requests_own_timing_and_counts(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    trace_id, metadata = new_trace()
    prompt = [1, 7, 8, 9]
    started = time.monotonic()
    responses = server.stub.Generate(
        token_request(prompt, 1000, request_id="to-abort", temperature=0.0), metadata=metadata, timeout=60
    )
    received = []
    for response in responses:
        received.append(response)
        if len(received) == 1:
            assert server.stub.Abort(pb.AbortRequest(request_ids=["to-abort"])).aborted_request_ids == [
                "to-abort"
            ]
    elapsed = time.monotonic() - started
    final = received[-1]
    num_tokens = sum(len(r.token_ids) for r in received)
    assert final.finish_reason == pb.ABORTED and 1 <= num_tokens < 1000
    assert (final.prompt_tokens, final.completion_tokens) == (len(prompt), num_tokens)

    span = check_span_shape(
        request_spans(exporter, trace_id),
        trace_id,
        **{
            "request.id": "to-abort",
            "usage.prompt_tokens": len(prompt),
            "usage.completion_tokens": num_tokens,
            "response.finish_reasons": ("aborted",),
        },
    )
    assert span.attributes["gen_ai.latency.e2e"] < elapsed  # not the time since the server started


def test_client_cancel_span_is_aborted(server: InProcessServer, exporter: InMemorySpanExporter) -> None:
    trace_id, metadata = new_trace()
    call = server.stub.Generate(
        token_request([1, 5, 6], 1000, request_id="to-cancel", temperature=0.0), metadata=metadata, timeout=60
    )
    num_tokens = len(next(call).token_ids)
    call.cancel()
    span = check_span_shape(
        request_spans(exporter, trace_id),
        trace_id,
        **{"request.id": "to-cancel", "usage.prompt_tokens": 3, "response.finish_reasons": ("aborted",)},
    )
    assert num_tokens <= span.attributes["gen_ai.usage.completion_tokens"] < 1000


def test_preemption_and_swap_events(tight_server: InProcessServer, exporter: InMemorySpanExporter) -> None:
    trace_id, metadata = new_trace()
    stats_before = tight_server.llm.stats()
    prompts = [[1, *range(100 + 20 * i, 119 + 20 * i)] for i in range(3)]  # 20 tokens each
    results: dict[int, list[Any]] = {}

    def run(i: int) -> None:
        req = token_request(prompts[i], 60, request_id=f"tight-{i}", temperature=0.0)
        results[i] = stream(tight_server, req, metadata)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(sum(len(r.token_ids) for r in results[i]) == 60 for i in range(len(prompts)))
    stats = tight_server.llm.stats()
    num_swaps = stats.num_swap_preemptions - stats_before.num_swap_preemptions
    assert num_swaps > 0  # the workload's premise

    spans = request_spans(exporter, trace_id, num_requests=len(prompts))
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert sorted(s.attributes["gen_ai.request.id"] for s in servers) == [f"tight-{i}" for i in range(3)]
    num_preemption_events = 0
    for span in servers:
        events = [(e.name, e.timestamp) for e in span.events]
        preemptions = [e for e in span.events if e.name == "preemption"]
        assert len(preemptions) == span.attributes["gen_ai.pagedserve.num_preemptions"]
        num_preemption_events += len(preemptions)
        for event in preemptions:
            assert event.attributes["gen_ai.pagedserve.preemption_mode"] == "swap"
        names = [name for name, _ in events]
        # every swap-out is followed by its swap-in (all requests completed), in time order
        assert names == ["preemption", "swap_out", "swap_in"] * len(preemptions)
        times = [t for _, t in events]
        assert times == sorted(times) and all(span.start_time <= t <= span.end_time for t in times)
    assert num_preemption_events == stats.num_preemptions - stats_before.num_preemptions


# -- the adapters ------------------------------------------------------------------------------------

TRITON_CLIENT = """
import json, queue, sys
import numpy as np
import tritonclient.grpc as tgrpc

port, model, traceparent = sys.argv[1:4]
responses = queue.Queue()
with tgrpc.InferenceServerClient(f"127.0.0.1:{port}") as client:
    client.start_stream(
        callback=lambda result, error: responses.put((result, error)),
        headers={"traceparent": traceparent, "tracestate": "vendor=v1"},
    )
    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"The capital of France is"], dtype=object))
    stream = tgrpc.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    params = {"temperature": 0, "max_tokens": 7, "ignore_eos": True}
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    client.async_stream_infer(model, [text, stream, sampling], request_id="triton-1")
    texts = []
    while True:
        result, error = responses.get(timeout=60)
        assert error is None, error
        texts.append(result.as_numpy("text_output")[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
print(json.dumps({"num_responses": len(texts)}))
"""


def test_triton_stream_infer_yields_the_same_span(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    trace_id, metadata = new_trace()
    out = run_python(TRITON_CLIENT, str(server.port), MODEL, dict(metadata)["traceparent"])
    # one response a token, unless the writer fell behind the engine and merged some (a loaded host:
    # CI once read 6); the span's count below is the tokens'
    assert 0 < json.loads(out.strip().splitlines()[-1])["num_responses"] <= 7
    prompt_tokens = len(server.llm.encode_prompt("The capital of France is"))
    span = check_span_shape(
        request_spans(exporter, trace_id),
        trace_id,
        **{
            "request.max_tokens": 7,
            "request.temperature": 0.0,
            "usage.prompt_tokens": prompt_tokens,
            "usage.completion_tokens": 7,
            "response.finish_reasons": ("length",),
        },
    )
    assert span.attributes["gen_ai.request.id"].startswith("v2-")
    assert span.attributes["gen_ai.pagedserve.client_request_id"] == "triton-1"  # the client's own


def test_rest_generate_stream_yields_the_same_span(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    trace_id, metadata = new_trace()
    body = {
        "id": "rest-1",
        "text_input": "Hello there",
        "parameters": {"temperature": 0, "max_tokens": 5, "ignore_eos": True},
    }
    req = urllib.request.Request(
        server.http_url(f"/v2/models/{MODEL}/generate_stream"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **dict(metadata)},
    )
    with urllib.request.urlopen(req, timeout=60) as reply:
        lines = reply.read().decode().splitlines()
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    # Five tokens come in one to five events: a stream merges the deltas a slow reader has not taken yet.
    assert 1 <= len(events) <= 5, events
    assert all(event["id"] == "rest-1" for event in events), events
    assert "".join(event["text_output"] for event in events), events
    check_span_shape(
        request_spans(exporter, trace_id),
        trace_id,
        **{
            "request.max_tokens": 5,
            "usage.prompt_tokens": len(server.llm.encode_prompt("Hello there")),
            "usage.completion_tokens": 5,
            "response.finish_reasons": ("length",),
            "pagedserve.client_request_id": "rest-1",
        },
    )


# -- refused requests --------------------------------------------------------------------------------

REJECTION_REASON = "gen_ai.pagedserve.rejection_reason"


def refusal_spans(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    """The trace's spans once its first server span has ended and a moment has passed: time for a
    second one of the call (the refused request traced again, as aborted, when its call ends) to show."""
    request_spans(exporter, trace_id)
    time.sleep(0.3)
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def check_refusal_span(
    spans: list[ReadableSpan], trace_id: int, reason: str, description: str, **expected: Any
) -> ReadableSpan:
    """Exactly one SERVER span, child of the caller's span, with status ERROR and `description`, the
    refusal `reason`, the attributes in `expected` (gen_ai.* names without the prefix), and no phases
    (the engine never ran the request)."""
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(servers) == 1, [(s.name, s.attributes) for s in servers]
    span = servers[0]
    assert span.name == "llm_request"
    assert span.context.trace_id == trace_id
    assert span.parent is not None and span.parent.is_remote and span.parent.span_id == PARENT_SPAN_ID
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == description
    assert span.attributes[REJECTION_REASON] == reason
    assert span.attributes["error.type"] == reason  # OpenTelemetry's class of the error
    for name, value in expected.items():
        assert span.attributes.get(f"gen_ai.{name}") == value, name
    assert "gen_ai.response.finish_reasons" not in span.attributes  # nothing ran to finish
    assert not [s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id]
    assert span.start_time <= span.end_time
    return span


def refused_grpc(call: Any, code: grpc.StatusCode) -> str:
    """The details of a call that must fail with `code`."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    return str(info.value.details())


@contextmanager
def server_status(srv: InProcessServer, status: str) -> Iterator[None]:
    """The server in `status` (draining: refusing new requests) for the block's calls."""
    state = srv.server.state
    state.status = status
    try:
        yield
    finally:
        state.status = "serving"


@contextmanager
def queue_bound(srv: InProcessServer, bound: int, once_admitted: bool = False) -> Iterator[None]:
    """The engine queues no more than `bound` requests; `once_admitted`: from the moment a request has
    been checked and tokenized (another request took the last place meanwhile), so that the engine
    refuses it as it starts it."""
    engine = srv.server.engine
    real_bound, real_prepare = engine.max_queued_requests, engine.prepare

    async def prepare(*args: Any, **kwargs: Any) -> list[int]:
        prompt: list[int] = await real_prepare(*args, **kwargs)
        engine.max_queued_requests = bound
        return prompt

    if once_admitted:
        engine.prepare = prepare
    else:
        engine.max_queued_requests = bound
    try:
        yield
    finally:
        engine.max_queued_requests = real_bound
        if once_admitted:
            del engine.prepare


def test_generate_refused_for_a_bad_field_has_an_error_span(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    trace_id, metadata = new_trace()
    req = token_request([1, 2, 3], 1_000_000, request_id="too-long", temperature=0.5)
    details = refused_grpc(lambda: stream(server, req, metadata), grpc.StatusCode.INVALID_ARGUMENT)
    check_refusal_span(
        refusal_spans(exporter, trace_id),
        trace_id,
        "invalid",
        details,
        **{
            "request.id": "too-long",
            "request.model": MODEL,
            "request.max_tokens": 1_000_000,
            "request.temperature": 0.5,
        },
    )


def test_complete_refused_for_an_unknown_model_names_it(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    trace_id, metadata = new_trace()
    req = token_request([1, 2, 3], 4)
    req.model = "no-such-model"
    details = refused_grpc(
        lambda: server.stub.Complete(req, metadata=metadata, timeout=60), grpc.StatusCode.INVALID_ARGUMENT
    )
    span = check_refusal_span(
        refusal_spans(exporter, trace_id), trace_id, "invalid", details, **{"request.model": "no-such-model"}
    )
    assert "gen_ai.request.id" not in span.attributes  # refused before an id was assigned


def test_embed_refused_has_an_error_span(server: InProcessServer, exporter: InMemorySpanExporter) -> None:
    trace_id, metadata = new_trace()
    req = pb.EmbedRequest(request_id="empty-embed", text="")
    details = refused_grpc(
        lambda: server.stub.Embed(req, metadata=metadata, timeout=60), grpc.StatusCode.INVALID_ARGUMENT
    )
    check_refusal_span(
        refusal_spans(exporter, trace_id),
        trace_id,
        "invalid",
        details,
        **{"request.id": "empty-embed", "operation.name": "embeddings"},
    )


def test_generate_refused_while_draining_has_an_unavailable_span(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    trace_id, metadata = new_trace()
    req = token_request([1, 2, 3], 4, request_id="while-draining")
    with server_status(server, "draining"):
        details = refused_grpc(lambda: stream(server, req, metadata), grpc.StatusCode.UNAVAILABLE)
    assert details == "server is draining"
    span = check_refusal_span(refusal_spans(exporter, trace_id), trace_id, "unavailable", details)
    assert "gen_ai.request.max_tokens" not in span.attributes  # refused before it was read


@pytest.mark.parametrize("once_admitted", [False, True], ids=["at-admission", "at-its-start"])
def test_generate_refused_on_a_full_queue_has_one_error_span(
    server: InProcessServer, exporter: InMemorySpanExporter, once_admitted: bool
) -> None:
    """The queue full at admission, or only once the request was admitted (the engine refuses it as it
    starts it): one span either way, the refusal's, not an aborted request's."""
    trace_id, metadata = new_trace()
    rid = f"queue-full-{once_admitted}"
    req = token_request([1, 2, 3], 4, request_id=rid)
    with queue_bound(server, 0, once_admitted):
        details = refused_grpc(lambda: stream(server, req, metadata), grpc.StatusCode.RESOURCE_EXHAUSTED)
    check_refusal_span(
        refusal_spans(exporter, trace_id),
        trace_id,
        "queue_full",
        details,
        **{"request.id": rid, "request.max_tokens": 4},
    )


def v2_request(model: str, text: str = "Hello", **parameters: Any) -> v2.ModelInferRequest:
    req = v2.ModelInferRequest(model_name=model, id="client-id")
    text_input = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text_input.contents.bytes_contents.append(text.encode())
    sampling = req.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    sampling.contents.bytes_contents.append(json.dumps(parameters).encode())
    return req


def test_kserve_grpc_infer_refusals_have_error_spans(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    stub = v2_grpc.GRPCInferenceServiceStub(server.channel)

    def infer(req: v2.ModelInferRequest, metadata: Any) -> None:
        stub.ModelInfer(req, metadata=metadata, timeout=60)

    trace_id, metadata = new_trace()
    details = refused_grpc(lambda: infer(v2_request("no-such-model"), metadata), grpc.StatusCode.NOT_FOUND)
    check_refusal_span(
        refusal_spans(exporter, trace_id),
        trace_id,
        "not_found",
        details,
        **{"request.model": "no-such-model", "pagedserve.client_request_id": "client-id"},
    )

    trace_id, metadata = new_trace()
    req = v2_request(MODEL, max_tokens=3, temperature=-1)
    details = refused_grpc(lambda: infer(req, metadata), grpc.StatusCode.INVALID_ARGUMENT)
    check_refusal_span(
        refusal_spans(exporter, trace_id),
        trace_id,
        "invalid",
        details,
        **{"pagedserve.client_request_id": "client-id"},
    )

    trace_id, metadata = new_trace()
    with queue_bound(server, 0, once_admitted=True):
        req = v2_request(MODEL, max_tokens=3, temperature=0)
        details = refused_grpc(lambda: infer(req, metadata), grpc.StatusCode.RESOURCE_EXHAUSTED)
    span = check_refusal_span(
        refusal_spans(exporter, trace_id), trace_id, "queue_full", details, **{"request.max_tokens": 3}
    )
    assert span.attributes["gen_ai.request.id"].startswith("v2-")  # the engine's id, as accepted ones


def test_triton_stream_infer_refusals_have_error_spans(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    """Each refused request on a ModelStreamInfer stream: an error message on the stream, and a span."""
    stub = v2_grpc.GRPCInferenceServiceStub(server.channel)
    for model, parameters, reason in (
        ("no-such-model", {}, "not_found"),
        (MODEL, {"max_tokens": "many"}, "invalid"),
    ):
        trace_id, metadata = new_trace()
        replies = list(
            stub.ModelStreamInfer(iter([v2_request(model, **parameters)]), metadata=metadata, timeout=60)
        )
        assert len(replies) == 1 and replies[0].error_message, replies
        assert replies[0].infer_response.id == "client-id"
        check_refusal_span(
            refusal_spans(exporter, trace_id),
            trace_id,
            reason,
            replies[0].error_message,
            **{"pagedserve.client_request_id": "client-id"},
        )
    trace_id, metadata = new_trace()
    with server_status(server, "draining"):
        replies = list(stub.ModelStreamInfer(iter([v2_request(MODEL)]), metadata=metadata, timeout=60))
    check_refusal_span(refusal_spans(exporter, trace_id), trace_id, "unavailable", replies[0].error_message)


def post_json(server: InProcessServer, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(
        server.http_url(path), data=body, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, json.loads(reply.read()).get("error", "")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


def test_kserve_rest_infer_refusals_have_error_spans(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    infer_body = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hello"]}],
        "parameters": {"max_tokens": 3},
    }
    cases = [
        ("/v2/models/no-such-model/infer", json.dumps(infer_body).encode(), 404, "not_found"),
        (f"/v2/models/{MODEL}/infer", b"{not json", 400, "invalid"),
        (f"/v2/models/{MODEL}/generate_stream", b'{"text_input": ""}', 400, "invalid"),
    ]
    for path, body, status, reason in cases:
        trace_id, metadata = new_trace()
        code, error = post_json(server, path, body, dict(metadata))
        assert code == status, error
        check_refusal_span(refusal_spans(exporter, trace_id), trace_id, reason, error)
    trace_id, metadata = new_trace()  # a request refused once its `id` was read: the span keeps it
    body = json.dumps({"id": "rest-client-id", "parameters": {"max_tokens": 3}}).encode()
    code, error = post_json(server, f"/v2/models/{MODEL}/generate", body, dict(metadata))
    assert code == 400 and "text_input" in error, error
    check_refusal_span(
        refusal_spans(exporter, trace_id),
        trace_id,
        "invalid",
        error,
        **{"pagedserve.client_request_id": "rest-client-id"},
    )
    trace_id, metadata = new_trace()
    with server_status(server, "draining"):
        code, error = post_json(
            server, f"/v2/models/{MODEL}/infer", json.dumps(infer_body).encode(), dict(metadata)
        )
    assert code == 503, error
    check_refusal_span(refusal_spans(exporter, trace_id), trace_id, "unavailable", error)
    trace_id, metadata = new_trace()
    with queue_bound(server, 0):
        code, error = post_json(
            server, f"/v2/models/{MODEL}/infer", json.dumps(infer_body).encode(), dict(metadata)
        )
    assert code == 429, error
    check_refusal_span(
        refusal_spans(exporter, trace_id), trace_id, "queue_full", error, **{"request.max_tokens": 3}
    )


# -- tracing off ---------------------------------------------------------------------------------------


class SpyProcessor:
    """A span processor that only counts what it is shown."""

    def __init__(self) -> None:
        self.num_started = self.num_ended = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.num_started += 1

    def on_end(self, span: Any) -> None:
        self.num_ended += 1

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


@pytest.fixture()
def global_spy() -> SpyProcessor:
    """A spy on the process-wide tracer provider (the one `opentelemetry.trace.get_tracer` uses); the
    global is put back afterwards, as OpenTelemetry's own test helpers do."""
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    spy = SpyProcessor()
    global_provider = TracerProvider()
    global_provider.add_span_processor(spy)
    saved = trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = None, Once()
    trace.set_tracer_provider(global_provider)
    yield spy
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
    global_provider.shutdown()


def test_default_settings_install_no_tracer_and_record_nothing(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch, global_spy: SpyProcessor
) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "PAGEDSERVE_TRACES_EXPORTER", "PAGEDSERVE_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    srv = InProcessServer(tiny_llama_dir, dtype="float32", served_model_name=MODEL, num_kv_blocks=64).start()
    try:
        assert srv.tracer.provider is None and not srv.tracer.enabled  # no provider, so no processor
        _, metadata = new_trace()  # a caller's trace headers alone do not switch tracing on
        responses = stream(srv, token_request([1, 2, 3], 4, temperature=0.0), metadata)
        assert sum(len(r.token_ids) for r in responses) == 4
        with pytest.raises(grpc.RpcError):  # and a cancelled call records nothing either
            call = srv.stub.Generate(token_request([1, 2, 3], 1000, temperature=0.0), metadata=metadata)
            next(call)
            call.cancel()
            list(call)
        # nor do refused requests
        too_long = token_request([1, 2, 3], 1_000_000)
        refused_grpc(lambda: stream(srv, too_long, metadata), grpc.StatusCode.INVALID_ARGUMENT)
        assert post_json(srv, "/v2/models/no-such-model/infer", b"{}", dict(metadata))[0] == 404
    finally:
        srv.stop()
    assert (global_spy.num_started, global_spy.num_ended) == (0, 0)
