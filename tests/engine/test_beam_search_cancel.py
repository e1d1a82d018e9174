"""A beam search cancelled at the worst moment of a round leaves nothing running: just after the
round has read all its beams, while it collects those reads (a Triton request timeout landed there in
CI). Cancels while the round's requests run are the chaos's (tests/e2e/test_chaos_audit.py)."""

from __future__ import annotations

import asyncio
import gc

from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.settings import EngineSettings


def test_a_search_cancelled_as_its_round_ends_leaves_no_request(tiny_llama_dir: str) -> None:
    """The cancel lands right after a round's reads have all finished, while the round waits on them
    once more to collect them: every one of its requests must still be closed (none left open for the
    garbage collector, which the cycle an exception's traceback makes may not run for a long time)."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256)
    sampling = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    params = BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True)

    async def scenario() -> tuple[int, list[str], int]:
        llm = await in_torch_thread(LLMEngine.from_settings, settings)
        engine = AsyncEngine(llm)
        engine.start()

        async def search() -> None:
            async for _ in engine.beam_search("s", [1, 5, 9], sampling, params):
                pass

        task = asyncio.create_task(search())
        rounds_seen = 0
        while not task.done():  # every turn of the loop: cancel as soon as a round has read its beams
            if engine._searches.get("s"):
                rounds_seen += 1
                while engine._searches.get("s") and not task.done():
                    await asyncio.sleep(0)
                if rounds_seen == 3:
                    task.cancel()
                    break
            await asyncio.sleep(0)
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(10):
            await asyncio.sleep(0)
        live = engine.live_request_ids()
        await engine.stop()
        return rounds_seen, live, len(engine._streams)

    gc.disable()  # what the test asks for: closed by the search, not by a collection
    try:
        rounds_seen, live, streams = asyncio.run(scenario())
    finally:
        gc.enable()
    assert rounds_seen == 3
    assert live == [] and streams == 0, f"left open: {live}"
