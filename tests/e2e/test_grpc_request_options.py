"""Request options through the front ends, on an in-process server (tiny model, real gRPC, real
tritonclient, real HTTP): a request's `priority` (our GenerateRequest field, Triton's request
parameter) orders the queue under `--scheduling-policy priority` and is refused (ours) or ignored
(Triton's, as Triton ignores it for a model without priority levels) under fcfs; structured outputs
(our `sampling.structured_outputs`, Triton's `structured_outputs` / `guided_decoding` sampling
parameter) constrain the text, and a schema the compiler refuses is INVALID_ARGUMENT naming the field;
`cached_tokens` reports the prompt tokens found in the prefix cache."""

from __future__ import annotations

import json
import queue
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from inprocess_server import InProcessServer, post_generate, scrape, wait_for
from pagedserve.rpc.v1 import generate_pb2 as pb

MODEL = "tiny"
PROMPT = [1, *range(200, 239)]  # 40 tokens: 5 full blocks of 8
WHITESPACE_BIAS = {
    198: 50.0,
    1116: 50.0,
    256: 50.0,
    197: 50.0,
}  # "\n", "\n\n", "  ", "\t" in SmolLM2's vocabulary


def start(model_dir: str, **settings: Any) -> InProcessServer:
    return InProcessServer(
        model_dir, None, dtype="float32", served_model_name=MODEL, block_size=8, max_num_seqs=1, **settings
    ).start()


