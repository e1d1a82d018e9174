"""vLLM's detokenization flags over gRPC, for routers that tokenize and detokenize themselves (vLLM's gRPC
server and sgl-model-gateway send token ids): `sampling.detokenize: false` streams the same token ids
(and logprobs) as a decoded request with empty text, in Generate and Complete; a request whose output
the server would read as text (stop strings, a chat's tool calls or reasoning) is INVALID_ARGUMENT
naming the field, and the server goes on serving. `spaces_between_special_tokens` reaches the
tokenizer's decode.

In-process servers on the tiny Llama (the default model's tokenizer and chat template): one with hermes
tool calls, one with `--reasoning-parser qwen3` too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from inprocess_server import InProcessServer
from pagedserve.rpc.v1 import generate_pb2 as pb
from spaced_tokenizer import SpacedSpecialTokens

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
QUESTION = pb.ChatMessage(role="user", content="What is the weather like in Paris today?")
WEATHER = pb.Tool(
    name="get_weather",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
)
SPECIAL = [0, 1, 2, 4, 12]  # <|endoftext|>, <|im_start|>, <|im_end|> (EOS), <reponame>, <jupyter_text>


def start(model_dir: str, **settings: Any) -> InProcessServer:
    return InProcessServer(
        model_dir,
        None,
        dtype="float32",
        num_kv_blocks=128,
        block_size=16,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        **settings,
    ).start()


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    srv = start(tiny_llama_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reasoning_server(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    srv = start(tiny_llama_dir, reasoning_parser="qwen3")
    yield srv
    srv.stop()


def sampling(**fields: Any) -> pb.SamplingParameters:
    return pb.SamplingParameters(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **fields})


def text_request(**fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, sampling=sampling(**fields))


def chat_request(detokenize: bool, **chat: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[QUESTION], **chat), sampling=sampling(detokenize=detokenize)
    )


def stream(srv: InProcessServer, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(srv.stub.Generate(req, timeout=120))


def ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def logprobs(
    responses: list[pb.GenerateResponse] | pb.GenerateResponse,
) -> list[list[tuple[int, float, int]]]:
    """Each generated token's entries (sampled first, then the top), without their text."""
    entries = (
        [e for r in responses for e in r.logprobs] if isinstance(responses, list) else responses.logprobs
    )
    return [[(t.token_id, t.logprob, t.rank) for t in (e.sampled, *e.top)] for e in entries]


def texts(responses: list[pb.GenerateResponse] | pb.GenerateResponse) -> list[str]:
    """Every text a response carries: the completion's and its logprobs' tokens'."""
    out = responses if isinstance(responses, list) else [responses]
    return [r.text for r in out] + [t.text for r in out for e in r.logprobs for t in (e.sampled, *e.top)]


def test_generate_without_detokenize_streams_the_same_token_ids_with_empty_text(
    server: InProcessServer,
) -> None:
    decoded = stream(server, text_request(logprobs=2, prompt_logprobs=1))
    bare = stream(server, text_request(logprobs=2, prompt_logprobs=1, detokenize=False))

    assert ids(bare) == ids(decoded) and len(ids(bare)) == 12
    assert "".join(r.text for r in decoded) != "" and any(texts(decoded)[len(decoded) :])
    assert set(texts(bare)) == {""}, texts(bare)
    assert logprobs(bare) == logprobs(decoded) and len(logprobs(bare)) == 12
    assert [(p.sampled.token_id, p.sampled.logprob) for r in bare for p in r.prompt_logprobs] == [
        (p.sampled.token_id, p.sampled.logprob) for r in decoded for p in r.prompt_logprobs
    ]
    assert bare[-1].finish_reason == decoded[-1].finish_reason == pb.LENGTH
    assert bare[-1].completion_tokens == 12


def test_complete_without_detokenize_returns_the_same_token_ids_with_empty_text(
    server: InProcessServer,
) -> None:
    decoded = server.stub.Complete(text_request(n=2, temperature=1.0, seed=7, logprobs=1), timeout=120)
    bare = server.stub.Complete(
        text_request(n=2, temperature=1.0, seed=7, logprobs=1, detokenize=False), timeout=120
    )
    for with_text, without in zip(decoded.completions, bare.completions, strict=True):
        assert list(without.token_ids) == list(with_text.token_ids) and len(without.token_ids) == 12
        assert logprobs(without) == logprobs(with_text)
        assert with_text.text != "" and set(texts(without)) == {""}, texts(without)
        assert without.finish_reason == pb.LENGTH and without.completion_tokens == 12


