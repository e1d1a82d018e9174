"""Clients that go away while their request runs, through every front end: the request is aborted
at once, counted once, and traced as the metrics count it.

- A KServe REST client that hangs up aborts its request even while its handler has nothing to write:
  `/generate_stream` with `"stream": false` (one event at the end), and any endpoint while the
  server's --stream-interval holds tokens back. Both generated to max_tokens for nobody.
- A caller gone after the engine finished its request, before it read the final delta: the metrics
  count the request finished, and its span said aborted (with the tokens the caller had read). Through
  the KServe / Triton adapter (REST and gRPC alike) and the async engine's own API.
- Triton's model statistics count a request as the metrics do: one the engine finished is a success
  even when its caller left first, one aborted by a drain is none.
- A caller gone while the engine dies under its request is counted as aborted; it was counted
  nowhere (its abort waited for a step that never came, and the dead engine failed only the requests
  still read).

Real servers on loopback (inprocess_server.py), real sockets; nothing is stubbed (one test injects a
dead worker's failing step, as test_observability_audit does; `finished_unread` holds steps back,
unchanged, until its caller has read the first delta).

The gRPC Generation service (rpc/server.py) asks `AsyncEngine.unread_final_delta` as the adapter
does; its race needs a client to cancel between the engine's final delta and the servicer reading it
(one event-loop turn), which no real client can hit on purpose: the engine API test below covers
what it relies on (every front end closes the engine's generator first, then asks)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest
from grpc_helpers import (
    IDLE_AFTER_ABORT_S,
    LONG_MAX_TOKENS,
    LONG_NUM_KV_BLOCKS,
    long_context_copy,
    metric_sample,
    wait_until,
)
from inprocess_server import InProcessServer, abort_leftovers, exporting_to, is_idle, server_span, wait_for
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pagedserve.engine.async_engine import in_torch_thread
from pagedserve.errors import EngineDeadError
from pagedserve.outputs import RequestDelta
from pagedserve.sampling_params import SamplingParams
from pagedserve_adapters.llm_model import LLMModel, LLMRequest, Tensor, parse_request

MODEL = "tiny"
HELD = LONG_MAX_TOKENS  # a --stream-interval that holds back every token after the first


@pytest.fixture(scope="module")
def long_model(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return long_context_copy(tiny_llama_dir, tmp_path_factory.mktemp("long-llama"))


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def start(model_dir: str, stream_interval: int, provider: Any = None) -> InProcessServer:
    """Room for one LONG_MAX_TOKENS request: one that ends within seconds was cut short."""
    return InProcessServer(
        model_dir,
        provider,
        dtype="float32",
        served_model_name=MODEL,
        block_size=16,
        num_kv_blocks=LONG_NUM_KV_BLOCKS,
        stream_interval=stream_interval,
    ).start()


@pytest.fixture(scope="module")
def server(long_model: str, exporter: InMemorySpanExporter) -> Iterator[InProcessServer]:
    provider = exporting_to(exporter)
    srv = start(long_model, 1, provider)
    yield srv
    srv.stop()
    provider.shutdown()


@pytest.fixture(scope="module")
def held_server(long_model: str) -> Iterator[InProcessServer]:
    srv = start(long_model, HELD)
    yield srv
    srv.stop()


# -- a REST client hangs up while its handler has nothing to write -------------------------------------


def counter(srv: InProcessServer, name: str, **labels: str) -> float:
    return metric_sample(srv.http_port, name, model_name=MODEL, **labels)


def post_and_hang_up(srv: InProcessServer, path: str, body: dict[str, Any], stream: bool) -> None:
    """POST `body` over a connection of its own, wait until the request has generated tokens (and,
    for a stream, until its first event arrived), then close the connection without reading on."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    tokens = counter(srv, "vllm:generation_tokens_total")
    with socket.create_connection(("127.0.0.1", srv.http_port), timeout=30) as sock:
        sock.sendall(head.encode() + data)
        if stream:
            received = b""
            while b"data: " not in received:
                chunk = sock.recv(65536)
                assert chunk, f"the server closed the connection: {received!r}"
                received += chunk
            assert received.startswith(b"HTTP/1.1 200"), received
        # the handler has taken the first token (and the engine goes on with the next ones)
        wait_for(lambda: counter(srv, "vllm:generation_tokens_total") >= tokens + 3, what="tokens")


def long_body(stream: bool) -> dict[str, Any]:
    parameters = {"max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": stream}
    return {"text_input": "Hello", "parameters": parameters}


