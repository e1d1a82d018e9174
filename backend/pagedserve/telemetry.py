"""Prometheus metrics (under vLLM's names, so existing dashboards and autoscalers work), request logs,
and OpenTelemetry request spans. Nothing here runs per token beyond a few counter updates; with
tracing disabled no span processor exists at all."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics_core import Metric

from pagedserve.logs import REQUESTS_LOGGER
from pagedserve.outputs import RequestDelta, RequestMetrics

logger = logging.getLogger(REQUESTS_LOGGER)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# vLLM v1's own edges for the histograms below that the older ones above predate: its request latency
# buckets (queue, prefill, decode, inference), tokens per engine step, and the n parameter
_REQUEST_LATENCY_BUCKETS = (*_E2E_BUCKETS, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
SUMMARY_INTERVAL_S = 10.0
FINISH_REASONS = ("length", "stop", "error")  # of requests counted by vllm:request_success
# vLLM's reasons: the end-of-sequence token is a "stop", as a stop token or string is.
_VLLM_FINISH_REASONS = {"eos": "stop"}
# stream_error: a Triton ModelStreamInfer stream that another request's error ended (triton_grpc_error);
# stalled_client: a stream whose client stopped reading, given up by --stream-write-timeout
ABORT_CAUSES = ("client_cancel", "deadline", "abort_rpc", "drain", "stream_error", "stalled_client")
# Why a request was refused before it ran (pagedserve:request_rejections): a bad field (INVALID_ARGUMENT,
# HTTP 400), the queue full (RESOURCE_EXHAUSTED, 429), the server not serving (starting, draining, the
# engine dead: UNAVAILABLE, 503), an unknown model or version (a KServe v2 / Triton call: NOT_FOUND, 404).
REJECTION_REASONS = ("invalid", "queue_full", "unavailable", "not_found")
# OpenTelemetry's `error.type` on a request span that ended in error (the semantic conventions' low
# cardinality class of the error): a refused request's is its rejection reason above; a request the
# engine failed under it (a model fault, the engine dying) has this one.
ENGINE_ERROR = "engine_error"
# The span attribute of the id a KServe v2 or Triton client gave its request (the protocol's `id`): the
# engine's own id (gen_ai.request.id) is unique, the client's need not be.
CLIENT_REQUEST_ID = "gen_ai.pagedserve.client_request_id"


@dataclass
class _Snapshot:
    """Cumulative engine counters at the last observation, to turn them into counter increments."""

    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    swapped_out: int = 0
    swapped_in: int = 0
    spec_drafts: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class _StreamTimes:
    last_token: dict[tuple[str, int], float] = field(default_factory=dict)


class EngineMetrics:
    """Fed once per engine step with the engine's stats and that step's deltas, and once per abort.

    While the engine is busy it logs a throughput / KV-usage summary every `summary_interval_s`."""

    def __init__(
        self,
        model_name: str,
        bytes_per_block: int = 0,
        registry: CollectorRegistry | None = None,
        summary_interval_s: float = SUMMARY_INTERVAL_S,
        max_model_len: int = 10000,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        # this process's CPU time, memory and file descriptors (process_*, as vLLM's /metrics has them)
        ProcessCollector(registry=self.registry)
        self.model_name = model_name
        self.bytes_per_block = bytes_per_block
        self.summary_interval_s = summary_interval_s
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r
        )
        self.swapped = Gauge("vllm:num_requests_swapped", "Requests swapped out to CPU", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", labels, registry=r)
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts",
            "Speculative decoding: drafts run (one a sequence and step)",
            labels,
            registry=r,
        )
        self.draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens run", labels, registry=r
        )
        self.accepted_draft_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of started requests", labels, registry=r
        )
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=r)
        self.success = Counter(
            "vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Tokens looked up in the prefix cache", labels, registry=r
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Tokens found in the prefix cache", labels, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive tokens of a stream",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to last token",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Arrival to first scheduling",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per request",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Output tokens per completion (n of them per request with n > 1, as vLLM counts)",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self._add_vllm_v1_histograms(labels, max_model_len)
        self.swapped_blocks = Counter(
            "pagedserve:swapped_blocks",
            "KV blocks moved between device and CPU",
            [*labels, "direction"],
            registry=r,
        )
        self.swap_bytes = Counter(
            "pagedserve:swap_bytes",
            "KV bytes moved between device and CPU",
            [*labels, "direction"],
            registry=r,
        )
        self.aborts = Counter(
            "pagedserve:request_aborts", "Aborted requests by cause", [*labels, "cause"], registry=r
        )
        self.rejections = Counter(
            "pagedserve:request_rejections",
            "Requests refused before they ran, by reason (every front end's: our gRPC API, KServe v2 / "
            "Triton gRPC and REST): the clients' error rate, which no request metric counts",
            [*labels, "reason"],
            registry=r,
        )
        self._export_every_series()
        # The model's series of what every step or every delta feeds, looked up once: `labels()`
        # checks its arguments and takes a lock on each call (a round of the 64-request chat
        # benchmark gives 3,840 deltas; its Python runs between model steps, from a cold cache).
        m = model_name
        self._generation_tokens = self.generation_tokens.labels(m)
        self._itl = self.itl.labels(m)
        self._iteration_tokens = self.iteration_tokens.labels(m)
        self._gauges = (self.running.labels(m), self.waiting.labels(m), self.swapped.labels(m))
        self._kv_usage = self.kv_usage.labels(m)
        self._last = _Snapshot()
        self._streams = _StreamTimes()
        self.lora_info: Gauge | None = None  # `set_num_lora_adapters`
        self._lora_labels: tuple[str, ...] = ("0", "", "")
        self._window_start = time.monotonic()
        self._window_tokens = [0, 0]  # prompt, generation
        self._is_idle = True  # nothing was left to do after the last step
        # Requests the server makes itself (warm-up, deep health checks) are no client's traffic: no
        # request counter, histogram or log line sees them (gauges and engine counters still do).
        self.unmetered_request_ids: set[str] = set()

    def _add_vllm_v1_histograms(self, labels: list[str], max_model_len: int) -> None:
        """vLLM v1's request phase, request parameter and per-step histograms: its names, help texts
        and bucket edges (token counts in 1-2-5 steps up to the context length, as vLLM's are)."""

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

        token_buckets = one_two_five_buckets(max_model_len)
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKEN_BUCKETS,
        )

    def set_cache_config_info(self, info: Mapping[str, str]) -> None:
        """vLLM's `vllm:cache_config_info`: a gauge at 1 whose labels are the KV cache's settings
        (`cache_config_labels`), set once when the engine has sized its cache."""
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=self.registry,
        )
        gauge.labels(**info).set(1)

    def set_num_lora_adapters(self, num_adapters: int) -> None:
        """vLLM's `vllm:lora_requests_info`, once the engine serves LoRA adapters: one series whose
        labels name the adapters of the running and of the waiting requests (comma separated,
        `set_lora_in_use`) and `max_lora` (here the adapters loaded: all are), its value the time they
        last changed. vLLM adds a series for every combination it meets; this one keeps only the
        current one."""
        if self.lora_info is None:
            self.lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
            self.lora_info.labels(*self._lora_labels).set_to_current_time()
        self._relabel_lora(str(num_adapters), *self._lora_labels[1:])

    def set_lora_in_use(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        if self.lora_info is not None:
            self._relabel_lora(self._lora_labels[0], ",".join(waiting), ",".join(running))

    def _relabel_lora(self, *labels: str) -> None:
        assert self.lora_info is not None
        if labels != self._lora_labels:
            self.lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
            self.lora_info.labels(*labels).set_to_current_time()

    def _export_every_series(self) -> None:
        """Every series at 0 from the start, so dashboards and rate() see it before its first event."""
        m = self.model_name
        for metric in (
            self.running,
            self.waiting,
            self.swapped,
            self.kv_usage,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.ttft,
            self.tpot,
            self.itl,
            self.e2e,
            self.queue_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.prefill_time,
            self.decode_time,
            self.inference_time,
            self.max_generation_tokens,
            self.params_n,
            self.params_max_tokens,
            self.iteration_tokens,
        ):
            metric.labels(m)
        for reason in FINISH_REASONS:
            self.success.labels(m, reason)
        for direction in ("out", "in"):
            self.swapped_blocks.labels(m, direction)
            self.swap_bytes.labels(m, direction)
        for cause in ABORT_CAUSES:
            self.aborts.labels(m, cause)
        for reason in REJECTION_REASONS:
            self.rejections.labels(m, reason)

    def watch_engine_process(self, pid: int) -> None:
        """The engine process's CPU time, memory and file descriptors as well, under
        pagedserve_engine_process_* (`serve` with its engine in a process of its own: process_* are
        the front end's). A process that has exited reports none."""
        ProcessCollector(namespace="pagedserve_engine", pid=lambda: pid, registry=self.registry)

    def watch_ranks(self, pids: list[int]) -> None:
        """The CPU time, memory and file descriptors of the tensor-parallel ranks this server started
        (`pids`: ranks 1..N-1), as pagedserve_rank_process_* with a `rank` label."""
        if pids:
            self.registry.register(_RankProcesses(pids))

    def record_step(self, stats: Any, deltas: list[RequestDelta], now: float | None = None) -> None:
        """`stats` is the engine's `EngineStats` after the step."""
        now = time.monotonic() if now is None else now
        if self._is_idle:  # idle time is no part of a throughput window
            self._window_start, self._window_tokens = now, [0, 0]
        self._set_gauges(stats)
        self._add_cumulative(stats)
        num_tokens = self._record_deltas(deltas, now)
        if num_tokens is not None:  # as vLLM: one sample per step that gave client requests output
            self._iteration_tokens.observe(num_tokens)
        self._maybe_log_summary(stats, now)
        self._is_idle = stats.num_unfinished == 0

    def record_aborted(self, stats: Any, deltas: list[RequestDelta], now: float | None = None) -> None:
        """Requests were aborted between steps: `deltas` are their final (aborted) deltas and `stats`
        the engine's after the abort. No step may follow, so the gauges are refreshed here."""
        now = time.monotonic() if now is None else now
        self._set_gauges(stats)
        for delta in deltas:
            self._streams.last_token.pop((delta.request_id, delta.index), None)
            if delta.request_finished and delta.request_id not in self.unmetered_request_ids:
                log_finished(delta, now - delta.metrics.arrival_time)

    def record_failed(self, deltas: list[RequestDelta], now: float | None = None) -> None:
        """Requests the engine failed outside a step (it died): `deltas` are their final (error)
        deltas. Counted as a step's deltas are (record_step counts its own here), so no failure is
        missing from the counts."""
        self._record_deltas(deltas, time.monotonic() if now is None else now)

    def _record_deltas(self, deltas: list[RequestDelta], now: float) -> int | None:
        """Count the client requests' deltas; the tokens counted (prompt tokens of requests that got
        their first token, and generated tokens), None when no delta was a client request's."""
        num_tokens: int | None = None
        for delta in deltas:
            if delta.request_id not in self.unmetered_request_ids:
                num_tokens = (num_tokens or 0) + self._record_delta(delta, now)
        return num_tokens

    def record_abort(self, cause: str) -> None:
        """`cause` is one of ABORT_CAUSES."""
        self.aborts.labels(self.model_name, cause).inc()

    def record_rejection(self, reason: str) -> None:
        """`reason` is one of REJECTION_REASONS."""
        self.rejections.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _set_gauges(self, stats: Any) -> None:
        for gauge, value in zip(self._gauges, (stats.num_running, stats.num_waiting, stats.num_swapped)):
            gauge.set(value)
        self._kv_usage.set(1.0 - stats.num_free_blocks / max(1, stats.num_total_blocks))

    def _add_cumulative(self, stats: Any) -> None:
        """Add what the engine's counters gained since the last call (most gain nothing most steps)."""
        m, last = self.model_name, self._last
        for counter, gain in (
            (self.preemptions, stats.num_preemptions - last.preemptions),
            (self.spec_drafts, stats.num_spec_drafts - last.spec_drafts),
            (self.draft_tokens, stats.num_draft_tokens - last.draft_tokens),
            (self.accepted_draft_tokens, stats.num_accepted_draft_tokens - last.accepted_draft_tokens),
            (self.prefix_queries, stats.num_prefix_queries - last.prefix_queries),
            (self.prefix_hits, stats.num_prefix_hits - last.prefix_hits),
        ):
            if gain:
                counter.labels(m).inc(gain)
        for direction, now_count, before in (
            ("out", stats.num_swapped_out_blocks, last.swapped_out),
            ("in", stats.num_swapped_in_blocks, last.swapped_in),
        ):
            if now_count != before:
                self.swapped_blocks.labels(m, direction).inc(now_count - before)
                self.swap_bytes.labels(m, direction).inc((now_count - before) * self.bytes_per_block)
        self._last = _Snapshot(
            stats.num_preemptions,
            stats.num_prefix_queries,
            stats.num_prefix_hits,
            stats.num_swapped_out_blocks,
            stats.num_swapped_in_blocks,
            stats.num_spec_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_draft_tokens,
        )

    def _record_delta(self, delta: RequestDelta, now: float) -> int:
        """Count one delta; returns the prompt and generated tokens it added to the token counters."""
        m, key = self.model_name, (delta.request_id, delta.index)
        num_new = num_counted = len(delta.new_token_ids)
        if num_new:
            self._generation_tokens.inc(num_new)
        self._window_tokens[1] += num_new
        last = self._streams.last_token.get(key)
        if last is None and num_new:
            if delta.index == 0:
                self.prompt_tokens.labels(m).inc(delta.num_prompt_tokens)
                self._window_tokens[0] += delta.num_prompt_tokens
                num_counted += delta.num_prompt_tokens
                metrics = delta.metrics
                if metrics.time_to_first_token is not None:
                    self.ttft.labels(m).observe(metrics.time_to_first_token)
                if metrics.time_in_queue is not None:
                    self.queue_time.labels(m).observe(metrics.time_in_queue)
        elif last is not None and num_new:
            self._itl.observe(now - last)
        if num_new:
            self._streams.last_token[key] = now
        if delta.finished:
            self._streams.last_token.pop(key, None)
            self.request_generation_tokens.labels(m).observe(delta.num_output_tokens)
        if delta.request_finished:
            self._record_finished(delta, now)
        return num_counted

    def _record_finished(self, delta: RequestDelta, now: float) -> None:
        m, metrics = self.model_name, delta.metrics
        reason = delta.finish_reason or "unknown"
        self.success.labels(m, _VLLM_FINISH_REASONS.get(reason, reason)).inc()
        e2e = now - metrics.arrival_time
        self.e2e.labels(m).observe(e2e)
        self.request_prompt_tokens.labels(m).observe(delta.num_prompt_tokens)
        if metrics.first_token_time is not None and delta.num_output_tokens > 1:
            self.tpot.labels(m).observe((now - metrics.first_token_time) / (delta.num_output_tokens - 1))
        self._record_phases(metrics)
        self._record_params(delta)
        log_finished(delta, e2e)

    def _record_phases(self, metrics: RequestMetrics) -> None:
        """vLLM's request phases: prefill from the first scheduling to the first token, decode from the
        first token to the last, inference from the first scheduling to the last token. Like vLLM's,
        they run from the FIRST scheduling: a preemption's wait (and its recompute) falls inside the
        phase it interrupted. A request that never got a token has no phases to observe."""
        scheduled, first, last = (
            metrics.first_scheduled_time,
            metrics.first_token_time,
            metrics.last_token_time,
        )
        if scheduled is None or first is None or last is None:
            return
        m = self.model_name
        self.prefill_time.labels(m).observe(first - scheduled)
        self.decode_time.labels(m).observe(last - first)
        self.inference_time.labels(m).observe(last - scheduled)

    def _record_params(self, delta: RequestDelta) -> None:
        """The request's n and max_tokens and its longest completion, known from the engine's record
        (not for a request that failed before it reached the engine)."""
        metrics, m = delta.metrics, self.model_name
        if metrics.n is None or metrics.max_tokens is None:
            return
        longest = max(tokens for _, tokens in delta.completion_ends())
        self.max_generation_tokens.labels(m).observe(longest)
        self.params_n.labels(m).observe(metrics.n)
        self.params_max_tokens.labels(m).observe(metrics.max_tokens)

    def _maybe_log_summary(self, stats: Any, now: float) -> None:
        elapsed = now - self._window_start
        if elapsed < self.summary_interval_s or elapsed <= 0:
            return
        prompt, generation = self._window_tokens
        logging.getLogger("pagedserve.engine").info(
            "throughput: prompt %.1f tok/s, generation %.1f tok/s; running %d, waiting %d, swapped %d; "
            "KV cache %.1f%% used",
            prompt / elapsed,
            generation / elapsed,
            stats.num_running,
            stats.num_waiting,
            stats.num_swapped,
            100.0 * (1.0 - stats.num_free_blocks / max(1, stats.num_total_blocks)),
        )
        self._window_start, self._window_tokens = now, [0, 0]


class _RankProcesses:
    """Prometheus' process metrics of each rank, one series per rank under one name: a rank that has
    exited reports none (as ProcessCollector does for a pid it cannot read)."""

    def __init__(self, pids: list[int]) -> None:
        self._processes = [
            (str(rank), ProcessCollector(namespace="pagedserve_rank", pid=_constant(pid), registry=None))
            for rank, pid in enumerate(pids, start=1)
        ]

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for rank, process in self._processes:
            for family in process.collect():
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "rank": rank}, sample.value)
        return list(families.values())


