"""Beam search over gRPC (`sampling.use_beam_search`, vLLM's online beam search): Generate streams and
Complete returns the n beams that offline `LLM.beam_search` finds on the same model and prompt, best
first, token for token, with their generated part's text; n=1 is greedy decoding; length_penalty
reaches the ranking; a client that cancels mid-search, or an Abort call of its id, leaves nothing
running; every field beam search would not honour is INVALID_ARGUMENT naming it.

One in-process server and one offline LLM on the tiny Llama whose generation_config names an EOS it
emits (the second greedy token of PROMPTS[0], as tests/engine/test_beam_search.py does), so that beams
end both ways, EOS and length, and whose context is long enough for a search that outlasts any
check below."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_helpers import (
    IDLE_AFTER_ABORT_S,
    LONG_NUM_KV_BLOCKS,
    ServerProcess,
    long_context_copy,
    metric_sample,
    wait_until,
)
from inprocess_server import InProcessServer, abort_leftovers, is_idle, wait_for
from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.beam_search import BeamSearchOutput
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

MODEL = "tiny"
PROMPTS = ["The capital of France is", "Once upon a time in a land far away there lived a very old king who"]
MAX_TOKENS = 10
QUESTION = pb.ChatMessage(role="user", content="What is the weather like in Paris today?")
WEATHER = pb.Tool(name="get_weather", parameters=json.dumps({"type": "object"}))
SETTINGS: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": LONG_NUM_KV_BLOCKS, "block_size": 16}
# A search this long takes tens of seconds here (n=4, 300 tokens: 1.3 s on the 2-core host, each round
# slower as the context grows): one that is idle within IDLE_AFTER_ABORT_S of its cancel was stopped.
LONG_SEARCH_TOKENS = 8000
SHUTDOWN_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def eos_model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    plain = LLM(model=tiny_llama_dir, **SETTINGS)
    greedy = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eos, tokenizer_eos = greedy[0].outputs[0].token_ids[1], plain.get_tokenizer().eos_token_id
    dest = tmp_path_factory.mktemp("tiny-eos")
    long_context_copy(tiny_llama_dir, dest)
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, tokenizer_eos]}))
    return str(dest)


@pytest.fixture(scope="module")
def llm(eos_model_dir: str) -> LLM:
    return LLM(model=eos_model_dir, **SETTINGS)


@pytest.fixture(scope="module")
def server(eos_model_dir: str) -> Iterator[InProcessServer]:
    srv = InProcessServer(eos_model_dir, None, served_model_name=MODEL, **SETTINGS).start()
    yield srv
    srv.stop()


def beam_request(prompt: str = PROMPTS[0], request_id: str = "", **sampling: Any) -> pb.GenerateRequest:
    fields = {"use_beam_search": True, "temperature": 0.0, "max_tokens": MAX_TOKENS, **sampling}
    return pb.GenerateRequest(request_id=request_id, text=prompt, sampling=pb.SamplingParameters(**fields))


def offline(llm: LLM, prompt: str | list[int], k: int, **params: Any) -> BeamSearchOutput:
    [output] = llm.beam_search([prompt], BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, **params))
    return output


def check_beams(
    llm: LLM, prompt_ids: list[int], want: BeamSearchOutput, got: list[pb.GenerateResponse]
) -> None:
    """The responses are the offline beams, in order: the generated ids, their text without an ending
    EOS's (skip_special_tokens, the default), the counts and the finish reason."""
    tokenizer, eos_ids = llm.get_tokenizer(), llm.engine.eos_token_ids
    assert [r.index for r in got] == list(range(len(want.sequences)))
    for beam, response in zip(want.sequences, got, strict=True):
        generated = beam.tokens[len(prompt_ids) :]
        ends_with_eos = beam.finish_reason == "stop"
        assert list(response.token_ids) == generated
        assert response.text == tokenizer.decode(
            generated[:-1] if ends_with_eos else generated, skip_special_tokens=True
        )
        assert response.finish_reason == (pb.EOS if ends_with_eos else pb.LENGTH)
        assert not ends_with_eos or generated[-1] in eos_ids
        assert (response.prompt_tokens, response.completion_tokens) == (len(prompt_ids), len(generated))
        assert response.request_id and response.error == ""


