"""Faults inside a live single-rank server: the affected streams fail with INTERNAL and a message that
says why, no client hangs, and health follows whether the engine can go on.

The server runs in this test's event loop (the same Server, AsyncEngine and LLMEngine that
`pagedserve serve` assembles, on a loopback port, with real grpc.aio clients) so a fault can be
injected into it: a healthy model never raises on demand, so a test replaces the executor's
`execute` (or the scheduler's `schedule`) on the live engine with one that raises. Nothing else is
stubbed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import READINESS, request
from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineDeadError
from pagedserve.rpc.server import Server, run_until_signalled
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc
from pagedserve.settings import EngineSettings

pytestmark = pytest.mark.slow

MAX_TOKENS = 900  # ~4 s of tokens on the tiny model: still running when the fault is injected
NO_HANG_S = 30.0  # every call must end (with its status) well within this


@dataclass
class LiveServer:
    server: Server
    llm: LLMEngine
    stub: pb_grpc.GenerationStub
    health: health_pb2_grpc.HealthStub

    async def status(self, service: str) -> int:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return int(reply.status)

    async def is_idle(self) -> bool:
        h = await self.stub.Health(pb.HealthRequest(), timeout=10)
        return h.num_running == 0 and h.num_waiting == 0 and h.kv_cache_usage == 0.0


@asynccontextmanager
async def live_server(model_dir: str, **settings: Any) -> AsyncIterator[LiveServer]:
    engine_settings = EngineSettings(model=model_dir, dtype="float32", num_kv_blocks=256, **settings)
    llm = await in_torch_thread(LLMEngine.from_settings, engine_settings)
    server = Server()
    port = server.add_port("127.0.0.1:0")
    await server.open()
    try:
        await server.start(AsyncEngine(llm))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield LiveServer(
                server, llm, pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
            )
    finally:
        await server.stop(grace=0.5)  # a second stop (after run_until_signalled) is harmless


def raise_on_next_call(owner: object, method: str, exc: Exception, *, once: bool) -> None:
    """Fault injection: `owner.method` raises `exc` on its next call (and every call unless `once`)."""
    real = getattr(owner, method)

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if once:
            setattr(owner, method, real)
        raise exc

    setattr(owner, method, faulty)


async def start_streams(live: LiveServer, num: int) -> list[Any]:
    """`num` streams that have each received their first token, so all of them are running. A stream
    read after the others may get its first tokens in one response (deltas queued while its reader was
    behind are merged), so a response carries at least one token, not exactly one."""
    calls = [live.stub.Generate(request(f"Stream {i} says", max_tokens=MAX_TOKENS)) for i in range(num)]
    for call in calls:
        assert len((await call.read()).token_ids) >= 1
    return calls


async def outcome(call: Any) -> tuple[grpc.StatusCode, str, int]:
    """Read a stream to its end: its status code, status details and how many tokens it streamed."""
    num_tokens = 0
    try:  # read(), not `async for`: start_streams already read from the call
        while (response := await call.read()) is not grpc.aio.EOF:
            num_tokens += len(response.token_ids)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", num_tokens
    return grpc.StatusCode.OK, "", num_tokens


async def outcomes(calls: list[Any]) -> list[tuple[grpc.StatusCode, str, int]]:
    return await asyncio.wait_for(asyncio.gather(*(outcome(c) for c in calls)), NO_HANG_S)


async def eventually(predicate: Callable[[], Any], timeout: float = 10.0) -> bool:
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.02)
    return True


def test_a_model_fault_fails_the_batch_with_internal_and_the_server_serves_on(tiny_llama_dir: str) -> None:
    """A model exception ends the requests of the step it hit; the engine itself is intact, so it stays
    ready and the next request is served (llm_engine.step: a model fault fails the batch, not the
    engine)."""

    async def scenario() -> None:
        async with live_server(tiny_llama_dir) as live:
            calls = await start_streams(live, 3)
            fault = RuntimeError("injected model fault")
            raise_on_next_call(live.llm.executor, "execute", fault, once=True)
            for code, details, num_tokens in await outcomes(calls):
                assert code == grpc.StatusCode.INTERNAL and "injected model fault" in details, details
                assert num_tokens < MAX_TOKENS
            assert await eventually(live.is_idle)  # their KV blocks are free
            assert await live.status(READINESS) == health_pb2.HealthCheckResponse.SERVING
            after = [r async for r in live.stub.Generate(request(max_tokens=5), timeout=NO_HANG_S)]
            assert after[-1].finish_reason == pb.LENGTH and after[-1].completion_tokens == 5

    asyncio.run(scenario())


def test_a_model_fault_is_not_counted_as_a_client_cancel(tiny_llama_dir: str) -> None:
    """Abort counts by cause are what operators alert on: a failed request is not a cancelled one."""

    async def scenario() -> None:
        async with live_server(tiny_llama_dir) as live:
            registry, labels = live.llm.metrics.registry, {"model_name": live.llm.metrics.model_name}
            calls = await start_streams(live, 2)
            raise_on_next_call(live.llm.executor, "execute", RuntimeError("injected"), once=True)
            assert {code for code, _, _ in await outcomes(calls)} == {grpc.StatusCode.INTERNAL}
            cancels = registry.get_sample_value(
                "pagedserve:request_aborts_total", {**labels, "cause": "client_cancel"}
            )
            assert not cancels, cancels  # no client cancelled anything

    asyncio.run(scenario())


# Faults the engine cannot continue after: the executor reporting a lost rank (how the tensor-parallel
# executor says a worker died) and an exception in the engine's own bookkeeping (the scheduler).
FATAL_FAULTS = [
    ("executor", "execute", EngineDeadError("injected: rank 0 lost")),
    ("scheduler", "schedule", RuntimeError("injected scheduler fault")),
]


@pytest.mark.parametrize(("component", "method", "fault"), FATAL_FAULTS, ids=[c for c, _, _ in FATAL_FAULTS])
def test_an_engine_fault_fails_every_request_with_internal_and_health_goes_not_serving(
    tiny_llama_dir: str, component: str, method: str, fault: Exception
) -> None:
    async def scenario() -> None:
        async with live_server(tiny_llama_dir, max_num_seqs=2) as live:
            running = await start_streams(live, 2)
            queued = live.stub.Generate(request("Waiting", max_tokens=MAX_TOKENS))
            assert await eventually(lambda: waiting_count(live, 1))
            watcher = asyncio.create_task(live.server.watch_engine())
            raise_on_next_call(getattr(live.llm, component), method, fault, once=False)
            for code, details, _ in await outcomes([*running, queued]):
                assert code == grpc.StatusCode.INTERNAL and str(fault) in details, (code, details)
            await asyncio.wait_for(watcher, NO_HANG_S)  # it returns once it has flipped health
            assert await live.status("") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await live.status(READINESS) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await live.stub.Generate(request(max_tokens=2), timeout=NO_HANG_S).read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # `pagedserve serve` then exits 1 so the orchestrator restarts it
            assert await asyncio.wait_for(run_until_signalled(live.server, 5.0), NO_HANG_S) == 1

    asyncio.run(scenario())


async def waiting_count(live: LiveServer, num: int) -> bool:
    return (await live.stub.Health(pb.HealthRequest(), timeout=10)).num_waiting == num