@pytest.fixture(scope="module")
def priority_server(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    srv = start(tiny_llama_dir, scheduling_policy="priority")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fcfs_server(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    srv = start(tiny_llama_dir)
    yield srv
    srv.stop()


def request(request_id: str, max_tokens: int = 8, priority: int = 0, **sampling: Any) -> pb.GenerateRequest:
    params = pb.SamplingParameters(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return pb.GenerateRequest(
        request_id=request_id, token_ids=pb.TokenIds(ids=PROMPT), sampling=params, priority=priority
    )


def stream_in_thread(
    srv: InProcessServer, req: pb.GenerateRequest, events: queue.Queue[Any]
) -> threading.Thread:
    """Stream `req`, putting (request id, response or the RpcError) on `events` as they come."""

    def run() -> None:
        try:
            for response in srv.stub.Generate(req, timeout=120):
                events.put((req.request_id, response))
        except grpc.RpcError as exc:
            events.put((req.request_id, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def first_tokens_order(events: queue.Queue[Any], ids: set[str], timeout: float = 60.0) -> list[str]:
    """The order in which the requests `ids` got their first token (every request runs to its end)."""
    order: list[str] = []
    finished: set[str] = set()
    while finished != ids:
        rid, item = events.get(timeout=timeout)
        assert not isinstance(item, grpc.RpcError), f"{rid}: {item}"
        if rid in ids and item.token_ids and rid not in order:
            order.append(rid)
        if rid in ids and item.finish_reason:
            finished.add(rid)
    return order


def test_queued_requests_start_by_priority_not_arrival(priority_server: InProcessServer) -> None:
    """One seat (max_num_seqs 1), held by the most urgent request until both others wait: the one of
    lower value starts first though it arrived last."""
    srv = priority_server
    events: queue.Queue[Any] = queue.Queue()
    holder = stream_in_thread(srv, request("holder", max_tokens=900, priority=-5), events)
    wait_for(lambda: srv.llm.stats().num_running == 1, what="the holder to run")
    threads = [stream_in_thread(srv, request("late-urgent-not", priority=7), events)]
    wait_for(lambda: srv.llm.stats().num_waiting == 1, what="the first request to wait")
    threads.append(stream_in_thread(srv, request("urgent", priority=1), events))
    wait_for(lambda: srv.llm.stats().num_waiting == 2, what="both requests to wait")
    assert srv.stub.Abort(pb.AbortRequest(request_ids=["holder"]), timeout=10).aborted_request_ids == [
        "holder"
    ]
    assert first_tokens_order(events, {"urgent", "late-urgent-not"}) == ["urgent", "late-urgent-not"]
    for thread in [holder, *threads]:
        thread.join(timeout=30)


def test_a_more_urgent_request_preempts_the_running_one(priority_server: InProcessServer) -> None:
    """The seat is taken by a request of priority 3; one of priority 0 arriving takes it at once (the
    other is preempted, then finishes with the tokens it gives alone)."""
    srv = priority_server
    alone = [t for r in srv.stub.Generate(request("alone", max_tokens=60), timeout=60) for t in r.token_ids]
    events: queue.Queue[Any] = queue.Queue()
    low = stream_in_thread(srv, request("low", max_tokens=60, priority=3), events)
    wait_for(lambda: srv.llm.stats().num_running == 1, what="the low-priority request to run")
    preemptions = srv.llm.stats().num_preemptions
    high = stream_in_thread(srv, request("high", max_tokens=4, priority=0), events)
    tokens: dict[str, list[int]] = {"low": [], "high": []}
    finished: list[str] = []
    while len(finished) < 2:
        rid, item = events.get(timeout=60)
        assert not isinstance(item, grpc.RpcError), f"{rid}: {item}"
        tokens[rid] += item.token_ids
        if item.finish_reason:
            finished.append(rid)
    low.join(timeout=30)
    high.join(timeout=30)
    assert finished == ["high", "low"]
    assert srv.llm.stats().num_preemptions > preemptions
    assert tokens["low"] == alone


def test_fcfs_refuses_a_priority_naming_the_field(fcfs_server: InProcessServer) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(fcfs_server.stub.Generate(request("p", priority=2), timeout=30))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("priority:")
    assert "--scheduling-policy priority" in caught.value.details()
    assert [r.finish_reason for r in fcfs_server.stub.Generate(request("after"), timeout=30)][-1] == pb.LENGTH


def triton_stream(srv: InProcessServer, priority: int, params: dict[str, Any]) -> list[Any]:
    """One request on a tritonclient stream: (result, error) pairs until its final response."""
    import tritonclient.grpc as tgrpc

    responses: queue.Queue[Any] = queue.Queue()
    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Name a color."], dtype=object))
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    exclude = tgrpc.InferInput("exclude_input_in_output", [1], "BOOL")
    exclude.set_data_from_numpy(np.array([True]))
    got = []
    with tgrpc.InferenceServerClient(f"127.0.0.1:{srv.port}") as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(MODEL, [text, sampling, exclude], request_id="t", priority=priority)
        while True:
            result, error = responses.get(timeout=60)
            got.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return got


@pytest.mark.parametrize(
    ("policy", "sent", "level"),
    [
        ("fcfs", 1, 0),
        ("fcfs", 9, 0),
        ("priority", 0, 0),
        ("priority", 1, -1),
        ("priority", 3, 1),
        ("priority", 9, 0),
        ("priority", 2**64 - 1, 0),  # the largest uint64: a level above the last
    ],
)
def test_triton_priority_is_a_level_or_ignored_as_the_policy_says(
    policy: str, sent: int, level: int, fcfs_server: InProcessServer, priority_server: InProcessServer
) -> None:
    """tritonclient sends `priority` as a uint64 request parameter. Under fcfs it is ignored, as
    Triton ignores it for a model without priority levels; under priority it picks one of the 3
    levels (the defaults), and 0 (not given) or a level above them runs at the default level, 2: the
    engine's priority is the level less the default one (the default level is the engine's 0)."""
    srv = fcfs_server if policy == "fcfs" else priority_server
    seen: list[int] = []
    engine = srv.server.engine
    original = engine.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("priority", 0))
        return original(*args, **kwargs)

    engine.generate = spy
    try:
        got = triton_stream(srv, sent, {"temperature": 0, "max_tokens": 4})
    finally:
        del engine.generate
    assert [error for _, error in got] == [None]
    assert seen == [level]


def test_a_triton_request_of_level_1_runs_before_one_without_a_priority(
    priority_server: InProcessServer,
) -> None:
    """Triton's level 1 is the most urgent and a request without a priority runs at the default level:
    with the one seat held, a request without a priority waits first, one of level 1 after it, and
    the level-1 request runs first (one seat: it finishes first)."""
    import tritonclient.grpc as tgrpc

    srv = priority_server
    events: queue.Queue[Any] = queue.Queue()
    holder = stream_in_thread(srv, request("holder", max_tokens=900, priority=-5), events)
    wait_for(lambda: srv.llm.stats().num_running == 1, what="the holder to run")
    finals: queue.Queue[Any] = queue.Queue()

    def on_response(result: Any, error: Any) -> None:
        finals.put(error if error is not None else result.get_response().id)

    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Name a color."], dtype=object))
    params = json.dumps({"temperature": 0, "max_tokens": 4}).encode()
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([params], dtype=object))
    with tgrpc.InferenceServerClient(f"127.0.0.1:{srv.port}") as client:
        client.start_stream(callback=on_response)
        client.async_stream_infer(MODEL, [text, sampling], request_id="default")
        wait_for(lambda: srv.llm.stats().num_waiting == 1, what="the request without a priority to wait")
        client.async_stream_infer(MODEL, [text, sampling], request_id="level-1", priority=1)
        wait_for(lambda: srv.llm.stats().num_waiting == 2, what="both requests to wait")
        srv.stub.Abort(pb.AbortRequest(request_ids=["holder"]), timeout=10)
        order = [finals.get(timeout=60) for _ in range(2)]
        client.stop_stream()
    holder.join(timeout=30)
    assert order == ["level-1", "default"]


def test_model_config_reports_the_priority_levels_under_the_priority_policy(
    fcfs_server: InProcessServer, priority_server: InProcessServer
) -> None:
    """Triton's clients read the levels from the model config's dynamic_batching, over gRPC and REST;
    under fcfs the model has none (priorities are ignored), as a Triton model without levels."""
    import tritonclient.grpc as tgrpc

    for srv, expected, rest_expected in (
        (
            priority_server,
            {"priority_levels": "3", "default_priority_level": "2"},  # protobuf's JSON: int64 as strings
            {"priority_levels": 3, "default_priority_level": 2},  # Triton's HTTP JSON: numbers
        ),
        (fcfs_server, None, None),
    ):
        with tgrpc.InferenceServerClient(f"127.0.0.1:{srv.port}") as client:
            config = client.get_model_config(MODEL, as_json=True)["config"]
        with urllib.request.urlopen(srv.http_url(f"/v2/models/{MODEL}/config"), timeout=30) as reply:
            rest_config = json.loads(reply.read())
        assert config.get("dynamic_batching") == expected
        rest_batching = rest_config.get("dynamic_batching")  # with its default-valued fields, as Triton's
        assert rest_batching == rest_expected or {k: rest_batching[k] for k in rest_expected} == rest_expected


@pytest.mark.parametrize("bad", ["high", -1, 1.5, True, 2**64])
def test_a_bad_triton_priority_is_a_400_naming_it(priority_server: InProcessServer, bad: Any) -> None:
    status, body = post_generate(
        priority_server, MODEL, {"text_input": "Hi", "parameters": {"priority": bad}}
    )
    assert status == 400
    assert body["error"].startswith("parameters.priority:")


def test_cached_tokens_count_the_prompt_found_in_the_prefix_cache(fcfs_server: InProcessServer) -> None:
    """A prompt of 5 full blocks, twice: the second finds the first 4 in the cache (the last block is
    computed again, as the last prompt token must run to sample from). Every response says so (the
    3 tokens may come in fewer responses: deltas queued while the reader was behind are merged)."""

    def req(rid: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=rid,
            token_ids=pb.TokenIds(ids=[1, *range(300, 339)]),
            sampling=pb.SamplingParameters(temperature=0, max_tokens=3, ignore_eos=True),
        )

    first = list(fcfs_server.stub.Generate(req("first"), timeout=60))
    second = list(fcfs_server.stub.Generate(req("second"), timeout=60))
    for responses, cached in ((first, 0), (second, 32)):
        assert sum(len(r.token_ids) for r in responses) == 3
        assert {r.cached_tokens for r in responses} == {cached}
    assert fcfs_server.stub.Complete(req("third"), timeout=60).completions[0].cached_tokens == 32


def structured(srv: InProcessServer, rid: str, max_tokens: int = 24, **kind: Any) -> str:
    req = request(rid, max_tokens=max_tokens, structured_outputs=pb.StructuredOutputs(**kind))
    responses = list(srv.stub.Generate(req, timeout=60))
    assert responses[-1].finish_reason in (pb.EOS, pb.LENGTH)
    return "".join(r.text for r in responses)


def test_structured_outputs_constrain_the_text(fcfs_server: InProcessServer) -> None:
    """The tiny model's weights are random: unconstrained, its text matches none of these."""
    free = "".join(r.text for r in fcfs_server.stub.Generate(request("free", max_tokens=24), timeout=60))
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2}", free)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", structured(fcfs_server, "rx", regex=r"[0-9]{3}-[a-z]{2}"))
    choices = ["red", "green", "deep blue"]
    assert structured(fcfs_server, "ch", choice=pb.Choices(choices=choices)) in choices
    grammar = 'root ::= "(" [a-c] [a-c] ")"'
    assert re.fullmatch(r"\([a-c]{2}\)", structured(fcfs_server, "gr", grammar=grammar))


@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ({"regex": "[0-9"}, "structured_outputs.regex:"),
        ({"json": "{not json"}, "structured_outputs.json:"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar:"),
        ({"json_object": False}, "structured_outputs:"),
        ({}, "structured_outputs:"),
        ({"choice": pb.Choices(choices=[])}, "structured_outputs.choice:"),
        # over 64 KiB: compile time grows faster than the spec (an enum of 100,000 values took 38 s)
        (
            {"json": json.dumps({"enum": [f"v{i}" for i in range(10_000)]})},
            "structured_outputs.json: at most",
        ),
        ({"regex": "a" * 70_000}, "structured_outputs.regex: at most"),
        ({"choice": pb.Choices(choices=["c" * 1000] * 70)}, "structured_outputs.choice: at most"),
    ],
)
def test_a_constraint_that_does_not_compile_is_invalid_argument_naming_it(
    fcfs_server: InProcessServer, kind: dict[str, Any], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(
            fcfs_server.stub.Generate(
                request("bad", structured_outputs=pb.StructuredOutputs(**kind)), timeout=30
            )
        )
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(field), caught.value.details()
    assert [r.finish_reason for r in fcfs_server.stub.Generate(request("after"), timeout=30)][-1] == pb.LENGTH


@pytest.mark.parametrize("name", ["structured_outputs", "guided_decoding"])
def test_triton_clients_give_structured_outputs_as_a_sampling_parameter(
    fcfs_server: InProcessServer, name: str
) -> None:
    got = triton_stream(fcfs_server, 0, {"temperature": 0, "max_tokens": 12, name: {"regex": "[0-9]{4}"}})
    [(result, error)] = got
    assert error is None
    assert re.fullmatch("[0-9]{4}", result.as_numpy("text_output")[0].decode())


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        (
            {"structured_outputs": {"regex": "a", "colour": "red"}},
            "sampling_parameters.structured_outputs.colour:",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}},
            "sampling_parameters.guided_decoding:",
        ),
        ({"structured_outputs": ["regex"]}, "sampling_parameters.structured_outputs:"),
        ({"structured_outputs": {"regex": 5}}, "sampling_parameters.structured_outputs.regex:"),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex:"),
    ],
)
def test_bad_structured_outputs_over_rest_are_a_400_naming_the_field(
    fcfs_server: InProcessServer, parameters: dict[str, Any], field: str
) -> None:
    status, body = post_generate(fcfs_server, MODEL, {"text_input": "Hi", "parameters": parameters})
    assert status == 400
    assert body["error"].startswith(field), body["error"]


