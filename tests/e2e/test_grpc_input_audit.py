"""Bad input and misbehaving clients against `pagedserve.rpc.v1`: each gets a specific answer (a status
naming the field), and the server goes on serving everyone else at full speed.

One in-process server (the CLI's assembly, real sockets, real grpc clients) on the tiny model with a
longer context and a strict chat template of the kind real models ship (Llama-2 and Mistral raise
when roles do not alternate)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_helpers import LONG_MAX_TOKENS, long_context_copy, request, wait_until
from inprocess_server import InProcessServer, scrape
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

STRICT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> InProcessServer:
    model_dir = Path(long_context_copy(tiny_llama_dir, tmp_path_factory.mktemp("strict-llama")))
    (model_dir / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    srv = InProcessServer(
        str(model_dir), provider=None, dtype="float32", block_size=16, num_kv_blocks=1280
    ).start()
    yield srv
    srv.stop()


def assert_serves_on(server: InProcessServer) -> None:
    responses = list(server.stub.Generate(request(max_tokens=2), timeout=30))
    assert sum(len(r.token_ids) for r in responses) == 2 and responses[-1].finish_reason == pb.LENGTH


def invalid_argument(call: object, *args: object) -> str:
    """Call an RPC (a stream is read to its end); it must fail with INVALID_ARGUMENT: its details."""
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, timeout=30)  # type: ignore[operator]
        if not hasattr(result, "DESCRIPTOR"):
            list(result)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


def test_a_chat_the_template_refuses_is_invalid_argument_naming_messages(server: InProcessServer) -> None:
    """The template's raise_exception() came back as UNKNOWN ("Unexpected <class TemplateError>")."""
    odd = pb.ChatMessages(messages=[pb.ChatMessage(role="assistant", content="hi")])
    req = pb.GenerateRequest(messages=odd, sampling=pb.SamplingParameters(max_tokens=2))
    for call, arg in (
        (server.stub.Generate, req),
        (server.stub.Complete, req),
        (server.stub.Tokenize, pb.TokenizeRequest(messages=odd)),
    ):
        details = invalid_argument(call, arg)
        assert details.startswith("messages:") and "roles must alternate" in details, details
    good = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    assert server.stub.Tokenize(pb.TokenizeRequest(messages=good)).token_ids
    assert_serves_on(server)


def _ahead(request_id: str, num: int) -> str:
    """The id a server that counts would assign `num` ids after `request_id` (itself if it does not count)."""
    match = re.fullmatch(r"(.*\D)(\d+)", request_id)
    return f"{match[1]}{int(match[2]) + num}" if match else request_id


def test_a_caller_without_a_request_id_never_gets_another_clients_id(server: InProcessServer) -> None:
    """Assigned ids counted req-0, req-1, ...: a client that chose an id a few ahead for itself made
    the caller without an id that reached it fail with INVALID_ARGUMENT "request_id: 'req-N' is
    already running"."""
    seen = list(server.stub.Generate(request(max_tokens=1), timeout=30))[0].request_id
    taken = _ahead(seen, 3)
    call = server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS, request_id=taken), timeout=60)
    try:
        assert next(call).request_id == taken
        ids = []
        for _ in range(5):
            responses = list(server.stub.Generate(request(max_tokens=2), timeout=30))
            assert sum(len(r.token_ids) for r in responses) == 2
            ids.append(responses[0].request_id)
        assert taken not in ids and len(set(ids)) == 5
    finally:
        call.cancel()


def test_another_client_cannot_abort_a_request_by_guessing_its_assigned_id(server: InProcessServer) -> None:
    """With counted ids, Abort(req-0 ... req-999) ended every request whose caller let the server
    choose its id."""
    call = server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS), timeout=60)
    try:
        own = next(call).request_id
        guesses = [f"req-{i}" for i in range(1000)] + [f"health-req-{i}" for i in range(1000)]
        assert list(server.stub.Abort(pb.AbortRequest(request_ids=guesses)).aborted_request_ids) == []
        assert list(server.stub.Abort(pb.AbortRequest(request_ids=[own])).aborted_request_ids) == [own]
        assert list(call)[-1].finish_reason == pb.ABORTED
    finally:
        call.cancel()


