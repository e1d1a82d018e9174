"""The Embed RPC on an in-process server (tiny model, real gRPC): vectors equal to the model's final
hidden states, shared batches with Generate streams, aborts, metrics, and every bad request refused
as INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from inprocess_server import InProcessServer, exporting_to, scrape, server_span, wait_for
from pagedserve.rpc.v1 import generate_pb2 as pb

MODEL = "tiny"
PROMPT = [1, *range(300, 349)]  # 50 tokens
CONTEXT = 1024


@pytest.fixture(scope="module")
def exporter() -> Any:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, exporter: Any) -> Iterator[InProcessServer]:
    srv = InProcessServer(
        tiny_llama_dir,
        exporting_to(exporter),
        dtype="float32",
        served_model_name=MODEL,
        block_size=8,
        max_num_seqs=2,
        max_model_len=CONTEXT,
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hidden_states(tiny_llama_dir: str) -> Any:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32)

    def forward(prompt: list[int]) -> Any:
        with torch.inference_mode():
            return model(torch.tensor([prompt])).last_hidden_state[0].double()

    return forward


def assert_close(got: Any, want: Any) -> None:
    import torch

    got_t = torch.tensor(list(got), dtype=torch.float64)
    assert got_t.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got_t, want, dim=0) >= 1 - 1e-3
    assert got_t.norm().item() == pytest.approx(want.norm().item(), rel=1e-3)


def test_embed_returns_the_models_vector(server: InProcessServer, hidden_states: Any) -> None:
    import torch

    rows = hidden_states(PROMPT)
    last = server.stub.Embed(pb.EmbedRequest(request_id="e1", token_ids=pb.TokenIds(ids=PROMPT)), timeout=60)
    assert last.request_id == "e1" and last.prompt_tokens == len(PROMPT)
    assert_close(last.embedding, torch.nn.functional.normalize(rows[-1], dim=0))
    mean = server.stub.Embed(
        pb.EmbedRequest(token_ids=pb.TokenIds(ids=PROMPT), pooling="mean", normalize=False), timeout=60
    )
    assert mean.request_id.startswith("req-")
    assert_close(mean.embedding, rows.mean(dim=0))
    again = server.stub.Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=PROMPT)), timeout=60)
    assert again.cached_tokens == 48  # six full blocks of 8; the last token runs again
    assert_close(again.embedding, torch.nn.functional.normalize(rows[-1], dim=0))
    tail = server.stub.Embed(
        pb.EmbedRequest(token_ids=pb.TokenIds(ids=PROMPT), truncate_prompt_tokens=10, model=MODEL), timeout=60
    )
    assert tail.prompt_tokens == 10
    assert_close(tail.embedding, torch.nn.functional.normalize(hidden_states(PROMPT[-10:])[-1], dim=0))
    text = server.stub.Embed(pb.EmbedRequest(text="The capital of France"), timeout=60)
    ids = server.stub.Tokenize(pb.TokenizeRequest(text="The capital of France"), timeout=60).token_ids
    assert text.prompt_tokens == len(ids)
    assert_close(text.embedding, torch.nn.functional.normalize(hidden_states(list(ids))[-1], dim=0))


def test_embed_and_generate_share_the_engine(server: InProcessServer) -> None:
    """Embeddings sent while a stream generates: the stream's tokens are those of a quiet run, every
    embedding equals the one computed alone, and the metrics count the embeddings as finished
    requests, not in the histograms of generation parameters."""
    greedy = pb.SamplingParameters(temperature=0, max_tokens=40, ignore_eos=True)
    generate = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT[:20]), sampling=greedy)
    quiet = [t for r in server.stub.Generate(generate, timeout=60) for t in r.token_ids]
    alone = server.stub.Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=PROMPT[5:45])), timeout=60).embedding
    before = scrape(server)
    tokens: list[int] = []
    stream = threading.Thread(
        target=lambda: tokens.extend(
            t for r in server.stub.Generate(generate, timeout=60) for t in r.token_ids
        )
    )
    stream.start()
    embeddings = [
        server.stub.Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=PROMPT[5:45])), timeout=60).embedding
        for _ in range(4)
    ]
    stream.join(timeout=60)
    assert tokens == quiet
    for embedding in embeddings:
        assert list(embedding) == pytest.approx(list(alone), abs=1e-5)
    after = scrape(server)
    key = ("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", MODEL)))
    assert after[key] - before.get(key, 0.0) == 4
    params = ("vllm:request_params_max_tokens_count", (("model_name", MODEL),))
    assert after[params] - before[params] == 1  # the stream's: an embedding has no max_tokens


def take_both_seats(server: InProcessServer) -> list[Any]:
    """Two streams running (the server's --max-num-seqs): a request sent now waits for a seat."""
    long = pb.SamplingParameters(temperature=0, max_tokens=CONTEXT - 8, ignore_eos=True)
    streams = [
        server.stub.Generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT[:8]), sampling=long), timeout=60
        )
        for _ in range(2)
    ]
    for stream in streams:
        next(stream)  # its first token: running
    return streams


