"""The engine core steps the engine on the torch thread without waiting for the event loop between
steps, and a stream whose reader is behind gets the deltas that queued meanwhile as one: the same
tokens, text and logprobs, in fewer deltas."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pagedserve.engine.async_engine import AsyncEngine, KvEventBatch, _Stream, in_torch_thread
from pagedserve.engine.core_process import EngineFace
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineDeadError
from pagedserve.outputs import RequestDelta, RequestMetrics
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineSettings

PROMPT = [1, 5, 9, 14]


@pytest.mark.parametrize(
    "build", [LLMEngine.from_settings, EngineFace.from_settings], ids=["thread", "process"]
)
def test_the_engine_steps_on_while_the_event_loop_is_blocked(
    tiny_llama_dir: str, build: Callable[[EngineSettings], LLMEngine]
) -> None:
    """The loop blocked after the first token (a long synchronous call on it): the engine generates
    the rest meanwhile, on the torch thread or in its own process, and the reader then gets it in one
    delta. A loop that steps the engine itself got one step done in that time, then one delta a step
    once it ran again."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    async def scenario() -> tuple[list[RequestDelta], list[RequestDelta]]:
        engine = AsyncEngine(await in_torch_thread(build, settings))
        engine.start()
        read_at_once = [delta async for delta in engine.generate("at-once", PROMPT, params)]
        blocked = []
        async for delta in engine.generate("blocked", PROMPT, params):
            if not blocked:
                time.sleep(2.0)  # blocks the event loop: no coroutine and no callback runs
            blocked.append(delta)
        await engine.stop()
        return read_at_once, blocked

    read_at_once, blocked = asyncio.run(scenario())
    assert sum(len(d.new_token_ids) for d in read_at_once) == 12
    # the tokens made while the loop was blocked come in one delta (a loaded machine's loop may have
    # taken the first two steps' tokens together before it blocked: [2, 10] in one CI run)
    sizes = [len(d.new_token_ids) for d in blocked]
    assert len(sizes) == 2 and sizes[0] <= 3 and sum(sizes) == 12, sizes
    assert [d.num_output_tokens for d in blocked] == [sizes[0], 12]
    assert [t for d in blocked for t in d.new_token_ids] == [t for d in read_at_once for t in d.new_token_ids]
    assert "".join(d.new_text for d in blocked) == "".join(d.new_text for d in read_at_once)
    merged = blocked[1].new_logprobs
    assert (
        merged is not None
        and [max(e, key=lambda t: e[t].logprob) for e in merged] == blocked[1].new_token_ids
    )
    assert blocked[-1].finished and blocked[-1].finish_reason == "length"


def _delta(index: int, tokens: list[int], finished: bool = False, error: str | None = None) -> RequestDelta:
    return RequestDelta(
        request_id="r",
        new_token_ids=tokens,
        new_text="".join(f"<{t}>" for t in tokens),
        new_logprobs=None,
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=4,
        num_output_tokens=0,
        metrics=RequestMetrics(arrival_time=0.0),
        index=index,
        error=error,
    )


def test_an_unread_delta_takes_in_the_next_of_its_completion_only() -> None:
    stream = _Stream(arrival_time=0.0, num_prompt_tokens=4)
    stream.put(_delta(0, [1]))
    stream.put(_delta(0, [2]))  # merged: the same completion, the one before it unfinished
    stream.put(_delta(1, [7]))  # another completion: an item of its own
    stream.put(_delta(0, [3]))  # not merged across completion 1's item: the order is kept
    stream.put(_delta(0, [4], finished=True))  # merged: a final delta takes the one before it in
    stream.put(_delta(1, [8]))
    stream.put(_delta(1, [9], error="aborted"))  # merged: an abort's final delta takes it in too
    stream.put(_delta(1, [10]))  # not merged into a delta with an error
    error = ValueError("refused")
    stream.put(error)
    stream.put(_delta(1, [11]))  # not merged into an exception

    def shown(item: RequestDelta | BaseException) -> tuple[object, ...]:
        if isinstance(item, BaseException):
            return (item,)
        return (item.index, item.new_token_ids, item.new_text, item.finished, item.error)

    assert [shown(item) for item in stream.items] == [
        (0, [1, 2], "<1><2>", False, None),
        (1, [7], "<7>", False, None),
        (0, [3, 4], "<3><4>", True, None),
        (1, [8, 9], "<8><9>", False, "aborted"),
        (1, [10], "<10>", False, None),
        (error,),
        (1, [11], "<11>", False, None),
    ]


