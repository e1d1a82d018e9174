"""`pagedserve serve` assembled as the CLI assembles it (our gRPC service and the KServe v2 / Triton
adapter on one port, HTTP with /metrics and KServe v2 REST on another), on loopback, running in a
background event loop of the test process: so a test owns its tracer provider and can read the
engine's own counters. Real sockets and real clients, nothing mocked.

`run_python` runs a client (tritonclient) in a process of its own, as clients are in production."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

# (sample name, sorted labels) -> value, from a /metrics scrape
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

FROM_SETTINGS = object()  # build the tracer provider from the settings, as `pagedserve serve` does


class InProcessServer:
    def __init__(self, model_dir: str, provider: Any = FROM_SETTINGS, **settings: Any) -> None:
        from pagedserve.rpc.cli import ServeSettings

        # the engine on the server's torch thread unless a test asks for engine_process=True: tests
        # read (and fault) the engine's own objects through `llm`
        settings.setdefault("engine_process", False)
        self.settings = ServeSettings(model=model_dir, host="127.0.0.1", port=0, http_port=0, **settings)
        self.provider = provider
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inprocess-server", daemon=True)

    def start(self, timeout: float = 300.0) -> InProcessServer:
        self.thread.start()
        self.call(self._start(), timeout)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationStub(self.channel)
        return self

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.channel.close()
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)

    @property
    def llm(self) -> Any:
        """The LLMEngine: its stats() and metrics are the engine's own counts."""
        return self.server.engine.engine

    @property
    def tracer(self) -> Any:
        return self.server.servicer.tracer

    def http_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    async def _start(self) -> None:
        from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
        from pagedserve.engine.core_process import EngineFace
        from pagedserve.engine.llm_engine import LLMEngine
        from pagedserve.rpc.http import HttpEndpoint
        from pagedserve.rpc.server import Server, keepalive_options
        from pagedserve.telemetry import RequestTracer, configure_tracing
        from pagedserve_adapters.grpc_service import SERVICE as INFERENCE_SERVICE
        from pagedserve_adapters.grpc_service import add_to_server as add_inference_service
        from pagedserve_adapters.llm_model import LLMModel, PriorityLevels
        from pagedserve_adapters.rest import routes as rest_routes

        s = self.settings
        provider = self.provider
        if provider is FROM_SETTINGS:
            provider = configure_tracing(s.otlp_traces_endpoint, s.traces_exporter)
        tracer = RequestTracer(provider, s.served_model_name or "")
        self.server = server = Server(
            tracer,
            keepalive_options(s.grpc_keepalive_time, s.grpc_keepalive_timeout),
            s.stream_write_timeout,
            s.allow_runtime_lora_updating,
            s.auto_tool_call_parser,
            s.reasoning_parser,
            s.api_key,
        )
        model = LLMModel(server, PriorityLevels(s.triton_priority_levels, s.triton_default_priority_level))
        add_inference_service(server.grpc, model)
        server.services.append(INFERENCE_SERVICE)
        self.port = server.add_port(f"{s.host}:{s.port}")
        self.http = HttpEndpoint(server, rest_routes(model))
        self.http_port = await self.http.start(s.host, s.http_port)
        await server.open()
        build = EngineFace.from_settings if s.engine_process else LLMEngine.from_settings
        llm = await in_torch_thread(build, s)
        tracer.model_name = llm.config.model.served_model_name
        await server.start(AsyncEngine(llm, s.max_queued_requests, s.stream_interval), warmup=s.warmup)

    async def _stop(self) -> None:
        await self.http.stop()
        await self.server.stop(grace=0.5)


def is_idle(srv: InProcessServer) -> bool:
    """No request runs or waits, every KV block is free, and no stream is left to any handler."""
    stats = srv.llm.stats()
    return (
        stats.num_unfinished == 0
        and stats.num_free_blocks == stats.num_total_blocks
        and srv.server.engine.num_live_requests == 0
    )


def abort_leftovers(srv: InProcessServer) -> None:
    """Whatever a failed test left running, so that the next test starts on an idle engine."""

    async def abort_all() -> None:
        for request_id in srv.server.engine.live_request_ids():
            srv.server.engine.abort(request_id)

    srv.call(abort_all())
    wait_for(lambda: is_idle(srv), what="an idle engine")


def post_generate(srv: InProcessServer, model: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST `body` to KServe's /generate of `model`: the status and the JSON answer (errors too)."""
    req = urllib.request.Request(
        srv.http_url(f"/v2/models/{model}/generate"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def subscribe(srv: InProcessServer) -> tuple[Any, queue.Queue[Any]]:
    """The KvEvents call and a queue its messages (then its RpcError, or None at its end) arrive on."""
    call = srv.stub.KvEvents(pb.KvEventsRequest(), timeout=120)
    received: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        try:
            for message in call:
                received.put(message)
            received.put(None)
        except grpc.RpcError as exc:
            received.put(exc)

    threading.Thread(target=read, daemon=True).start()
    return call, received


def stored_until(received: queue.Queue[Any], wanted: list[bytes]) -> list[pb.BlockStored]:
    """The BlockStored events received until every hash in `wanted` has come."""
    events, seen = [], set()
    while not set(wanted) <= seen:
        message = received.get(timeout=30)
        assert isinstance(message, pb.KvEventBatch), message
        for event in message.events:
            if event.HasField("stored"):
                events.append(event.stored)
                seen.update(event.stored.block_hashes)
    return events


def exporting_to(exporter: Any) -> Any:
    """A tracer provider that hands each finished span to `exporter` at once (an InMemorySpanExporter)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(f"timed out waiting for {what}")


def parse_metrics(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(srv: InProcessServer) -> Samples:
    """Every sample of the server's /metrics."""
    with urllib.request.urlopen(srv.http_url("/metrics"), timeout=10) as reply:
        return parse_metrics(reply.read().decode())


def server_span(exporter: Any, trace_id: int) -> Any:
    """The server span of trace `trace_id` once `exporter` (an InMemorySpanExporter) has it."""
    from opentelemetry.trace import SpanKind

    def find() -> Any:
        spans = exporter.get_finished_spans()
        return next((s for s in spans if s.kind is SpanKind.SERVER and s.context.trace_id == trace_id), None)

    return wait_for(find, what=f"the server span of trace {trace_id:x}")


def run_python(code: str, *args: str, timeout: float = 120.0) -> str:
    """Run `code` in a fresh interpreter (for tritonclient); its stdout, or a failure with its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"child exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout
