"""Prometheus metrics equal the engine's own counts after a known workload; request spans carry the
gen_ai attributes and child spans in order, under the caller's trace; disabled tracing is inert."""

from __future__ import annotations

import time

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
    parent = tracer.extract({"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
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
    tracer.record(parent, "traced", params, last, tokenize=tokenized)
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
    assert all(children[i].end_time <= children[i + 1].start_time + 1000 for i in range(3))


def test_disabled_tracing_has_no_provider_and_records_nothing() -> None:
    assert configure_tracing(None) is None
    assert configure_tracing(None, "none") is None
    tracer = RequestTracer(None, "m")
    assert not tracer.enabled
    tracer.record(None, "x", SamplingParams(), None)  # type: ignore[arg-type]  # returns before reading


def test_console_exporter_installs_one_processor() -> None:
    provider = configure_tracing(None, "console")
    assert provider is not None
    assert len(provider._active_span_processor._span_processors) == 1
    provider.shutdown()
