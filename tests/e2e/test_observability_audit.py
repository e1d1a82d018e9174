"""Observability at its edges, the same through every front end (our gRPC API, KServe v2 REST, the
KServe v2 / Triton gRPC adapter): a request failed by a dead engine, or by a model fault under one
of its n completions, ends its span with ERROR and counts as failed; a deep health check on a full
queue answers not-ready in one log line; `pagedserve generate` takes its flags from PAGEDSERVE_*
variables as `serve` does; `vllm:request_success` uses vLLM's finish reasons, and
`pagedserve:request_aborts` tells a deadline from a cancel on the adapter too.

The servers run in the test process (inprocess_server.py), so a test owns the tracer provider and can
inject a fault into the live engine. Nothing else is stubbed."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from inprocess_server import InProcessServer, Samples, exporting_to, scrape, server_span, wait_for
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pagedserve.errors import EngineDeadError
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.telemetry import ENGINE_ERROR

MODEL = "tiny"
MAX_TOKENS = 900  # seconds of tokens on the tiny model: still running when the fault is injected
FAULT = "injected: rank 1 lost"


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def sse_events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")
    ]


def traceparent(trace_id: int) -> str:
    return f"00-{trace_id:032x}-00f067aa0ba902b7-01"


# -- a dead engine: every front end's span ends with ERROR ------------------------------------------

GRPC_TRACE, REST_TRACE, TRITON_TRACE = 0xA1, 0xA2, 0xA3


@dataclass
class EngineDeath:
    """What clients and the server showed after the engine died under three running requests."""

    grpc_error: grpc.RpcError
    rest_events: list[dict[str, Any]]
    triton_error: grpc.RpcError
    spans: dict[int, ReadableSpan]  # server span by trace id
    before: Samples
    after: Samples


def triton_infer_request(max_tokens: int) -> Any:
    """A unary KServe v2 / Triton ModelInferRequest in raw form, as tritonclient builds it."""
    from pagedserve_adapters.v2 import inference_pb2 as v2

    request = v2.ModelInferRequest(model_name=MODEL, id="triton-doomed")
    sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}).encode()
    for name, raw in (("text_input", b"Hello"), ("sampling_parameters", sampling)):
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
        request.raw_input_contents.append(struct.pack("<I", len(raw)) + raw)
    return request


@pytest.fixture(scope="module")
def engine_death(tiny_llama_dir: str) -> EngineDeath:
    from pagedserve_adapters.v2 import inference_pb2_grpc as v2_grpc

    exporter = InMemorySpanExporter()
    provider = exporting_to(exporter)
    srv = InProcessServer(
        tiny_llama_dir, provider, dtype="float32", served_model_name=MODEL, num_kv_blocks=256
    )
    srv.start()
    try:
        before = scrape(srv)
        params = pb.SamplingParameters(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        grpc_call = srv.stub.Generate(
            pb.GenerateRequest(request_id="grpc-doomed", text="Hello", sampling=params),
            metadata=[("traceparent", traceparent(GRPC_TRACE))],
            timeout=60,
        )
        next(grpc_call)
        body = {"text_input": "Hello", "parameters": {"max_tokens": MAX_TOKENS, "ignore_eos": True}}
        rest = urllib.request.urlopen(
            urllib.request.Request(
                srv.http_url(f"/v2/models/{MODEL}/generate_stream"),
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "traceparent": traceparent(REST_TRACE)},
            ),
            timeout=60,
        )
        rest_events = [json.loads(rest.readline().decode().removeprefix("data: "))]
        triton = v2_grpc.GRPCInferenceServiceStub(srv.channel).ModelInfer.future(
            triton_infer_request(MAX_TOKENS),
            metadata=[("traceparent", traceparent(TRITON_TRACE))],
            timeout=60,
        )
        wait_for(lambda: srv.llm.stats().num_running == 3, what="three running requests")

        def lost_rank(*args: object) -> None:
            raise EngineDeadError(FAULT)

        srv.llm.executor.execute = lost_rank  # the next step fails as a dead worker makes it
        with pytest.raises(grpc.RpcError) as grpc_info:
            list(grpc_call)
        with pytest.raises(grpc.RpcError) as triton_info:
            triton.result(timeout=60)
        rest_events += sse_events(rest.read().decode())
        rest.close()

        def server_spans() -> dict[int, ReadableSpan] | None:
            found = {
                s.context.trace_id: s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER
            }
            return found if {GRPC_TRACE, REST_TRACE, TRITON_TRACE} <= set(found) else None

        spans = wait_for(server_spans, what="the three requests' spans")
        return EngineDeath(grpc_info.value, rest_events, triton_info.value, spans, before, scrape(srv))
    finally:
        srv.stop()
        provider.shutdown()


@pytest.mark.slow
def test_every_front_end_fails_the_request_with_the_engines_reason(engine_death: EngineDeath) -> None:
    assert engine_death.grpc_error.code() == grpc.StatusCode.INTERNAL
    assert f"engine failed: {FAULT}" in engine_death.grpc_error.details()
    assert "error" not in engine_death.rest_events[0]  # the first token, then the failure
    assert FAULT in engine_death.rest_events[-1]["error"], engine_death.rest_events[-1]
    triton = engine_death.triton_error
    assert triton.code() == grpc.StatusCode.INTERNAL  # as on our API: a failure, not a refusal
    assert FAULT in triton.details(), triton.details()


@pytest.mark.slow
@pytest.mark.parametrize("trace_id", [GRPC_TRACE, REST_TRACE, TRITON_TRACE], ids=["grpc", "rest", "triton"])
def test_a_request_failed_by_a_dead_engine_ends_its_span_with_error(
    engine_death: EngineDeath, trace_id: int
) -> None:
    span = engine_death.spans[trace_id]
    assert span.status.status_code is StatusCode.ERROR, span.status
    assert FAULT in (span.status.description or "")
    assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert span.attributes["error.type"] == ENGINE_ERROR


@pytest.mark.slow
def test_requests_failed_by_a_dead_engine_are_counted_as_failed(engine_death: EngineDeath) -> None:
    """As a model fault's failed requests are: once each, finish reason error (the process exits
    soon after, but a scrape in between, or the last one before it, must not miss them)."""
    after, before = engine_death.after, engine_death.before

    def diff(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert diff("vllm:request_success_total", finished_reason="error") == 3
    assert diff("vllm:e2e_request_latency_seconds_count") == 3
    assert diff("vllm:request_prompt_tokens_count") == 3
    for reason in ("length", "stop"):
        assert diff("vllm:request_success_total", finished_reason=reason) == 0
    assert not diff("pagedserve:request_aborts_total", cause="client_cancel")  # failed, not cancelled


# -- a live server: deep health on a full queue, model faults ----------------------------------------


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, exporter: InMemorySpanExporter) -> InProcessServer:
    """Two sequences run at once and one request may wait: a third request fills the queue."""
    provider = exporting_to(exporter)
    srv = InProcessServer(
        tiny_llama_dir,
        provider,
        dtype="float32",
        served_model_name=MODEL,
        num_kv_blocks=256,
        max_num_seqs=2,
        max_queued_requests=1,
    ).start()
    yield srv
    srv.stop()
    provider.shutdown()


def long_request(request_id: str, n: int = 1) -> pb.GenerateRequest:
    params = pb.SamplingParameters(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=n)
    return pb.GenerateRequest(request_id=request_id, text="Hello", sampling=params)


def idle(srv: InProcessServer) -> bool:
    stats = srv.llm.stats()
    return stats.num_unfinished == 0 and stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.slow
def test_deep_health_on_a_full_queue_answers_not_ready_in_one_line(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A full queue is an answer (this server takes no more work now), not a fault: a probe every few
    seconds must not write a traceback each time."""
    running = []
    for i in range(2):  # one at a time: while one waits to be scheduled, the queue is full
        running.append(server.stub.Generate(long_request(f"busy-{i}"), timeout=60))
        next(running[-1])
    waiting = server.stub.Generate(long_request("waiting"), timeout=60)
    try:
        wait_for(lambda: server.stub.Health(pb.HealthRequest()).num_waiting == 1, what="a full queue")
        caplog.clear()
        with caplog.at_level("INFO", logger="pagedserve"):
            replies = [server.stub.Health(pb.HealthRequest(deep=True), timeout=10) for _ in range(3)]
        assert [(r.ready, r.status, r.num_waiting) for r in replies] == [(False, "serving", 1)] * 3
        lines = [r for r in caplog.records if r.name.startswith("pagedserve") and r.levelname != "INFO"]
        assert len(lines) <= 3, [r.getMessage() for r in lines]  # at most one line a probe
        for record in lines:
            assert record.exc_info is None and "\n" not in record.getMessage(), record.getMessage()
            assert "queued" in record.getMessage()  # and it says why
    finally:
        for call in [*running, waiting]:
            call.cancel()
    wait_for(lambda: idle(server), what="an idle engine")
    assert server.stub.Health(pb.HealthRequest(deep=True), timeout=60).ready  # and ready once it drains