def test_structured_outputs_over_rest_generate(fcfs_server: InProcessServer) -> None:
    parameters = {"temperature": 0, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}
    status, body = post_generate(
        fcfs_server, MODEL, {"text_input": "Hi", "exclude_input_in_output": True, "parameters": parameters}
    )
    assert status == 200, body
    assert body["text_output"] in ("yes", "no")


def aborts_by_deadline(srv: InProcessServer) -> float:
    return scrape(srv).get(
        ("pagedserve:request_aborts_total", (("cause", "deadline"), ("model_name", MODEL))), 0.0
    )


def test_a_triton_request_past_its_timeout_is_aborted_and_the_stream_goes_on(
    fcfs_server: InProcessServer,
) -> None:
    """Triton's schedule-policy `timeout` (microseconds, tritonclient's `timeout=`): a request not done
    in time ends with an error on the stream, its blocks freed and its abort counted as a deadline;
    another request on the same stream finishes."""
    import tritonclient.grpc as tgrpc

    srv = fcfs_server
    before = aborts_by_deadline(srv)
    responses: queue.Queue[Any] = queue.Queue()

    def inputs(max_tokens: int) -> list[Any]:
        text = tgrpc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"Count to a thousand."], dtype=object))
        sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
        params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
        sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
        return [text, sampling]

    with tgrpc.InferenceServerClient(f"127.0.0.1:{srv.port}") as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(MODEL, inputs(900), request_id="slow", timeout=30_000)
        client.async_stream_infer(MODEL, inputs(4), request_id="quick")
        got = [responses.get(timeout=60) for _ in range(2)]
        client.stop_stream()
    errors = [str(error) for _, error in got if error is not None]
    results = [result for result, error in got if error is None]
    assert len(errors) == 1 and "Request timeout expired (30000 us)" in errors[0]
    assert [r.get_response().id for r in results] == ["quick"]
    assert wait_for(lambda: aborts_by_deadline(srv) == before + 1, what="the deadline abort to be counted")
    assert wait_for(lambda: srv.server.engine.num_live_requests == 0, what="the engine to drop the request")


