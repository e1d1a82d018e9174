"""The request metrics of vLLM's reference Grafana dashboard and vLLM v1's /metrics that the older
set lacked (request prefill / decode / inference time, the longest completion, the n and max_tokens
parameters, tokens per engine step, cache_config_info), scraped over real HTTP from an in-process
server on the tiny model after known gRPC requests: vLLM's names and bucket edges, one sample per
client request (none for the warm-up, a deep health check or a client's abort), and values that agree
with each other, with the token counters and with the request's span. The KV cache is tiny, so
concurrent requests are preempted by swap."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from inprocess_server import InProcessServer, Samples, exporting_to, scrape, wait_for
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pagedserve.rpc.v1 import generate_pb2 as pb

MODEL = "tiny"
BLOCK_SIZE = 8
NUM_KV_BLOCKS = 16
NUM_CPU_BLOCKS = 64
PHASES = (
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
)
PER_REQUEST = (
    *PHASES,
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
)
# vLLM v1's edges (vllm/v1/metrics/loggers.py), written out here rather than taken from our code
LATENCY_EDGES = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
LATENCY_EDGES += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_EDGES = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_EDGES = [1, 2, 5, 10, 20]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def started(tiny_llama_dir: str, exporter: InMemorySpanExporter) -> tuple[InProcessServer, Samples]:
    """The server and its /metrics right after start (its warm-up request has run). 16 KV blocks
    of 8 tokens and a roomy CPU pool: three 80-token requests cannot run together, so the younger
    ones are swapped out and back in."""
    provider = exporting_to(exporter)
    srv = InProcessServer(
        tiny_llama_dir,
        provider,
        dtype="float32",
        served_model_name=MODEL,
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE,
        num_cpu_kv_blocks=NUM_CPU_BLOCKS,
        preemption_mode="swap",
        enable_prefix_caching=False,
    ).start()
    yield srv, scrape(srv)
    srv.stop()
    provider.shutdown()


@pytest.fixture(scope="module")
def server(started: tuple[InProcessServer, Samples]) -> InProcessServer:
    return started[0]


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def diff(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def bucket_edges(samples: Samples, name: str) -> list[float]:
    edges = [
        float(dict(labels)["le"])
        for n, labels in samples
        if n == f"{name}_bucket" and dict(labels).get("model_name") == MODEL
    ]
    return sorted(edges)


def one_two_five(max_value: int) -> list[float]:
    edges = [float(m * 10**e) for e in range(8) for m in (1, 2, 5)]
    return [edge for edge in edges if edge <= max_value]


def generate(server: InProcessServer, prompt: list[int], request_id: str, **sampling: Any) -> list[Any]:
    params = pb.SamplingParameters(ignore_eos=True, **sampling)
    req = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=params)
    return list(server.stub.Generate(req, timeout=120))


def prompt(i: int, length: int = 20) -> list[int]:
    return [1, *range(100 + 20 * i, 99 + 20 * i + length)]


def server_spans(exporter: InMemorySpanExporter, request_ids: list[str]) -> list[ReadableSpan]:
    def find() -> list[ReadableSpan] | None:
        spans = {  # (a request refused before it had an id has a span without one)
            s.attributes.get("gen_ai.request.id"): s
            for s in exporter.get_finished_spans()
            if s.kind is SpanKind.SERVER and s.attributes is not None
        }
        return [spans[i] for i in request_ids] if all(i in spans for i in request_ids) else None

    return wait_for(find, what=f"the server spans of {request_ids}")


def check_tokens_per_step(after: Samples, before: Samples) -> None:
    """Every token the counters count was counted in the step that processed it."""
    num_tokens = diff(after, before, "vllm:prompt_tokens_total")
    num_tokens += diff(after, before, "vllm:generation_tokens_total")
    assert num_tokens > 0
    assert diff(after, before, "vllm:iteration_tokens_total_sum") == num_tokens


def check_phases(after: Samples, before: Samples, spans: list[ReadableSpan]) -> None:
    """prefill + decode = inference <= e2e - queue time (sums over the requests between the scrapes),
    and prefill is what each request's span says (from its first scheduling to its first token)."""
    prefill, decode, inference = (diff(after, before, f"{name}_sum") for name in PHASES)
    e2e = diff(after, before, "vllm:e2e_request_latency_seconds_sum")
    queue = diff(after, before, "vllm:request_queue_time_seconds_sum")
    assert prefill > 0 and decode > 0
    assert prefill + decode == pytest.approx(inference, abs=1e-9)
    assert inference <= e2e - queue + 1e-9
    span_prefill = sum(s.attributes["gen_ai.latency.time_in_model_prefill"] for s in spans)
    assert prefill == pytest.approx(span_prefill, abs=1e-6)