def _constant(value: int) -> Callable[[], int]:
    return lambda: value


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's edges for token-count histograms."""
    edges: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(edges)
            edges.append(mantissa * scale)
        scale *= 10


def cache_config_labels(
    cache: Any, cache_dtype: str, num_gpu_blocks: int, num_cpu_blocks: int
) -> dict[str, str]:
    """The labels of `vllm:cache_config_info`: those of vLLM's CacheConfig that we have a value for
    (`cache` is our CacheConfig; KV blocks are per rank), as strings the way vLLM writes them."""
    values = {
        "block_size": cache.block_size,
        "cache_dtype": cache_dtype,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "gpu_memory_utilization": cache.memory_utilization,
        "kv_cache_memory_bytes": cache.kv_cache_memory,
        "num_cpu_blocks": num_cpu_blocks,
        "num_gpu_blocks": num_gpu_blocks,
        "num_gpu_blocks_override": cache.num_blocks,
        "swap_space": cache.swap_space,
        "engine": 0,
    }
    return {name: str(value) for name, value in values.items()}


def log_finished(delta: RequestDelta, e2e: float) -> None:
    """The one info line of a finished request (aborted ones included); the same values ride on the
    record as `request_id`, `num_prompt_tokens`, ... for structured (JSON) log handlers (--log-format
    json). Nothing is built under --no-log-requests."""
    if not logger.isEnabledFor(logging.INFO):
        return
    metrics = delta.metrics
    ends = delta.completion_ends()
    fields = {
        "request_id": delta.request_id,
        "num_prompt_tokens": delta.num_prompt_tokens,
        "num_output_tokens": sum(tokens for _, tokens in ends),
        "ttft_s": metrics.time_to_first_token,
        "e2e_s": e2e,
        "num_preemptions": metrics.num_preemptions,
        "finish_reason": ",".join(reason for reason, _ in ends),  # one per completion
    }
    logger.info(
        "request finished id=%s prompt_tokens=%d output_tokens=%d ttft_s=%.3f e2e_s=%.3f "
        "preemptions=%d finish_reason=%s",
        delta.request_id,
        delta.num_prompt_tokens,
        fields["num_output_tokens"],
        metrics.time_to_first_token or 0.0,
        e2e,
        metrics.num_preemptions,
        fields["finish_reason"],
        extra=fields,
    )