def test_a_unary_triton_request_past_its_timeout_is_deadline_exceeded(fcfs_server: InProcessServer) -> None:
    import tritonclient.grpc as tgrpc
    from tritonclient.utils import InferenceServerException

    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hi"], dtype=object))
    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([b'{"max_tokens": 900, "ignore_eos": true}'], dtype=object))
    with tgrpc.InferenceServerClient(f"127.0.0.1:{fcfs_server.port}") as client:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(MODEL, [text, sampling], timeout=30_000)
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "Request timeout expired" in caught.value.message()
        # a timeout the request meets changes nothing
        result = client.infer(MODEL, [text, sampling_of(4)], timeout=60_000_000)
        assert result.as_numpy("text_output") is not None


def sampling_of(max_tokens: int) -> Any:
    import tritonclient.grpc as tgrpc

    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps({"max_tokens": max_tokens}).encode()], dtype=object))
    return sampling


def test_rest_generate_past_its_timeout_is_a_504(fcfs_server: InProcessServer) -> None:
    body = {"text_input": "Hi", "parameters": {"max_tokens": 900, "ignore_eos": True, "timeout": 30_000}}
    status, reply = post_generate(fcfs_server, MODEL, body)
    assert status == 504
    assert reply["error"].startswith("Request timeout expired")