class HeldAdmission:
    """The server's `AsyncEngine.prepare` held at a gate until `release()`: a request stays in its
    admission (where tokenizing or compiling a grammar takes up to seconds) as long as a test needs."""

    def __init__(self, server: InProcessServer) -> None:
        self.server, self.engine = server, server.server.engine
        self.gate = server.call(_new_event())
        self.entered = threading.Event()  # a request reached the gate
        original = self.engine.prepare

        async def held(*args: object, **kwargs: object) -> object:
            self.entered.set()
            await self.gate.wait()
            return await original(*args, **kwargs)

        self.engine.prepare = held

    def release(self) -> None:
        self.server.loop.call_soon_threadsafe(self.gate.set)

    def restore(self) -> None:
        self.release()
        del self.engine.prepare


async def _new_event() -> asyncio.Event:
    return asyncio.Event()


def test_a_request_id_is_held_and_abortable_while_its_request_is_admitted(server: InProcessServer) -> None:
    """While a request was being admitted its id was neither held nor abortable: an Abort call found
    nothing (and the request ran to its end), and a second request under the id was admitted beside
    it. Now the second is refused and the Abort ends the first before its first token."""
    held = HeldAdmission(server)
    first: list[object] = []
    try:
        thread = threading.Thread(
            target=lambda: first.extend(
                server.stub.Generate(request(request_id="held", max_tokens=8), timeout=60)
            )
        )
        thread.start()
        assert held.entered.wait(timeout=30)
        assert invalid_argument(server.stub.Generate, request(request_id="held", max_tokens=2)) == (
            "request_id: 'held' is already running"
        )
        aborted = server.stub.Abort(pb.AbortRequest(request_ids=["held"]), timeout=10)
        assert list(aborted.aborted_request_ids) == ["held"]
        held.release()
        thread.join(timeout=60)
    finally:
        held.restore()
    assert [r.finish_reason for r in first] == [pb.ABORTED]
    assert not any(r.token_ids for r in first) and first[0].error == "aborted by an Abort call"
    assert not server.server.engine._reserved
    assert_serves_on(server)
    list(server.stub.Generate(request(request_id="held", max_tokens=2), timeout=30))  # the id is free again


def test_a_request_refused_in_its_admission_frees_its_id(server: InProcessServer) -> None:
    bad = pb.GenerateRequest(request_id="refused", text="hi", sampling=_sp(top_k=-2))
    assert invalid_argument(server.stub.Generate, bad).startswith("top_k:")
    # grpc.aio sends the status first, then raises in the handler, which releases the id
    assert wait_until(lambda: not server.server.engine._reserved, timeout=10)
    assert (
        list(server.stub.Generate(request(request_id="refused", max_tokens=2), timeout=30))[-1].finish_reason
        == pb.LENGTH
    )


def test_a_huge_prompt_does_not_stall_the_other_streams(server: InProcessServer) -> None:
    """Tokenizing ran on the event loop: while a 2 MB prompt was tokenized (only to be refused as too
    long) no other stream got a token; the longest pause between a running stream's tokens equalled
    the whole time the huge request took."""
    victim = server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS), timeout=120)
    arrivals: list[float] = []

    def read() -> None:
        try:
            for _ in victim:
                arrivals.append(time.monotonic())
        except grpc.RpcError:
            pass  # cancelled below

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert wait_until(lambda: len(arrivals) >= 20, timeout=30)
        start = time.monotonic()
        details = invalid_argument(server.stub.Generate, request("a" * 2_000_000))
        end = time.monotonic()
        assert details.startswith("prompt:") and "context length" in details, details
        assert wait_until(lambda: arrivals[-1] > end, timeout=30)  # the victim streams on after it
    finally:
        victim.cancel()
        reader.join(timeout=30)
    window = [t for t in arrivals if t < start][-1:] + [t for t in arrivals if start <= t]
    worst_gap = max(b - a for a, b in zip(window, window[1:]))
    assert worst_gap < 0.5 * (end - start), (worst_gap, end - start)


def _sp(**kwargs: object) -> pb.SamplingParameters:
    return pb.SamplingParameters(**kwargs)


DEEP_JSON = "[" * 5000 + "]" * 5000


def _user() -> pb.ChatMessage:
    return pb.ChatMessage(role="user", content="hi")


def _call_with_arguments(arguments: str) -> pb.ChatMessage:
    return pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="f", arguments=arguments)])


def _chat(*messages: pb.ChatMessage, **fields: object) -> pb.GenerateRequest:
    chat = pb.ChatMessages(messages=messages, **fields)  # type: ignore[arg-type]
    return pb.GenerateRequest(messages=chat, sampling=_sp(max_tokens=2))


def _struct(**values: object) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


def _constrained(**kind: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text="hi", sampling=_sp(max_tokens=4, structured_outputs=pb.StructuredOutputs(**kind))
    )


