"""KV events from the asyncio engine (a KV-aware router's feed), on the tiny model: a listener starts
from a snapshot of the prefix cache, then gets each step's named and evicted blocks, whose hashes it
can compute from the tokens (SHA-256 chained over int64 token ids); the cache is followed only while
someone listens; a listener that falls behind is cut off; prefix caching off refuses listeners."""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from typing import Any

import pytest
from pagedserve.core.block_manager import BlockRemoved, BlockStored
from pagedserve.engine.async_engine import (
    AsyncEngine,
    KvEventBatch,
    KvEventListener,
    KvEventsOverflow,
    in_torch_thread,
)
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineSettings

BLOCK = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def chain(tokens: list[int]) -> list[bytes]:
    hashes, parent = [], b""
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hashlib.sha256(parent + array("q", tokens[start : start + BLOCK]).tobytes()).digest()
        hashes.append(parent)
    return hashes


def run(model_dir: str, scenario: Any, **settings: Any) -> Any:
    async def main() -> Any:
        given = {"dtype": "float32", "block_size": BLOCK, "num_kv_blocks": 16, **settings}
        llm = await in_torch_thread(LLMEngine.from_settings, EngineSettings(model=model_dir, **given))
        engine = AsyncEngine(llm)
        engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


async def generate(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    return [t async for delta in engine.generate(request_id, prompt, PARAMS) for t in delta.new_token_ids]


def drain(listener: KvEventListener) -> list[KvEventBatch]:
    batches = []
    while not listener.queue.empty():
        item = listener.queue.get_nowait()
        assert isinstance(item, KvEventBatch), item
        batches.append(item)
    return batches


def test_a_listener_starts_from_a_snapshot_then_follows_the_named_blocks(tiny_llama_dir: str) -> None:
    first = [1, *range(100, 119)]  # 20 tokens: 2 full blocks
    second = [1, *range(100, 107), *range(300, 320)]  # block 0 shared with `first`, then 3 of its own

    async def scenario(engine: AsyncEngine) -> Any:
        output = await generate(engine, "before", first)  # nobody listens: nothing recorded
        assert engine.engine.scheduler.block_manager.kv_events is None
        listener = engine.subscribe_kv_events()
        await generate(engine, "after", second)
        batches = drain(listener)
        engine.unsubscribe_kv_events(listener)
        await generate(engine, "unheard", [1, *range(500, 530)])
        return output, batches, engine.engine.scheduler.block_manager.kv_events

    output, batches, recording = run(tiny_llama_dir, scenario)
    # `first` ran 20 prompt tokens and 3 generated ones into the cache: blocks 0-1 are full and named
    assert batches[0].snapshot == chain(first + output)[:2] and batches[0].events == []
    assert [b.sequence for b in batches] == list(
        range(batches[0].sequence, batches[0].sequence + len(batches))
    )
    events = [event for batch in batches[1:] for event in batch.events]
    assert all(isinstance(event, BlockStored) for event in events)
    named = [h for event in events for h in event.block_hashes]
    assert named == chain(second)[1:3]  # block 0 was a hit: named before; 27 tokens + 3 fill only 3
    assert events[0].parent_block_hash == chain(second)[0]
    assert [t for event in events for t in event.token_ids] == second[BLOCK : 3 * BLOCK]
    assert recording is None  # the last listener gone: the cache is not followed


def test_evictions_are_reported(tiny_llama_dir: str) -> None:
    """12 blocks: three prompts of 6 blocks each (5 of them full and named), one after the other; the
    third takes the 2 blocks left free and evicts 4 of the first's, its tail first."""
    prompts = [[1, *range(base, base + 43)] for base in (100, 200, 300)]  # 44 tokens + 4: 6 blocks each

    async def scenario(engine: AsyncEngine) -> list[Any]:
        listener = engine.subscribe_kv_events()
        for index, prompt in enumerate(prompts):
            await generate(engine, f"p{index}", prompt)
        return [event for batch in drain(listener) for event in batch.events]

    events = run(tiny_llama_dir, scenario, num_kv_blocks=12)
    removed = [h for event in events if isinstance(event, BlockRemoved) for h in event.block_hashes]
    stored = [h for event in events if isinstance(event, BlockStored) for h in event.block_hashes]
    assert len(stored) == 15  # each prompt: 5 full blocks (44 prompt tokens and 3 generated computed)
    assert removed == chain(prompts[0])[1:5][::-1]  # the oldest prompt's, least recently freed first


def test_a_listener_that_falls_behind_is_cut_off_and_the_rest_go_on(tiny_llama_dir: str) -> None:
    async def scenario(engine: AsyncEngine) -> Any:
        slow = engine.subscribe_kv_events(max_pending=2)
        fast = engine.subscribe_kv_events()
        for index in range(3):
            await generate(engine, f"r{index}", [1, *range(100 * (index + 1), 100 * (index + 1) + 9)])
        items = [slow.queue.get_nowait() for _ in range(slow.queue.qsize())]
        return items, drain(fast), slow.closed

    items, fast, closed = run(tiny_llama_dir, scenario)
    assert closed and isinstance(items[-1], KvEventsOverflow) and "subscribe again" in str(items[-1])
    assert [type(item) for item in items[:-1]] == [KvEventBatch, KvEventBatch]
    assert fast[0].snapshot == [] and len(fast) == 4  # the snapshot and one batch a prompt


def test_prefix_caching_off_refuses_listeners(tiny_llama_dir: str) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        with pytest.raises(InvalidRequestError, match="prefix caching is off"):
            engine.subscribe_kv_events()

    run(tiny_llama_dir, scenario, enable_prefix_caching=False)
