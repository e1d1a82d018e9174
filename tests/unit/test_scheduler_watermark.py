"""The watermark in the scheduler: admission, swap-in and recompute readmission keep it free even in an
otherwise empty pool, so add() rejects what could only ever run by eating into it, and everything it
accepts finishes (nothing is accepted and then left waiting forever, holding up the queue behind it)."""

from __future__ import annotations

import random

import pytest
from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import FinishReason, Sequence, SequenceStatus


def make(
    num_blocks: int = 10,
    block_size: int = 4,
    watermark: float = 0.1,
    budget: int = 64,
    mode: str = "swap",
    num_cpu_blocks: int = 16,
    max_model_len: int = 64,
    enable_prefix_caching: bool = False,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len, preemption_mode=mode
    )
    manager = BlockManager(num_blocks, block_size, watermark, num_cpu_blocks, enable_prefix_caching)
    return Scheduler(config, manager)


def add(s: Scheduler, request_id: str, num_prompt: int, max_tokens: int, first: int = 1) -> Sequence:
    seq = Sequence(request_id, list(range(first, first + num_prompt)), SamplingParams(max_tokens=max_tokens))
    s.add(seq)
    return seq


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = [r.request_id for r in out.scheduled if r.do_sample]
    s.update(out, ModelRunnerOutput(sampled, [7] * len(sampled)))
    return out


def run_to_completion(s: Scheduler, max_num_steps: int) -> int:
    """Steps until every request has finished; fails if that takes more than `max_num_steps`."""
    for num_steps in range(1, max_num_steps + 1):
        step(s)
        if not s.has_unfinished_requests():
            return num_steps
    raise AssertionError(f"still unfinished after {max_num_steps} steps: {list(s.requests.values())}")


def test_repro_prompt_that_fits_only_by_eating_the_watermark_is_rejected_and_the_queue_moves() -> None:
    # 100 blocks of 16, watermark 1 block: one request may hold 99 blocks = 1584 tokens in KV
    s = make(num_blocks=100, block_size=16, watermark=0.01, budget=2048, max_model_len=4096)
    with pytest.raises(InvalidRequestError) as info:
        add(s, "big", 1590, max_tokens=10)  # its prompt alone needs 100 blocks
    assert info.value.field == "prompt" and "big" not in s.requests
    assert "never fit" in info.value.message and "watermark of 1" in info.value.message
    small = add(s, "small", 10, max_tokens=3)
    assert run_to_completion(s, max_num_steps=3) == 3
    assert small.finish_reason is FinishReason.LENGTH and small.output_token_ids == [7, 7, 7]
    assert s.block_manager.num_free_blocks == 100


def test_largest_accepted_request_is_admitted_at_the_exact_boundary_and_the_queue_behind_it_runs() -> None:
    s = make(num_blocks=100, block_size=16, watermark=0.01, budget=2048, max_model_len=4096)
    with pytest.raises(InvalidRequestError) as info:
        add(s, "over", 1575, max_tokens=11)  # 1585 tokens in KV: 100 blocks
    assert info.value.field == "max_tokens"
    big = add(s, "big", 1575, max_tokens=10)  # 1584 tokens in KV: exactly 99 blocks
    small = add(s, "small", 10, max_tokens=3)
    out = step(s)  # the prompt takes 99 blocks, leaving exactly the watermark: small must wait
    assert [r.request_id for r in out.scheduled] == ["big"] and len(big.block_table) == 99
    assert s.block_manager.num_free_blocks == 1 and s.waiting == [small]
    run_to_completion(s, max_num_steps=9 + 3)
    assert big.output_token_ids == [7] * 10 and small.output_token_ids == [7] * 3
    assert s.block_manager.num_free_blocks == 100


def test_the_same_request_fits_without_a_watermark() -> None:
    s = make(watermark=0.0)  # 10 blocks of 4: 40 tokens in KV
    add(s, "b", 32, max_tokens=9)
    with pytest.raises(InvalidRequestError):
        make(watermark=0.1).add(Sequence("b", list(range(32)), SamplingParams(max_tokens=9)))


def preempt_the_boundary_request(mode: str) -> tuple[Scheduler, Sequence, Sequence]:
    """a (older) and b (36 tokens in KV at most: 9 blocks, the most one request may hold) both run; b
    is preempted when a grows into the last block."""
    s = make(mode=mode)
    with pytest.raises(InvalidRequestError):
        add(s, "one-more", 32, max_tokens=6)
    a, b = add(s, "a", 4, max_tokens=3), add(s, "b", 32, max_tokens=5, first=100)
    step(s)  # a: [0], b: [1 .. 8], the watermark block 9 free; each samples a token
    assert (a.block_table, b.block_table) == ([0], list(range(1, 9)))
    step(s)  # a takes block 9; b needs a 9th block: none left, b is preempted
    assert a.block_table == [0, 9] and s.num_preemptions == 1 and b.block_table == []
    return s, a, b


