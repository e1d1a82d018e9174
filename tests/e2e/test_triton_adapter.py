"""KServe v2 / Triton compatibility: real `tritonclient` (gRPC and HTTP) and plain HTTP against a real
`pagedserve serve` on the default model, on loopback. Requests are built with tritonclient's own
protobufs, never with the server's adapter stubs."""

from __future__ import annotations

import contextlib
import gc
import json
import queue
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from grpc_health.v1 import health_pb2
from grpc_helpers import ServerProcess, metric_sample, request, wait_until
from pagedserve.rpc.v1 import generate_pb2 as pb
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(default_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess("--model", default_model_dir, "--dtype", "float32", log=log).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(autouse=True)
def _collect_http_clients() -> Iterator[None]:
    """tritonclient.http's clients sit in a reference cycle with their gevent pool; left to the cyclic
    collector, one may be freed later on another thread (a later module's in-process server), where
    its __del__ fails (gevent's InvalidThreadUseError, an unraisable-exception warning in that test).
    Collected here, after each test, they are freed on this thread."""
    yield
    gc.collect()


@pytest.fixture()
def client(server: ServerProcess) -> tgrpc.InferenceServerClient:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as c:
        yield c


def our_text(server: ServerProcess, prompt: str = PROMPT, max_tokens: int = 12) -> str:
    """The greedy completion from pagedserve's own Generate RPC."""
    req = request(prompt, max_tokens=max_tokens, ignore_eos=False)
    return "".join(r.text for r in server.stub.Generate(req, timeout=60))


def grpc_inputs(
    prompt: str | None = PROMPT, stream: bool | None = None, **params: Any
) -> list[tgrpc.InferInput]:
    inputs = []
    if prompt is not None:
        text = tgrpc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
        inputs.append(text)
    if stream is not None:
        flag = tgrpc.InferInput("stream", [1], "BOOL")
        flag.set_data_from_numpy(np.array([stream]))
        inputs.append(flag)
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(
        np.array([json.dumps({"temperature": 0, "max_tokens": 12, **params}).encode()], dtype=object)
    )
    return [*inputs, sampling]


def collect(responses: queue.Queue[Any], until_final: int, timeout: float = 60) -> list[Any]:
    """(result, error) pairs from a stream callback until `until_final` responses flagged final."""
    got, finals, deadline = [], 0, time.monotonic() + timeout
    while finals < until_final:
        result, error = responses.get(timeout=max(0.1, deadline - time.monotonic()))
        got.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            finals += 1
    return got


def flag_input(name: str, value: bool = True) -> tgrpc.InferInput:
    flag = tgrpc.InferInput(name, [1], "BOOL")
    flag.set_data_from_numpy(np.array([value]))
    return flag


def is_final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def http_status(server: ServerProcess, path: str) -> int | None:
    """The status of a GET on the HTTP port, or None once it no longer answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


# -- health, metadata, config ---------------------------------------------------------------------


def test_health_metadata_and_config(client: tgrpc.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("no-such-model")
    assert client.get_server_metadata().name == "pagedserve"

    metadata = client.get_model_metadata(MODEL)
    assert metadata.name == MODEL and list(metadata.versions) == ["1"]
    inputs = {t.name: (t.datatype, list(t.shape)) for t in metadata.inputs}
    assert inputs["text_input"] == ("BYTES", [1]) and inputs["stream"] == ("BOOL", [1])
    assert {t.name for t in metadata.outputs} >= {"text_output", "finish_reason", "num_output_tokens"}

    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert config["name"] == MODEL
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert config.get("max_batch_size", 0) == 0  # proto3 JSON leaves out the zero

    index = client.get_model_repository_index().models
    assert [(m.name, m.version, m.state) for m in index] == [(MODEL, "1", "READY")]

    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no-such-model")
    assert info.value.status() == "StatusCode.NOT_FOUND" and "no-such-model" in info.value.message()


def test_grpc_health_answers_for_the_inference_service(server: ServerProcess) -> None:
    """A probe or a mesh that checks the KServe v2 service by name (grpc_health_probe -service=...)
    gets its state, as for our own service; a name the server does not serve is NOT_FOUND."""
    for name in ("", "pagedserve.rpc.v1.Generation", "inference.GRPCInferenceService"):
        reply = server.health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    with pytest.raises(grpc.RpcError) as info:
        server.health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_rest_config_and_statistics_are_json_as_triton_writes_them(server: ServerProcess) -> None:
    """Triton's HTTP model config (ModelConfigToJson) prints every field, default-valued ones too, and
    its 64-bit integers as numbers, as do its statistics: tritonclient.http users index them so
    (`config["max_batch_size"]`, `dims` of ints). Protobuf's own JSON mapping would give neither."""
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
        config = http.get_model_config(MODEL)
        stats = http.get_inference_statistics(MODEL)["model_stats"][0]
    assert config["max_batch_size"] == 0 and config["platform"] == ""
    dims = {io["name"]: io["dims"] for io in config["input"] + config["output"]}
    assert dims["text_input"] == [1] and dims["text_output"] == [-1]
    assert config["input"][0]["optional"] is False  # text_input: required, said so
    assert isinstance(stats["inference_count"], int)
    assert isinstance(stats["inference_stats"]["success"]["count"], int)
    assert isinstance(stats["inference_stats"]["success"]["ns"], int)


def test_rest_statistics_have_every_field_triton_writes(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    """tritonclient.http users (perf_analyzer's reports, dashboards) index every duration Triton writes,
    `inference_stats.compute_infer.ns` among them; `GET v2/models/stats` answers for every model."""
    client.infer(MODEL, grpc_inputs(max_tokens=4))
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
        stats = http.get_inference_statistics(MODEL)["model_stats"][0]
        every_model = http.get_inference_statistics()["model_stats"]
    assert {"batch_stats", "memory_usage", "response_stats"} <= set(stats)
    durations = stats["inference_stats"]
    names = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
    assert set(durations) == {*names, "cache_hit", "cache_miss"}
    assert all(
        set(d) == {"count", "ns"} and all(isinstance(v, int) for v in d.values()) for d in durations.values()
    )
    successes = durations["success"]["count"]
    assert (
        successes >= 1
        and durations["compute_infer"]["count"] == durations["compute_input"]["count"] == successes
    )
    # the engine's time and the tokenizing, each within the requests' whole time
    assert 0 < durations["compute_infer"]["ns"] < durations["success"]["ns"]
    assert 0 < durations["compute_input"]["ns"] < durations["success"]["ns"]
    assert [m["name"] for m in every_model] == [MODEL]
    assert every_model[0]["inference_count"] >= stats["inference_count"]


# -- unary and streaming inference over gRPC -----------------------------------------------------


def test_unary_infer_returns_the_whole_completion(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    expected = our_text(server)
    result = client.infer(
        MODEL, grpc_inputs()
    )  # not streaming: the prompt is prepended, as vLLM's backend does
    assert result.as_numpy("text_output")[0].decode() == PROMPT + expected

    flags = tgrpc.InferInput("exclude_input_in_output", [1], "BOOL")
    flags.set_data_from_numpy(np.array([True]))
    counts = tgrpc.InferInput("return_num_output_tokens", [1], "BOOL")
    counts.set_data_from_numpy(np.array([True]))
    reason = tgrpc.InferInput("return_finish_reason", [1], "BOOL")
    reason.set_data_from_numpy(np.array([True]))
    result = client.infer(MODEL, [*grpc_inputs(), flags, counts, reason], request_id="unary-1")
    assert result.as_numpy("text_output")[0].decode() == expected
    assert result.as_numpy("finish_reason")[0].decode() in ("length", "stop")
    assert result.as_numpy("num_output_tokens")[0] <= 12
    assert result.get_response().id == "unary-1"


@pytest.mark.parametrize("empty_final", [False, True])
def test_stream_pieces_concatenate_to_the_greedy_text(
    server: ServerProcess, client: tgrpc.InferenceServerClient, empty_final: bool
) -> None:
    expected = our_text(server)
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(
        MODEL, grpc_inputs(stream=True), request_id="s-1", enable_empty_final_response=empty_final
    )
    got = collect(responses, until_final=1)
    started = time.monotonic()
    client.stop_stream()
    assert time.monotonic() - started < 5.0  # the server closes the stream once the client half-closed

    assert all(error is None for _, error in got)
    replies = [result.get_response() for result, _ in got]
    assert {r.id for r in replies} == {"s-1"} and {r.model_name for r in replies} == {MODEL}
    finals = [r.parameters["triton_final_response"].bool_param for r in replies]
    assert finals == [False] * (len(finals) - 1) + [True]
    texts = [result.as_numpy("text_output") for result, _ in got]
    if empty_final:
        assert not replies[-1].outputs and texts[-1] is None  # the data-less final response
        texts = texts[:-1]
    assert len(texts) > 1 and "".join(t[0].decode() for t in texts) == expected


def test_one_stream_carries_concurrent_requests_and_a_non_streamed_one(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(MODEL, grpc_inputs(stream=True), request_id="a")
    client.async_stream_infer(MODEL, grpc_inputs("Water boils at", stream=True), request_id="b")
    client.async_stream_infer(MODEL, grpc_inputs("Water boils at", stream=False), request_id="c")
    got = collect(responses, until_final=3)
    client.stop_stream()
    pieces: dict[str, str] = {}
    for result, error in got:
        assert error is None
        rid = result.get_response().id
        pieces[rid] = pieces.get(rid, "") + result.as_numpy("text_output")[0].decode()
    assert pieces["a"] == our_text(server)
    assert pieces["b"] == our_text(server, "Water boils at")
    assert pieces["c"] == "Water boils at" + pieces["b"]  # one response with the whole text, prompt first


def test_cancelling_a_stream_aborts_its_requests_and_frees_blocks(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(
        MODEL, grpc_inputs(stream=True, max_tokens=2000, ignore_eos=True), request_id="long"
    )
    result, error = responses.get(timeout=60)
    assert error is None and not result.get_response().parameters["triton_final_response"].bool_param
    assert server.stub.Health(pb.HealthRequest()).num_running == 1
    client.stop_stream(cancel_requests=True)
    assert server.engine_idle(timeout=10), "the cancelled stream's request still holds KV blocks"


def test_cancelling_a_stream_aborts_every_request_in_flight_on_it(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    for rid, prompt in (("long-1", PROMPT), ("long-2", "Water boils at")):
        inputs = grpc_inputs(prompt, stream=True, max_tokens=2000, ignore_eos=True)
        client.async_stream_infer(MODEL, inputs, request_id=rid)
    started: set[str] = set()
    deadline = time.monotonic() + 60
    while started != {"long-1", "long-2"}:  # both have streamed a token: both hold KV blocks
        result, error = responses.get(timeout=max(0.1, deadline - time.monotonic()))
        assert error is None and not is_final(result)
        started.add(result.get_response().id)
    assert server.stub.Health(pb.HealthRequest()).num_running == 2
    client.stop_stream(cancel_requests=True)
    assert server.engine_idle(timeout=10), "a cancelled stream's request still holds KV blocks"


# -- typed contents, logprobs and token counts, statistics ---------------------------------------


def typed_request(
    prompt: str | bytes | list[bytes] = PROMPT, stream: bool = False, **params: Any
) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest with every input in typed `contents` (tritonclient always sends raw)."""
    request = service_pb2.ModelInferRequest(model_name=MODEL, id="typed")
    texts = prompt if isinstance(prompt, list) else [prompt.encode() if isinstance(prompt, str) else prompt]
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[len(texts)])
    text.contents.bytes_contents.extend(texts)
    sampling = request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    sampling.contents.bytes_contents.append(
        json.dumps({"temperature": 0, "max_tokens": 12, **params}).encode()
    )
    for name in ("stream", "exclude_input_in_output"):
        switch = request.inputs.add(name=name, datatype="BOOL", shape=[1])
        switch.contents.bool_contents.append(stream if name == "stream" else True)
    return request


def text_output(response: Any) -> str:
    """`text_output` of a ModelInferResponse, read from its raw (length-prefixed) contents."""
    index = [t.name for t in response.outputs].index("text_output")
    return "".join(v.decode() for v in deserialize_bytes_tensor(response.raw_output_contents[index]))


def test_typed_contents_inputs_give_the_same_text_as_raw_inputs(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    expected = our_text(server)
    raw = client.infer(MODEL, [*grpc_inputs(), flag_input("exclude_input_in_output")])
    assert raw.as_numpy("text_output")[0].decode() == expected

    stub = service_pb2_grpc.GRPCInferenceServiceStub(server.channel)
    unary = stub.ModelInfer(typed_request(), timeout=60)
    assert unary.id == "typed" and text_output(unary) == expected
    streamed = list(stub.ModelStreamInfer(iter([typed_request(stream=True)]), timeout=60))
    assert all(not r.error_message and r.infer_response.id == "typed" for r in streamed)
    assert len(streamed) > 1 and "".join(text_output(r.infer_response) for r in streamed) == expected


def test_malformed_typed_contents_are_rejected_by_field(server: ServerProcess) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(server.channel)
    wrong_field = typed_request()  # BOOL values in the INT32 field
    flag = next(t for t in wrong_field.inputs if t.name == "stream")
    flag.contents.ClearField("bool_contents")
    flag.contents.int_contents.append(1)
    both_forms = typed_request()  # raw data for tensors that also carry contents
    both_forms.raw_input_contents.extend([b"\x00"] * len(both_forms.inputs))
    cases = [
        (typed_request([b"a", b"b"]), "inputs.text_input.shape"),
        (wrong_field, "inputs.stream"),
        (both_forms, "inputs.text_input.contents"),
    ]
    for bad, field in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(bad, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
    assert text_output(stub.ModelInfer(typed_request(), timeout=60)) == our_text(server)


def our_completion(server: ServerProcess, num_top: int) -> pb.GenerateResponse:
    """Greedy completion of PROMPT from our Generate RPC, with `num_top` top logprobs per token."""
    req = request(PROMPT, max_tokens=12, ignore_eos=False, logprobs=num_top)
    merged = pb.GenerateResponse()
    for reply in server.stub.Generate(req, timeout=60):
        merged.token_ids.extend(reply.token_ids)
        merged.logprobs.extend(reply.logprobs)
        merged.prompt_tokens = reply.prompt_tokens or merged.prompt_tokens
    return merged


def test_logprobs_and_token_counts_match_our_generate(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    ours = our_completion(server, num_top=2)
    num_prompt_tokens = len(server.stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids)
    assert ours.prompt_tokens == num_prompt_tokens
    switches = [
        flag_input(f"return_{name}")
        for name in ("logprobs", "cumulative_logprob", "num_input_tokens", "num_output_tokens")
    ]
    result = client.infer(MODEL, [*grpc_inputs(logprobs=2), *switches])
    assert result.as_numpy("num_input_tokens").tolist() == [num_prompt_tokens]
    assert result.as_numpy("num_output_tokens").tolist() == [len(ours.token_ids)]
    entries = json.loads(result.as_numpy("logprobs")[0])  # vLLM's form: per token {id: {logprob, rank, ...}}
    assert len(entries) == len(ours.token_ids)
    for entry, token_id, expected in zip(entries, ours.token_ids, ours.logprobs, strict=True):
        assert set(entry) == {str(t.token_id) for t in expected.top} and len(entry) == 2  # greedy: in top-2
        for top in expected.top:
            got = entry[str(top.token_id)]
            assert got["rank"] == top.rank and (got["decoded_token"] or "") == top.text
            assert got["logprob"] == pytest.approx(top.logprob, abs=1e-4) and got["logprob"] <= 0.0
        assert entry[str(token_id)]["rank"] == 1
    cumulative = result.as_numpy("cumulative_logprob").tolist()
    assert cumulative == pytest.approx([sum(e.sampled.logprob for e in ours.logprobs)], abs=1e-3)

    # asked for by name, without the switches: the same values (not 0.0 and "null")
    named = [tgrpc.InferRequestedOutput(name) for name in ("text_output", "cumulative_logprob", "logprobs")]
    by_name = client.infer(MODEL, grpc_inputs(), outputs=named)
    assert by_name.as_numpy("cumulative_logprob").tolist() == pytest.approx(cumulative, abs=1e-4)
    named_entries = json.loads(by_name.as_numpy("logprobs")[0])
    assert [list(entry) for entry in named_entries] == [[str(t)] for t in ours.token_ids]  # sampled only
    for entry, top_two, token_id in zip(named_entries, entries, map(str, ours.token_ids), strict=True):
        assert entry[token_id]["logprob"] == pytest.approx(top_two[token_id]["logprob"], abs=1e-4)

    # streamed with return_logprobs alone: each response carries its new tokens' sampled logprob only
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(MODEL, [*grpc_inputs(stream=True), *switches], request_id="lp")
    got = collect(responses, until_final=1)
    client.stop_stream()
    streamed_ids: list[int] = []
    for piece, error in got:
        assert error is None and piece.as_numpy("num_input_tokens").tolist() == [num_prompt_tokens]
        new = json.loads(piece.as_numpy("logprobs")[0])
        assert piece.as_numpy("num_output_tokens").tolist() == [len(new)]
        assert all(len(entry) == 1 for entry in new)
        streamed_ids += [int(token_id) for entry in new for token_id in entry]
    assert streamed_ids == list(ours.token_ids)


def test_statistics_count_requests_and_their_durations(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    def stats() -> Any:
        models = client.get_inference_statistics(MODEL).model_stats
        assert [(m.name, m.version) for m in models] == [(MODEL, "1")]
        return models[0]

    before, started_ms, started = stats(), time.time_ns() // 1_000_000, time.monotonic_ns()
    client.infer(MODEL, grpc_inputs())
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(MODEL, grpc_inputs(stream=True))
    collect(responses, until_final=1)
    client.stop_stream()
    elapsed_ns, after = time.monotonic_ns() - started, stats()

    assert after.inference_count - before.inference_count == 2
    assert after.execution_count - before.execution_count == 2
    success = after.inference_stats.success.ns - before.inference_stats.success.ns
    assert after.inference_stats.success.count - before.inference_stats.success.count == 2
    assert 0 < success <= elapsed_ns
    assert after.inference_stats.queue.count - before.inference_stats.queue.count == 2
    assert 0 <= after.inference_stats.queue.ns - before.inference_stats.queue.ns <= success
    assert after.inference_stats.fail == before.inference_stats.fail
    assert started_ms <= after.last_inference <= time.time_ns() // 1_000_000

    # a cancelled request counts as a failure, not a success
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(MODEL, grpc_inputs(stream=True, max_tokens=2000, ignore_eos=True))
    responses.get(timeout=60)
    client.stop_stream(cancel_requests=True)
    assert server.engine_idle(timeout=10)
    failed = stats()
    assert failed.inference_stats.fail.count - after.inference_stats.fail.count == 1
    assert failed.inference_stats.fail.ns > after.inference_stats.fail.ns
    assert failed.inference_count == after.inference_count
    assert failed.execution_count - after.execution_count == 1

    assert [m.name for m in client.get_inference_statistics().model_stats] == [MODEL]
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("no-such-model")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
        over_http = http.get_inference_statistics(MODEL)["model_stats"][0]
    assert int(over_http["inference_count"]) == failed.inference_count


# -- malformed requests --------------------------------------------------------------------------


def _bad_requests() -> dict[str, tuple[str, list[tgrpc.InferInput], str]]:
    wrong_type = tgrpc.InferInput("text_input", [1], "INT32")
    wrong_type.set_data_from_numpy(np.array([7], dtype=np.int32))
    two = tgrpc.InferInput("text_input", [2], "BYTES")
    two.set_data_from_numpy(np.array([b"a", b"b"], dtype=object))
    bad_json = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    bad_json.set_data_from_numpy(np.array([b"{not json"], dtype=object))
    return {
        "wrong datatype": (MODEL, [wrong_type], "inputs.text_input.datatype"),
        "bad shape": (MODEL, [two], "inputs.text_input.shape"),
        "invalid JSON": (MODEL, [*grpc_inputs()[:1], bad_json], "sampling_parameters"),
        "bad parameter": (MODEL, grpc_inputs(temperature=-1.0), "sampling_parameters.temperature"),
        "unknown parameter": (MODEL, grpc_inputs(beam_width=4), "sampling_parameters.beam_width"),
        "missing text_input": (MODEL, grpc_inputs(prompt=None), "inputs.text_input"),
        "unknown model": ("no-such-model", grpc_inputs(), "model_name"),
    }


@pytest.mark.parametrize("case", list(_bad_requests()))
def test_malformed_unary_request_is_rejected_by_field(
    server: ServerProcess, client: tgrpc.InferenceServerClient, case: str
) -> None:
    model, inputs, field = _bad_requests()[case]
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs)
    expected = "StatusCode.NOT_FOUND" if case == "unknown model" else "StatusCode.INVALID_ARGUMENT"
    assert info.value.status() == expected and field in info.value.message()
    assert client.infer(MODEL, grpc_inputs()).as_numpy("text_output")[0].decode() == PROMPT + our_text(server)


def test_stream_errors_arrive_as_messages_and_the_stream_stays_open(
    server: ServerProcess, client: tgrpc.InferenceServerClient
) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    for model, inputs, _ in _bad_requests().values():
        client.async_stream_infer(model, inputs)
    got = collect(responses, until_final=len(_bad_requests()))
    assert all(result is None and error is not None for result, error in got)
    messages = sorted(error.message() for _, error in got)
    assert all(any(field in m for m in messages) for _, _, field in _bad_requests().values())

    client.async_stream_infer(MODEL, grpc_inputs(stream=True), request_id="after")
    after = collect(responses, until_final=1)
    client.stop_stream()
    assert "".join(r.as_numpy("text_output")[0].decode() for r, _ in after) == our_text(server)


def test_triton_grpc_error_header_ends_the_stream_with_a_status(server: ServerProcess) -> None:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        responses: queue.Queue[Any] = queue.Queue()
        client.start_stream(
            callback=lambda result, error: responses.put((result, error)),
            headers={"triton_grpc_error": "true"},
        )
        client.async_stream_infer(MODEL, grpc_inputs(prompt=None))
        result, error = responses.get(timeout=30)
        assert result is None and error.status() == "StatusCode.INVALID_ARGUMENT"
        client.stop_stream()


def test_requests_a_stream_error_ends_are_counted_as_stream_errors_not_client_cancels(
    server: ServerProcess,
) -> None:
    """With triton_grpc_error, one request's error ends the stream and so aborts the others on it: the
    server's doing, not the client's, so they are no `client_cancel`."""
    aborts = {
        cause: metric_sample(server.http_port, "pagedserve:request_aborts_total", cause=cause)
        for cause in ("client_cancel", "stream_error")
    }
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        responses: queue.Queue[Any] = queue.Queue()
        client.start_stream(
            callback=lambda result, error: responses.put((result, error)),
            headers={"triton_grpc_error": "true"},
        )
        client.async_stream_infer(MODEL, grpc_inputs(stream=True, max_tokens=2000, ignore_eos=True))
        result, error = responses.get(timeout=30)  # its first token: it runs
        assert error is None and result.as_numpy("text_output") is not None
        client.async_stream_infer(MODEL, grpc_inputs(prompt=None))
        while error is None:
            result, error = responses.get(timeout=30)
        assert error.status() == "StatusCode.INVALID_ARGUMENT"
        client.stop_stream()

    def stream_error_counted() -> bool:
        now = metric_sample(server.http_port, "pagedserve:request_aborts_total", cause="stream_error")
        return now == aborts["stream_error"] + 1

    assert wait_until(stream_error_counted, timeout=30)
    assert (
        metric_sample(server.http_port, "pagedserve:request_aborts_total", cause="client_cancel")
        == (aborts["client_cancel"])
    )


def test_undecodable_request_gets_invalid_argument(server: ServerProcess) -> None:
    call = server.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as info:
        call(b"\x0a\x03\xff\xfe\xfd", timeout=10)  # field 1 (model_name) holding invalid UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_name" in info.value.details()


# -- HTTP: tritonclient.http, KServe v2 REST and the generate extension ---------------------------


def http_inputs(binary: bool) -> list[thttp.InferInput]:
    text = thttp.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object), binary_data=binary)
    sampling = thttp.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(
        np.array([json.dumps({"temperature": 0, "max_tokens": 12}).encode()], dtype=object),
        binary_data=binary,
    )
    exclude = thttp.InferInput("exclude_input_in_output", [1], "BOOL")
    exclude.set_data_from_numpy(np.array([True]), binary_data=binary)
    return [text, sampling, exclude]


def post(server: ServerProcess, path: str, body: Any) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=data)
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_http_clients_get_the_same_text(server: ServerProcess) -> None:
    expected = our_text(server)
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        assert client.get_model_config(MODEL)["model_transaction_policy"] == {"decoupled": True}
        for binary in (True, False):
            outputs = [thttp.InferRequestedOutput("text_output", binary_data=binary)]
            result = client.infer(MODEL, http_inputs(binary), outputs=outputs)
            assert result.as_numpy("text_output")[0] in (expected, expected.encode())

    params = {"temperature": 0, "max_tokens": 12}
    status, body = post(server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": params})
    assert status == 200 and json.loads(body)["text_output"] == PROMPT + expected
    status, body = post(
        server,
        f"/v2/models/{MODEL}/versions/1/generate",
        {"text_input": PROMPT, "exclude_input_in_output": True, "parameters": params},
    )
    assert status == 200 and json.loads(body)["text_output"] == expected
    # Triton's generate extension: a top-level property that names no input is a parameter
    status, body = post(server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, **params})
    assert status == 200 and json.loads(body)["text_output"] == PROMPT + expected

    status, body = post(
        server, f"/v2/models/{MODEL}/generate_stream", {"text_input": PROMPT, "parameters": params}
    )
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected


def test_http_health_and_metadata(server: ServerProcess) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready", "/health/ready"):
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as reply:
            assert reply.status == 200, path
    with urllib.request.urlopen(
        f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}", timeout=10
    ) as reply:
        assert json.loads(reply.read())["name"] == MODEL
    # a model or version not served is 404, as on every other model route: 503 would say "retry"
    for path in ("/v2/models/no-such-model/ready", f"/v2/models/{MODEL}/versions/7/ready"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10)
        assert info.value.code == 404 and "model_" in json.loads(info.value.read())["error"], path


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        (f"/v2/models/{MODEL}/generate", b"{not json", 400, "request"),
        (f"/v2/models/{MODEL}/generate", {"parameters": {}}, 400, "text_input"),
        (f"/v2/models/{MODEL}/generate", {"text_input": "x", "parameters": {"top_p": 2}}, 400, "top_p"),
        (
            f"/v2/models/{MODEL}/generate_stream",
            {"text_input": "x", "parameters": {"max_tokens": 0}},
            400,
            "max_tokens",
        ),
        ("/v2/models/no-such-model/generate", {"text_input": "x"}, 404, "model_name"),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["x"]}]},
            400,
            "text_input",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "text_input", "datatype": "FP99", "shape": [1], "data": [1]}]},
            400,
            "datatype",
        ),
        (f"/v2/models/{MODEL}/infer", {"inputs": []}, 400, "inputs"),
    ],
)
def test_malformed_http_requests_get_400_and_the_next_call_succeeds(
    server: ServerProcess, path: str, body: Any, status: int, field: str
) -> None:
    got_status, got_body = post(server, path, body)
    assert got_status == status and field in json.loads(got_body)["error"]
    ok_status, ok_body = post(
        server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": {"max_tokens": 2}}
    )
    assert ok_status == 200 and json.loads(ok_body)["text_output"].startswith(PROMPT)


def test_example_triton_client_streams_the_greedy_text(server: ServerProcess) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "triton_stream_client.py"
    args = [PROMPT, "--url", f"127.0.0.1:{server.port}", "--max-tokens", "12"]
    done = subprocess.run([sys.executable, str(example), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == our_text(server) + "\n"


# -- lifecycle: drain on SIGTERM, --served-model-name ---------------------------------------------


def unary_infer(server: ServerProcess, inputs: list[tgrpc.InferInput]) -> Any:
    """A unary ModelInfer's result, or the InferenceServerException it raised."""
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        try:
            return client.infer(MODEL, inputs, client_timeout=120)
        except InferenceServerException as exc:
            return exc


def test_readiness_goes_false_on_sigterm_while_liveness_stays_true_until_exit(
    default_model_dir: str, tmp_path: Path
) -> None:
    proc = ServerProcess(
        "--model", default_model_dir, "--dtype", "float32", "--shutdown-timeout", "8", log=tmp_path / "log"
    ).wait_ready()  # fmt: skip
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{proc.port}")
    try:
        responses: queue.Queue[Any] = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = grpc_inputs(stream=True, max_tokens=2000, ignore_eos=True)
        client.async_stream_infer(
            MODEL, [*inputs, flag_input("return_finish_reason")], request_id="in-flight"
        )
        result, error = responses.get(timeout=60)
        assert error is None and not is_final(result)
        assert client.is_server_ready() and http_status(proc, "/v2/health/ready") == 200
        # and two whole-completion calls in flight, which the drain will cut short too
        pool = ThreadPoolExecutor(2)
        long_params = {"max_tokens": 2000, "ignore_eos": True}
        unary = pool.submit(unary_infer, proc, grpc_inputs(**long_params))
        generate = pool.submit(
            post, proc, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, **long_params}
        )
        assert wait_until(lambda: proc.stub.Health(pb.HealthRequest()).num_running == 3, timeout=60)

        proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while client.is_server_ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        # draining: the request is still streaming; not ready everywhere, live everywhere
        assert proc.proc.poll() is None and not any(is_final(r) for r, _ in list(responses.queue))
        assert not client.is_server_ready() and not client.is_model_ready(MODEL)
        assert http_status(proc, "/v2/health/ready") == 503
        assert http_status(proc, f"/v2/models/{MODEL}/ready") == 503
        assert proc.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        inference_health = proc.health.Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService")
        )
        assert inference_health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert [m.state for m in client.get_model_repository_index().models] == ["UNAVAILABLE"]
        assert client.get_model_repository_index().models[0].name == MODEL
        assert json.loads(post(proc, "/v2/repository/index", {"ready": True})[1]) == []  # as gRPC's `ready`
        assert [m["state"] for m in json.loads(post(proc, "/v2/repository/index", b"")[1])] == ["UNAVAILABLE"]
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, grpc_inputs())
        assert info.value.status() == "StatusCode.UNAVAILABLE" and "draining" in info.value.message()

        live_answers = []
        while proc.proc.poll() is None:  # every answer until the process is gone says live
            for answer in (http_status(proc, "/v2/health/live"), http_status(proc, "/health/live")):
                if answer is not None:
                    live_answers.append(answer == 200)
            with contextlib.suppress(InferenceServerException):
                live_answers.append(client.is_server_live(client_timeout=1))
            time.sleep(0.05)
        assert live_answers and all(live_answers)
        assert proc.proc.returncode == 0
        finals = [r for r, e in list(responses.queue) if e is None and is_final(r)]
        assert [r.as_numpy("finish_reason")[0].decode() for r in finals] == ["aborted"]
        # a whole completion cut short is an error to retry elsewhere, not a short text that looks whole
        unary_error = unary.result(timeout=30)
        assert isinstance(unary_error, InferenceServerException), unary_error
        assert unary_error.status() == "StatusCode.UNAVAILABLE"
        assert "the request was aborted after" in unary_error.message()
        assert "server shutting down" in unary_error.message()
        status, body = generate.result(timeout=30)
        assert status == 503 and json.loads(body)["error"].startswith("the request was aborted after")
        pool.shutdown()
    finally:
        with contextlib.suppress(InferenceServerException):
            client.stop_stream(cancel_requests=True)
        client.close()
        proc.stop()


def test_served_model_name_replaces_the_directory_name(tiny_llama_dir: str, tmp_path: Path) -> None:
    name, derived = "team-llm", Path(tiny_llama_dir).name
    proc = ServerProcess(
        "--model", tiny_llama_dir, "--dtype", "float32", "--num-kv-blocks", "64",
        "--served-model-name", name, log=tmp_path / "log",
    ).wait_ready()  # fmt: skip
    try:
        with tgrpc.InferenceServerClient(f"127.0.0.1:{proc.port}") as client:
            index = client.get_model_repository_index().models
            assert [(m.name, m.version, m.state) for m in index] == [(name, "1", "READY")]
            assert client.get_model_metadata(name).name == name
            assert client.get_model_config(name).config.name == name
            assert client.is_model_ready(name) and not client.is_model_ready(derived)
            result = client.infer(name, grpc_inputs(max_tokens=4))
            assert result.get_response().model_name == name
            assert result.as_numpy("text_output")[0].decode().startswith(PROMPT)
            for call in (
                lambda: client.get_model_metadata(derived),
                lambda: client.infer(derived, grpc_inputs()),
            ):
                with pytest.raises(InferenceServerException) as info:
                    call()
                assert info.value.status() == "StatusCode.NOT_FOUND" and name in info.value.message()
        assert proc.stub.ModelInfo(pb.ModelInfoRequest()).model_name == name
        assert http_status(proc, f"/v2/models/{name}") == 200
        assert http_status(proc, f"/v2/models/{name}/ready") == 200
        assert http_status(proc, f"/v2/models/{derived}") == 404
        status, body = post(
            proc, f"/v2/models/{name}/generate", {"text_input": PROMPT, "parameters": {"max_tokens": 4}}
        )
        assert status == 200 and json.loads(body)["model_name"] == name
        assert post(proc, f"/v2/models/{derived}/generate", {"text_input": PROMPT})[0] == 404
    finally:
        proc.stop()


def test_stream_interval_reaches_triton_and_kserve_streams(tiny_llama_dir: str, tmp_path: Path) -> None:
    """`--stream-interval 3`: the first token alone, then three a response, on ModelStreamInfer and on
    KServe REST generate_stream alike, and the pieces still make the whole text."""
    proc = ServerProcess(
        "--model", tiny_llama_dir, "--dtype", "float32", "--num-kv-blocks", "64",
        "--stream-interval", "3", "--enforce-eager", log=tmp_path / "log",
    ).wait_ready()  # fmt: skip
    model = Path(tiny_llama_dir).name
    try:
        expected = "".join(r.text for r in proc.stub.Generate(request(PROMPT, max_tokens=7), timeout=60))
        responses: queue.Queue[Any] = queue.Queue()
        with tgrpc.InferenceServerClient(f"127.0.0.1:{proc.port}") as client:
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            inputs = grpc_inputs(stream=True, max_tokens=7, ignore_eos=True)
            inputs.append(flag_input("return_num_output_tokens"))
            client.async_stream_infer(model, inputs, request_id="s-3")
            got = collect(responses, until_final=1)
            client.stop_stream()
        params = {"temperature": 0, "max_tokens": 7, "ignore_eos": True}
        status, body = post(
            proc, f"/v2/models/{model}/generate_stream", {"text_input": PROMPT, "parameters": params}
        )
    finally:
        proc.stop()
    assert all(error is None for _, error in got)
    # [1, 3, 3] tokens a response; responses queued while the server's writer was behind (a loaded
    # host) come merged, so a response may end after 4 tokens but never elsewhere
    counts = [int(result.as_numpy("num_output_tokens")[0]) for result, _ in got]
    ends = [sum(counts[: i + 1]) for i in range(len(counts))]
    assert set(ends) <= {1, 4, 7} and ends[-1] == 7, counts
    assert "".join(result.as_numpy("text_output")[0].decode() for result, _ in got) == expected
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and 1 <= len(events) <= 3  # 3, or fewer merged
    assert "".join(e["text_output"] for e in events) == expected
