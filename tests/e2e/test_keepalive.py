"""A client gone without closing its connection (a crashed host, a cut network, a hung process: here a
real client process stopped with SIGSTOP, whose kernel still holds the socket open) has its request
aborted once the server's keepalive ping goes unanswered (--grpc-keepalive-time/-timeout). Without
keepalive nothing on the server noticed: the request streamed on to max_tokens, or, queued or held
back by --stream-interval, held its place and KV blocks for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from grpc_helpers import LONG_MAX_TOKENS, LONG_NUM_KV_BLOCKS, long_context_copy, metric_sample, wait_until
from inprocess_server import InProcessServer, wait_for
from pagedserve.rpc.cli import ServeSettings
from pydantic import ValidationError

MODEL = "tiny"
# A ping after 1 s of silence, answered within 1 s: the stopped client is found out within seconds,
# a small fraction of its request's run time (LONG_MAX_TOKENS).
DETECTED_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    model = long_context_copy(tiny_llama_dir, tmp_path_factory.mktemp("long-llama"))
    srv = InProcessServer(
        model,
        None,
        dtype="float32",
        served_model_name=MODEL,
        block_size=16,
        num_kv_blocks=LONG_NUM_KV_BLOCKS,
        grpc_keepalive_time=1.0,
        grpc_keepalive_timeout=1.0,
    ).start()
    yield srv
    srv.stop()


def is_idle(srv: InProcessServer) -> bool:
    stats = srv.llm.stats()
    return stats.num_unfinished == 0 and stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.slow
def test_a_stopped_client_s_stream_is_aborted_once_a_ping_goes_unanswered(server: InProcessServer) -> None:
    wait_for(lambda: is_idle(server), what="an idle engine")
    aborts = metric_sample(server.http_port, "pagedserve:request_aborts_total", cause="client_cancel")
    finished = metric_sample(server.http_port, "vllm:request_success_total", finished_reason="length")
    client = subprocess.Popen(
        [sys.executable, "-c", STREAM_CLIENT, str(server.port), str(LONG_MAX_TOKENS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "streaming"  # tokens flow to it
        os.kill(client.pid, signal.SIGSTOP)  # alive to its kernel, silent to the server
        assert wait_until(lambda: is_idle(server), DETECTED_WITHIN_S), server.llm.stats()
        assert (
            metric_sample(server.http_port, "pagedserve:request_aborts_total", cause="client_cancel")
            == aborts + 1
        )
        assert (
            metric_sample(server.http_port, "vllm:request_success_total", finished_reason="length")
            == finished
        )
    finally:
        client.kill()
        client.wait(timeout=30)
        for request_id in server.server.engine.live_request_ids():  # what a failed check left running
            server.call(_abort(server, request_id))
        wait_for(lambda: is_idle(server), what="an idle engine")


async def _abort(server: InProcessServer, request_id: str) -> None:
    server.server.engine.abort(request_id)


STREAM_CLIENT = """
import sys
import time
import grpc
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc

port, max_tokens = sys.argv[1], int(sys.argv[2])
stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
params = pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
for response in stub.Generate(pb.GenerateRequest(text="Hello", sampling=params)):
    print("streaming", flush=True)
    time.sleep(3600)  # reads no further response, until the test ends this process
"""


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"grpc_keepalive_time": -1}, "grpc_keepalive_time"),
        ({"grpc_keepalive_timeout": 0}, "grpc_keepalive_timeout"),
    ],
)
def test_bad_keepalive_settings_are_refused_by_name(settings: dict[str, float], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        ServeSettings(**settings)


def test_keepalive_zero_turns_the_pings_off() -> None:
    from pagedserve.rpc.server import keepalive_options

    assert keepalive_options(0, 20) == []
    assert dict(keepalive_options(30, 20)) == {
        "grpc.keepalive_time_ms": 30000,
        "grpc.keepalive_timeout_ms": 20000,
        "grpc.http2.ping_timeout_ms": 20000,
    }
