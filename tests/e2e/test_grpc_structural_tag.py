"""`structured_outputs.structural_tag` through the real server: our gRPC `StructuredOutputs` field and
Triton's `structured_outputs` sampling parameter (KServe v2 REST generate) force the tool call the
tag describes; a malformed tag is INVALID_ARGUMENT (a 400) naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from inprocess_server import InProcessServer, post_generate
from pagedserve.rpc.v1 import generate_pb2 as pb

MODEL = "tiny"
PROMPT = [1, 500, 600, 700, 800, 900]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
# xgrammar's form: at most 2 tokens of free text, then the call (a random-weight model never reaches a
# trigger by itself); JSON's whitespace capped, which the random model would otherwise spend its tokens on
CALL = json.dumps(
    {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "any_text", "max_tokens": 2},
                {
                    "type": "tag",
                    "begin": "<function=get_weather>",
                    "content": {"type": "json_schema", "json_schema": WEATHER, "max_whitespace_cnt": 1},
                    "end": "</function>",
                },
            ],
        },
    }
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[InProcessServer]:
    srv = InProcessServer(
        tiny_llama_dir, None, dtype="float32", served_model_name=MODEL, block_size=8
    ).start()
    yield srv
    srv.stop()


def generate(srv: InProcessServer, structural_tag: str) -> list[pb.GenerateResponse]:
    sampling = pb.SamplingParameters(
        temperature=0, max_tokens=64, structured_outputs=pb.StructuredOutputs(structural_tag=structural_tag)
    )
    request = pb.GenerateRequest(request_id="tag", token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling)
    return list(srv.stub.Generate(request, timeout=60))


def assert_call(text: str) -> None:
    _, begin, rest = text.partition("<function=get_weather>")
    assert begin and rest.endswith("</function>"), text
    assert json.loads(rest.removesuffix("</function>"))["city"] in ("Paris", "Rome"), text


def test_a_structural_tag_forces_the_tool_call_over_grpc(server: InProcessServer) -> None:
    responses = generate(server, CALL)
    assert responses[-1].finish_reason == pb.EOS
    assert_call("".join(r.text for r in responses))


def test_triton_clients_give_a_structural_tag_in_structured_outputs(server: InProcessServer) -> None:
    parameters = {"temperature": 0, "max_tokens": 64, "structured_outputs": {"structural_tag": CALL}}
    status, body = post_generate(
        server, MODEL, {"text_input": "What is the weather in Rome?", "parameters": parameters}
    )
    assert status == 200, body
    assert_call(body["text_output"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "not JSON: "),
        ("{not json", "not JSON: "),
        (
            '{"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {}}]}',
            'structures[0]: needs "end"',
        ),
        (
            '{"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {"type": "nope"}, "end": "</f>"}]}',
            "does not compile: ",
        ),
    ],
)
def test_a_malformed_structural_tag_is_invalid_argument_naming_it(
    server: InProcessServer, spec: str, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        generate(server, spec)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert details.startswith(f"structured_outputs.structural_tag: {message}"), details
    assert generate(server, CALL)[-1].finish_reason == pb.EOS  # the server goes on


def test_a_malformed_structural_tag_over_rest_is_a_400_naming_it(server: InProcessServer) -> None:
    parameters = {"structured_outputs": {"structural_tag": "[1]"}}
    status, body = post_generate(server, MODEL, {"text_input": "Hi", "parameters": parameters})
    assert status == 400
    assert body["error"].startswith("structured_outputs.structural_tag: must be a JSON object"), body
