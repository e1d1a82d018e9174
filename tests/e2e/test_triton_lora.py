"""LoRA adapters through the KServe v2 / Triton front ends (in-process server serving two PEFT adapters
of the tiny model, real tritonclient, real HTTP): `lora_name` in the `sampling_parameters` JSON or the
request's parameters, as Triton's vLLM backend takes it, runs the request through that adapter; an
unknown adapter or a name that is not a string is refused at once, naming lora_name."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from inprocess_server import InProcessServer, is_idle, post_generate, wait_for
from lora_serving import MODEL, build_adapters, offline, start_server

PROMPT = "Name a color."
MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_adapters(tmp_path_factory.mktemp("lora"), tiny_llama_dir)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: str, adapters: dict[str, str]) -> dict[str | None, str]:
    """Offline LLM's greedy completion of PROMPT per adapter name (None: the base model)."""
    names: list[str | None] = ["sql", "chat", None]
    outputs = offline(tiny_llama_dir, adapters, [(PROMPT, name) for name in names], MAX_TOKENS)
    texts = {name: out.text for name, out in zip(names, outputs)}
    assert len(set(texts.values())) == 3, texts  # each adapter says something else
    return texts


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: str, adapters: dict[str, str]) -> Iterator[InProcessServer]:
    server = start_server(tiny_llama_dir, adapters)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _idle_after(srv: InProcessServer) -> Iterator[None]:
    yield
    wait_for(lambda: is_idle(srv), what="an idle engine")


def text_input() -> Any:
    import tritonclient.grpc as tgrpc

    text = tgrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
    return text


def sampling_input(params: dict[str, Any]) -> Any:
    import tritonclient.grpc as tgrpc

    sampling = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    return sampling


def stream_inputs(params: dict[str, Any]) -> list[Any]:
    import tritonclient.grpc as tgrpc

    stream = tgrpc.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    return [text_input(), stream, sampling_input(params)]


def stream_requests(
    srv: InProcessServer, requests: list[tuple[str, list[Any], dict[str, Any]]]
) -> dict[str, Any]:
    """Send (id, inputs, request parameters) requests on one tritonclient stream: each id's text, or the
    error message its stream error carried."""
    import tritonclient.grpc as tgrpc

    responses: queue.Queue[Any] = queue.Queue()
    got: dict[str, Any] = {rid: "" for rid, _, _ in requests}
    with tgrpc.InferenceServerClient(f"127.0.0.1:{srv.port}") as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        for rid, inputs, parameters in requests:
            client.async_stream_infer(MODEL, inputs, request_id=rid, parameters=parameters or None)
        finals = 0
        while finals < len(requests):
            result, error = responses.get(timeout=60)
            if error is not None:
                # tritonclient hands a stream error over without its request's id: one error per test
                got["error"] = error.message()
                finals += 1
                continue
            response = result.get_response()
            got[response.id] += "".join(t.decode() for t in result.as_numpy("text_output"))
            finals += response.parameters["triton_final_response"].bool_param
        client.stop_stream()
    return got


def test_a_stream_runs_through_the_adapter_its_sampling_parameters_name(
    srv: InProcessServer, expected: dict[str | None, str]
) -> None:
    """The vLLM backend's way: `lora_name` in the sampling_parameters JSON; several adapters and the
    base model on one stream."""
    got = stream_requests(
        srv,
        [
            ("sql", stream_inputs({**GREEDY, "lora_name": "sql"}), {}),
            ("chat", stream_inputs({**GREEDY, "lora_name": "chat"}), {}),
            ("base", stream_inputs(GREEDY), {}),
        ],
    )
    assert got == {"sql": expected["sql"], "chat": expected["chat"], "base": expected[None]}


def test_without_sampling_parameters_the_request_parameters_name_the_adapter(
    srv: InProcessServer, expected: dict[str | None, str]
) -> None:
    """No sampling_parameters tensor: the request's parameters are the sampling parameters, lora_name
    among them (not streamed: one response, the prompt before the completion)."""
    got = stream_requests(srv, [("p", [text_input()], {**GREEDY, "lora_name": "chat"})])
    assert got == {"p": PROMPT + expected["chat"]}


@pytest.mark.parametrize(
    ("lora_name", "message"),
    [("nope", "unknown adapter 'nope'"), (5, "sampling_parameters.lora_name: must be a string")],
)
def test_a_bad_lora_name_is_an_error_naming_it_and_the_stream_goes_on(
    srv: InProcessServer, expected: dict[str | None, str], lora_name: Any, message: str
) -> None:
    got = stream_requests(
        srv,
        [
            ("bad", stream_inputs({**GREEDY, "lora_name": lora_name}), {}),
            ("good", stream_inputs({**GREEDY, "lora_name": "sql"}), {}),
        ],
    )
    assert "lora_name" in got["error"] and message in got["error"], got["error"]
    assert got["bad"] == "" and got["good"] == expected["sql"]


def test_model_infer_refuses_an_unknown_adapter_as_invalid_argument(srv: InProcessServer) -> None:
    import tritonclient.grpc as tgrpc
    from tritonclient.utils import InferenceServerException

    with (
        tgrpc.InferenceServerClient(f"127.0.0.1:{srv.port}") as client,
        pytest.raises(InferenceServerException) as refused,
    ):
        client.infer(MODEL, [text_input(), sampling_input({**GREEDY, "lora_name": "nope"})])
    assert refused.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert "lora_name" in refused.value.message() and "unknown adapter 'nope'" in refused.value.message()


def test_kserve_rest_generate_takes_lora_name_in_its_parameters(
    srv: InProcessServer, expected: dict[str | None, str]
) -> None:
    status, body = post_generate(
        srv, MODEL, {"text_input": PROMPT, "parameters": {**GREEDY, "lora_name": "sql"}}
    )
    assert status == 200, body
    assert body["text_output"] == PROMPT + expected["sql"]
    for lora_name, message in (("nope", "unknown adapter 'nope'"), (["sql"], "must be a string")):
        status, body = post_generate(
            srv, MODEL, {"text_input": PROMPT, "parameters": {**GREEDY, "lora_name": lora_name}}
        )
        assert status == 400, body
        assert "lora_name" in body["error"] and message in body["error"], body