def test_swap_in_at_the_exact_boundary_once_the_pool_is_otherwise_empty() -> None:
    s, a, b = preempt_the_boundary_request("swap")
    assert b.status is SequenceStatus.SWAPPED and s.block_manager.cpu_block_tables == {"b": list(range(8))}
    out = step(s)  # 8 free, b needs 9: it waits; a samples its last token and finishes
    assert [r.request_id for r in out.scheduled] == ["a"] and a.finish_reason is FinishReason.LENGTH
    out = step(s)  # 10 free, b needs 9: 10 - 9 == the watermark; the pool is free, b starts at 0
    assert out.blocks_to_swap_in == list(zip(range(8), range(8)))
    assert b.block_table == list(range(9)) and s.block_manager.num_free_blocks == 1
    run_to_completion(s, max_num_steps=4)
    assert b.output_token_ids == [7] * 5 and s.block_manager.num_free_blocks == 10


def test_recompute_readmission_at_the_exact_boundary_once_the_pool_is_otherwise_empty() -> None:
    s, a, b = preempt_the_boundary_request("recompute")
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_tokens == 33
    out = step(s)  # 8 free, b needs 9 for its 33 tokens: it waits; a finishes
    assert [r.request_id for r in out.scheduled] == ["a"] and a.is_finished
    out = step(s)  # readmitted: 33 tokens in 9 blocks, 10 - 9 == the watermark
    assert [(r.request_id, r.num_computed_tokens, len(r.token_ids)) for r in out.scheduled] == [("b", 0, 33)]
    assert len(b.block_table) == 9 and s.block_manager.num_free_blocks == 1
    run_to_completion(s, max_num_steps=4)
    assert b.output_token_ids == [7] * 5 and s.block_manager.num_free_blocks == 10


def test_admission_keeps_the_watermark_while_another_request_runs() -> None:
    s = make()
    a = add(s, "a", 3, max_tokens=2)
    step(s)  # a holds 1 block: 9 free
    b = add(s, "b", 33, max_tokens=3, first=100)  # 9 blocks would fit the 9 free, not with the watermark
    out = step(s)
    assert [r.request_id for r in out.scheduled] == ["a"] and s.waiting == [b] and a.is_finished
    out = step(s)
    assert [r.request_id for r in out.scheduled] == ["b"] and s.block_manager.num_free_blocks == 1


def parallel_sequences(request_id: str, prompt: list[int], n: int, max_tokens: int) -> list[Sequence]:
    """A request's sequences as the engine queues them: siblings fork from the first (n > 1)."""
    seqs = [Sequence(f"{request_id}#{i}", prompt, SamplingParams(max_tokens=max_tokens)) for i in range(n)]
    seqs[0].pending_forks = seqs[1:]
    for seq in seqs:
        seq.is_multi_sequence = n > 1
    return seqs


@pytest.mark.parametrize("seed", range(4))
def test_every_accepted_request_finishes_under_random_pressure(seed: int) -> None:
    """Random pools, watermarks, budgets, modes, request sizes and n: whatever add() accepts finishes
    within a bounded number of steps, and both pools are whole again at the end."""
    rng = random.Random(seed)
    for _ in range(50):
        num_blocks, block_size = rng.randint(4, 24), rng.choice([2, 4, 8])
        s = make(
            num_blocks=num_blocks,
            block_size=block_size,
            watermark=rng.choice([0.0, 0.05, 0.1, 0.2, 0.3]),
            budget=rng.choice([4, 8, 32, 256]),
            mode=rng.choice(["swap", "recompute"]),
            num_cpu_blocks=rng.randint(0, 2 * num_blocks),
            max_model_len=num_blocks * block_size + 8,
            enable_prefix_caching=rng.random() < 0.5,
        )
        accepted: list[Sequence] = []
        for i in range(rng.randint(1, 12)):
            prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, num_blocks * block_size))]
            seqs = parallel_sequences(
                f"r{i}", prompt, rng.choice([1, 1, 1, 2, 3]), rng.randint(1, 2 * block_size)
            )
            try:
                s.add(seqs[0])
            except InvalidRequestError:
                continue
            accepted.extend(seqs)
        run_to_completion(s, max_num_steps=sum(q.max_num_tokens for q in accepted) + 10)
        assert all(q.finish_reason is FinishReason.LENGTH for q in accepted)
        assert s.block_manager.num_free_blocks == num_blocks
        assert s.block_manager.num_free_cpu_blocks == s.block_manager.num_cpu_blocks
