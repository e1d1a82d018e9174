"""Memory pressure on a tiny random Llama: swap and recompute preemption, prefix caching, chunked
prefill and parallel sampling all leave greedy outputs exactly as an unconstrained run's."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import InvalidRequestError


def mixed_workload(num_requests: int = 64, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [
        [1] + [rng.randrange(3, 49152) for _ in range(rng.randint(3, 60))] for _ in range(num_requests)
    ]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 40), ignore_eos=True) for _ in prompts]
    return prompts, params


def token_ids(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    return mixed_workload()


@pytest.fixture(scope="module")
def unconstrained(
    tiny_llama_dir: str, workload: tuple[list[list[int]], list[SamplingParams]]
) -> list[list[int]]:
    llm = LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=1024, block_size=8, enable_prefix_caching=False
    )
    out = token_ids(llm, *workload)
    assert llm.engine.stats().num_preemptions == 0
    return out


def test_swap_preemption_keeps_outputs(tiny_llama_dir: str, workload: tuple, unconstrained: list) -> None:
    # 40 blocks of 8 tokens cannot hold 64 requests of up to 100 tokens: preempt by swapping to CPU
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=40,
        block_size=8,
        num_cpu_kv_blocks=200,
        preemption_mode="swap",
        max_num_seqs=32,
        max_num_batched_tokens=256,
    )
    assert token_ids(llm, *workload) == unconstrained
    stats = llm.engine.stats()
    assert stats.num_swap_preemptions > 0 and stats.num_swapped_out_blocks > 0
    assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks  # every swapped request came back
    assert stats.num_free_blocks == 40 and stats.num_free_cpu_blocks == 200


def test_swap_space_in_gib_sizes_the_cpu_pool_and_swapping_keeps_outputs(
    tiny_llama_dir: str, workload: tuple, unconstrained: list
) -> None:
    # The CPU pool from --swap-space: GiB over the bytes of one block (keys and values of every layer
    # and KV head for block_size tokens, float32), derived here from the checkpoint's config.
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    swap_space = 0.00075  # GiB: 786 KiB, room for ~196 blocks of 8 tokens
    expected_num_cpu_blocks = int(swap_space * 1024**3) // (8 * bytes_per_token)
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=40,
        block_size=8,
        swap_space=swap_space,
        preemption_mode="swap",
        max_num_seqs=32,
        max_num_batched_tokens=256,
    )
    stats = llm.engine.stats()
    assert stats.num_total_cpu_blocks == expected_num_cpu_blocks == 196
    cpu_cache = llm.engine.executor.worker.cache_engine.cpu_cache  # the host tensor really allocated
    assert cpu_cache.shape[2] == expected_num_cpu_blocks
    assert cpu_cache.numel() * cpu_cache.element_size() <= swap_space * 1024**3
    assert token_ids(llm, *workload) == unconstrained
    stats = llm.engine.stats()
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions == 0
    assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks > 0
    assert stats.num_free_cpu_blocks == expected_num_cpu_blocks


def test_recompute_only_keeps_outputs(tiny_llama_dir: str, workload: tuple, unconstrained: list) -> None:
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=40,
        block_size=8,
        swap_space=0,
        max_num_seqs=32,
        max_num_batched_tokens=256,
    )
    assert token_ids(llm, *workload) == unconstrained
    stats = llm.engine.stats()
    assert stats.num_recompute_preemptions > 0 and stats.num_swap_preemptions == 0


def test_full_swap_space_falls_back_to_recompute(
    tiny_llama_dir: str, workload: tuple, unconstrained: list
) -> None:
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=40,
        block_size=8,
        num_cpu_kv_blocks=12,
        max_num_seqs=32,
        max_num_batched_tokens=256,
    )
    assert token_ids(llm, *workload) == unconstrained
    stats = llm.engine.stats()
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions > 0


def test_request_that_can_never_fit_leaves_others_unaffected(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=6, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = token_ids(llm, [[1, 2, 3]], [params])[0]
    engine = llm.engine
    engine.add_request("fits", [1, 2, 3], params)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("too-big", [1] * 30, SamplingParams(max_tokens=40))
    assert info.value.field == "max_tokens" and "never fit" in info.value.message
    tokens = drain(engine)
    assert list(tokens) == ["fits"] and len(alone) == 20 and tokens["fits"] == alone
    assert engine.stats().num_free_blocks == 6


def step(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    for delta in engine.step():
        tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)


def drain(engine: LLMEngine, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    tokens = {} if tokens is None else tokens
    while engine.has_unfinished_requests():
        step(engine, tokens)
    return tokens


SYSTEM = [1] + list(range(2000, 2045))  # 46 tokens: 5 full blocks of 8 and a partial one


def test_prefix_caching_shares_blocks_of_a_common_system_prompt(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    engine.add_request("a", SYSTEM + [300, 301, 302], params)
    step(engine, tokens)  # a's prompt is computed: its 6 full blocks are now cached
    a_blocks = list(engine.scheduler.requests["a"].block_table)
    engine.add_request("b", SYSTEM + [400, 401], params)
    step(engine, tokens)
    b = engine.scheduler.requests["b"]
    shared = a_blocks[:5]  # SYSTEM's full blocks; block 6 mixes SYSTEM with a's own tokens
    assert b.block_table[:5] == shared and b.block_table[5] not in a_blocks
    assert [engine.scheduler.block_manager.ref_counts[i] for i in shared] == [2] * 5
    assert engine.stats().num_prefix_hits == 5 * 8
    cached = drain(engine, tokens)
    off = LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, enable_prefix_caching=False
    )
    uncached = [
        o.outputs[0].token_ids for o in off.generate([SYSTEM + [300, 301, 302], SYSTEM + [400, 401]], params)
    ]
    assert [cached["a"], cached["b"]] == uncached


def test_prefix_cache_on_and_off_give_the_same_greedy_outputs(
    tiny_llama_dir: str, unconstrained: list
) -> None:
    prompts, params = mixed_workload()
    shared = [SYSTEM + p[1:] for p in prompts[:16]]
    on = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=300, block_size=8)
    off = LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=300, block_size=8, enable_prefix_caching=False
    )
    expected = token_ids(off, shared, params[:16])
    assert token_ids(on, shared[:1], params[:1]) == expected[:1]  # caches SYSTEM's blocks
    assert token_ids(on, shared, params[:16]) == expected
    assert on.engine.stats().num_prefix_hits > 0 and off.engine.stats().num_prefix_hits == 0


def test_requests_arriving_together_share_a_system_prompt_computed_in_their_first_step(
    tiny_llama_dir: str,
) -> None:
    # A cold cache: all 16 prompts are admitted in one step, and the first computes SYSTEM's 5 full
    # blocks in it; every layer writes the step's K/V before any token attends, so the other 15 read them.
    prompts, params = mixed_workload()
    shared = [SYSTEM + p[1:] for p in prompts[:16]]
    off = LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=300, block_size=8, enable_prefix_caching=False
    )
    on = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=300, block_size=8)
    assert token_ids(on, shared, params[:16]) == token_ids(off, shared, params[:16])
    assert on.engine.stats().num_prefix_hits == 15 * 40


def test_a_failed_step_names_no_block_it_shared_and_the_prompts_run_afresh(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [SYSTEM + [300, 301, 302], SYSTEM + [400, 401]]
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[1], params)
    execute, planned = engine.executor.execute, []

    def fail(output: Any) -> Any:
        planned.extend((r.request_id, r.num_computed_tokens, len(r.token_ids)) for r in output.scheduled)
        raise RuntimeError("injected model fault")

    engine.executor.execute = fail  # type: ignore[method-assign]
    deltas = engine.step()
    engine.executor.execute = execute  # type: ignore[method-assign]
    assert planned == [("a", 0, 49), ("b", 40, 8)]  # b was to read SYSTEM's blocks as a wrote them
    assert sorted(d.request_id for d in deltas) == ["a", "b"] and all(d.error for d in deltas)
    manager = engine.scheduler.block_manager
    assert not manager.cached_block_ids and manager.num_free_blocks == 64
    off = LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, enable_prefix_caching=False
    )
    assert token_ids(llm, prompts, [params, params]) == token_ids(off, prompts, [params, params])


def test_evicted_block_is_never_read_as_cached(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=12, block_size=8)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = token_ids(llm, [SYSTEM], [params])  # 49 computed tokens: 6 full blocks cached, ref count 0
    manager = engine.scheduler.block_manager
    assert list(manager.evictor) == [5, 4, 3, 2, 1, 0]  # the tail is evicted first
    # another prompt needs 11 of the 12 blocks: 6 never-cached ones, then 5 evicted (LRU: tail first)
    token_ids(llm, [[1] + list(range(5000, 5080))], [params])
    system_hashes = list(manager._block_hashes(None, SYSTEM, 0, 6))
    assert manager.cached_block_ids.get(system_hashes[0]) == 0  # SYSTEM's first block survived
    assert not set(system_hashes[1:]) & manager.cached_block_ids.keys()  # the evicted ones are forgotten
    hits_before = engine.stats().num_prefix_hits
    again = token_ids(llm, [SYSTEM], [params])
    assert engine.stats().num_prefix_hits - hits_before == 8  # only the surviving block is reused
    assert again == first  # whatever was evicted was recomputed, not read


def test_chunked_prefill_matches_unchunked(tiny_llama_dir: str) -> None:
    prompts = [[1] + list(range(700, 700 + n)) for n in (300, 5, 120, 33)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    whole = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
    )
    chunked = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    assert token_ids(chunked, prompts, [params] * 4) == token_ids(whole, prompts, [params] * 4)


def test_parallel_sampling_is_reproducible_and_shares_prompt_blocks(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8)
    engine = llm.engine
    prompt = SYSTEM + [77, 78]  # 48 tokens: 6 full blocks, the last shared one holds the last prompt token
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    engine.add_request("p", prompt, params)
    engine.step()  # the parent's prefill; its siblings fork from it
    seqs = [engine.scheduler.requests[f"p#{i}"] for i in range(4)]
    prompt_blocks = seqs[0].block_table[:5]
    assert all(s.block_table[:5] == prompt_blocks for s in seqs)
    assert [engine.scheduler.block_manager.ref_counts[b] for b in prompt_blocks] == [4] * 5
    assert all(s.block_table[5] == seqs[0].block_table[5] for s in seqs)  # the last prompt block too
    engine.step()  # each sibling recomputes the last prompt token: copy on write of the shared block
    assert len({s.block_table[5] for s in seqs}) == 4
    assert all(s.block_table[:5] == prompt_blocks for s in seqs)
    drain(engine)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert engine.stats().num_free_blocks == 64
