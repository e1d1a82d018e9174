"""`--api-key`: every call on both ports needs `authorization: Bearer <key>`, refused before anything
runs (gRPC UNAUTHENTICATED, HTTP 401); gRPC health, reflection, /metrics and the health routes stay
open for probes and scrapers; tritonclient sends the key as a header and works unchanged.

One in-process server (the CLI's assembly, real sockets, real clients) on the tiny model."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from inprocess_server import InProcessServer, parse_metrics, run_python
from pagedserve.rpc.v1 import generate_pb2 as pb

KEY = "s3cret-Key_42"
GOOD = (("authorization", f"Bearer {KEY}"),)
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    srv = InProcessServer(
        tiny_llama_dir, provider=None, dtype="float32", num_kv_blocks=64, served_model_name=MODEL, api_key=KEY
    ).start()
    yield srv
    srv.stop()


def generate(
    server: InProcessServer, metadata: tuple[tuple[str, str], ...] | None
) -> list[pb.GenerateResponse]:
    params = pb.SamplingParameters(max_tokens=3, temperature=0.0)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 500, 600]), sampling=params)
    return list(server.stub.Generate(request, metadata=metadata, timeout=60))


def request_counts(server: InProcessServer) -> float:
    """Every request the engine ended, however it ended."""
    with urllib.request.urlopen(server.http_url("/metrics"), timeout=30) as reply:
        samples = parse_metrics(reply.read().decode())
    return sum(
        value
        for (name, _), value in samples.items()
        if name in ("vllm:request_success_total", "pagedserve:request_aborts_total")
    )


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        (("authorization", "Bearer wrong"),),
        (("authorization", KEY),),
        (("authorization", f"bearer {KEY}"),),
    ],
    ids=["none", "wrong-key", "no-bearer", "lowercase-bearer"],
)
def test_grpc_calls_without_the_key_are_refused_before_they_run(
    server: InProcessServer, metadata: tuple[tuple[str, str], ...] | None
) -> None:
    before = request_counts(server)
    calls = [
        lambda: generate(server, metadata),
        lambda: server.stub.Complete(pb.GenerateRequest(text="Hi"), metadata=metadata, timeout=30),
        lambda: server.stub.ModelInfo(pb.ModelInfoRequest(), metadata=metadata, timeout=30),
        lambda: server.stub.Tokenize(pb.TokenizeRequest(text="Hi"), metadata=metadata, timeout=30),
        lambda: server.stub.Abort(pb.AbortRequest(request_ids=["x"]), metadata=metadata, timeout=30),
        lambda: server.stub.Health(pb.HealthRequest(deep=True), metadata=metadata, timeout=30),
        lambda: next(iter(server.stub.KvEvents(pb.KvEventsRequest(), metadata=metadata, timeout=30))),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.details().startswith(
            "missing or wrong API key: send the header authorization: Bearer"
        )
    assert request_counts(server) == before  # nothing reached the engine
    assert sum(len(r.token_ids) for r in generate(server, GOOD)) == 3


def test_probes_and_reflection_need_no_key(server: InProcessServer) -> None:
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "pagedserve.rpc.v1.Generation"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    [answer] = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in answer.list_services_response.service}
    assert "pagedserve.rpc.v1.Generation" in names


def http(
    server: InProcessServer, path: str, key: str | None = None, body: object = None
) -> tuple[int, bytes, dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.http_url(path), data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def test_http_routes_need_the_key_but_metrics_and_health(server: InProcessServer) -> None:
    for path in ("/metrics", "/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"):
        assert http(server, path)[0] == 200, path
    generate_body = {"text_input": "Hi", "parameters": {"max_tokens": 2}}
    guarded = [
        ("/v2", None),
        (f"/v2/models/{MODEL}", None),
        (f"/v2/models/{MODEL}/ready", None),
        (f"/v2/models/{MODEL}/generate", generate_body),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
        ("/v2/logging", None),  # log settings, read
        ("/v2/logging", {"log_verbose_level": 1}),  # and changed
        (f"/v2/repository/models/{MODEL}/load", {}),  # the model repository's load and unload
        (f"/v2/repository/models/{MODEL}/unload", {}),
    ]
    for path, body in guarded:
        for key in (None, "wrong"):
            status, answer, headers = http(server, path, key, body)
            assert status == 401, (path, key)
            assert json.loads(answer)["error"].startswith("missing or wrong API key")
            assert headers["WWW-Authenticate"] == 'Bearer realm="pagedserve"'
    status, answer, _ = http(server, f"/v2/models/{MODEL}/generate", KEY, generate_body)
    assert status == 200 and json.loads(answer)["model_name"] == MODEL
    assert http(server, f"/v2/models/{MODEL}", KEY)[0] == 200


TRITON_CLIENT = """
import json, sys
import numpy as np
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

port, model, key = sys.argv[1:4]
with tgrpc.InferenceServerClient(f"127.0.0.1:{port}") as client:
    try:
        client.is_server_ready()
        refused = None
    except InferenceServerException as exc:
        refused = exc.status()
    headers = {"authorization": f"Bearer {key}"}
    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps({"max_tokens": 2}).encode()], dtype=object))
    result = client.infer(model, [text, sampling], headers=headers)
    print(json.dumps({"refused": refused, "ready": client.is_server_ready(headers=headers),
                      "text": result.as_numpy("text_output")[0].decode()}))
"""


def test_tritonclient_sends_the_key_as_a_header(server: InProcessServer) -> None:
    out = json.loads(run_python(TRITON_CLIENT, str(server.port), MODEL, KEY))
    assert out["refused"] == "StatusCode.UNAUTHENTICATED" and out["ready"] is True and out["text"]