# Requests test_grpc_server.py does not already try: each must be refused naming its field.
INVALID = [
    ("n", pb.GenerateRequest(text="hi", sampling=_sp(n=0))),
    ("n", pb.GenerateRequest(text="hi", sampling=_sp(n=-3))),
    ("max_tokens", pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=-1))),
    ("max_tokens", pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=2**63 - 1))),
    ("min_tokens", pb.GenerateRequest(text="hi", sampling=_sp(min_tokens=-1))),
    ("top_k", pb.GenerateRequest(text="hi", sampling=_sp(top_k=-2))),
    ("top_p", pb.GenerateRequest(text="hi", sampling=_sp(top_p=float("nan")))),
    ("temperature", pb.GenerateRequest(text="hi", sampling=_sp(temperature=float("inf")))),
    ("min_p", pb.GenerateRequest(text="hi", sampling=_sp(min_p=float("nan")))),
    ("frequency_penalty", pb.GenerateRequest(text="hi", sampling=_sp(frequency_penalty=float("-inf")))),
    ("repetition_penalty", pb.GenerateRequest(text="hi", sampling=_sp(repetition_penalty=0))),
    ("logprobs", pb.GenerateRequest(text="hi", sampling=_sp(logprobs=-1))),
    ("stop_token_ids", pb.GenerateRequest(text="hi", sampling=_sp(stop_token_ids=[-1]))),
    ("token_ids.ids[0]", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1, 5]))),
    ("token_ids.ids[0]", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**63 - 1]))),
    ("request_id", pb.GenerateRequest(text="hi", request_id="tab\there")),
    # n sequences were built on the event loop: 2**62 of them froze it until the kernel killed the server
    ("n", pb.GenerateRequest(text="hi", sampling=_sp(n=2**62))),
    # min_tokens bans the stop ids by index: one past the vocabulary failed the whole batch's step
    ("stop_token_ids[0]", pb.GenerateRequest(text="hi", sampling=_sp(stop_token_ids=[49152], min_tokens=2))),
    # every stop string is searched after every token on the thread that steps everyone
    ("stop", pb.GenerateRequest(text="hi", sampling=_sp(stop=[f"s{i}" for i in range(65)]))),
    ("stop", pb.GenerateRequest(text="hi", sampling=_sp(stop=["s" * 1025]))),
    # JSON nested past the parser's depth, and numbers JSON lacks: a RecursionError or ValueError, UNKNOWN
    ("messages[1].tool_calls[0].arguments", _chat(_user(), _call_with_arguments(DEEP_JSON))),
    ("tools[0].parameters", _chat(_user(), tools=[pb.Tool(name="f", parameters=DEEP_JSON)])),
    ("chat_template_kwargs", _chat(_user(), chat_template_kwargs=_struct(x=float("nan")))),
    ("chat_template_kwargs", _chat(_user(), chat_template_kwargs=_struct(x=float("inf")))),
    # constraints that match no text compiled, then failed the request at its first token (INTERNAL)
    ("structured_outputs.grammar", _constrained(grammar="root ::= root")),
    ("structured_outputs.grammar", _constrained(grammar='root ::= a\na ::= a "b"')),
    ("structured_outputs.regex", _constrained(regex="[^\\x00-\\U0010FFFF]")),
]