def infer_body() -> dict[str, Any]:
    sampling = json.dumps({"max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "temperature": 0})
    inputs = [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hello"]},
        {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": [sampling]},
    ]
    return {"inputs": inputs}


def check_hang_up_aborts(srv: InProcessServer, endpoint: str, body: dict[str, Any], stream: bool) -> None:
    wait_for(lambda: is_idle(srv), what="an idle engine")
    aborts, finished = (
        counter(srv, "pagedserve:request_aborts_total", cause="client_cancel"),
        counter(srv, "vllm:request_success_total", finished_reason="length"),
    )
    try:
        post_and_hang_up(srv, f"/v2/models/{MODEL}/{endpoint}", body, stream)
        assert wait_until(lambda: is_idle(srv), IDLE_AFTER_ABORT_S), srv.llm.stats()
        assert counter(srv, "pagedserve:request_aborts_total", cause="client_cancel") == aborts + 1
        assert counter(srv, "vllm:request_success_total", finished_reason="length") == finished
    finally:
        abort_leftovers(srv)


@pytest.mark.slow
def test_a_client_gone_from_a_generate_stream_sent_at_the_end_aborts_its_request(
    server: InProcessServer,
) -> None:
    """`"stream": false` writes one event, at the end: until then nothing found the client gone, and
    the request ran to max_tokens."""
    check_hang_up_aborts(server, "generate_stream", long_body(stream=False), stream=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("endpoint", "stream"),
    [("generate_stream", True), ("generate_stream", False), ("generate", False), ("infer", False)],
)
def test_a_client_gone_while_stream_interval_holds_its_tokens_aborts_its_request(
    held_server: InProcessServer, endpoint: str, stream: bool
) -> None:
    """The engine hands the handler no delta while --stream-interval holds tokens back: a handler
    that looked at the connection only at a delta (or a write) found the client gone at the end."""
    body = infer_body() if endpoint == "infer" else long_body(stream)
    check_hang_up_aborts(held_server, endpoint, body, stream)


# -- a caller gone after the engine finished its request ------------------------------------------------


def adapter_request(max_tokens: int) -> LLMRequest:
    """What the KServe / Triton front ends make of a request (`text_input` and sampling parameters)."""
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return parse_request([Tensor("text_input", "BYTES", [1], ["Hello"])], params)


async def finished_unread(srv: InProcessServer, deltas: AsyncGenerator[RequestDelta, None]) -> None:
    """Read the first delta and no more while the engine finishes the request (`deltas` not started).

    Once a step has sampled the request's first token, the engine's next step waits until that delta is
    read. Unheld, a loop slower than the steps (a loaded machine; every time with the loop held for
    0.5 s) took the passes of the request's last steps before the reader ran, and handed it their
    deltas merged, the final one among them, as it hands any reader that is behind: that caller had
    read its request to the end and left no final delta unread. The engine is idle first: a step of an
    earlier request, aborted but still running, would sample a token the gate took for this one's."""
    while not is_idle(srv):
        await asyncio.sleep(0.01)
    executor, read = srv.llm.executor, threading.Event()
    sampled = False

    def held_after_the_first_token(output: Any) -> Any:  # on the torch thread
        nonlocal sampled
        if sampled:
            read.wait(timeout=30)
        result = type(executor).execute(executor, output)
        sampled = sampled or bool(result.sampled_token_ids)
        return result

    executor.execute = held_after_the_first_token
    try:
        first = await anext(deltas)
    finally:
        read.set()
        del executor.execute
    assert not first.request_finished, first
    while srv.llm.has_unfinished_requests():
        await asyncio.sleep(0.01)
    # It ended inside a step that may still be returning on the torch thread: the engine loop hands
    # that step's deltas to their streams before a later job of that thread is seen done.
    await in_torch_thread(lambda: None)


async def leave_after_the_engine_finished(srv: InProcessServer, model: LLMModel, trace_id: int) -> str:
    """A KServe / Triton call (REST or gRPC: both go through LLMModel) whose caller goes away after
    the engine finished its request, its final delta unread. Its request id."""
    carrier = {"traceparent": f"00-{trace_id:032x}-00f067aa0ba902b7-01"}
    deltas = model.generate(adapter_request(4), carrier)
    await finished_unread(srv, deltas)
    (request_id,) = srv.server.engine.live_request_ids()
    await deltas.aclose()  # the caller goes away
    return request_id


@pytest.mark.slow
def test_a_caller_gone_after_the_engine_finished_is_traced_and_counted_as_finished(
    server: InProcessServer, exporter: InMemorySpanExporter
) -> None:
    """The metrics count the request finished (length, 4 tokens); its span said aborted with the one
    token its caller had read, and Triton's statistics counted a failure."""
    wait_for(lambda: is_idle(server), what="an idle engine")
    finished = counter(server, "vllm:request_success_total", finished_reason="length")
    aborts = counter(server, "pagedserve:request_aborts_total", cause="client_cancel")
    model = LLMModel(server.server)  # its own statistics, read below
    server.call(leave_after_the_engine_finished(server, model, 0xD1))

    span = server_span(exporter, 0xD1)
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert span.attributes["gen_ai.usage.completion_tokens"] == 4
    assert counter(server, "vllm:request_success_total", finished_reason="length") == finished + 1
    assert counter(server, "pagedserve:request_aborts_total", cause="client_cancel") == aborts
    assert (model.stats.success_count, model.stats.fail_count) == (1, 0)


@pytest.mark.slow
def test_a_request_aborted_by_a_drain_is_no_success_in_tritons_statistics(server: InProcessServer) -> None:
    """The drain's abort ends the stream with finish reason aborted, counted under
    pagedserve:request_aborts{cause="drain"} and not as a success; Triton's statistics counted a
    success, as for a request read to its end."""

    async def drained(model: LLMModel) -> list[RequestDelta]:
        deltas = model.generate(adapter_request(LONG_MAX_TOKENS), {})
        seen = [await anext(deltas)]
        (request_id,) = server.server.engine.live_request_ids()
        assert server.server.engine.abort(request_id, "server shutting down", "drain")
        return seen + [delta async for delta in deltas]

    wait_for(lambda: is_idle(server), what="an idle engine")
    model = LLMModel(server.server)
    seen = server.call(drained(model))
    assert seen[-1].finish_reason == "aborted" and seen[-1].error == "server shutting down"
    assert (model.stats.success_count, model.stats.fail_count) == (0, 1)


# -- the async engine's own API --------------------------------------------------------------------------


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_the_engine_gives_an_unread_final_delta_once_and_nothing_else(server: InProcessServer) -> None:
    """What a front end asks as its call ends, once it has closed the engine's generator: the final
    delta its caller left unread (once); nothing for a request read to the end, one aborted by its
    caller leaving, or an earlier request under a reused id."""
    engine = server.server.engine

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        deltas = engine.generate("left", [1, 2, 3], greedy(4))
        await finished_unread(server, deltas)
        await deltas.aclose()
        final = engine.unread_final_delta("left")
        seen["closed, then asked"] = (final.finish_reason, final.num_output_tokens, final.request_finished)
        seen["asked again"] = engine.unread_final_delta("left")

        seen["read to the end"] = [d async for d in engine.generate("read", [1, 2, 3], greedy(4))][
            -1
        ].finish_reason
        seen["read, asked"] = engine.unread_final_delta("read")

        deltas = engine.generate("cut", [1, 2, 3], greedy(LONG_MAX_TOKENS))
        await anext(deltas)
        await deltas.aclose()  # aborted: the engine had not ended it
        seen["cut, asked"] = engine.unread_final_delta("cut")

        deltas = engine.generate("reused", [1, 2, 3], greedy(4))
        await finished_unread(server, deltas)
        await deltas.aclose()  # its final delta waits, unasked
        while engine.live_request_ids():
            await asyncio.sleep(0.01)
        deltas = engine.generate("reused", [1, 2, 3], greedy(LONG_MAX_TOKENS))
        await anext(deltas)
        await deltas.aclose()  # the new request under that id: aborted
        seen["reused id, asked"] = engine.unread_final_delta("reused")
        return seen

    wait_for(lambda: is_idle(server), what="an idle engine")
    assert server.call(scenario()) == {
        "closed, then asked": ("length", 4, True),
        "asked again": None,
        "read to the end": "length",
        "read, asked": None,
        "cut, asked": None,
        "reused id, asked": None,
    }
    assert not engine._unread_finals


@pytest.mark.slow
def test_unread_final_deltas_nobody_asks_for_are_bounded(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front end that never asks (the server's own requests) leaves the oldest to be forgotten."""
    from pagedserve.engine import async_engine

    monkeypatch.setattr(async_engine, "_MAX_NUM_UNREAD_FINALS", 2)
    engine = server.server.engine

    async def leave(request_id: str) -> None:
        deltas = engine.generate(request_id, [1, 2, 3], greedy(2))
        await finished_unread(server, deltas)
        await deltas.aclose()

    wait_for(lambda: is_idle(server), what="an idle engine")
    for i in range(4):
        server.call(leave(f"unasked-{i}"))

    async def ask_all() -> list[str | None]:
        finals = [engine.unread_final_delta(f"unasked-{i}") for i in range(4)]
        return [final and final.finish_reason for final in finals]

    assert server.call(ask_all()) == [None, None, "length", "length"]


@pytest.mark.slow
def test_a_caller_gone_while_the_engine_dies_is_counted_as_aborted(tiny_llama_dir: str) -> None:
    """The caller leaves during the step that kills the engine: its abort waits for the next step,
    which never comes, and the dead engine fails only the requests whose streams are still read."""
    srv = InProcessServer(tiny_llama_dir, None, dtype="float32", served_model_name=MODEL, num_kv_blocks=64)
    srv.start()
    in_step, left = threading.Event(), threading.Event()

    def lost_rank(*args: object) -> None:  # a step that fails as a dead worker makes it, once we left
        in_step.set()
        left.wait(timeout=30)
        raise EngineDeadError("injected: rank 1 lost")

    async def leave_while_the_engine_dies() -> None:
        deltas = srv.server.engine.generate("doomed", [1, 2, 3], greedy(500), lambda: "client_cancel")
        await anext(deltas)
        srv.llm.executor.execute = lost_rank
        while not in_step.is_set():
            await asyncio.sleep(0.01)
        await deltas.aclose()  # the caller goes away
        left.set()
        while srv.server.engine.dead is None:
            await asyncio.sleep(0.01)

    try:
        srv.call(leave_while_the_engine_dies())
        assert counter(srv, "pagedserve:request_aborts_total", cause="client_cancel") == 1
        assert counter(srv, "vllm:request_success_total", finished_reason="error") == 0
    finally:
        left.set()
        srv.stop()
