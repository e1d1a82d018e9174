"""A client that cancels a call and at once sends a new one with the same request id (a retry after a
client-side timeout) gets either a clear rejection or a complete stream of its own: never the old
request's tokens, never a request that is silently dropped and hangs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import RequestDelta
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineSettings


def test_an_id_is_reusable_only_once_its_cancelled_request_has_left_the_engine(tiny_llama_dir: str) -> None:
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    short = SamplingParams(max_tokens=4, ignore_eos=True)

    async def scenario() -> tuple[list[str], list[RequestDelta], bool]:
        llm = await in_torch_thread(LLMEngine.from_settings, settings)
        engine = AsyncEngine(llm)
        engine.start()
        old = engine.generate("x", [1, 5, 9], long)
        await anext(old)
        await anext(old)  # the old request is running, and the loop has its next step under way
        await old.aclose()  # the caller went away: its abort waits for the loop
        # no await has yielded to the loop since: the abort is certainly still pending
        rejections: list[str] = []
        try:
            await anext(engine.generate("x", [1, 7, 9], short))
        except InvalidRequestError as exc:
            rejections.append(str(exc))
        while True:  # retry until the id is free again: then the whole stream is its own
            try:
                new = engine.generate("x", [1, 7, 9], short)
                deltas = await asyncio.wait_for(_collect(new), timeout=10)
                break
            except InvalidRequestError as exc:
                rejections.append(str(exc))
                await asyncio.sleep(0.01)
        idle = not llm.has_unfinished_requests()
        await engine.stop()
        return rejections, deltas, idle

    rejections, deltas, idle = asyncio.run(scenario())
    assert rejections, "the id was taken again while its old request was still pending abort"
    assert all(r.startswith("request_id:") and "still being cancelled" in r for r in rejections)
    assert [d.num_output_tokens for d in deltas] == [1, 2, 3, 4]  # its own tokens, none of the old one's
    assert [d.num_prompt_tokens for d in deltas] == [3] * 4
    assert deltas[-1].request_finished and deltas[-1].finish_reason == "length"
    assert idle


async def _collect(stream: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    return [delta async for delta in stream]


@pytest.mark.parametrize("message", [None, "stop it"])
def test_an_aborted_id_is_free_again_after_its_final_delta(tiny_llama_dir: str, message: str | None) -> None:
    """The Abort path: the stream keeps its id until it has read the final (aborted) delta."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def scenario() -> tuple[str, RequestDelta, list[RequestDelta]]:
        llm = await in_torch_thread(LLMEngine.from_settings, settings)
        engine = AsyncEngine(llm)
        engine.start()
        old = engine.generate("y", [1, 5, 9], params)
        await anext(old)
        assert engine.abort("y", *([message] if message else []))
        with pytest.raises(InvalidRequestError) as info:
            await anext(engine.generate("y", [1, 7, 9], params))
        final = [delta async for delta in old][-1]
        again = await _collect(engine.generate("y", [1, 7, 9], SamplingParams(max_tokens=2, ignore_eos=True)))
        await engine.stop()
        return str(info.value), final, again

    rejection, final, again = asyncio.run(scenario())
    assert rejection.startswith("request_id:")
    assert final.finish_reason == "aborted" and final.error == (message or "aborted")
    assert [d.num_output_tokens for d in again] == [1, 2]