@pytest.mark.parametrize("k", [2, 4])
def test_generate_and_complete_return_the_offline_beams(server: InProcessServer, llm: LLM, k: int) -> None:
    """PROMPTS[0] has a beam that ends with the EOS after two tokens (it ranks first) and beams that run
    to max_tokens; PROMPTS[1] none that end early."""
    for prompt in PROMPTS:
        prompt_ids = llm.get_tokenizer().encode(prompt)
        want = offline(llm, prompt, k)
        streamed = list(server.stub.Generate(beam_request(prompt, n=k), timeout=120))
        check_beams(llm, prompt_ids, want, streamed)
        completed = server.stub.Complete(beam_request(prompt, n=k), timeout=120).completions
        check_beams(llm, prompt_ids, want, list(completed))
    assert [b.finish_reason for b in offline(llm, PROMPTS[0], k).sequences][:2] == ["stop", "length"]


def test_a_chat_is_searched_from_its_template_s_prompt(server: InProcessServer, llm: LLM) -> None:
    messages = [{"role": "user", "content": QUESTION.content}]
    prompt_ids = llm.engine.encode_chat(messages)
    req = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[QUESTION]),
        sampling=pb.SamplingParameters(use_beam_search=True, n=3, temperature=0.0, max_tokens=MAX_TOKENS),
    )
    check_beams(llm, prompt_ids, offline(llm, prompt_ids, 3), list(server.stub.Generate(req, timeout=120)))


def test_n_1_is_greedy_decoding(server: InProcessServer) -> None:
    """Width 1 keeps the best token each round. With an EOS reached (PROMPTS[0]'s second token) the
    finished beam ranks first at length_penalty 0, as greedy decoding stops there."""
    cases = [(PROMPTS[0], {"length_penalty": 0.0}), (PROMPTS[1], {"ignore_eos": True})]
    for prompt, fields in cases:
        greedy_fields = {k: v for k, v in fields.items() if k != "length_penalty"}
        greedy = pb.GenerateRequest(
            text=prompt,
            sampling=pb.SamplingParameters(temperature=0.0, max_tokens=MAX_TOKENS, **greedy_fields),
        )
        want = server.stub.Complete(greedy, timeout=120).completions[0]
        [got] = list(server.stub.Generate(beam_request(prompt, n=1, **fields), timeout=120))
        assert list(got.token_ids) == list(want.token_ids) and got.text == want.text and got.text
        assert got.finish_reason == want.finish_reason
    assert want.finish_reason == pb.LENGTH and len(want.token_ids) == MAX_TOKENS
    first = server.stub.Complete(
        pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParameters(temperature=0.0))
    )
    assert first.completions[0].finish_reason == pb.EOS and len(first.completions[0].token_ids) == 2


def test_length_penalty_changes_the_ranking_as_offline(server: InProcessServer, llm: LLM) -> None:
    """At 0 the short EOS beam of PROMPTS[0] ranks first; at 4 long beams, whose length divides their
    (negative) cumulative logprob by far more, rank above it."""
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    orders = []
    for penalty in (0.0, 4.0):
        want = offline(llm, PROMPTS[0], 3, length_penalty=penalty)
        got = list(server.stub.Generate(beam_request(n=3, length_penalty=penalty), timeout=120))
        check_beams(llm, prompt_ids, want, got)
        orders.append([list(r.token_ids) for r in got])
    assert orders[0] != orders[1] and len(orders[0][0]) == 2 and len(orders[1][0]) == MAX_TOKENS