def test_an_aborted_embed_is_cancelled(server: InProcessServer) -> None:
    """Both seats taken by streams: an Embed call waits, an Abort call ends it, CANCELLED."""
    streams = take_both_seats(server)
    outcome: queue.Queue[Any] = queue.Queue()

    def embed() -> None:
        try:
            outcome.put(server.stub.Embed(pb.EmbedRequest(request_id="emb-abort", text="hello"), timeout=60))
        except grpc.RpcError as exc:
            outcome.put(exc)

    threading.Thread(target=embed, daemon=True).start()
    wait_for(lambda: "emb-abort" in server.server.engine.live_request_ids(), what="the embed call queued")
    aborted = server.stub.Abort(pb.AbortRequest(request_ids=["emb-abort"]), timeout=10)
    assert list(aborted.aborted_request_ids) == ["emb-abort"]
    error = outcome.get(timeout=30)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.CANCELLED
    for stream in streams:
        stream.cancel()


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"token_ids": pb.TokenIds(ids=PROMPT), "pooling": "cls"}, "pooling"),
        ({"token_ids": pb.TokenIds(ids=PROMPT), "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (
            {"token_ids": pb.TokenIds(ids=PROMPT), "truncate_prompt_tokens": CONTEXT + 1},
            "truncate_prompt_tokens",
        ),
        ({"token_ids": pb.TokenIds(ids=list(range(1, CONTEXT + 2)))}, "prompt"),
        ({"token_ids": pb.TokenIds(ids=[1, 10**9])}, "token_ids.ids[1]"),
        ({"token_ids": pb.TokenIds(ids=[])}, "prompt"),
        ({"text": ""}, "text"),
        ({}, "input"),
        ({"text": "hi", "model": "other"}, "model"),
        ({"text": "hi", "priority": 3}, "priority"),
        ({"text": "hi", "request_id": "x" * 300}, "request_id"),
    ],
)
def test_a_bad_embed_request_is_invalid_argument_naming_the_field(
    server: InProcessServer, request_fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Embed(pb.EmbedRequest(**request_fields), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:"), caught.value.details()


def test_an_embed_request_without_input_is_told_the_inputs_it_has(server: InProcessServer) -> None:
    """EmbedRequest has no messages: the error no longer names them as Generate's does."""
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Embed(pb.EmbedRequest(), timeout=30)
    assert caught.value.details() == "input: set one of text or token_ids"


def test_a_prompt_may_fill_the_context(server: InProcessServer) -> None:
    """A prompt as long as the context: an embedding generates nothing, so it fits."""
    full = server.stub.Embed(
        pb.EmbedRequest(token_ids=pb.TokenIds(ids=list(range(1, CONTEXT + 1)))), timeout=60
    )
    assert full.prompt_tokens == CONTEXT and len(full.embedding) > 0


def test_an_embed_call_is_traced_as_an_embeddings_operation(server: InProcessServer, exporter: Any) -> None:
    """A server span as a Generate call's, joined to the caller's trace, with the semantic conventions'
    operation name and no sampling attributes; its usage is the prompt."""
    trace_id = 0x5EED0000000000000000000000000001
    traceparent = f"00-{trace_id:032x}-{0x1234:016x}-01"
    server.stub.Embed(
        pb.EmbedRequest(request_id="traced", token_ids=pb.TokenIds(ids=PROMPT[:12])),
        metadata=[("traceparent", traceparent)],
        timeout=60,
    )
    span = server_span(exporter, trace_id)
    attrs = dict(span.attributes)
    assert attrs["gen_ai.operation.name"] == "embeddings"
    assert attrs["gen_ai.request.id"] == "traced" and attrs["gen_ai.usage.prompt_tokens"] == 12
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)
    assert not {"gen_ai.request.max_tokens", "gen_ai.request.temperature", "gen_ai.request.n"} & attrs.keys()
    assert [
        child.name
        for child in exporter.get_finished_spans()
        if child.parent and child.parent.span_id == span.context.span_id
    ] == ["tokenize", "queue", "prefill"]


def test_an_embed_call_past_its_deadline_leaves_the_engine(server: InProcessServer) -> None:
    """Both seats taken: an Embed call with a 0.5 s deadline waits, expires, and its request is gone
    from the engine (aborted, as a Generate call's is), while the streams go on."""
    streams = take_both_seats(server)
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Embed(pb.EmbedRequest(request_id="emb-late", text="hello"), timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: "emb-late" not in server.server.engine.live_request_ids(), what="the request aborted")
    assert next(streams[0]).token_ids  # the streams still run
    for stream in streams:
        stream.cancel()