def test_a_timeout_past_before_the_engine_takes_the_request_counts_as_a_deadline_abort(
    fcfs_server: InProcessServer,
) -> None:
    """1 us has passed before the engine sees the request: it is still aborted by its deadline, a 504,
    and counted as one, so that every request ends in exactly one counter."""
    engine = fcfs_server.llm
    # an earlier test's aborted request, counted once the engine drops it, would count here too
    wait_for(lambda: not engine.has_unfinished_requests(), what="the engine to drop earlier requests")
    before = aborts_by_deadline(fcfs_server)
    body = {"text_input": "Hi", "parameters": {"max_tokens": 4, "timeout": 1}}
    status, reply = post_generate(fcfs_server, MODEL, body)
    assert status == 504
    assert reply["error"].startswith("Request timeout expired (1 us)")
    assert wait_for(lambda: aborts_by_deadline(fcfs_server) == before + 1, what="the deadline abort counted")
    assert wait_for(lambda: fcfs_server.server.engine.num_live_requests == 0, what="no request left")


@pytest.mark.parametrize("bad", ["soon", -1, 0.5, False])
def test_a_bad_triton_timeout_is_a_400_naming_it(fcfs_server: InProcessServer, bad: Any) -> None:
    status, body = post_generate(fcfs_server, MODEL, {"text_input": "Hi", "parameters": {"timeout": bad}})
    assert status == 400
    assert body["error"].startswith("parameters.timeout:")