def test_include_stop_str_in_output_keeps_the_eos_s_text(server: InProcessServer, llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    [short, *_] = list(server.stub.Generate(beam_request(n=2, include_stop_str_in_output=True), timeout=120))
    assert short.finish_reason == pb.EOS and short.text == tokenizer.decode(list(short.token_ids))
    assert short.text != tokenizer.decode(list(short.token_ids)[:-1])


def long_search(request_id: str) -> pb.GenerateRequest:
    return beam_request(request_id=request_id, n=2, max_tokens=LONG_SEARCH_TOKENS, ignore_eos=True)


def num_finished(srv: InProcessServer | ServerProcess, model: str = MODEL) -> float:
    """The engine's requests finished at max_tokens: a search's rounds, one each per beam."""
    return metric_sample(
        srv.http_port, "vllm:request_success_total", model_name=model, finished_reason="length"
    )


def wait_mid_search(srv: InProcessServer, request_id: str) -> None:
    """Until the search has run some rounds, its id live."""
    before = num_finished(srv)
    wait_for(lambda: num_finished(srv) >= before + 8, what="rounds")
    assert request_id in srv.server.engine.live_request_ids()


def aborts(srv: InProcessServer, cause: str) -> float:
    return metric_sample(srv.http_port, "pagedserve:request_aborts_total", model_name=MODEL, cause=cause)


def client_cancels(srv: InProcessServer) -> float:
    return aborts(srv, "client_cancel")


def test_a_client_that_cancels_mid_search_leaves_nothing_running(server: InProcessServer, llm: LLM) -> None:
    """Idle (no request, every KV block free, no stream, no search) within IDLE_AFTER_ABORT_S of the
    cancel, and still so a moment later: no round started after it. (Between two rounds the search
    itself counts as live, so an idle engine is not a search between rounds.)"""
    wait_for(lambda: is_idle(server), what="an idle engine")
    cancels = client_cancels(server)
    try:
        call = server.stub.Generate(long_search("cancelled-search"), timeout=120)
        wait_mid_search(server, "cancelled-search")
        assert server.stub.Health(pb.HealthRequest()).num_in_flight == 1  # the search, not its rounds
        call.cancel()
        assert wait_until(lambda: is_idle(server), IDLE_AFTER_ABORT_S), server.llm.stats()
        assert server.stub.Health(pb.HealthRequest()).num_in_flight == 0
        # counted once, as the search, not as its round's requests (most of them already finished)
        assert wait_until(lambda: client_cancels(server) == cancels + 1, 5), client_cancels(server) - cancels
        finished = num_finished(server)
        time.sleep(0.5)
        assert is_idle(server) and num_finished(server) == finished
        assert finished < 2 * LONG_SEARCH_TOKENS
        stats = server.llm.stats()
        assert stats.num_unfinished == 0 and stats.num_free_blocks == stats.num_total_blocks
        again = beam_request(request_id="cancelled-search", n=2)  # its id free again, the engine serving
        got = list(server.stub.Generate(again, timeout=120))
        check_beams(llm, llm.get_tokenizer().encode(PROMPTS[0]), offline(llm, PROMPTS[0], 2), got)
    finally:
        abort_leftovers(server)


def test_an_abort_call_ends_the_search_aborted(server: InProcessServer) -> None:
    wait_for(lambda: is_idle(server), what="an idle engine")
    abort_calls, cancels = aborts(server, "abort_rpc"), client_cancels(server)
    try:
        call = server.stub.Generate(long_search("aborted-search"), timeout=120)
        wait_mid_search(server, "aborted-search")
        with pytest.raises(grpc.RpcError) as duplicate:  # its id is held for the whole search
            list(server.stub.Generate(beam_request(request_id="aborted-search"), timeout=60))
        assert duplicate.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert duplicate.value.details().startswith("request_id: ")
        answer = server.stub.Abort(pb.AbortRequest(request_ids=["aborted-search"]), timeout=30)
        assert list(answer.aborted_request_ids) == ["aborted-search"]
        [last] = list(call)
        assert last.finish_reason == pb.ABORTED and last.error == "aborted by an Abort call"
        assert last.request_id == "aborted-search" and not last.token_ids
        assert wait_until(lambda: is_idle(server), IDLE_AFTER_ABORT_S), server.llm.stats()
        assert (aborts(server, "abort_rpc"), client_cancels(server)) == (abort_calls + 1, cancels)
    finally:
        abort_leftovers(server)


def test_a_failed_step_mid_search_ends_it_with_internal(server: InProcessServer, llm: LLM) -> None:
    """A model fault fails the step's requests (the engine serves on): the search ends with the error,
    nothing of it left running, and the aborts of the round's other requests, if any, are not counted
    as a client's."""
    wait_for(lambda: is_idle(server), what="an idle engine")
    executor, cancels = server.llm.executor, client_cancels(server)
    real = executor.execute

    def faulty(scheduler_output: Any) -> Any:
        """The next step that runs requests fails (not one that only drops finished ones)."""
        if not scheduler_output.scheduled:
            return real(scheduler_output)
        executor.execute = real
        raise RuntimeError("injected model fault")

    try:
        call = server.stub.Generate(long_search("failed-search"), timeout=120)
        wait_mid_search(server, "failed-search")
        executor.execute = faulty
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert "injected model fault" in caught.value.details(), caught.value.details()
        assert wait_until(lambda: is_idle(server), IDLE_AFTER_ABORT_S), server.llm.stats()
        assert client_cancels(server) == cancels
        got = list(server.stub.Generate(beam_request(n=2), timeout=120))
        check_beams(llm, llm.get_tokenizer().encode(PROMPTS[0]), offline(llm, PROMPTS[0], 2), got)
    finally:
        executor.execute = real
        abort_leftovers(server)


def test_a_full_queue_mid_search_ends_it_with_resource_exhausted(server: InProcessServer) -> None:
    """With one queued request allowed, the first round (one beam) is admitted and the second round's
    second beam is not: the search ends as that request was refused, its round's others aborted (by
    the server, not counted as a client's cancel)."""
    wait_for(lambda: is_idle(server), what="an idle engine")
    engine, cancels = server.server.engine, client_cancels(server)
    bound = engine.max_queued_requests
    engine.max_queued_requests = 1
    try:
        with pytest.raises(grpc.RpcError) as caught:
            list(server.stub.Generate(beam_request(n=4), timeout=60))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry later" in caught.value.details(), caught.value.details()
        assert wait_until(lambda: is_idle(server), IDLE_AFTER_ABORT_S), server.llm.stats()
        assert client_cancels(server) == cancels
    finally:
        engine.max_queued_requests = bound
        abort_leftovers(server)
    assert len(list(server.stub.Generate(beam_request(n=4), timeout=60))) == 4


def sampling(**fields: Any) -> pb.SamplingParameters:
    return pb.SamplingParameters(**{"use_beam_search": True, "max_tokens": 4, **fields})


def chat(**fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=[QUESTION], **fields), sampling=sampling())


