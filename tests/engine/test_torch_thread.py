"""A serving process runs all its torch work on one thread: the engine is built there and every step
runs there, never on the event loop's thread (libgomp slows every op down once two threads hold
OpenMP teams; see engine/async_engine.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineSettings


def test_engine_is_built_and_stepped_on_the_one_torch_thread(tiny_llama_dir: str) -> None:
    def build() -> tuple[LLMEngine, threading.Thread]:
        settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
        return LLMEngine.from_settings(settings), threading.current_thread()

    async def scenario() -> tuple[threading.Thread, list[threading.Thread], list[Any]]:
        llm, built_on = await in_torch_thread(build)
        step_threads: list[threading.Thread] = []
        real_step = llm.step

        def step() -> Any:  # the real step, noting the thread it runs on
            step_threads.append(threading.current_thread())
            return real_step()

        llm.step = step  # type: ignore[method-assign]
        engine = AsyncEngine(llm)
        engine.start()
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        async def collect(request_id: str, prompt: list[int]) -> list[Any]:
            return [delta async for delta in engine.generate(request_id, prompt, params)]

        outputs = await asyncio.gather(*(collect(f"r{i}", [1, 5 + i, 9]) for i in range(3)))
        await engine.stop()
        return built_on, step_threads, outputs

    built_on, step_threads, outputs = asyncio.run(scenario())
    assert built_on is not threading.main_thread()
    assert len(step_threads) >= 4 and set(step_threads) == {built_on}
    assert all(sum(len(d.new_token_ids) for d in deltas) == 4 for deltas in outputs)