def fail_next_step(srv: InProcessServer, message: str) -> None:
    """The engine's next model step raises once: a model fault fails that step's requests, not the
    engine."""
    executor = srv.llm.executor
    real = executor.execute

    def faulty(*args: object) -> None:
        executor.execute = real
        raise RuntimeError(message)

    executor.execute = faulty


@pytest.mark.slow
def test_a_model_fault_under_an_n_2_request_ends_its_span_with_error(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    """The call ends at its first failed completion, before the request's last delta: the span still
    says the request failed, and why, through our gRPC API and the KServe adapter alike."""
    wait_for(lambda: idle(server), what="an idle engine")
    call = server.stub.Generate(
        long_request("n2-grpc", n=2), metadata=[("traceparent", traceparent(0xB1))], timeout=60
    )
    next(call)
    fail_next_step(server, "injected model fault 1")
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.INTERNAL and "injected model fault 1" in info.value.details()

    wait_for(lambda: idle(server), what="an idle engine")
    body = {"text_input": "Hello", "parameters": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "n": 2}}
    with urllib.request.urlopen(
        urllib.request.Request(
            server.http_url(f"/v2/models/{MODEL}/generate_stream"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "traceparent": traceparent(0xB2)},
        ),
        timeout=60,
    ) as rest:
        rest.readline()
        fail_next_step(server, "injected model fault 2")
        events = sse_events(rest.read().decode())
    assert "injected model fault 2" in events[-1]["error"], events[-1]

    for trace_id, fault in ((0xB1, "injected model fault 1"), (0xB2, "injected model fault 2")):
        span = server_span(exporter, trace_id)
        assert span.status.status_code is StatusCode.ERROR and fault in (span.status.description or "")
        assert span.attributes["gen_ai.response.finish_reasons"] == ("error", "error")  # one a completion
        assert span.attributes["error.type"] == ENGINE_ERROR
        assert span.attributes["gen_ai.request.n"] == 2