def test_no_samples_from_the_warm_up_or_a_deep_health_check(
    started: tuple[InProcessServer, Samples],
) -> None:
    server, at_start = started
    assert server.stub.Health(pb.HealthRequest(deep=True), timeout=60).ready
    after = scrape(server)
    for samples in (at_start, after):
        for name in (*PER_REQUEST, "vllm:iteration_tokens_total"):
            assert (f"{name}_count", (("model_name", MODEL),)) in samples, name  # exported at 0
            assert value(samples, f"{name}_count") == 0, name


def test_bucket_edges_are_vllms(server: InProcessServer) -> None:
    samples = scrape(server)
    max_model_len = server.llm.config.model.max_model_len
    expected = {
        **{name: LATENCY_EDGES for name in PHASES},
        "vllm:request_max_num_generation_tokens": one_two_five(max_model_len),
        "vllm:request_params_max_tokens": one_two_five(max_model_len),
        "vllm:request_params_n": N_EDGES,
        "vllm:iteration_tokens_total": ITERATION_EDGES,
    }
    for name, edges in expected.items():
        assert bucket_edges(samples, name) == [*map(float, edges), float("inf")], name


def test_cache_config_info_carries_the_real_cache(server: InProcessServer) -> None:
    samples = scrape(server)
    infos = [dict(labels) for (name, labels), v in samples.items() if name == "vllm:cache_config_info"]
    assert len(infos) == 1
    info = infos[0]
    assert samples[("vllm:cache_config_info", tuple(sorted(info.items())))] == 1
    llm = server.llm
    assert llm.num_kv_blocks == NUM_KV_BLOCKS and llm.executor.num_cpu_blocks == NUM_CPU_BLOCKS
    assert info["block_size"] == str(BLOCK_SIZE)
    assert info["num_gpu_blocks"] == str(NUM_KV_BLOCKS)
    assert info["num_gpu_blocks_override"] == str(NUM_KV_BLOCKS)
    assert info["num_cpu_blocks"] == str(NUM_CPU_BLOCKS)
    assert info["enable_prefix_caching"] == "False"
    assert info["cache_dtype"] == "float32"
    assert info["swap_space"] == str(llm.config.cache.swap_space)
    assert info["engine"] == "0"


def test_one_request(server: InProcessServer, exporter: InMemorySpanExporter) -> None:
    """20 prompt tokens and 7 generated, alone: 7 steps, the first with 21 tokens, then 1 each."""
    before = scrape(server)
    responses = generate(server, prompt(0), "one", max_tokens=7, temperature=0.0)
    assert sum(len(r.token_ids) for r in responses) == 7
    after = scrape(server)

    for name in PER_REQUEST:
        assert diff(after, before, f"{name}_count") == 1, name
    assert diff(after, before, "vllm:request_max_num_generation_tokens_sum") == 7
    assert diff(after, before, "vllm:request_params_n_sum") == 1
    assert diff(after, before, "vllm:request_params_max_tokens_sum") == 7
    assert diff(after, before, "vllm:iteration_tokens_total_count") == 7
    assert diff(after, before, "vllm:iteration_tokens_total_bucket", le="1.0") == 6
    assert diff(after, before, "vllm:iteration_tokens_total_bucket", le="16.0") == 6
    assert diff(after, before, "vllm:iteration_tokens_total_bucket", le="32.0") == 7
    check_tokens_per_step(after, before)
    check_phases(after, before, server_spans(exporter, ["one"]))