def test_a_finished_delta_takes_in_nothing_after_it() -> None:
    stream = _Stream(arrival_time=0.0, num_prompt_tokens=4)
    stream.put(_delta(0, [1], finished=True))
    stream.put(_delta(0, [2]))  # cannot happen in the engine; kept apart all the same
    assert [d.new_token_ids for d in stream.items if isinstance(d, RequestDelta)] == [[1], [2]]


def test_the_reader_waits_for_an_item_and_takes_them_in_order() -> None:
    async def scenario() -> list[RequestDelta | BaseException]:
        stream = _Stream(arrival_time=0.0, num_prompt_tokens=4)
        reader = asyncio.create_task(stream.get())
        await asyncio.sleep(0)
        assert not reader.done()  # nothing queued yet
        stream.put(_delta(0, [1]))
        first = await reader
        stream.put(_delta(0, [2], finished=True))
        return [first, await stream.get()]

    first, second = asyncio.run(scenario())
    assert isinstance(first, RequestDelta) and first.new_token_ids == [1]
    assert isinstance(second, RequestDelta) and second.new_token_ids == [2] and second.finished


def test_the_engine_runs_at_most_16_passes_ahead_of_a_blocked_loop(tiny_llama_dir: str) -> None:
    """Passes the loop has not taken are bounded: a stuck loop cannot have the core pile up deltas.
    Blocked after the first token, the loop then finds 16 passes waiting (a 17th may be handed over
    while it takes them): their tokens come in one delta, the rest as the engine makes them."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def scenario() -> list[RequestDelta]:
        engine = AsyncEngine(await in_torch_thread(LLMEngine.from_settings, settings))
        engine.start()
        [_ async for _ in engine.generate("warm-up", PROMPT, params)]  # every shape compiled
        deltas = []
        async for delta in engine.generate("blocked", PROMPT, params):
            if not deltas:
                time.sleep(2.0)  # the tiny model makes the other 39 tokens in far less
            deltas.append(delta)
        await engine.stop()
        return deltas

    deltas = asyncio.run(scenario())
    sizes = [len(d.new_token_ids) for d in deltas]
    assert sizes[0] == 1 and 16 <= sizes[1] <= 18, sizes
    assert sum(sizes) == 40 and deltas[-1].finished


def test_a_kv_listener_gone_before_its_snapshot_leaves_the_recording_off(tiny_llama_dir: str) -> None:
    """The block manager records the prefix cache's changes exactly while someone listens, also when
    the only listener leaves before the core has taken its snapshot."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=3)

    async def scenario() -> list[object]:
        engine = AsyncEngine(await in_torch_thread(LLMEngine.from_settings, settings))
        engine.start()
        block_manager = engine.engine.scheduler.block_manager
        seen = []
        engine.unsubscribe_kv_events(engine.subscribe_kv_events())  # gone at once
        [_ async for _ in engine.generate("first", PROMPT, params)]  # passes run after it
        seen.append(block_manager.kv_events)
        kept = engine.subscribe_kv_events()
        snapshot = await asyncio.wait_for(kept.queue.get(), 30)
        assert isinstance(snapshot, KvEventBatch) and snapshot.snapshot is not None
        seen.append(block_manager.kv_events)
        engine.unsubscribe_kv_events(kept)
        [_ async for _ in engine.generate("second", PROMPT, params)]
        seen.append(block_manager.kv_events)
        await engine.stop()
        return seen

    assert asyncio.run(scenario()) == [None, [], None]


