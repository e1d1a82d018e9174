"""max_tokens=None, vLLM's "until the context is full": each request generates the room its context
leaves after its prompt (after truncate_prompt_tokens), one params object serving prompts of any
length. A min_tokens past that room is taken, as vLLM takes it: the request runs to the context and
ends with "length". A prompt that leaves no room is refused naming the prompt, as with any max_tokens.
None set on a SamplingParams after it was made works as None passed to it. These requests used to be
refused ("must be an integer >= 1"), or, set afterwards, failed with a TypeError in the engine."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=MAX_MODEL_LEN
    )


def prompt(length: int) -> list[int]:
    return [1, *range(300, 300 + length - 1)]


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(c.token_ids) for out in outputs for c in out.outputs]


def until_full(**given: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": None, "ignore_eos": True, **given})


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert (stats.num_unfinished, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_each_prompt_generates_up_to_the_context(llm: LLM) -> None:
    prompts = [prompt(4), prompt(40), prompt(MAX_MODEL_LEN - 1)]
    params = until_full()
    outputs = llm.generate(prompts, params)  # one params object for prompts of three lengths
    rooms = [MAX_MODEL_LEN - 4, MAX_MODEL_LEN - 40, 1]
    assert [len(ids) for ids in token_ids(outputs)] == rooms
    assert [out.outputs[0].finish_reason for out in outputs] == ["length"] * 3
    assert [out.metrics.max_tokens for out in outputs if out.metrics] == rooms  # vLLM's params histogram
    assert params.max_tokens is None  # resolved on a copy: the caller's params are as given
    assert token_ids(outputs) == token_ids(llm.generate(prompts, [greedy(k) for k in rooms]))
    assert_idle(llm)


def test_chat_and_the_engine_s_add_request_take_none(llm: LLM) -> None:
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], until_full())
    assert len(chat.prompt_token_ids) + len(chat.outputs[0].token_ids) == MAX_MODEL_LEN
    assert chat.outputs[0].finish_reason == "length"
    engine = llm.engine
    engine.add_request("direct", prompt(10), until_full())
    new_token_ids, finish_reason = [], None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            new_token_ids += delta.new_token_ids
            finish_reason = delta.finish_reason
    assert (len(new_token_ids), finish_reason) == (MAX_MODEL_LEN - 10, "length")
    llm.generate([prompt(4)], greedy(1))  # a step more frees the finished request's worker state
    assert_idle(llm)


def test_parallel_sampling_runs_every_completion_to_the_context(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=None, ignore_eos=True)
    (out,) = llm.generate([prompt(40)], params)
    assert [len(c.token_ids) for c in out.outputs] == [MAX_MODEL_LEN - 40] * 3
    assert [c.finish_reason for c in out.outputs] == ["length"] * 3
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # three seeds, three completions
    assert_idle(llm)


def test_min_tokens_bans_stops_and_past_the_room_runs_to_the_context(llm: LLM) -> None:
    """vLLM checks min_tokens only against a max_tokens given: one past the room is taken, and the
    request ends at the context with every stop token banned to the end."""
    room = MAX_MODEL_LEN - 40
    (reference,) = llm.generate([prompt(40)], until_full())
    first = reference.outputs[0].token_ids[0]
    stopping = until_full(stop_token_ids=[first])
    (stopped,) = llm.generate([prompt(40)], stopping)
    assert (stopped.outputs[0].token_ids, stopped.outputs[0].finish_reason) == ([first], "stop")
    (held,) = llm.generate([prompt(40)], replace(stopping, min_tokens=5))
    ids, reason = held.outputs[0].token_ids, held.outputs[0].finish_reason
    assert first not in ids[:5]
    assert (reason, len(ids)) == ("length", room) or (reason == "stop" and ids[-1] == first and len(ids) > 5)
    (past,) = llm.generate([prompt(40)], replace(stopping, min_tokens=1000))
    assert len(past.outputs[0].token_ids) == room and past.outputs[0].finish_reason == "length"
    assert first not in past.outputs[0].token_ids
    assert_idle(llm)


def test_none_set_after_construction_works_as_none_given(llm: LLM) -> None:
    params = SamplingParams(temperature=0, ignore_eos=True, min_tokens=3)
    params.max_tokens = None
    prompts = [prompt(4), prompt(40)]
    assert token_ids(llm.generate(prompts, params)) == token_ids(llm.generate(prompts, until_full()))
    assert [len(ids) for ids in token_ids(llm.generate(prompts, params))] == [60, 24]
    assert_idle(llm)


@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 6])
def test_a_prompt_that_fills_the_context_is_refused_naming_the_prompt(llm: LLM, length: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([prompt(4), prompt(length)], until_full())
    assert info.value.field == "prompt" and "prompts[1]" in info.value.message
    assert_idle(llm)


def test_truncated_prompts_leave_the_room_after_their_kept_tokens(llm: LLM) -> None:
    """-1 keeps as many tokens as leave max_tokens of room: with None, room for one token (vLLM's -1
    keeps the whole context, which would leave none)."""
    too_long = prompt(100)
    kept_40 = until_full(truncate_prompt_tokens=40)
    as_many = until_full(truncate_prompt_tokens=-1)
    minus_one, forty = llm.generate([too_long, too_long], [as_many, kept_40])
    assert minus_one.prompt_token_ids == too_long[-(MAX_MODEL_LEN - 1) :]
    assert len(minus_one.outputs[0].token_ids) == 1
    assert forty.prompt_token_ids == too_long[-40:] and len(forty.outputs[0].token_ids) == MAX_MODEL_LEN - 40
    assert [minus_one.outputs[0].finish_reason, forty.outputs[0].finish_reason] == ["length"] * 2
    assert_idle(llm)


def test_speculative_decoding_drafts_up_to_the_context(
    llm: LLM, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts from an oracle (the run without drafts, every third one wrong) stop at the context."""
    from pagedserve.spec_decode import SpeculativeConfig
    from spec_drafts import oracle_proposer

    prompts = [prompt(20), prompt(50)]
    theirs = llm.generate(prompts, until_full())
    reference = [(p, list(out.outputs[0].token_ids)) for p, out in zip(prompts, theirs, strict=True)]
    monkeypatch.setattr(SpeculativeConfig, "propose", oracle_proposer(reference))
    drafting = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=64,
        block_size=8,
        max_model_len=MAX_MODEL_LEN,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    ours = drafting.generate(prompts, until_full())
    assert token_ids(ours) == token_ids(theirs)
    assert [len(ids) for ids in token_ids(ours)] == [MAX_MODEL_LEN - 20, MAX_MODEL_LEN - 50]
    assert [out.outputs[0].finish_reason for out in ours] == ["length"] * 2
    stats = drafting.engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0