def test_n_2_request_is_one_sample_with_its_longest_completion(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    before = scrape(server)
    responses = generate(server, prompt(1), "two", max_tokens=5, n=2, temperature=0.8, seed=7)
    assert sorted({r.index for r in responses}) == [0, 1]
    assert sum(len(r.token_ids) for r in responses) == 10
    after = scrape(server)

    for name in PER_REQUEST:  # one request, whatever its n
        assert diff(after, before, f"{name}_count") == 1, name
    assert diff(after, before, "vllm:request_generation_tokens_count") == 2  # one per completion
    assert diff(after, before, "vllm:request_max_num_generation_tokens_sum") == 5  # not 10
    assert diff(after, before, "vllm:request_params_n_sum") == 2
    assert diff(after, before, "vllm:request_params_n_bucket", le="1.0") == 0
    assert diff(after, before, "vllm:request_params_n_bucket", le="2.0") == 1
    assert diff(after, before, "vllm:request_params_max_tokens_sum") == 5
    check_tokens_per_step(after, before)
    check_phases(after, before, server_spans(exporter, ["two"]))


def test_preempted_requests_are_measured_from_their_first_scheduling(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    """As vLLM's: a preemption's wait lies inside the phase it interrupted (here decode), and the
    request is one sample however often it was scheduled."""
    before, stats_before = scrape(server), server.llm.stats()
    request_ids = [f"tight-{i}" for i in range(3)]
    results: dict[int, list[Any]] = {}

    def run(i: int) -> None:
        results[i] = generate(server, prompt(2 + i), request_ids[i], max_tokens=60, temperature=0.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(sum(len(r.token_ids) for r in results[i]) == 60 for i in range(3))
    after = scrape(server)
    assert server.llm.stats().num_swap_preemptions > stats_before.num_swap_preemptions  # the premise

    for name in PER_REQUEST:
        assert diff(after, before, f"{name}_count") == 3, name
    assert diff(after, before, "vllm:request_max_num_generation_tokens_sum") == 3 * 60
    assert diff(after, before, "vllm:request_params_max_tokens_sum") == 3 * 60
    check_tokens_per_step(after, before)
    spans = server_spans(exporter, request_ids)
    check_phases(after, before, spans)
    # each preemption (after the request's first token: its prompt ran in one step) until its swap-in
    gaps = 0.0
    for span in spans:
        events = {
            name: [e.timestamp for e in span.events if e.name == name] for name in ("preemption", "swap_in")
        }
        assert len(events["preemption"]) == len(events["swap_in"])
        gaps += sum(end - start for start, end in zip(events["preemption"], events["swap_in"])) / 1e9
    assert gaps > 0
    assert diff(after, before, "vllm:request_decode_time_seconds_sum") >= gaps


def test_an_aborted_request_is_in_the_step_counts_only(server: InProcessServer) -> None:
    """As vLLM: a request its client aborted is no finished request (no per-request sample), but the
    tokens the engine processed for it are in the steps' counts."""
    before = scrape(server)
    params = pb.SamplingParameters(max_tokens=100, temperature=0.0, ignore_eos=True)
    req = pb.GenerateRequest(request_id="abort-me", token_ids=pb.TokenIds(ids=prompt(6)), sampling=params)
    call = server.stub.Generate(req, timeout=120)
    next(call)
    aborted = server.stub.Abort(pb.AbortRequest(request_ids=["abort-me"]))
    assert list(aborted.aborted_request_ids) == ["abort-me"]
    assert list(call)[-1].finish_reason == pb.ABORTED

    def idle() -> Samples | None:
        samples = scrape(server)
        return samples if value(samples, "vllm:num_requests_running") == 0 else None

    after = wait_for(idle, what="an idle engine")

    for name in PER_REQUEST:
        assert diff(after, before, f"{name}_count") == 0, name
    assert diff(after, before, "vllm:e2e_request_latency_seconds_count") == 0
    check_tokens_per_step(after, before)
