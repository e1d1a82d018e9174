"""Beam search through the KServe v2 / Triton adapters (`"use_beam_search": true` in
`sampling_parameters`, as Triton's vLLM backend takes it): ModelInfer, REST infer and /generate return
the n beams that offline `LLM.beam_search` finds on the same model and prompt, best first, as any n > 1
request's n completions; a ModelStreamInfer stream and /generate_stream send one response per beam, in
an n > 1 stream's shape; n=1 is greedy decoding; every field beam search would not honour, n out of
range, length_penalty without it and a use_beam_search that is no JSON boolean are refused naming the
field, and the server serves on. Real tritonclient (gRPC and HTTP) and raw HTTP against a real server
(the in-process one test_grpc_beam_search.py runs, with the adapters on its ports), on the tiny Llama
whose EOS it emits, so that beams end both ways (EOS and length)."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from grpc_helpers import metric_sample
from inprocess_server import InProcessServer, is_idle, wait_for
from pagedserve import LLM
from pagedserve.beam_search import BeamSearchOutput
from test_grpc_beam_search import (
    LONG_SEARCH_TOKENS,
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    SETTINGS,
    eos_model_dir,
    llm,
    offline,
)
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow

__all__ = ["eos_model_dir", "llm"]  # fixtures shared with test_grpc_beam_search.py
K = 3
OUTPUTS = ("text_output", "finish_reason", "cumulative_logprob", "num_output_tokens")


@pytest.fixture(scope="module")
def server(eos_model_dir: str) -> Iterator[InProcessServer]:
    srv = InProcessServer(eos_model_dir, None, served_model_name=MODEL, **SETTINGS).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: InProcessServer) -> Iterator[tgrpc.InferenceServerClient]:
    with tgrpc.InferenceServerClient(f"127.0.0.1:{server.port}") as c:
        yield c


def beam_parameters(n: int = K, **more: Any) -> dict[str, Any]:
    return {"use_beam_search": True, "n": n, "temperature": 0, "max_tokens": MAX_TOKENS, **more}


def triton_inputs(module: Any, prompt: str, sampling: dict[str, Any], **flags: bool) -> list[Any]:
    """`module`: tritonclient.grpc or tritonclient.http, whose InferInput each takes the same way."""
    inputs = []
    for name, value in (
        ("text_input", prompt.encode()),
        ("sampling_parameters", json.dumps(sampling).encode()),
    ):
        tensor = module.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value], dtype=object))
        inputs.append(tensor)
    for name, flag in flags.items():
        tensor = module.InferInput(name, [1], "BOOL")
        tensor.set_data_from_numpy(np.array([flag]))
        inputs.append(tensor)
    return inputs


def requested(module: Any) -> list[Any]:
    return [module.InferRequestedOutput(name) for name in OUTPUTS]


def want_outputs(llm: LLM, prompt: str, want: BeamSearchOutput, prefix: str) -> dict[str, list[Any]]:
    """The offline beams as the adapter's outputs: each beam's generated text (an ending EOS's left
    out, skip_special_tokens being the default) after `prefix`, its vLLM finish reason, its cumulative
    logprob and its number of generated tokens."""
    tokenizer, num_prompt = llm.get_tokenizer(), len(llm.get_tokenizer().encode(prompt))
    out: dict[str, list[Any]] = {name: [] for name in OUTPUTS}
    for beam in want.sequences:
        generated, ends_with_eos = beam.tokens[num_prompt:], beam.finish_reason == "stop"
        text = tokenizer.decode(generated[:-1] if ends_with_eos else generated, skip_special_tokens=True)
        out["text_output"].append(prefix + text)
        out["finish_reason"].append("stop" if ends_with_eos else "length")
        out["cumulative_logprob"].append(beam.cum_logprob)
        out["num_output_tokens"].append(len(generated))
    return out


def got_outputs(result: Any) -> dict[str, list[Any]]:
    """A tritonclient InferResult's outputs as plain lists."""
    out: dict[str, list[Any]] = {}
    for name in OUTPUTS:
        values = result.as_numpy(name)
        out[name] = [v.decode() if isinstance(v, bytes) else v.item() for v in values]
    return out


