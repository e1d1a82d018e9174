"""`stream_interval` N: a completion's first token is delivered at once, then its tokens come N to a
delta, and the last delta carries what is left. The same tokens, text and logprobs as with one delta a
token, only in fewer deltas; an Abort that ends a completion while tokens are held back delivers them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestDelta
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineSettings

PROMPT = [1, 5, 9, 14]


async def _collect(stream: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    return [delta async for delta in stream]


def _run_twice(model_dir: str, params: SamplingParams, interval: int) -> tuple[list[RequestDelta], ...]:
    """The same greedy request with one delta a token, then with `interval`, on one engine."""
    settings = EngineSettings(model=model_dir, dtype="float32", num_kv_blocks=64)

    async def scenario() -> tuple[list[RequestDelta], list[RequestDelta]]:
        llm = await in_torch_thread(LLMEngine.from_settings, settings)
        engine = AsyncEngine(llm)
        engine.start()
        every = await _collect(engine.generate("every", PROMPT, params))
        engine.stream_interval = interval
        batched = await _collect(engine.generate("batched", PROMPT, params))
        await engine.stop()
        return every, batched

    return asyncio.run(scenario())


def _by_index(deltas: list[RequestDelta], index: int) -> list[RequestDelta]:
    return [d for d in deltas if d.index == index]


def _check_ends(deltas: list[RequestDelta], ends: list[int]) -> None:
    """The deltas end after the output token counts in `ends`, or after some of them: deltas the
    reader had not taken when the next came are merged (a loaded host's loop behind the engine), so
    that a delta may carry several intervals' tokens, but never ends inside an interval."""
    got = [d.num_output_tokens for d in deltas]
    assert set(got) <= set(ends) and got == sorted(set(got)) and got[-1] == ends[-1], (got, ends)
    assert [len(d.new_token_ids) for d in deltas] == [b - a for a, b in zip([0, *got], got)]


def test_tokens_come_n_to_a_delta_after_the_first(tiny_llama_dir: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2)
    every, batched = _run_twice(tiny_llama_dir, params, interval=3)

    _check_ends(every, list(range(1, 10)))
    _check_ends(batched, [1, 4, 7, 9])
    assert [t for d in batched for t in d.new_token_ids] == [t for d in every for t in d.new_token_ids]
    assert "".join(d.new_text for d in batched) == "".join(d.new_text for d in every)
    for delta in batched:  # one logprobs entry per token, in order
        assert delta.new_logprobs is not None and len(delta.new_logprobs) == len(delta.new_token_ids)
        assert [max(e, key=lambda t: e[t].logprob) for e in delta.new_logprobs] == delta.new_token_ids
    assert [d.finished for d in batched] == [False] * (len(batched) - 1) + [True]
    assert batched[-1].request_finished and batched[-1].finish_reason == "length"


def test_each_of_n_completions_is_batched_on_its_own(tiny_llama_dir: str) -> None:
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=5, ignore_eos=True)
    every, batched = _run_twice(tiny_llama_dir, params, interval=2)

    for index in (0, 1):
        ours, reference = _by_index(batched, index), _by_index(every, index)
        _check_ends(ours, [1, 3, 5])
        assert [t for d in ours for t in d.new_token_ids] == [t for d in reference for t in d.new_token_ids]
        assert ours[-1].finished and ours[-1].finish_reason == "length"
    assert sum(d.request_finished for d in batched) == 1 and batched[-1].request_finished


def test_an_interval_longer_than_the_output_sends_the_first_token_and_then_the_rest(
    tiny_llama_dir: str,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    _, batched = _run_twice(tiny_llama_dir, params, interval=100)
    _check_ends(batched, [1, 6])


@pytest.mark.parametrize("message", [None, "stop it"])
def test_an_abort_delivers_the_tokens_held_back(tiny_llama_dir: str, message: str | None) -> None:
    """An Abort ends a completion between two batched deltas: the final delta brings every token the
    engine generated for it, none are lost."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def scenario() -> list[RequestDelta]:
        llm = await in_torch_thread(LLMEngine.from_settings, settings)
        engine = AsyncEngine(llm, stream_interval=1000)
        engine.start()
        stream = engine.generate("x", PROMPT, params)
        first = await anext(stream)
        async with asyncio.timeout(10):
            while engine._streams["x"].held.get(0) is None:  # a few more tokens, held back
                await asyncio.sleep(0.005)
        assert engine.abort("x", *([message] if message else []))
        deltas = [first, *await _collect(stream)]
        idle = not llm.has_unfinished_requests()
        await engine.stop()
        assert idle
        return deltas

    deltas = asyncio.run(scenario())
    final = deltas[-1]
    assert final.finish_reason == "aborted" and final.error == (message or "aborted")
    assert 1 < final.num_output_tokens < 400
    assert sum(len(d.new_token_ids) for d in deltas) == final.num_output_tokens
    assert len(deltas) == 2  # the first token, then everything else with the abort


def test_stream_interval_below_one_is_refused(tiny_llama_dir: str) -> None:
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=16)
    llm = LLMEngine.from_settings(settings)
    try:
        with pytest.raises(ValueError, match="stream_interval: must be at least 1, got 0"):
            AsyncEngine(llm, stream_interval=0)
    finally:
        llm.executor.shutdown()