def test_server_metadata_lists_the_schedule_policy_extension(fcfs_server: InProcessServer) -> None:
    import tritonclient.grpc as tgrpc

    with tgrpc.InferenceServerClient(f"127.0.0.1:{fcfs_server.port}") as client:
        assert "schedule_policy" in client.get_server_metadata().extensions


def tokens_of(srv: InProcessServer, req: pb.GenerateRequest) -> list[int]:
    return [t for r in srv.stub.Generate(req, timeout=60) for t in r.token_ids]


def test_logit_controls_over_grpc(fcfs_server: InProcessServer) -> None:
    srv = fcfs_server
    free = tokens_of(srv, request("free", max_tokens=12))
    assert set(free) != {42}
    assert tokens_of(srv, request("bias", max_tokens=12, logit_bias={42: 100.0})) == [42] * 12
    allowed = [7, 8, 9]
    assert set(tokens_of(srv, request("allowed", max_tokens=12, allowed_token_ids=allowed))) <= set(allowed)
    # the tokens of a word the model generates: banned, it is never completed
    word = srv.stub.Detokenize(pb.DetokenizeRequest(token_ids=free[2:4]), timeout=10).text
    banned = "".join(
        r.text for r in srv.stub.Generate(request("bad", max_tokens=12, bad_words=[word]), timeout=60)
    )
    assert word.strip() not in banned


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids:"),
        ({"logit_bias": {10**9: 1.0}}, "logit_bias:"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias:"),
        ({"bad_words": [""]}, "bad_words:"),
        ({"prompt_logprobs": 21}, "prompt_logprobs:"),
    ],
)
def test_bad_logit_controls_are_invalid_argument_naming_the_field(
    fcfs_server: InProcessServer, sampling: dict[str, Any], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(fcfs_server.stub.Generate(request("bad", **sampling), timeout=30))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(field), caught.value.details()


def test_triton_clients_give_logit_controls_as_sampling_parameters(fcfs_server: InProcessServer) -> None:
    biased = {"temperature": 0, "max_tokens": 6, "logit_bias": {"42": 100}}
    [(result, error)] = triton_stream(fcfs_server, 0, biased)
    assert error is None
    req = pb.GenerateRequest(
        text="Name a color.",
        sampling=pb.SamplingParameters(temperature=0, max_tokens=6, logit_bias={42: 100.0}),
    )
    ours = "".join(r.text for r in fcfs_server.stub.Generate(req, timeout=60))
    assert result.as_numpy("text_output")[0].decode() == ours
    status, body = post_generate(
        fcfs_server,
        MODEL,
        {"text_input": "Hi", "parameters": {"allowed_token_ids": "[1, 2]", "bad_words": 5}},
    )
    assert status == 400
    assert body["error"].startswith("sampling_parameters.bad_words:")


def test_prompt_logprobs_over_grpc_are_the_models(fcfs_server: InProcessServer, tiny_llama_dir: str) -> None:
    """Every prompt token after the first, with its logprob as a float32 forward pass of the same model
    gives it and the top 3 there; on the first response only, the same through Complete."""
    import torch
    from transformers import AutoModelForCausalLM

    responses = list(fcfs_server.stub.Generate(request("plp", max_tokens=3, prompt_logprobs=3), timeout=60))
    entries = responses[0].prompt_logprobs
    assert len(responses[0].prompt_logprobs) == len(PROMPT) - 1
    assert not any(r.prompt_logprobs for r in responses[1:])  # (its 3 tokens in up to 3 responses)
    assert [e.sampled.token_id for e in entries] == PROMPT[1:]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for position, entry in enumerate(entries):
        row = expected[position]
        assert entry.sampled.logprob == pytest.approx(row[PROMPT[position + 1]].item(), abs=1e-3)
        assert [t.token_id for t in entry.top][:3] == row.topk(3).indices.tolist()
        assert entry.sampled.rank == int((row > row[PROMPT[position + 1]]).sum()) + 1
    completed = fcfs_server.stub.Complete(request("plp2", max_tokens=3, prompt_logprobs=0), timeout=60)
    assert [e.sampled.token_id for e in completed.completions[0].prompt_logprobs] == PROMPT[1:]


def test_prompt_logprobs_past_a_message_go_over_the_first_responses(
    fcfs_server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt's logprobs in one message passed the 4 MiB a default gRPC client reads (16,000
    tokens at prompt_logprobs 20: 9 MB), so no default client could read its answer. Past the bound
    (lowered here to a third of these) they go ahead in messages of their own, in order, then the
    tokens as before; Complete's one message is unchanged."""
    from pagedserve.rpc import server

    whole = fcfs_server.stub.Complete(request("plp-whole", max_tokens=3, prompt_logprobs=3), timeout=60)
    expected = list(whole.completions[0].prompt_logprobs)
    assert len(expected) == len(PROMPT) - 1
    bound = sum(entry.ByteSize() for entry in expected) // 3
    monkeypatch.setattr(server, "MAX_PROMPT_LOGPROBS_BYTES", bound)
    responses = list(
        fcfs_server.stub.Generate(request("plp-split", max_tokens=3, prompt_logprobs=3), timeout=60)
    )
    ahead = [r for r in responses if not r.token_ids]
    assert len(ahead) >= 2 and responses[: len(ahead)] == ahead  # the logprobs first, alone
    assert all(r.ByteSize() <= bound + max(e.ByteSize() for e in expected) + 64 for r in ahead)
    assert all(r.request_id == "plp-split" and r.prompt_tokens == len(PROMPT) for r in ahead)
    assert [e for r in responses for e in r.prompt_logprobs] == expected
    assert [t for r in responses for t in r.token_ids] == list(whole.completions[0].token_ids)
    assert 1 <= len(responses) - len(ahead) <= 3  # three tokens (deltas merge for a slow reader)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_model_info_says_the_scheduling_policy(
    policy: str, fcfs_server: InProcessServer, priority_server: InProcessServer
) -> None:
    srv = fcfs_server if policy == "fcfs" else priority_server
    assert srv.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).scheduling_policy == policy