def test_a_kill_while_the_core_steps_fails_the_requests_and_stops_it(tiny_llama_dir: str) -> None:
    """kill() (a worker rank found dead between steps) while the core is stepping: every live request
    ends with an error delta, the core returns at its next pass, and nothing starts afterwards."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def scenario() -> tuple[list[RequestDelta], bool, object]:
        engine = AsyncEngine(await in_torch_thread(LLMEngine.from_settings, settings))
        engine.start()
        deltas = []
        async for delta in engine.generate("killed", PROMPT, params):
            deltas.append(delta)
            if len(deltas) == 2:
                engine.kill(EngineDeadError("rank 1 died"))
        await in_torch_thread(lambda: None)  # queued behind the core's job: it has returned
        with pytest.raises(EngineDeadError):
            [_ async for _ in engine.generate("later", PROMPT, params)]
        running, core = engine.is_running, engine._core
        engine.engine.executor.shutdown()
        return deltas, running, core

    deltas, running, core = asyncio.run(scenario())
    last = deltas[-1]
    assert last.finished and last.finish_reason == "error" and "rank 1 died" in (last.error or "")
    assert sum(len(d.new_token_ids) for d in deltas) < 500
    assert not running and core is None


def test_a_fault_fails_the_lora_change_of_its_pass_and_every_request(tiny_llama_dir: str) -> None:
    """A pass that faults (here adding a request raises: a bug, not a refusal) ends the engine: its
    requests get an error delta, and a LoRA change the pass never reached fails rather than hangs."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4)

    async def scenario() -> tuple[list[RequestDelta], BaseException | None]:
        llm = await in_torch_thread(LLMEngine.from_settings, settings)

        def add_request(*args: object) -> None:
            raise RuntimeError("a bug in add_request")

        llm.add_request = add_request  # type: ignore[method-assign]
        engine = AsyncEngine(llm)
        deltas = engine.generate("faulty", PROMPT, params)
        first = asyncio.ensure_future(anext(deltas))
        lora = asyncio.ensure_future(engine.load_lora_adapter("a0", "/nowhere"))
        await asyncio.sleep(0.1)  # both in the inbox: nothing takes it before start()
        engine.start()  # one pass: the add raises before the LoRA change runs
        received = [await asyncio.wait_for(first, 30)]
        received += [d async for d in deltas]
        error = await asyncio.wait_for(asyncio.gather(lora, return_exceptions=True), 30)
        llm.executor.shutdown()
        return received, error[0]

    received, error = asyncio.run(scenario())
    assert len(received) == 1 and received[0].finish_reason == "error"
    assert "a bug in add_request" in (received[0].error or "")
    assert isinstance(error, EngineDeadError)


class _FailingSemaphore(threading.Semaphore):
    """The passes-ahead bound raising: an exception outside the engine's own code, in the core's loop."""

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        raise RuntimeError("injected outside the pass")


def test_an_exception_escaping_the_core_fails_the_engine_rather_than_hang(tiny_llama_dir: str) -> None:
    """`run_pass` catches the engine's faults; one raised in the core's own loop used to end its job
    with the core still marked running: never started again, every stream waiting forever."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def scenario() -> tuple[list[RequestDelta], BaseException | None]:
        engine = AsyncEngine(await in_torch_thread(LLMEngine.from_settings, settings))
        engine._passes_ahead = _FailingSemaphore(16)
        engine.start()
        deltas = await asyncio.wait_for(collect(engine.generate("stranded", PROMPT, params)), 30)
        engine.engine.executor.shutdown()
        return deltas, engine.dead

    deltas, dead = asyncio.run(scenario())
    assert deltas[-1].finish_reason == "error"
    assert "the engine core failed: RuntimeError('injected outside the pass')" in (deltas[-1].error or "")
    assert isinstance(dead, EngineDeadError)


def test_a_pass_the_front_end_cannot_read_fails_the_engine_rather_than_hang(tiny_llama_dir: str) -> None:
    """The engine process's reader thread: an error reading a pass (other than the process's end)
    used to end the thread, and with it every stream's hope of another delta."""
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def scenario() -> list[RequestDelta]:
        face = await in_torch_thread(EngineFace.from_settings, settings)
        engine = AsyncEngine(face)
        real_receive = face.executor.receive

        def receive() -> Any:
            real_receive()
            raise ValueError("a pass that does not unpickle")

        face.executor.receive = receive  # type: ignore[method-assign]
        engine.start()
        try:
            return await asyncio.wait_for(collect(engine.generate("unread", PROMPT, params)), 30)
        finally:
            await engine.stop()

    deltas = asyncio.run(scenario())
    assert deltas[-1].finish_reason == "error"
    assert "could not be read: ValueError('a pass that does not unpickle')" in (deltas[-1].error or "")


async def collect(deltas: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    return [delta async for delta in deltas]
