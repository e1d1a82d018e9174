"""The adapters' tensor codecs and the vLLM-backend request semantics, without a server."""

from __future__ import annotations

import json
import struct

import pytest
from pagedserve.errors import InvalidRequestError
from pagedserve_adapters import tensors
from pagedserve_adapters.llm_model import Completion, Tensor, parse_request


def text(prompt: str = "Hi") -> Tensor:
    return Tensor("text_input", "BYTES", [1], [prompt.encode()])


def flag(name: str, value: bool) -> Tensor:
    return Tensor(name, "BOOL", [1], [value])


def sampling(params: object) -> Tensor:
    return Tensor("sampling_parameters", "BYTES", [1], [json.dumps(params).encode()])


def test_bytes_round_trip_with_length_prefix() -> None:
    raw = tensors.encode_bytes([b"ab", "\u00e9", b""])
    assert raw == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 2) + "\u00e9".encode() + struct.pack(
        "<I", 0
    )
    assert tensors.decode_raw("x", "BYTES", [3], raw) == [b"ab", "\u00e9".encode(), b""]


@pytest.mark.parametrize(
    ("datatype", "shape", "data", "message"),
    [
        ("BYTES", [1], b"\x05\x00\x00\x00ab", "runs past the end"),
        ("BYTES", [1], b"\x01\x00", "length prefix"),
        ("BYTES", [2], tensors.encode_bytes([b"a"]), "needs 2"),
        ("INT32", [1], b"\x00\x00\x00", "whole number"),
        ("BOOL", [-1], b"\x01", "negative"),
    ],
)
def test_raw_decoding_errors_name_the_tensor(
    datatype: str, shape: list[int], data: bytes, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        tensors.decode_raw("inputs.x", datatype, shape, data)
    assert info.value.field.startswith("inputs.x")


def test_numeric_raw_and_json_forms() -> None:
    assert tensors.decode_raw("x", "UINT32", [2], tensors.encode_raw("UINT32", [3, 70000])) == [3, 70000]
    assert tensors.decode_raw("x", "BOOL", [1], b"\x01") == [True]
    assert tensors.decode_json("x", "BYTES", [1, 1], [["hi"]]) == [b"hi"]
    with pytest.raises(InvalidRequestError, match="not a BOOL"):
        tensors.decode_json("x", "BOOL", [1], [1])


def test_typed_contents_are_read_from_the_datatype_field() -> None:
    from types import SimpleNamespace

    contents = SimpleNamespace(bytes_contents=[b"hi"], bool_contents=[True, False], int_contents=[1])
    assert tensors.decode_contents("x", "BYTES", [1], contents) == [b"hi"]
    assert tensors.decode_contents("x", "BOOL", [2], contents) == [True, False]
    with pytest.raises(InvalidRequestError, match="holds 1 INT32 elements but its shape \\[2\\] needs 2"):
        tensors.decode_contents("inputs.x", "INT32", [2], contents)
    with pytest.raises(InvalidRequestError, match="must be sent in raw_input_contents") as info:
        tensors.decode_contents("inputs.x", "FP16", [1], contents)
    assert info.value.field == "inputs.x"


def test_defaults_follow_the_vllm_backend() -> None:
    plain = parse_request([text()], {})
    assert not plain.stream and not plain.exclude_input and plain.outputs == ("text_output",)
    assert plain.params.max_tokens == 16
    streamed = parse_request([text(), flag("stream", True)], {})
    assert streamed.stream and streamed.exclude_input  # the prompt is not streamed back


def test_sampling_parameters_accept_strings_and_fall_back_to_request_parameters() -> None:
    req = parse_request(
        [text(), sampling({"temperature": "0.5", "max_tokens": "7", "stop": "\n", "ignore_eos": "true"})], {}
    )
    assert (req.params.temperature, req.params.max_tokens, req.params.stop, req.params.ignore_eos) == (
        0.5,
        7,
        ["\n"],
        True,
    )
    from_parameters = parse_request(
        [text()], {"max_tokens": 5, "stream": True, "triton_enable_empty_final_response": True}
    )
    assert from_parameters.params.max_tokens == 5 and from_parameters.stream


def test_return_switches_select_outputs_and_logprobs() -> None:
    req = parse_request([text(), flag("return_num_output_tokens", True), flag("return_logprobs", True)], {})
    assert req.outputs == ("text_output", "logprobs", "num_output_tokens")
    assert req.params.logprobs == 0  # the sampled tokens' logprobs are computed for the output
    assert parse_request([text()], {}, ["finish_reason"]).outputs == ("finish_reason",)


@pytest.mark.parametrize(
    ("inputs", "parameters", "outputs", "field"),
    [
        ([], {}, [], "inputs.text_input"),
        ([text("")], {}, [], "inputs.text_input"),
        ([Tensor("text_input", "INT32", [1], [1])], {}, [], "inputs.text_input.datatype"),
        ([Tensor("text_input", "BYTES", [2], [b"a", b"b"])], {}, [], "inputs.text_input.shape"),
        ([Tensor("text_input", "BYTES", [1], [b"\xff"])], {}, [], "inputs.text_input"),
        ([text(), Tensor("image", "BYTES", [1], [b""])], {}, [], "inputs.image"),
        ([text(), sampling([1])], {}, [], "sampling_parameters"),
        ([text(), sampling({"top_k": -2})], {}, [], "sampling_parameters.top_k"),
        ([text(), sampling({"top_k": "2.5"})], {}, [], "sampling_parameters.top_k"),
        ([text(), sampling({"temperature": "warm"})], {}, [], "sampling_parameters.temperature"),
        ([text(), sampling({"best_of": 2})], {}, [], "sampling_parameters.best_of"),
        (
            [text(), flag("stream", True), flag("exclude_input_in_output", False)],
            {},
            [],
            "inputs.exclude_input_in_output",
        ),
        ([text()], {"stream": "yes"}, [], "inputs.stream"),
        ([text()], {}, ["embeddings"], "outputs.embeddings"),
    ],
)
def test_invalid_requests_name_their_field(
    inputs: list[Tensor], parameters: dict[str, object], outputs: list[str], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(inputs, parameters, outputs)
    assert info.value.field == field


def test_completion_builds_stream_and_final_outputs() -> None:
    from pagedserve.outputs import RequestDelta, RequestMetrics

    req = parse_request(
        [text("Q:"), flag("return_finish_reason", True), flag("return_num_output_tokens", True)], {}
    )
    completion = Completion(req)

    def delta(new: str, ids: list[int], reason: str | None) -> RequestDelta:
        return RequestDelta("r", ids, new, None, reason is not None, reason, 2, len(ids), RequestMetrics(0.0))

    first = delta(" a", [5], None)
    completion.add(first)
    assert [t.values for t in completion.step_outputs(first)] == [[b" a"], [b"None"], [1]]
    completion.add(delta(" b", [6, 7], "eos"))
    final = {t.name: t.values for t in completion.final_outputs()}
    assert final == {"text_output": [b"Q: a b"], "finish_reason": [b"stop"], "num_output_tokens": [3]}