REFUSED: list[tuple[str, pb.GenerateRequest]] = [
    ("n", pb.GenerateRequest(text="hi", sampling=sampling(n=11))),
    ("n", pb.GenerateRequest(text="hi", sampling=sampling(n=0))),
    ("n", pb.GenerateRequest(text="hi", sampling=sampling(n=-1))),
    ("top_p", pb.GenerateRequest(text="hi", sampling=sampling(top_p=0.9))),
    ("top_k", pb.GenerateRequest(text="hi", sampling=sampling(top_k=5))),
    ("min_p", pb.GenerateRequest(text="hi", sampling=sampling(min_p=0.1))),
    ("repetition_penalty", pb.GenerateRequest(text="hi", sampling=sampling(repetition_penalty=1.2))),
    ("presence_penalty", pb.GenerateRequest(text="hi", sampling=sampling(presence_penalty=0.5))),
    ("frequency_penalty", pb.GenerateRequest(text="hi", sampling=sampling(frequency_penalty=-0.5))),
    ("seed", pb.GenerateRequest(text="hi", sampling=sampling(seed=0))),
    ("min_tokens", pb.GenerateRequest(text="hi", sampling=sampling(min_tokens=2))),
    ("logprobs", pb.GenerateRequest(text="hi", sampling=sampling(logprobs=0))),
    ("prompt_logprobs", pb.GenerateRequest(text="hi", sampling=sampling(prompt_logprobs=0))),
    ("detokenize", pb.GenerateRequest(text="hi", sampling=sampling(detokenize=False))),
    ("stop", pb.GenerateRequest(text="hi", sampling=sampling(stop=["."]))),
    ("stop_token_ids", pb.GenerateRequest(text="hi", sampling=sampling(stop_token_ids=[13]))),
    ("logit_bias", pb.GenerateRequest(text="hi", sampling=sampling(logit_bias={13: 5.0}))),
    ("allowed_token_ids", pb.GenerateRequest(text="hi", sampling=sampling(allowed_token_ids=[13]))),
    ("bad_words", pb.GenerateRequest(text="hi", sampling=sampling(bad_words=["Paris"]))),
    (
        "structured_outputs",
        pb.GenerateRequest(
            text="hi", sampling=sampling(structured_outputs=pb.StructuredOutputs(regex="[a-z]+"))
        ),
    ),
    ("tools", chat(tools=[WEATHER])),
    ("tool_choice", chat(tools=[WEATHER], tool_choice="none")),
    ("tool_choice_function", chat(tools=[WEATHER], tool_choice_function="get_weather")),
    ("length_penalty", pb.GenerateRequest(text="hi", sampling=sampling(length_penalty=float("nan")))),
    ("length_penalty", pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(length_penalty=0.5))),
    (
        "length_penalty",
        pb.GenerateRequest(
            text="hi", sampling=pb.SamplingParameters(use_beam_search=False, length_penalty=2.0)
        ),
    ),
]


