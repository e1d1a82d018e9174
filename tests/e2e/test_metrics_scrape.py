"""`/metrics` scraped over real HTTP from an in-process server after a known gRPC workload: every
metric name of issue 9 and of vLLM's dashboard is there labelled with the model name, counters equal
the engine's own counts and the client's token counts, histograms have one sample per request (or per
token gap, or per step), and aborts are counted by cause. The KV budget is tiny so preemption by swap
happens."""

from __future__ import annotations

import threading
import urllib.request
from typing import Any

import grpc
import psutil
import pytest
from inprocess_server import InProcessServer, Samples, parse_metrics, wait_for
from pagedserve.rpc.v1 import generate_pb2 as pb

MODEL = "tiny"
BLOCK_SIZE = 16
CAUSES = ("client_cancel", "abort_rpc", "deadline")
VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_per_output_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_inference_time_seconds_count",
    "vllm:request_max_num_generation_tokens_count",
    "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_count",
    "vllm:iteration_tokens_total_count",
    "pagedserve:swap_bytes_total",
    "pagedserve:request_aborts_total",
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> InProcessServer:
    """16 KV blocks of 16 tokens (256 tokens) and a CPU pool: three 160-token requests cannot run
    together, so the youngest are swapped out and back in."""
    srv = InProcessServer(
        tiny_llama_dir,
        None,
        dtype="float32",
        served_model_name=MODEL,
        num_kv_blocks=16,
        block_size=BLOCK_SIZE,
        num_cpu_kv_blocks=64,
        preemption_mode="swap",
    ).start()
    yield srv
    srv.stop()


def scrape(server: InProcessServer) -> Samples:
    with urllib.request.urlopen(server.http_url("/metrics"), timeout=10) as reply:
        assert reply.status == 200 and reply.headers.get_content_type() == "text/plain"
        return parse_metrics(reply.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def diff(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def generate(server: InProcessServer, prompt: list[int], max_tokens: int, **sampling: Any) -> list[Any]:
    params = pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, **sampling)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)
    return list(server.stub.Generate(req, timeout=120))


def long_request(prompt: list[int], request_id: str = "") -> pb.GenerateRequest:
    """230 tokens: far longer than 0.3 s on the tiny model on CPU (about 4 ms a token)."""
    params = pb.SamplingParameters(max_tokens=230, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=params)


def prompt(i: int, length: int = 20) -> list[int]:
    return [1, *range(1000 + 50 * i, 999 + 50 * i + length)]