def check(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    for name in ("text_output", "finish_reason", "num_output_tokens"):
        assert got[name] == want[name], name
    assert got["cumulative_logprob"] == pytest.approx(want["cumulative_logprob"], abs=1e-4)
    assert len(set(got["text_output"])) == len(got["text_output"])  # K different beams
    assert want["cumulative_logprob"][-1] < 0  # real values, not the 0.0 of a request without them


def post(server: InProcessServer, path: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(server.http_url(path), data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_model_infer_rest_infer_and_generate_return_the_offline_beams(
    server: InProcessServer, llm: LLM, client: tgrpc.InferenceServerClient
) -> None:
    """PROMPTS[0]'s best beam ends with the EOS after two tokens, the others run to max_tokens;
    PROMPTS[1]'s all run to max_tokens. The prompt is prepended unless exclude_input_in_output."""
    for prompt in PROMPTS:
        want = offline(llm, prompt, K)
        with_prompt, without = want_outputs(llm, prompt, want, prompt), want_outputs(llm, prompt, want, "")
        grpc_result = client.infer(
            MODEL, triton_inputs(tgrpc, prompt, beam_parameters()), outputs=requested(tgrpc)
        )
        check(got_outputs(grpc_result), with_prompt)
        excluded = client.infer(
            MODEL,
            triton_inputs(tgrpc, prompt, beam_parameters(), exclude_input_in_output=True),
            outputs=requested(tgrpc),
        )
        check(got_outputs(excluded), without)
        with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
            http_result = http.infer(
                MODEL, triton_inputs(thttp, prompt, beam_parameters()), outputs=requested(thttp)
            )
        check(got_outputs(http_result), with_prompt)
        switches = {f"return_{name}": True for name in OUTPUTS[1:]}
        body = {"text_input": prompt, "parameters": {**beam_parameters(), **switches}}
        status, text = post(server, f"/v2/models/{MODEL}/generate", body)
        assert status == 200, text
        check(json.loads(text), with_prompt)
    assert offline(llm, PROMPTS[0], K).sequences[0].finish_reason == "stop"


def test_streams_send_each_beam_as_an_n_above_1_stream_sends_a_completion(
    server: InProcessServer, llm: LLM, client: tgrpc.InferenceServerClient
) -> None:
    """ModelStreamInfer with stream true and /generate_stream: one response per beam, best first, its
    tensors n long with the beam's text and counts at its rank and nothing at the others', the last
    one final. Fields at the values that leave them off (as a client filling in every field sends
    them) are served."""
    prompt = PROMPTS[0]
    want = want_outputs(llm, prompt, offline(llm, prompt, K), "")
    sampling = beam_parameters(top_p=1.0, top_k=-1, min_tokens=0, stop=[], length_penalty=1.0)
    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(
            MODEL,
            triton_inputs(tgrpc, prompt, sampling, stream=True),
            request_id="beams",
            outputs=requested(tgrpc),
        )
        streamed = [responses.get(timeout=120) for _ in range(K)]
    finally:
        client.stop_stream()
    assert [error for _, error in streamed] == [None] * K
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in streamed]
    assert finals == [False] * (K - 1) + [True]
    status, text = post(
        server,
        f"/v2/models/{MODEL}/generate_stream",
        {"text_input": prompt, "parameters": {**sampling, "return_num_output_tokens": True}},
    )
    assert status == 200, text
    events = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line]
    assert len(events) == K
    for rank in range(K):
        grpc_out = got_outputs(streamed[rank][0])
        for got in (grpc_out, {name: events[rank][name] for name in ("text_output", "num_output_tokens")}):
            assert got["text_output"] == [want["text_output"][rank] if i == rank else "" for i in range(K)]
            assert got["num_output_tokens"] == [
                want["num_output_tokens"][rank] if i == rank else 0 for i in range(K)
            ]
        assert grpc_out["finish_reason"][rank] == want["finish_reason"][rank]
        assert grpc_out["cumulative_logprob"][rank] == pytest.approx(
            want["cumulative_logprob"][rank], abs=1e-4
        )
        assert streamed[rank][0].get_response().id == "beams"


def test_n_1_is_greedy_decoding(client: tgrpc.InferenceServerClient) -> None:
    prompt = PROMPTS[1]  # no EOS within MAX_TOKENS
    greedy = client.infer(MODEL, triton_inputs(tgrpc, prompt, {"temperature": 0, "max_tokens": MAX_TOKENS}))
    beam = client.infer(MODEL, triton_inputs(tgrpc, prompt, beam_parameters(n=1)))
    text = greedy.as_numpy("text_output")[0].decode()
    assert beam.as_numpy("text_output").tolist() == [text.encode()] and len(text) > len(prompt)


REFUSED = [  # (sampling parameters, switches, field, the refusal's words)
    ({"use_beam_search": "true"}, {}, "sampling_parameters.use_beam_search", "must be a JSON boolean"),
    ({"use_beam_search": 1}, {}, "sampling_parameters.use_beam_search", "must be a JSON boolean"),
    (beam_parameters(n=11), {}, "sampling_parameters.n", "is the beam width"),
    (beam_parameters(n=0), {}, "sampling_parameters.n", "is the beam width"),
    ({"length_penalty": 2.0}, {}, "sampling_parameters.length_penalty", "needs use_beam_search true"),
    (
        {"use_beam_search": False, "length_penalty": 0.5},
        {},
        "sampling_parameters.length_penalty",
        "needs use_beam_search true",
    ),
    (beam_parameters(top_p=0.5), {}, "sampling_parameters.top_p", "does not honour it"),
    (beam_parameters(seed=7), {}, "sampling_parameters.seed", "does not honour it"),
    (beam_parameters(stop=["."]), {}, "sampling_parameters.stop", "does not honour it"),
    (beam_parameters(logprobs=1), {}, "sampling_parameters.logprobs", "does not honour it"),
    (
        beam_parameters(guided_decoding={"regex": "[0-9]+"}),
        {},
        "sampling_parameters.guided_decoding",
        "does not honour it",
    ),
    (beam_parameters(), {"return_logprobs": True}, "inputs.return_logprobs", "no per-token logprobs"),
]


@pytest.mark.parametrize(
    ("sampling", "flags", "field", "words"), REFUSED, ids=[f"{i}-{case[2]}" for i, case in enumerate(REFUSED)]
)
def test_a_refusal_names_the_field_and_the_server_serves_on(
    server: InProcessServer,
    client: tgrpc.InferenceServerClient,
    sampling: dict[str, Any],
    flags: dict[str, bool],
    field: str,
    words: str,
) -> None:
    """INVALID_ARGUMENT on ModelInfer, an error_message on the stream, 400 on REST infer and /generate,
    each naming the field (`parameters.<name>` sent to /generate reach the same sampling parameters)."""
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, triton_inputs(tgrpc, "Hi", sampling, **flags))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert caught.value.message().startswith(f"{field}: ") and words in caught.value.message()

    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(MODEL, triton_inputs(tgrpc, "Hi", sampling, stream=True, **flags))
        _, error = responses.get(timeout=60)
    finally:
        client.stop_stream()
    assert error is not None and error.message().startswith(f"{field}: ") and words in error.message()

    status, message = http_refusal(server, triton_inputs(thttp, "Hi", sampling, **flags))
    assert status == "400" and f"{field}: " in message
    status, text = post(
        server, f"/v2/models/{MODEL}/generate", {"text_input": "Hi", "parameters": {**sampling, **flags}}
    )
    assert status == 400 and json.loads(text)["error"].startswith(f"{field}: ") and words in text

    served = client.infer(MODEL, triton_inputs(tgrpc, "Hi", beam_parameters(n=2, max_tokens=2)))
    assert len(served.as_numpy("text_output")) == 2