PAIR = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
}


def test_json_without_free_whitespace(fcfs_server: InProcessServer) -> None:
    """`disable_any_whitespace`: no newline, tab or run of spaces anywhere in the JSON, though the
    request pushes the model towards them (without the option the grammar lets them through)."""
    req = request(
        "nows",
        max_tokens=40,
        logit_bias=WHITESPACE_BIAS,
        structured_outputs=pb.StructuredOutputs(json=json.dumps(PAIR), disable_any_whitespace=True),
    )
    text = "".join(r.text for r in fcfs_server.stub.Generate(req, timeout=60))
    assert text.startswith("{")
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "S", text).split('"')[0]  # strings may hold any
    assert not re.search(r"[\n\t\r]|  ", outside_strings), repr(text)


def test_the_example_client_asks_for_structured_outputs(fcfs_server: InProcessServer) -> None:
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "stream_client.py"
    address = f"127.0.0.1:{fcfs_server.port}"

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(example), "Pick a number.", "--address", address, *flags]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    done = run("--regex", "[0-9]{3}", "--max-tokens", "8")
    assert done.returncode == 0, done.stderr
    answer, summary = done.stdout.split("\n")[:2]
    assert re.fullmatch("[0-9]{3}", answer) and summary.startswith("[eos:"), done.stdout
    bad = run("--json-schema", "{not json")
    assert bad.returncode == 1 and "INVALID_ARGUMENT: structured_outputs.json" in bad.stderr


