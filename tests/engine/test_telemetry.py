"""Prometheus metrics equal the engine's own counts after a known workload; request spans carry the
gen_ai attributes and child spans in order, under the caller's trace; disabled tracing is inert."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.telemetry import RequestTracer, configure_tracing
from prometheus_client.parser import text_string_to_metric_families


def scrape(llm: LLM) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(llm.engine.metrics.render().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


@pytest.fixture(scope="module")
def workload_llm(tiny_llama_dir: str) -> tuple[LLM, list]:
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=12,
        block_size=8,
        served_model_name="m",
        preemption_mode="recompute",
    )
    prompts = [[1] + list(range(100 + 10 * i, 110 + 10 * i + i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True) for i in range(5)]
    params.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[0]))
    outputs = llm.generate(prompts, params)
    return llm, outputs


def test_counters_equal_the_engine_counts(workload_llm: tuple[LLM, list]) -> None:
    llm, outputs = workload_llm
    samples = scrape(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0  # 12 blocks force preemption
    assert value(samples, "vllm:num_preemptions_total") == stats.num_preemptions
    assert value(samples, "vllm:prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in outputs)
    assert value(samples, "vllm:generation_tokens_total") == sum(len(o.outputs[0].token_ids) for o in outputs)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    for reason in set(reasons):
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert value(samples, "vllm:prefix_cache_queries_total") == stats.num_prefix_queries
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0


def test_histograms_have_the_right_sample_counts(workload_llm: tuple[LLM, list]) -> None:
    llm, outputs = workload_llm
    samples = scrape(llm)
    num_requests = len(outputs)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert value(samples, "vllm:time_to_first_token_seconds_count") == num_requests
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == num_requests
    assert value(samples, "vllm:time_per_output_token_seconds_count") == num_requests
    # every token after a stream's first is one inter-token gap
    assert value(samples, "vllm:inter_token_latency_seconds_count") == num_tokens - num_requests
    assert value(samples, "vllm:request_generation_tokens_sum") == num_tokens


def test_request_spans_continue_the_callers_trace(workload_llm: tuple[LLM, list]) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    llm, _ = workload_llm
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider, "m")
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = llm.engine
    started = time.monotonic()
    prompt = [1, 2, 3, 4]  # (a server tokenizes here, before the request reaches the engine)
    tokenized = (started, time.monotonic())
    engine.add_request("traced", prompt, params)
    last = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            last = delta
    assert last is not None and last.request_finished
    tracer.finish_request(
        {"Traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}, "traced", params, last, tokenized, len(prompt)
    )
    spans = exporter.get_finished_spans()
    server = next(s for s in spans if s.name == "llm_request")
    children = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == server.context.span_id),
        key=lambda s: s.start_time,
    )
    assert [c.name for c in children] == ["tokenize", "queue", "prefill", "decode"]
    assert f"{server.context.trace_id:032x}" == trace_id and server.parent.span_id == 0x00F067AA0BA902B7
    attrs = server.attributes
    assert attrs["gen_ai.request.id"] == "traced" and attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.request.max_tokens"] == 5 and attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.prompt_tokens"] == 4 and attrs["gen_ai.usage.completion_tokens"] == 5
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.latency.time_to_first_token"] > 0 and attrs["gen_ai.latency.e2e"] > 0
    assert not server.events
    assert all(children[i].end_time <= children[i + 1].start_time + 1000 for i in range(3))


def test_a_span_and_log_line_of_an_n_greater_than_1_request_count_every_completion(
    workload_llm: tuple[LLM, list], caplog: pytest.LogCaptureFixture
) -> None:
    """The request's final delta is its last completion's: the span said that one's tokens and finish
    reason alone. Semantic conventions: the response's output tokens, and a finish reason per choice."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    llm, _ = workload_llm
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider, "m")
    engine = llm.engine
    # completion 0 stops at its first token (the id it samples first, seeded, made a stop id), the
    # others (seeds of their own) run on to max_tokens
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request("probe", [1, 2, 3, 4], params)
    first = [d.new_token_ids[0] for d in engine.step() if d.index == 0 and d.new_token_ids]
    engine.abort_request(["probe"])
    engine.step()  # the workers drop the probe
    stop = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, stop_token_ids=first)
    engine.add_request("n3", [1, 2, 3, 4], stop)
    deltas = []
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        while engine.has_unfinished_requests():
            deltas.extend(engine.step())
    tokens = {i: sum(len(d.new_token_ids) for d in deltas if d.index == i) for i in range(3)}
    reasons = {d.index: d.finish_reason for d in deltas if d.finished}
    last = deltas[-1]
    assert last.request_finished and sum(d.request_finished for d in deltas) == 1
    tracer.finish_request({}, "n3", stop, last, (last.metrics.arrival_time,) * 2, 4)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
    assert span.attributes["gen_ai.usage.completion_tokens"] == sum(tokens.values())
    assert span.attributes["gen_ai.response.finish_reasons"] == tuple(reasons[i] for i in range(3))
    assert len(set(span.attributes["gen_ai.response.finish_reasons"])) == 2  # stop and length
    (line,) = [r for r in caplog.records if r.getMessage().startswith("request finished id=n3")]
    assert line.num_output_tokens == sum(tokens.values())  # type: ignore[attr-defined]
    assert line.finish_reason == ",".join(reasons[i] for i in range(3))  # type: ignore[attr-defined]