def test_what_reads_no_text_is_served_without_detokenize(server: InProcessServer) -> None:
    """A chat whose output is not parsed (tools with tool_choice none), a grammar (token-level) and
    include_stop_str_in_output (about text alone: the stop token id ends both outputs) run as with
    text: the same tokens, no text."""
    greedy = ids(stream(server, text_request()))
    stop_id = next(t for i, t in enumerate(greedy) if i >= 4 and t not in greedy[:i])
    regex = pb.StructuredOutputs(regex="[0-9]{3}-[a-z]{4}")
    cases: list[tuple[pb.GenerateRequest, pb.GenerateRequest]] = [
        (
            chat_request(True, tools=[WEATHER], tool_choice="none"),
            chat_request(False, tools=[WEATHER], tool_choice="none"),
        ),
        (text_request(structured_outputs=regex), text_request(structured_outputs=regex, detokenize=False)),
        (
            text_request(include_stop_str_in_output=True, stop_token_ids=[stop_id]),
            text_request(include_stop_str_in_output=True, stop_token_ids=[stop_id], detokenize=False),
        ),
    ]
    for decoded_req, bare_req in cases:
        decoded, bare = stream(server, decoded_req), stream(server, bare_req)
        assert ids(bare) == ids(decoded) and ids(bare), bare_req
        assert "".join(r.text for r in decoded) != "" and set(texts(bare)) == {""}, bare_req
    assert ids(bare)[-1] == stop_id and bare[-1].finish_reason == pb.STOP


REFUSED = [
    ("stop", text_request(stop=["."], detokenize=False)),
    ("tools", chat_request(False, tools=[WEATHER])),  # tool_choice auto, the default with tools
    ("tool_choice", chat_request(False, tools=[WEATHER], tool_choice="auto")),
    ("tool_choice", chat_request(False, tools=[WEATHER], tool_choice="required")),
    ("tool_choice_function", chat_request(False, tools=[WEATHER], tool_choice_function="get_weather")),
]


@pytest.mark.parametrize(("field", "req"), REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_without_detokenize_what_needs_text_is_refused_naming_the_field(
    server: InProcessServer, field: str, req: pb.GenerateRequest
) -> None:
    for call in (lambda: stream(server, req), lambda: server.stub.Complete(req, timeout=120)):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith(f"{field}: "), caught.value.details()
        assert "detokenize" in caught.value.details()
    assert ids(stream(server, text_request(detokenize=False))) == ids(stream(server, text_request()))
    assert stream(server, chat_request(True, tools=[WEATHER]))[-1].finish_reason == pb.LENGTH


def test_a_reasoning_parser_refuses_chats_without_detokenize(reasoning_server: InProcessServer) -> None:
    """With --reasoning-parser every chat's output is parsed (tools or none); text and token-id
    prompts are not, and are served without text."""
    for req in (chat_request(False), chat_request(False, tools=[WEATHER], tool_choice="none")):
        with pytest.raises(grpc.RpcError) as caught:
            stream(reasoning_server, req)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("messages: "), caught.value.details()
        assert "--reasoning-parser qwen3" in caught.value.details()
    bare = stream(reasoning_server, text_request(detokenize=False))
    assert ids(bare) == ids(stream(reasoning_server, text_request())) and set(texts(bare)) == {""}
    assert stream(reasoning_server, chat_request(True))[-1].finish_reason == pb.LENGTH


def test_spaces_between_special_tokens_reaches_the_tokenizer_s_decode(
    server: InProcessServer, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a tokenizer that reads the flag (transformers 4's slow ones did), the streamed text is its
    decode of the ids with the flag; unset is true."""
    spaced = SpacedSpecialTokens.from_pretrained(tiny_llama_dir)
    monkeypatch.setattr(server.llm, "tokenizer", spaced)
    words = [t for w in (" hello", " world", ".", "\n", "é") for t in spaced.encode(w)]
    params = dict(temperature=1.0, seed=3, max_tokens=32, skip_special_tokens=False)
    prompt = pb.TokenIds(ids=spaced.encode(PROMPT))
    got: dict[bool | None, str] = {}
    for spaces in (None, True, False):
        flag = {} if spaces is None else {"spaces_between_special_tokens": spaces}
        req = pb.GenerateRequest(
            token_ids=prompt, sampling=sampling(**params, **flag, allowed_token_ids=[*SPECIAL, *words])
        )
        responses = stream(server, req)
        out = ids(responses)
        assert out[0] not in SPECIAL and sum(t in SPECIAL for t in out) >= 5, out
        got[spaces] = "".join(r.text for r in responses)
        assert got[spaces] == spaced.decode(out, spaces_between_special_tokens=spaces is not False)
        detokenize = pb.DetokenizeRequest(token_ids=out, **flag)
        assert server.stub.Detokenize(detokenize, timeout=30).text == got[spaces]
    assert got[None] == got[True] != got[False]
