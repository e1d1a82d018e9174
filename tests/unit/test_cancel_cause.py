"""`cancel_cause` on a real gRPC server on loopback: a call cut short by its deadline counts as
"deadline", also when the client's cancel reaches the server just before the server's own copy of
the deadline has passed (the client's copy starts first); any other cancel counts as
"client_cancel"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc.health.v1 import health_pb2, health_pb2_grpc
from pagedserve.rpc.server import DEADLINE_SLACK_S, cancel_cause


class Recorder(health_pb2_grpc.HealthServicer):
    """Holds each call until it is cancelled, then records what cancel_cause says of it."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.causes: asyncio.Queue[str] = asyncio.Queue()

    async def Check(self, request: object, context: grpc.aio.ServicerContext) -> None:
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.causes.put_nowait(cancel_cause(context))
            raise


@asynccontextmanager
async def serve() -> AsyncIterator[tuple[Recorder, health_pb2_grpc.HealthStub]]:
    recorder = Recorder()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield recorder, health_pb2_grpc.HealthStub(channel)
    finally:
        await server.stop(None)


async def cause_of(timeout: float | None, cancel_after: float | None) -> str:
    """What the server counts for one call with `timeout`, which the client cancels itself
    `cancel_after` seconds after the server started handling it (None: never)."""
    async with serve() as (recorder, stub):
        call = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        await asyncio.wait_for(recorder.started.wait(), 10)
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            call.cancel()
        with pytest.raises((grpc.RpcError, asyncio.CancelledError)):
            await call
        return await asyncio.wait_for(recorder.causes.get(), 10)


def test_an_expired_deadline_counts_as_the_deadline() -> None:
    assert asyncio.run(cause_of(timeout=0.3, cancel_after=None)) == "deadline"


def test_a_cancel_just_before_the_servers_deadline_counts_as_the_deadline() -> None:
    """What CI saw: the client's deadline fired and its cancel arrived while the server's copy of
    the deadline had a few milliseconds left. Here the client cancels 0.94 s after the server began
    the 1 s call: at most 60 ms before either copy of the deadline, both having started earlier."""
    assert DEADLINE_SLACK_S > 0.06
    assert asyncio.run(cause_of(timeout=1.0, cancel_after=1.0 - 0.06)) == "deadline"


def test_a_cancel_well_before_the_deadline_counts_as_the_clients() -> None:
    assert asyncio.run(cause_of(timeout=30.0, cancel_after=0.2)) == "client_cancel"


def test_a_cancel_without_a_deadline_counts_as_the_clients() -> None:
    assert asyncio.run(cause_of(timeout=None, cancel_after=0.2)) == "client_cancel"