# -- `pagedserve generate`: its flags are PAGEDSERVE_* variables too ----------------------------------


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    command = [sys.executable, "-m", "pagedserve", *args]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120, check=False)


def test_a_bad_generate_variable_stops_it_naming_the_variable(tiny_llama_dir: str) -> None:
    """Checked before the model loads, as `serve` checks its settings."""
    env = {
        "PAGEDSERVE_MODEL": tiny_llama_dir,
        "PAGEDSERVE_NUM_KV_BLOCKS": "64",
        "PAGEDSERVE_TEMPERATURE": "-1",
    }
    done = run_cli("generate", "--prompt", "Hello", env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pagedserve generate: error: PAGEDSERVE_TEMPERATURE: must be >= 0"), last_line
    assert "KV cache:" not in done.stderr  # no model was loaded


def test_generate_flags_come_from_pagedserve_variables_and_a_flag_wins(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedserve import LLM, SamplingParams
    from pagedserve.__main__ import main

    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    expected = {
        n: llm.generate("Hello", SamplingParams(max_tokens=n, temperature=0.0))[0].outputs[0].text.strip()
        for n in (3, 5)
    }
    assert expected[3] != expected[5]
    variables = {
        "PAGEDSERVE_MODEL": tiny_llama_dir,
        "PAGEDSERVE_DTYPE": "float32",
        "PAGEDSERVE_NUM_KV_BLOCKS": "64",
        "PAGEDSERVE_MAX_TOKENS": "3",
        "PAGEDSERVE_TEMPERATURE": "0",
        "PAGEDSERVE_CHAT": "false",  # --no-chat: the prompt as raw text, as above
    }
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert main(["generate", "--prompt", "Hello"]) == 0
    assert capsys.readouterr().out.strip() == expected[3]
    assert main(["generate", "--prompt", "Hello", "--max-tokens", "5"]) == 0  # the flag beats the variable
    assert capsys.readouterr().out.strip() == expected[5]


# -- metrics: vLLM's label values ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_request_ended_by_eos_counts_as_vllms_stop(server: InProcessServer) -> None:
    """vLLM counts a request ended by the end-of-sequence token under finished_reason="stop" (its
    reasons are stop, length, abort): a dashboard's `{finished_reason="stop"}` must see it."""
    wait_for(lambda: idle(server), what="an idle engine")
    prompt = pb.TokenIds(ids=[1, 415, 2936, 9060])
    greedy = pb.SamplingParameters(max_tokens=3, temperature=0.0)
    tokens = [
        t
        for r in server.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=greedy))
        for t in r.token_ids
    ]
    llm, eos_token_ids = server.llm, server.llm.eos_token_ids
    llm.eos_token_ids = frozenset({tokens[-1]})  # this model's end-of-sequence token, for one request
    try:
        before = scrape(server)
        replies = list(
            server.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=greedy), timeout=60)
        )
    finally:
        llm.eos_token_ids = eos_token_ids
    after = scrape(server)
    assert replies[-1].finish_reason == pb.EOS  # our own API still says which stop it was
    diffs = {
        reason: value(after, "vllm:request_success_total", finished_reason=reason)
        - value(before, "vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "eos")
    }
    assert diffs == {"stop": 1, "length": 0, "eos": 0}
    reasons = {
        dict(labels).get("finished_reason") for name, labels in after if name == "vllm:request_success_total"
    }
    assert "eos" not in reasons  # no series vLLM never has


@pytest.mark.slow
def test_an_expired_deadline_on_the_triton_adapter_counts_as_a_deadline(server: InProcessServer) -> None:
    """As on our gRPC API: `pagedserve:request_aborts` says why requests were cut, and a client's
    deadline is not a client's cancel."""
    from pagedserve_adapters.v2 import inference_pb2_grpc as v2_grpc

    wait_for(lambda: idle(server), what="an idle engine")
    before = scrape(server)
    stub = v2_grpc.GRPCInferenceServiceStub(server.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(triton_infer_request(MAX_TOKENS), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def causes() -> dict[str, float] | None:
        now = scrape(server)
        found = {
            cause: value(now, "pagedserve:request_aborts_total", cause=cause)
            - value(before, "pagedserve:request_aborts_total", cause=cause)
            for cause in ("deadline", "client_cancel")
        }
        return found if sum(found.values()) and idle(server) else None

    assert wait_for(causes, timeout=10, what="the aborted request counted") == {
        "deadline": 1,
        "client_cancel": 0,
    }