def test_bad_words_are_tokenized_once_on_the_tokenizer_thread(
    fcfs_server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not again on the event loop (check) nor on the engine thread (add_request): 1,024 words of 1,024
    characters take half a second, and a fast tokenizer is not to be shared between threads."""
    from pagedserve.sampling_params import SamplingParams

    threads: list[str] = []
    original = SamplingParams.update_from_tokenizer

    def recording(self: SamplingParams, tokenizer: Any) -> None:
        threads.append(threading.current_thread().name)
        original(self, tokenizer)

    monkeypatch.setattr(SamplingParams, "update_from_tokenizer", recording)
    words = ["quokka marmalade", "zeppelin"]
    for rid in ("w1", "w2"):  # the second finds the first's ids in the engine's cache
        responses = list(fcfs_server.stub.Generate(request(rid, bad_words=words), timeout=60))
        assert responses[-1].finish_reason == pb.LENGTH
    assert len(threads) == 1 and threads[0].startswith("pagedserve-tokenizer"), threads


def test_truncate_prompt_tokens_over_grpc(fcfs_server: InProcessServer) -> None:
    """The last 12 prompt tokens run as that tail sent alone would, and every response (prompt_tokens,
    the prompt logprobs) describes the prompt that ran."""
    truncated = list(
        fcfs_server.stub.Generate(request("tr", truncate_prompt_tokens=12, prompt_logprobs=0), timeout=60)
    )
    tail = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT[-12:]),
        sampling=pb.SamplingParameters(temperature=0, max_tokens=8, ignore_eos=True),
    )
    expected = [t for r in fcfs_server.stub.Generate(tail, timeout=60) for t in r.token_ids]
    assert [t for r in truncated for t in r.token_ids] == expected
    assert {r.prompt_tokens for r in truncated} == {12}
    assert [e.sampled.token_id for e in truncated[0].prompt_logprobs] == PROMPT[-11:]


@pytest.mark.parametrize("bad", [0, -2, 4096])
def test_a_bad_truncate_prompt_tokens_is_invalid_argument_naming_it(
    fcfs_server: InProcessServer, bad: int
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(fcfs_server.stub.Generate(request("trbad", truncate_prompt_tokens=bad), timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "truncate_prompt_tokens" in caught.value.details()


def test_triton_clients_give_truncate_prompt_tokens_as_a_sampling_parameter(
    fcfs_server: InProcessServer,
) -> None:
    """The Triton front ends truncate the tokenized text_input as ours does (REST generate here)."""
    text = "Tell me a story about a dragon who guards a library."
    ours = pb.GenerateRequest(
        text=text,
        sampling=pb.SamplingParameters(temperature=0, max_tokens=6, truncate_prompt_tokens=4),
    )
    expected = "".join(r.text for r in fcfs_server.stub.Generate(ours, timeout=60))
    params = {"temperature": 0, "max_tokens": 6, "truncate_prompt_tokens": 4, "exclude_input_in_output": True}
    status, body = post_generate(fcfs_server, MODEL, {"text_input": text, "parameters": params})
    assert status == 200, body
    assert body["text_output"] == expected
    untruncated = {k: v for k, v in params.items() if k != "truncate_prompt_tokens"}
    status, whole = post_generate(fcfs_server, MODEL, {"text_input": text, "parameters": untruncated})
    assert status == 200 and whole["text_output"] != expected  # the tail alone continues differently
    status, body = post_generate(
        fcfs_server, MODEL, {"text_input": text, "parameters": {"truncate_prompt_tokens": 0}}
    )
    assert status == 400
    assert body["error"].startswith("sampling_parameters.truncate_prompt_tokens:")
