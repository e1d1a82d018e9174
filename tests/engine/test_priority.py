"""`--scheduling-policy priority` on a tiny random Llama: requests run in (priority, arrival) order
through real steps, a more urgent arrival preempts a less urgent running request when the KV cache is
full (by swap and by recompute) without changing anyone's greedy tokens, and a request's priority is
validated (refused when non-zero under fcfs) in the engine, the async engine and the offline API."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import InvalidRequestError
from pagedserve.settings import EngineSettings

_rng = random.Random(7)
LOW_PROMPT = [1] + [_rng.randrange(3, 49152) for _ in range(39)]  # 40 tokens: 5 blocks of 8
HIGH_PROMPT = [1] + [_rng.randrange(3, 49152) for _ in range(19)]  # 20 tokens: 3 blocks
LOW_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # grows to 8 blocks
HIGH_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run_engine(engine: LLMEngine) -> tuple[dict[str, list[int]], list[list[str]]]:
    """Step until idle: each request's tokens, and per step the requests that got a token."""
    tokens: dict[str, list[int]] = {}
    steps = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return tokens, steps
        deltas = engine.step()
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        steps.append([d.request_id for d in deltas if d.new_token_ids])
    raise AssertionError("the engine did not finish its requests in 500 steps")


@pytest.fixture(scope="module")
def alone(tiny_llama_dir: str) -> dict[str, list[int]]:
    """Each request's greedy tokens when it runs by itself, with room to spare."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8)
    low, high = llm.generate([LOW_PROMPT, HIGH_PROMPT], [LOW_PARAMS, HIGH_PARAMS])
    return {"low": low.outputs[0].token_ids, "high": high.outputs[0].token_ids}


@pytest.fixture(scope="module")
def fcfs_llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8)


@pytest.fixture(scope="module")
def priority_llm(tiny_llama_dir: str) -> LLM:
    return LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, scheduling_policy="priority"
    )


def test_requests_run_by_priority_then_arrival(tiny_llama_dir: str) -> None:
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=64,
        block_size=8,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for request_id, priority in [("a", 2), ("b", 0), ("c", 1), ("d", -1), ("e", 0)]:
        llm.engine.add_request(request_id, HIGH_PROMPT, params, priority=priority)
    _, steps = run_engine(llm.engine)
    order = list(dict.fromkeys(rid for step in steps for rid in step))
    assert order == ["d", "b", "e", "c", "a"]
    assert all(len(step) == 1 for step in steps) and llm.engine.stats().num_preemptions == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_more_urgent_arrival_preempts_a_running_request_and_tokens_stay_the_same(
    tiny_llama_dir: str, alone: dict[str, list[int]], mode: str
) -> None:
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=8,
        block_size=8,
        num_cpu_kv_blocks=16 if mode == "swap" else 0,
        preemption_mode=mode,
        scheduling_policy="priority",
    )
    engine = llm.engine
    engine.add_request("low", LOW_PROMPT, LOW_PARAMS, priority=5)
    first = {}
    for _ in range(3):  # "low" runs alone: 43 tokens in 6 of the 8 blocks
        for delta in engine.step():
            first.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert engine.stats().num_free_blocks == 2
    engine.add_request("high", HIGH_PROMPT, HIGH_PARAMS, priority=-1)  # needs 3 blocks
    deltas = engine.step()
    assert [d.request_id for d in deltas] == ["high"]  # admitted at once: "low" made room
    stats = engine.stats()
    assert stats.num_preemptions == 1
    assert (stats.num_swap_preemptions, stats.num_recompute_preemptions) == (
        (1, 0) if mode == "swap" else (0, 1)
    )
    assert (stats.num_swapped, stats.num_waiting) == ((1, 0) if mode == "swap" else (0, 1))
    rest, steps = run_engine(engine)
    tokens = {rid: first.get(rid, []) + rest.get(rid, []) for rid in ("low", "high")}
    tokens["high"] = deltas[0].new_token_ids + tokens["high"]
    assert tokens == alone
    finished_high = next(i for i, step in enumerate(steps) if "high" not in step)
    assert all("low" not in step for step in steps[:finished_high])  # "high" ran through first
    stats = engine.stats()
    assert stats.num_preemptions == 1 and stats.num_free_blocks == 8
    assert stats.num_free_cpu_blocks == stats.num_total_cpu_blocks


def test_under_fcfs_the_arrival_waits_for_the_running_request(
    tiny_llama_dir: str, alone: dict[str, list[int]]
) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=8, block_size=8, num_cpu_kv_blocks=16)
    engine = llm.engine
    engine.add_request("low", LOW_PROMPT, LOW_PARAMS)
    for _ in range(3):
        engine.step()
    engine.add_request("high", HIGH_PROMPT, HIGH_PARAMS)
    assert [d.request_id for d in engine.step()] == ["low"]
    assert engine.stats().num_waiting == 1 and engine.stats().num_preemptions == 0


def test_parallel_samples_share_the_request_priority(priority_llm: LLM) -> None:
    engine = priority_llm.engine
    params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=4, ignore_eos=True)
    engine.add_request("many", HIGH_PROMPT, params, priority=-7)
    engine.step()  # the prompt is computed and the siblings forked
    assert {seq.priority for seq in engine.scheduler.requests.values()} == {-7}
    assert len(engine.scheduler.requests) == 3
    run_engine(engine)


def test_fcfs_refuses_a_non_zero_priority(fcfs_llm: LLM) -> None:
    engine, params = fcfs_llm.engine, SamplingParams(max_tokens=2)
    message = r"^priority: got 3, but the scheduling policy is fcfs; start the server with --scheduling-policy priority$"
    with pytest.raises(InvalidRequestError, match=message):
        engine.validate_request(HIGH_PROMPT, params, 3)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("x", HIGH_PROMPT, params, priority=3)
    with pytest.raises(InvalidRequestError, match=r"^priority: got 3, .*\(prompts\[1\]\)$"):
        fcfs_llm.generate([HIGH_PROMPT, HIGH_PROMPT], params, priority=[0, 3])
    assert not engine.has_unfinished_requests()  # a bad prompt adds none of the batch
    [out] = fcfs_llm.generate([HIGH_PROMPT], params, priority=[0])
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("priority", "message"),
    [
        ("1", r"^priority: must be an integer, got str$"),
        (1.0, r"^priority: must be an integer, got float$"),
        (True, r"^priority: must be an integer, got bool$"),
        (2**63, r"^priority: must be a 64-bit signed integer, got 9223372036854775808$"),
        (-(2**63) - 1, r"^priority: must be a 64-bit signed integer, got -9223372036854775809$"),
    ],
)
def test_the_engine_refuses_a_priority_that_is_not_an_int64(
    priority_llm: LLM, priority: Any, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        priority_llm.engine.add_request("x", HIGH_PROMPT, SamplingParams(max_tokens=2), priority=priority)
    assert not priority_llm.engine.has_unfinished_requests()


def test_the_engine_takes_the_int64_extremes(priority_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    priority_llm.engine.add_request("most", HIGH_PROMPT, params, priority=-(2**63))
    priority_llm.engine.add_request("least", HIGH_PROMPT, params, priority=2**63 - 1)
    tokens, _ = run_engine(priority_llm.engine)
    assert len(tokens["most"]) == len(tokens["least"]) == 2


def test_offline_generate_and_chat_take_one_priority_per_prompt(
    priority_llm: LLM, alone: dict[str, list[int]]
) -> None:
    outputs = priority_llm.generate([LOW_PROMPT, HIGH_PROMPT], [LOW_PARAMS, HIGH_PARAMS], priority=[3, -3])
    assert [o.outputs[0].token_ids for o in outputs] == [alone["low"], alone["high"]]  # input order
    messages = [{"role": "user", "content": "Hi"}]
    chats = priority_llm.chat([messages, messages], SamplingParams(max_tokens=2), priority=(1, 0))
    assert [len(c.outputs[0].token_ids) for c in chats] == [2, 2]


@pytest.mark.parametrize(
    ("priority", "message"),
    [
        ([1], r"^priority: got 1 for 2 prompts$"),
        ([1, 2, 3], r"^priority: got 3 for 2 prompts$"),
        (1, r"^priority: must be a list of one int per prompt, got int$"),
        ([1, "2"], r"^priority: must be integers$"),
        ([1, 2.5], r"^priority: must be integers$"),
        ([False, 1], r"^priority: must be integers$"),
        (
            [0, 2**63],
            r"^priority: must be a 64-bit signed integer, got 9223372036854775808 \(prompts\[1\]\)$",
        ),
    ],
)
def test_offline_generate_refuses_a_bad_priority_list(priority_llm: LLM, priority: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        priority_llm.generate([HIGH_PROMPT, LOW_PROMPT], SamplingParams(max_tokens=2), priority=priority)
    with pytest.raises(InvalidRequestError, match=message):
        messages = [{"role": "user", "content": "Hi"}]
        priority_llm.chat([messages, messages], SamplingParams(max_tokens=2), priority=priority)
    assert not priority_llm.engine.has_unfinished_requests()


def test_the_async_engine_passes_the_priority_on(tiny_llama_dir: str) -> None:
    settings = EngineSettings(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority"
    )
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def scenario() -> list[str]:
        engine = AsyncEngine(await in_torch_thread(LLMEngine.from_settings, settings))
        engine.start()
        finished: list[str] = []

        async def one(request_id: str, priority: int) -> None:
            async for delta in engine.generate(request_id, HIGH_PROMPT, params, priority=priority):
                if delta.request_finished:
                    finished.append(request_id)

        try:
            async with asyncio.timeout(60):
                await asyncio.gather(one("a", 1), one("b", -1), one("c", 0))
        finally:
            await engine.stop()
        return finished

    assert asyncio.run(scenario()) == ["b", "c", "a"]


def test_the_async_engine_refuses_a_priority_under_fcfs(tiny_llama_dir: str) -> None:
    settings = EngineSettings(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)

    async def scenario() -> None:
        engine = AsyncEngine(await in_torch_thread(LLMEngine.from_settings, settings))
        engine.check("x", HIGH_PROMPT, SamplingParams(max_tokens=2), 0)
        with pytest.raises(
            InvalidRequestError, match=r"^priority: got -1, but the scheduling policy is fcfs"
        ):
            engine.check("x", HIGH_PROMPT, SamplingParams(max_tokens=2), -1)
        with pytest.raises(InvalidRequestError, match=r"^priority: got 2, but"):
            await anext(engine.generate("y", HIGH_PROMPT, SamplingParams(max_tokens=2), priority=2))
        assert engine.num_live_requests == 0
        await engine.stop()

    asyncio.run(scenario())
