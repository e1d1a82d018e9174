"""`KvEvents` over real gRPC (in-process server, tiny model): a KV-aware router's feed. It opens with a
snapshot of the prefix cache, then streams the blocks each step names, whose hashes a router computes
from a prompt's tokens alone; a cancelled subscription stops the recording; a drain ends the feed with
UNAVAILABLE; with prefix caching off the call is FAILED_PRECONDITION."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from inprocess_server import InProcessServer, stored_until, subscribe, wait_for
from pagedserve.rpc.v1 import generate_pb2 as pb

BLOCK = 8


def start(model_dir: str, **settings: Any) -> InProcessServer:
    return InProcessServer(
        model_dir, None, dtype="float32", served_model_name="tiny", block_size=BLOCK, **settings
    ).start()


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def srv(tiny_llama_dir: str, request: pytest.FixtureRequest) -> Iterator[InProcessServer]:
    """The engine on the server's torch thread, then in a process of its own (--engine-process)."""
    server = start(tiny_llama_dir, engine_process=request.param)
    yield server
    server.stop()


def router_hashes(tokens: list[int]) -> list[bytes]:
    """What a router computes for a prompt, from the documented rule alone."""
    hashes, parent = [], b""
    for begin in range(0, len(tokens) - BLOCK + 1, BLOCK):
        block = array("q", tokens[begin : begin + BLOCK])
        parent = hashlib.sha256(parent + block.tobytes()).digest()  # little-endian on this machine
        hashes.append(parent)
    return hashes


def generate(srv: InProcessServer, request_id: str, prompt: list[int]) -> list[int]:
    params = pb.SamplingParameters(temperature=0, max_tokens=2, ignore_eos=True)
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling=params)
    return [t for r in srv.stub.Generate(request, timeout=60) for t in r.token_ids]


def test_the_feed_opens_with_a_snapshot_then_follows_what_a_router_can_hash(srv: InProcessServer) -> None:
    earlier = [1, *range(100, 120)]  # 21 tokens: 2 full blocks (+2 generated: still 2)
    generate(srv, "earlier", earlier)
    call, received = subscribe(srv)
    snapshot = received.get(timeout=30)
    assert snapshot.snapshot and snapshot.block_size == BLOCK and not snapshot.events
    assert set(router_hashes(earlier)) <= set(snapshot.cached_block_hashes)

    prompt = [1, *range(100, 107), *range(400, 425)]  # block 0 shared with `earlier`, 3 more full
    generate(srv, "prompt", prompt)
    wanted = router_hashes(prompt)[1:]
    events = stored_until(received, wanted)
    run = next(e for e in events if list(e.block_hashes)[:1] == wanted[:1])
    assert list(run.block_hashes) == wanted and run.parent_block_hash == router_hashes(prompt)[0]
    assert list(run.token_ids) == prompt[BLOCK : 4 * BLOCK]
    call.cancel()
    # the last subscriber gone, the engine stops following its cache (an engine process: is asked to)
    if srv.settings.engine_process:
        wait_for(lambda: not srv.server.engine._kv_recording, what="the recording to stop")
    else:
        wait_for(lambda: srv.llm.scheduler.block_manager.kv_events is None, what="the recording to stop")


def test_a_drain_ends_the_feed_with_unavailable(tiny_llama_dir: str) -> None:
    server = start(tiny_llama_dir)
    try:
        _, received = subscribe(server)
        assert received.get(timeout=30).snapshot
        server.call(server.server.drain(timeout=5))
        error = received.get(timeout=30)
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in error.details()
        with pytest.raises(grpc.RpcError) as refused:  # no new subscriber while draining
            next(server.stub.KvEvents(pb.KvEventsRequest(), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_prefix_caching_off_is_failed_precondition(tiny_llama_dir: str) -> None:
    server = start(tiny_llama_dir, enable_prefix_caching=False)
    try:
        with pytest.raises(grpc.RpcError) as info:
            next(server.stub.KvEvents(pb.KvEventsRequest(), timeout=30))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "prefix caching is off" in info.value.details()
    finally:
        server.stop()