def run_workload(server: InProcessServer) -> list[list[Any]]:
    """Three concurrent 160-token requests (preempted by swap), the same 33-token prompt twice (a
    prefix-cache hit on its two full blocks), and a greedy request run again to stop on its 5th token."""
    results: dict[int, list[Any]] = {}

    def run(i: int) -> None:
        results[i] = generate(server, prompt(i), 140, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    calls = [results[i] for i in range(3)]
    shared = prompt(9, length=33)
    calls += [generate(server, shared, 4, ignore_eos=True) for _ in range(2)]
    calls.append(generate(server, prompt(7), 8, ignore_eos=True))
    greedy = [t for r in calls[-1] for t in r.token_ids]  # greedy: the same tokens come again
    calls.append(generate(server, prompt(7), 8, ignore_eos=True, stop_token_ids=[greedy[4]]))
    return calls


def test_counters_and_histograms_equal_the_engine_counts(server: InProcessServer) -> None:
    before, stats_before = scrape(server), server.llm.stats()
    calls = run_workload(server)
    after, stats = scrape(server), server.llm.stats()

    for name in VLLM_NAMES:  # every name the dashboards read, labelled with the model
        assert any(n == name and dict(labels).get("model_name") == MODEL for n, labels in after), name

    # against what the client received
    num_prompt = sum(c[-1].prompt_tokens for c in calls)
    num_tokens = sum(len(r.token_ids) for c in calls for r in c)
    num_requests = len(calls)
    reasons = [pb.FinishReason.Name(c[-1].finish_reason).lower() for c in calls]
    assert reasons.count("stop") == 1 and num_prompt == 3 * 20 + 2 * 33 + 2 * 20
    assert diff(after, before, "vllm:prompt_tokens_total") == num_prompt
    assert diff(after, before, "vllm:generation_tokens_total") == num_tokens
    for reason in ("length", "stop"):
        assert diff(after, before, "vllm:request_success_total", finished_reason=reason) == reasons.count(
            reason
        )

    num_preemptions = stats.num_preemptions - stats_before.num_preemptions
    assert num_preemptions > 0 and stats.num_swap_preemptions > stats_before.num_swap_preemptions
    assert diff(after, before, "vllm:num_preemptions_total") == num_preemptions
    num_queries = stats.num_prefix_queries - stats_before.num_prefix_queries
    num_hits = stats.num_prefix_hits - stats_before.num_prefix_hits
    assert num_hits >= 2 * BLOCK_SIZE  # the repeated prompt's two full blocks
    assert diff(after, before, "vllm:prefix_cache_queries_total") == num_queries
    assert diff(after, before, "vllm:prefix_cache_hits_total") == num_hits
    model = server.llm.config.model
    bytes_per_block = model.kv_bytes_per_token * BLOCK_SIZE
    for direction, now_count, then_count in (
        ("out", stats.num_swapped_out_blocks, stats_before.num_swapped_out_blocks),
        ("in", stats.num_swapped_in_blocks, stats_before.num_swapped_in_blocks),
    ):
        assert now_count > then_count
        swapped_bytes = diff(after, before, "pagedserve:swap_bytes_total", direction=direction)
        assert swapped_bytes == (now_count - then_count) * bytes_per_block

    lengths = [sum(len(r.token_ids) for r in c) for c in calls]
    assert diff(after, before, "vllm:time_to_first_token_seconds_count") == num_requests
    assert diff(after, before, "vllm:e2e_request_latency_seconds_count") == num_requests
    assert diff(after, before, "vllm:time_per_output_token_seconds_count") == sum(n > 1 for n in lengths)
    assert diff(after, before, "vllm:inter_token_latency_seconds_count") == num_tokens - num_requests
    assert diff(after, before, "vllm:request_prompt_tokens_sum") == num_prompt
    assert diff(after, before, "vllm:request_generation_tokens_count") == num_requests
    for name in ("prefill_time_seconds", "decode_time_seconds", "inference_time_seconds", "params_n"):
        assert diff(after, before, f"vllm:request_{name}_count") == num_requests, name
    assert diff(after, before, "vllm:request_max_num_generation_tokens_sum") == num_tokens
    assert diff(after, before, "vllm:iteration_tokens_total_sum") == num_prompt + num_tokens
    for gauge in ("running", "waiting", "swapped"):
        assert value(after, f"vllm:num_requests_{gauge}") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0


def test_aborts_by_cause_and_gauges_after_the_last_abort(server: InProcessServer) -> None:
    before = scrape(server)
    long_call = server.stub.Generate(long_request(prompt(1), request_id="abort-me"), timeout=120)
    next(long_call)
    assert value(scrape(server), "vllm:num_requests_running") == 1
    # at once: on a quiet machine the tiny model finishes it within a fraction of a second
    aborted = server.stub.Abort(pb.AbortRequest(request_ids=["abort-me"]))
    assert list(aborted.aborted_request_ids) == ["abort-me"]
    assert list(long_call)[-1].finish_reason == pb.ABORTED

    # a deadline while a request runs (short: the request must not finish first)
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub.Generate(long_request(prompt(2)), timeout=0.1))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    cancelled = server.stub.Generate(long_request(prompt(3)), timeout=120)
    next(cancelled)
    cancelled.cancel()

    def settled() -> Samples | None:
        now = scrape(server)
        causes = [diff(now, before, "pagedserve:request_aborts_total", cause=c) for c in CAUSES]
        return now if causes == [1, 1, 1] and value(now, "vllm:num_requests_running") == 0 else None

    after = wait_for(settled, timeout=10, what="one abort of each cause and an idle engine")
    # refreshed after the last abort (by the abort itself, then by the step that drops worker state)
    for gauge in ("running", "waiting", "swapped"):
        assert value(after, f"vllm:num_requests_{gauge}") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0
    assert diff(after, before, "vllm:request_success_total", finished_reason="aborted") == 0


def test_one_process_reports_its_own_process_metrics(server: InProcessServer) -> None:
    """The engine on the server's thread: process_* are the one process's, and no engine process's."""
    samples = scrape(server)
    assert samples[("process_start_time_seconds", ())] == pytest.approx(psutil.Process().create_time(), abs=1)
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert not [name for name, _ in samples if name.startswith("pagedserve_engine_process_")]