# -- tracing ---------------------------------------------------------------------------------------

_EVENTS = {  # kind in RequestMetrics.preemption_events -> span events
    "recompute": ("preemption",),
    "swap": ("preemption", "swap_out"),
    "swap_in": ("swap_in",),
}


class RequestTracer:
    """One server span per request, continuing the caller's W3C trace, with child spans for tokenize,
    queue, prefill and decode built from the request's timestamps when it ends, and events for
    preemption and swap; a request refused before it ran gets its span too (`refuse`). A span that
    ended in error has status ERROR with the message and `error.type` (ENGINE_ERROR, or the refusal's
    reason).

    `provider=None` disables tracing: no tracer, no processor, and every front end's call returns at
    once without reading the request's metadata.

    With a provider, three switches (Triton's trace settings, changed while serving) pick the requests
    traced: `on` (trace_level TIMESTAMPS, else OFF), `rate` (one request traced of every `rate` that
    end) and `count` (traces left to take, -1 for no limit; at 0 tracing stops). At start every
    request is traced."""

    def __init__(self, provider: Any | None, model_name: str) -> None:
        self.provider = provider
        self.model_name = model_name
        self._tracer = provider.get_tracer("pagedserve") if provider is not None else None
        # monotonic -> epoch nanoseconds, for span timestamps taken with time.monotonic()
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self.on = provider is not None
        self.rate = 1
        self.count = -1
        self._since_traced = 0  # requests ended since the last one traced

    @property
    def can_trace(self) -> bool:
        """A provider is there: the switches can turn tracing on."""
        return self._tracer is not None

    @property
    def enabled(self) -> bool:
        return self._tracer is not None and self.on and self.count != 0

    def _sampled(self) -> bool:
        """Whether the request ending now is traced (one of every `rate`, `count` taking it)."""
        if not self.enabled:
            return False
        self._since_traced += 1
        if self._since_traced < self.rate:
            return False
        self._since_traced = 0
        if self.count > 0:
            self.count -= 1
        return True

    def extract(self, carrier: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> Any:
        """The caller's trace context from gRPC metadata (pairs) or HTTP headers (`traceparent`,
        `tracestate`; names in any case)."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        pairs = carrier.items() if isinstance(carrier, Mapping) else carrier or ()
        headers = {k.lower(): v for k, v in pairs if isinstance(v, str)}
        return TraceContextTextMapPropagator().extract(headers)

    def finish_request(
        self,
        carrier: Mapping[str, Any] | Iterable[tuple[str, Any]] | None,
        request_id: str,
        params: Any,
        last: RequestDelta | None,
        tokenize: tuple[float, float],
        num_prompt_tokens: int,
        client_request_id: str = "",
    ) -> None:
        """What every front end calls when a request's call ends, however it ended. `last` is the
        request's final delta: the one the call read, or the one the engine ended the request with
        while its caller went away (`AsyncEngine.unread_final_delta`), so that the span says what the
        metrics count; else a failed completion's (finish reason error), after which the call ended;
        or an earlier one (or none) when the caller went away, which aborted the request."""
        if not self._sampled():
            return
        if last is None or not last.request_finished:
            error = last.error if last is not None and last.finish_reason == "error" else None
            last = RequestDelta.ended_early(request_id, last, num_prompt_tokens, tokenize[1], error)
        self.record(
            self.extract(carrier), request_id, params, last, tokenize, client_request_id=client_request_id
        )

    def record(
        self,
        parent: Any,
        request_id: str,
        params: Any,
        delta: RequestDelta,
        tokenize: tuple[float, float] | None = None,
        end: float | None = None,
        client_request_id: str = "",
    ) -> None:
        """Emit the spans of a request that ended with final delta `delta`. Times are time.monotonic().
        `client_request_id`: the id the client's own protocol gave the request (KServe v2's and Triton's
        `id`, echoed in their responses), beside the engine's id."""
        if self._tracer is None:
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        metrics = delta.metrics
        end = time.monotonic() if end is None else end
        start = tokenize[0] if tokenize else metrics.arrival_time
        span = self._tracer.start_span(
            "llm_request",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self._ns(start),
            attributes=self._attributes(request_id, params, delta, end),
        )
        if client_request_id:
            span.set_attribute(CLIENT_REQUEST_ID, client_request_id)
        child_context = set_span_in_context(span)
        for name, span_start, span_end in self._phases(metrics, tokenize, end):
            child = self._tracer.start_span(name, context=child_context, start_time=self._ns(span_start))
            child.end(end_time=self._ns(max(span_start, span_end)))
        for when, kind in metrics.preemption_events:
            for event in _EVENTS.get(kind, ()):
                attrs = {"gen_ai.pagedserve.preemption_mode": kind} if event == "preemption" else {}
                span.add_event(event, attrs, timestamp=self._ns(when))
        if delta.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, delta.error or "generation failed"))
            span.set_attribute("error.type", ENGINE_ERROR)
        span.end(end_time=self._ns(end))

    def refuse(
        self,
        carrier: Mapping[str, Any] | Iterable[tuple[str, Any]] | None,
        reason: str,
        message: str,
        started: float,
        request_id: str = "",
        params: Any | None = None,
        model: str = "",
        client_request_id: str = "",
    ) -> None:
        """The span of a request refused before it ran, for `reason` (a REJECTION_REASONS value, as
        pagedserve:request_rejections counts it): from `started` (time.monotonic(), when its call came
        in) to now, status ERROR with the refusal's message, under the caller's trace. It says what was
        known of the request: its id and parameters once parsed (none before), the model it named
        (`model`; else the served one). No child spans: the request never reached the engine."""
        if self._tracer is None or not self._sampled():
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        attrs: dict[str, Any] = {
            "gen_ai.request.model": model or self.model_name,
            "gen_ai.pagedserve.rejection_reason": reason,
            "error.type": reason,
        }
        if request_id:
            attrs["gen_ai.request.id"] = request_id
        if client_request_id:
            attrs[CLIENT_REQUEST_ID] = client_request_id
        if params is not None:
            attrs.update(self._params_attributes(params))
        span = self._tracer.start_span(
            "llm_request",
            context=self.extract(carrier),
            kind=SpanKind.SERVER,
            start_time=self._ns(started),
            attributes=attrs,
        )
        span.set_status(Status(StatusCode.ERROR, message))
        span.end(end_time=self._ns(time.monotonic()))

    def _attributes(self, request_id: str, params: Any, delta: RequestDelta, end: float) -> dict[str, Any]:
        m = delta.metrics
        ends = delta.completion_ends()  # semantic conventions: the response's tokens, a reason a choice
        attrs: dict[str, Any] = {
            "gen_ai.request.id": request_id,
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            **self._params_attributes(params),
            "gen_ai.usage.prompt_tokens": delta.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": sum(tokens for _, tokens in ends),
            "gen_ai.response.finish_reasons": [reason for reason, _ in ends],
            "gen_ai.latency.e2e": end - m.arrival_time,
            "gen_ai.pagedserve.num_preemptions": m.num_preemptions,
        }
        if m.lora_name is not None:
            attrs["gen_ai.pagedserve.lora_name"] = m.lora_name
        if m.time_in_queue is not None:
            attrs["gen_ai.latency.time_in_queue"] = m.time_in_queue
        if m.time_to_first_token is not None:
            attrs["gen_ai.latency.time_to_first_token"] = m.time_to_first_token
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            attrs["gen_ai.latency.time_in_model_prefill"] = m.first_token_time - m.first_scheduled_time
            attrs["gen_ai.latency.time_in_model_decode"] = end - m.first_token_time
        return attrs

    @staticmethod
    def _params_attributes(params: Any) -> dict[str, Any]:
        if params.pooling is not None:  # an embedding: nothing sampled, nothing to say of sampling
            return {"gen_ai.operation.name": "embeddings"}  # the semantic conventions' operation
        return {
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,
        }

    @staticmethod
    def _phases(
        m: RequestMetrics, tokenize: tuple[float, float] | None, end: float
    ) -> list[tuple[str, float, float]]:
        """(name, start, end) of each phase the request reached; an aborted one's last phase ends at
        `end`. Prefill runs from first scheduling to the first token (recompute after a preemption is
        inside decode)."""
        phases = [("tokenize", *tokenize)] if tokenize else []
        phases.append(("queue", m.arrival_time, m.first_scheduled_time or end))
        if m.first_scheduled_time is not None:
            phases.append(("prefill", m.first_scheduled_time, m.first_token_time or end))
        if m.first_token_time is not None:
            phases.append(("decode", m.first_token_time, end))
        return phases

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns


def configure_tracing(otlp_endpoint: str | None, exporter: str | None = None) -> Any | None:
    """A TracerProvider when tracing is asked for, else None (no SDK object at all).

    The exporter is `exporter` (--traces-exporter), else OTEL_TRACES_EXPORTER, else otlp when an
    endpoint is given, else none; several may be given comma separated. OTLP speaks
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or OTEL_EXPORTER_OTLP_PROTOCOL): grpc (default) or
    http/protobuf. OTEL_SDK_DISABLED=true turns tracing off. Resource attributes come from
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; service.name is pagedserve unless they set it."""
    from pagedserve.settings import OtelSettings

    otel = OtelSettings()
    names = _exporter_names(exporter or otel.traces_exporter or ("otlp" if otlp_endpoint else "none"))
    if otel.sdk_disabled or not names:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = otel.exporter_otlp_traces_protocol or otel.exporter_otlp_protocol or "grpc"
    provider = TracerProvider(resource=_resource())
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_span_exporter(name, otlp_endpoint, protocol)))
    return provider


def _exporter_names(value: str) -> list[str]:
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    for name in names:
        if name not in ("otlp", "console", "none"):
            raise ValueError(
                f"traces exporter {name!r} (--traces-exporter / OTEL_TRACES_EXPORTER): "
                "use otlp, console or none"
            )
    return [] if "none" in names else list(dict.fromkeys(names))


def _resource() -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create()  # reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "pagedserve"}))
    return resource


def _span_exporter(name: str, endpoint: str | None, protocol: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    return _otlp_exporter(endpoint, protocol)


# OTLP protocol (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) -> the exporter package it needs (the image has both)
OTLP_EXPORTER_PACKAGES = {
    "grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "http/protobuf": "opentelemetry-exporter-otlp-proto-http",
}


def _otlp_exporter(endpoint: str | None, protocol: str) -> Any:
    if protocol not in OTLP_EXPORTER_PACKAGES:
        raise ValueError(
            f"OTLP protocol {protocol!r} (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL): use grpc or http/protobuf"
        )
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise RuntimeError(
            f"OTLP tracing over {protocol} needs the exporter package: pip install {OTLP_EXPORTER_PACKAGES[protocol]}"
        ) from exc
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