def http_refusal(server: InProcessServer, inputs: list[Any]) -> tuple[str, str]:
    """tritonclient.http's refusal of the inputs: its status and message. The exception's traceback is
    dropped: through tritonclient's frame that raised it (a local holding the exception) it made a
    reference cycle holding the client, which the collector then freed on some other thread, closing
    the client again there (gevent's InvalidThreadUseError in the tests' warnings)."""
    with thttp.InferenceServerClient(f"127.0.0.1:{server.http_port}") as http:
        try:
            http.infer(MODEL, inputs)
        except InferenceServerException as exc:
            exc.__traceback__ = None  # tritonclient's frame holding `exc`: the cycle
            return str(exc.status()), exc.message()
    raise AssertionError("tritonclient.http's request was served, not refused")


def test_a_search_past_its_triton_timeout_is_aborted_as_a_deadline_once(
    server: InProcessServer, client: tgrpc.InferenceServerClient
) -> None:
    """Triton's request `timeout` (microseconds) ends a search still running its rounds: DEADLINE_EXCEEDED,
    nothing of it left running, and one deadline abort counted, the search's (its rounds' requests,
    mostly finished when the deadline comes, count none)."""

    def deadline_aborts() -> float:
        return metric_sample(
            server.http_port, "pagedserve:request_aborts_total", model_name=MODEL, cause="deadline"
        )

    wait_for(lambda: is_idle(server), what="an idle engine")
    before = deadline_aborts()
    sampling = beam_parameters(2, max_tokens=LONG_SEARCH_TOKENS, ignore_eos=True)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(MODEL, triton_inputs(tgrpc, PROMPTS[0], sampling), timeout=500_000)
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "Request timeout expired (500000 us)" in caught.value.message()
    wait_for(lambda: is_idle(server), what="nothing of the search left running")
    wait_for(lambda: deadline_aborts() == before + 1, what="the deadline abort counted")
    assert deadline_aborts() == before + 1