@pytest.mark.parametrize(("field", "req"), REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_what_beam_search_does_not_honour_is_refused_naming_the_field(
    server: InProcessServer, field: str, req: pb.GenerateRequest
) -> None:
    req.request_id = f"refused-{field}"
    calls = (
        lambda: list(server.stub.Generate(req, timeout=60)),
        lambda: server.stub.Complete(req, timeout=60),
    )
    for call in calls:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith(f"{field}: "), caught.value.details()
    served = beam_request(request_id=req.request_id, n=2, max_tokens=2)  # the refused call held nothing
    assert len(list(server.stub.Generate(served, timeout=60))) == 2


def test_values_that_change_nothing_are_served(server: InProcessServer, llm: LLM) -> None:
    """A field at the value that leaves it off (as a client that fills in every field sends it) is no
    refusal; truncate_prompt_tokens shapes the prompt before the search."""
    neutral = beam_request(
        PROMPTS[1],
        n=2,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
        detokenize=True,
        truncate_prompt_tokens=4,
    )
    tail = llm.get_tokenizer().encode(PROMPTS[1])[-4:]
    check_beams(llm, tail, offline(llm, tail, 2), list(server.stub.Generate(neutral, timeout=60)))


def test_sigterm_drains_a_search_then_aborts_it(eos_model_dir: str, tmp_path: Path) -> None:
    """A real `pagedserve serve` (the engine in its own process, the default): a search that outlives
    --shutdown-timeout counts as in flight through the drain (also between its rounds), then ends
    ABORTED with the drain's message; the server exits cleanly."""
    flags = ["--model", eos_model_dir, "--dtype", "float32", "--block-size", "16"]
    flags += ["--num-kv-blocks", str(LONG_NUM_KV_BLOCKS), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    proc = ServerProcess(*flags, log=tmp_path / "server.log").wait_ready()
    try:
        call = proc.stub.Generate(long_search("drained-search"), timeout=120)
        # rounds finishing (each round's one-token requests finish in the step that runs them: the
        # engine's running count reads 0 between steps)
        wait_for(lambda: num_finished(proc, Path(eos_model_dir).name) >= 8, what="the search's rounds")
        proc.proc.terminate()
        signalled = time.monotonic()
        [last] = list(call)
        waited = time.monotonic() - signalled
        assert last.finish_reason == pb.ABORTED and last.error == "server shutting down", last
        assert last.request_id == "drained-search" and not last.token_ids
        assert 0.9 * SHUTDOWN_TIMEOUT_S <= waited < SHUTDOWN_TIMEOUT_S + 15, waited
        assert proc.proc.wait(timeout=30) == 0, proc.log.read_text()[-2000:]
    finally:
        proc.stop()


def test_health_counts_searches_in_flight_where_the_engine_counts_none(server: InProcessServer) -> None:
    """Each round's one-token requests finish in the step that runs them, so the engine's running and
    waiting counts read 0 between its steps while a search runs; num_in_flight counts the search once
    (not its rounds' requests) and a plain stream once, what a router balancing on Health needs."""
    wait_for(lambda: is_idle(server), what="an idle engine")
    try:
        search = server.stub.Generate(long_search("counted-search"), timeout=120)
        wait_mid_search(server, "counted-search")
        plain = pb.GenerateRequest(
            text=PROMPTS[1],
            sampling=pb.SamplingParameters(temperature=0, max_tokens=LONG_SEARCH_TOKENS, ignore_eos=True),
        )
        stream = server.stub.Generate(plain, timeout=120)
        next(stream)
        counts = [server.stub.Health(pb.HealthRequest()) for _ in range(20)]
        assert all(h.num_in_flight == 2 for h in counts), [h.num_in_flight for h in counts]
        search.cancel()
        stream.cancel()
        assert wait_until(lambda: is_idle(server), IDLE_AFTER_ABORT_S), server.llm.stats()
        assert server.stub.Health(pb.HealthRequest()).num_in_flight == 0
    finally:
        abort_leftovers(server)