@pytest.mark.parametrize(("field", "req"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_odd_values_are_refused_naming_the_field(server: InProcessServer, field: str, req: object) -> None:
    for call in (server.stub.Generate, server.stub.Complete):
        assert invalid_argument(call, req).startswith(f"{field}:")
    assert_serves_on(server)


def test_odd_tokenize_detokenize_and_undecodable_nested_fields(server: InProcessServer) -> None:
    assert invalid_argument(server.stub.Tokenize, pb.TokenizeRequest()).startswith("input:")
    for ids in ([-1], [49152], [2**63 - 1]):
        details = invalid_argument(server.stub.Detokenize, pb.DetokenizeRequest(token_ids=ids))
        assert details == f"token_ids[0]: {ids[0]} is not in [0, 49152)"
    raw = server.channel.unary_stream(
        "/pagedserve.rpc.v1.Generation/Generate",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    bad_stop = pb.GenerateRequest(text="hi").SerializeToString() + b"\x2a\x03\x62\x01\xff"  # sampling.stop
    assert invalid_argument(raw, bad_stop).startswith("sampling.stop:")
    assert_serves_on(server)


@pytest.mark.parametrize(("ids", "index"), [([5, 7, 3, 49152, 9], 3), ([5, -2, 49152], 1), ([50000], 0)])
def test_a_token_id_outside_the_vocabulary_is_named_by_its_index_and_value(
    server: InProcessServer, ids: list[int], index: int
) -> None:
    """ "token_ids: must be in [0, vocab)" (Detokenize) and "prompt_token_ids: ..." (a prompt of token
    ids: not the proto's name) left the client to find the bad id; each now names the field as the
    client spells it, the first bad id's index and its value (negative ones too)."""
    said = f"{ids[index]} is not in [0, 49152)"
    details = invalid_argument(server.stub.Detokenize, pb.DetokenizeRequest(token_ids=ids))
    assert details == f"token_ids[{index}]: {said}"
    prompt = pb.TokenIds(ids=ids)
    req = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParameters(max_tokens=2))
    for call, arg in (
        (server.stub.Generate, req),
        (server.stub.Complete, req),
        (server.stub.Embed, pb.EmbedRequest(token_ids=prompt)),
    ):
        assert invalid_argument(call, arg) == f"token_ids.ids[{index}]: {said}"
    assert_serves_on(server)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_a_seed_at_the_edges_of_int64_samples_and_fails_nobody_beside_it(
    server: InProcessServer, seed: int
) -> None:
    """The sampler mixed the seed with the output index past torch's 64 bits: the step failed with
    INTERNAL for the seeded request and for every stream batched with it."""
    victim = server.stub.Generate(request(max_tokens=LONG_MAX_TOKENS), timeout=120)
    try:
        assert next(victim).token_ids
        seeded = list(server.stub.Generate(request(max_tokens=4, temperature=1.0, seed=seed), timeout=30))
        assert sum(len(r.token_ids) for r in seeded) == 4 and seeded[-1].finish_reason == pb.LENGTH
        assert next(victim).token_ids  # still streaming
    finally:
        victim.cancel()
    assert_serves_on(server)


def test_a_burst_past_grpcs_pending_call_bound_is_answered_not_cancelled(server: InProcessServer) -> None:
    """gRPC core cancelled the calls of a burst past 1,000 waiting for the server's code (its default
    bound), at random, with CANCELLED that a client reads as its own and does not retry, before
    pagedserve saw them: 3,000 health checks at once lost 412. Every one is answered now."""

    async def burst() -> Counter[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def one() -> str:
                try:
                    await stub.Health(pb.HealthRequest(), timeout=120)
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}"
                return "OK"

            return Counter(await asyncio.gather(*(one() for _ in range(3000))))

    assert asyncio.run(burst()) == {"OK": 3000}


def test_refused_requests_are_counted_by_reason_on_every_front_end(server: InProcessServer) -> None:
    """Requests refused before they ran moved no metric (no span either): a client sending bad requests
    was invisible to dashboards. pagedserve:request_rejections counts them on every front end; a
    metadata call for an unknown model is no request and is not counted."""
    import urllib.error
    import urllib.request

    import numpy as np
    import tritonclient.grpc as tgrpc
    from tritonclient.utils import InferenceServerException

    def rejections() -> dict[str, float]:
        samples = scrape(server)
        return {
            dict(labels)["reason"]: value
            for (name, labels), value in samples.items()
            if name == "pagedserve:request_rejections_total"
        }

    def post(path: str, body: dict[str, object]) -> int:
        req = urllib.request.Request(server.http_url(path), data=json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=30) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    model = server.llm.config.model.served_model_name
    before = rejections()
    assert set(before) == {"invalid", "queue_full", "unavailable", "not_found"}  # every series, from 0
    assert invalid_argument(server.stub.Complete, request(temperature=-1.0))  # our gRPC API
    assert post(f"/v2/models/{model}/generate", {"text_input": "x", "parameters": {"top_p": 2}}) == 400
    assert post("/v2/models/nope/generate", {"text_input": "x"}) == 404
    text = tgrpc.InferInput("text_input", [1], "INT32")  # Triton gRPC: the wrong datatype
    text.set_data_from_numpy(np.array([1], dtype=np.int32))
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as triton:
        with pytest.raises(InferenceServerException):
            triton.infer(model, [text])
        with pytest.raises(InferenceServerException):
            triton.get_model_metadata("nope")  # not a request
    after = rejections()
    assert {reason: after[reason] - before[reason] for reason in after} == {
        "invalid": 3,
        "queue_full": 0,
        "unavailable": 0,
        "not_found": 1,
    }