def test_recompute_preemption_is_an_event_of_the_victims_span(workload_llm: tuple[LLM, list]) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    llm, _ = workload_llm
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider, "m")
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    preemptions_before = engine.stats().num_preemptions
    for i in range(3):  # 3 x 40 tokens = 15 blocks of 8 > 12: the youngest is recomputed
        engine.add_request(f"tight-{i}", [1, *range(500 + 20 * i, 509 + 20 * i)], params)
    finals = []
    while engine.has_unfinished_requests():
        finals += [d for d in engine.step() if d.request_finished]
    for delta in finals:
        tracer.record(None, delta.request_id, params, delta)
    num_preemptions = engine.stats().num_preemptions - preemptions_before
    assert num_preemptions > 0
    events = [e for s in exporter.get_finished_spans() if s.name == "llm_request" for e in s.events]
    assert [e.name for e in events] == ["preemption"] * num_preemptions  # no swap: recompute mode
    assert {e.attributes["gen_ai.pagedserve.preemption_mode"] for e in events} == {"recompute"}


# -- aborts --------------------------------------------------------------------------------------------


@pytest.fixture()
def fresh_llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, served_model_name="m")


def test_abort_request_returns_final_deltas_and_refreshes_gauges(
    fresh_llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    engine = fresh_llm.engine
    started = time.monotonic()
    engine.add_request("gone", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    num_tokens = sum(len(d.new_token_ids) for _ in range(4) for d in engine.step())
    assert value(scrape(fresh_llm), "vllm:num_requests_running") == 1
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        (delta,) = engine.abort_request(["gone", "unknown-id"])
    assert (delta.request_id, delta.finish_reason, delta.finished, delta.request_finished) == (
        "gone",
        "aborted",
        True,
        True,
    )
    assert (delta.num_prompt_tokens, delta.num_output_tokens) == (5, num_tokens) and num_tokens == 4
    metrics = delta.metrics
    assert started <= metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time
    assert metrics.finished_time <= time.monotonic()
    # no step follows an abort of the last request: the abort itself refreshed the gauges
    samples = scrape(fresh_llm)
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0
    assert not engine.metrics._streams.last_token  # nothing kept for the aborted stream
    (record,) = [r for r in caplog.records if r.name == "pagedserve.requests"]
    assert (record.request_id, record.num_output_tokens, record.finish_reason) == ("gone", 4, "aborted")
    assert engine.abort_request(["gone"]) == []


def test_async_abort_final_deltas_carry_the_requests_timing_and_counts(fresh_llm: LLM) -> None:
    from pagedserve.engine.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def scenario() -> tuple[list, list, float]:
        engine = AsyncEngine(fresh_llm.engine)
        started = time.monotonic()
        # aborted before the engine loop ever saw it
        never = engine.generate("never-run", [1, 2, 3], params)
        first = asyncio.ensure_future(anext(never))
        await asyncio.sleep(0)
        assert engine.abort("never-run", "stop it")
        engine.start()
        never_deltas = [await first]
        # aborted while running
        running, received = engine.generate("running", [1, 2, 3, 4], params), []
        async for delta in running:
            received.append(delta)
            if len(received) == 3:
                assert engine.abort("running", "stop it too")
        await engine.halt()  # (stop() would shut the LLM's executor down)
        return never_deltas, received, started

    never_deltas, received, started = asyncio.run(scenario())
    (never,) = never_deltas
    assert (never.finish_reason, never.error, never.num_prompt_tokens, never.num_output_tokens) == (
        "aborted",
        "stop it",
        3,
        0,
    )
    assert started <= never.metrics.arrival_time <= never.metrics.finished_time
    final = received[-1]
    num_tokens = sum(len(d.new_token_ids) for d in received)
    assert (final.finish_reason, final.error, final.num_prompt_tokens) == ("aborted", "stop it too", 4)
    assert final.num_output_tokens == num_tokens and 3 <= num_tokens < 500
    assert (
        started <= final.metrics.arrival_time <= final.metrics.first_token_time <= final.metrics.finished_time
    )


# -- logs ----------------------------------------------------------------------------------------------


def test_one_structured_line_per_finished_request(fresh_llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]
    prompts = [[1, 2, 3], [1, 4, 5, 6], [1, 7]]
    with caplog.at_level(logging.INFO, logger="pagedserve.requests"):
        outputs = fresh_llm.generate(prompts, params)
    records = {r.request_id: r for r in caplog.records if r.name == "pagedserve.requests"}
    assert sorted(records) == sorted(o.request_id for o in outputs)
    for out, prompt, p in zip(outputs, prompts, params):
        record = records[out.request_id]
        assert (record.num_prompt_tokens, record.num_output_tokens, record.finish_reason) == (
            len(prompt),
            p.max_tokens,
            "length",
        )
        assert 0 < record.ttft_s <= record.e2e_s
        assert record.levelno == logging.INFO
        message = record.getMessage()
        for part in (
            f"id={out.request_id}",
            f"prompt_tokens={len(prompt)}",
            f"output_tokens={p.max_tokens}",
            "finish_reason=length",
            f"e2e_s={record.e2e_s:.3f}",
        ):
            assert part in message


def test_throughput_summary_every_interval_while_busy(
    fresh_llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = fresh_llm.engine.metrics
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert metrics.summary_interval_s == 10.0
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        fresh_llm.generate([[1, 2, 3]] * 2, params)  # far under 10 s: no summary yet
        assert not [r for r in caplog.records if r.name == "pagedserve.engine"]
        metrics.summary_interval_s = 0.0  # every step after the first of a busy period
        fresh_llm.generate([[1, 2, 3], [1, 2, 4]], params)
    summaries = [r.getMessage() for r in caplog.records if r.name == "pagedserve.engine"]
    assert len(summaries) == 20 - 1  # 20 steps; the first opens the window
    pattern = re.compile(
        r"throughput: prompt ([0-9.]+) tok/s, generation ([0-9.]+) tok/s; running (\d+), waiting 0, "
        r"swapped 0; KV cache ([0-9.]+)% used"
    )
    parsed = [pattern.fullmatch(s) for s in summaries]
    assert all(parsed), summaries[:3]
    assert all(float(m.group(2)) > 0 and float(m.group(4)) > 0 for m in parsed[:-1])
    assert [int(m.group(3)) for m in parsed] == [2] * 18 + [0]  # both finish on the last step


# -- tracing configuration -------------------------------------------------------------------------


@pytest.fixture()
def otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "OTEL_TRACES_EXPORTER",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def exporters(provider: Any) -> list[str]:
    return [type(p.span_exporter).__name__ for p in provider._active_span_processor._span_processors]


def test_disabled_tracing_has_no_provider_and_records_nothing(otel_env: pytest.MonkeyPatch) -> None:
    assert configure_tracing(None) is None
    assert configure_tracing(None, "none") is None
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert configure_tracing("http://collector:4317") is None  # the standard variable says none
    otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    otel_env.setenv("OTEL_SDK_DISABLED", "true")
    assert configure_tracing(None) is None
    tracer = RequestTracer(None, "m")
    assert not tracer.enabled
    tracer.finish_request(None, "x", SamplingParams(), None, (0.0, 0.0), 1)  # returns before reading


def test_console_exporter_from_the_flag_or_otel_traces_exporter(otel_env: pytest.MonkeyPatch) -> None:
    provider = configure_tracing(None, "console")
    assert exporters(provider) == ["ConsoleSpanExporter"]
    assert provider.resource.attributes["service.name"] == "pagedserve"
    provider.shutdown()
    otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    otel_env.setenv("OTEL_SERVICE_NAME", "llm-gateway-backend")
    provider = configure_tracing(None)
    assert exporters(provider) == ["ConsoleSpanExporter"]
    assert provider.resource.attributes["service.name"] == "llm-gateway-backend"  # the environment wins
    provider.shutdown()
    otel_env.delenv("OTEL_SERVICE_NAME")
    otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,k8s.pod.name=p-0")
    provider = configure_tracing(None)
    attrs = provider.resource.attributes
    assert (attrs["service.name"], attrs["k8s.pod.name"]) == ("from-attrs", "p-0")
    provider.shutdown()
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        configure_tracing(None, "jaeger")


@pytest.mark.parametrize(
    ("protocol", "module", "package"),
    [
        ("grpc", "opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc"),
        ("http/protobuf", "opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http"),
    ],
)
def test_otlp_protocol_from_the_environment(
    otel_env: pytest.MonkeyPatch, protocol: str, module: str, package: str
) -> None:
    import importlib.util

    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    try:
        installed = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        installed = False
    if installed:
        provider = configure_tracing("http://127.0.0.1:1")
        (processor,) = provider._active_span_processor._span_processors
        assert type(processor.span_exporter).__module__.startswith(module)
        provider.shutdown()
    else:
        with pytest.raises(RuntimeError, match=package):
            configure_tracing("http://127.0.0.1:1")


def test_unknown_otlp_protocol_is_named(otel_env: pytest.MonkeyPatch) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        configure_tracing("http://127.0.0.1:1")


def test_each_ranks_process_is_a_series_of_its_own() -> None:
    """watch_ranks([pid of rank 1, pid of rank 2]): pagedserve_rank_process_* with a rank label, each
    series read from its own process; a rank that has exited drops out instead of failing the scrape."""
    import subprocess
    import sys

    import psutil
    from pagedserve.telemetry import EngineMetrics

    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        metrics = EngineMetrics("m")
        metrics.watch_ranks([child.pid for child in children])
        samples = {
            (s.name, s.labels.get("rank")): s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples
            if s.name.startswith("pagedserve_rank_process_")
        }
        for rank, child in enumerate(children, start=1):
            started = psutil.Process(child.pid).create_time()
            assert samples[("pagedserve_rank_process_start_time_seconds", str(rank))] == pytest.approx(
                started, abs=1
            )
            assert samples[("pagedserve_rank_process_resident_memory_bytes", str(rank))] > 0
            assert ("pagedserve_rank_process_cpu_seconds_total", str(rank)) in samples
        assert {rank for _, rank in samples} == {"1", "2"}
        children[1].kill()
        children[1].wait()
        after = metrics.render().decode()
        assert 'rank="1"' in after and 'rank="2"' not in after
    finally:
        for child in children:
            child.kill()
            child.wait()
