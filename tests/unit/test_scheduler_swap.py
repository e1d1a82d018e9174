"""Scheduler preemption by swap with exact block maps, and swapped requests resuming before new ones."""

from __future__ import annotations

import logging
import re

import pytest
from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import FinishReason, Sequence, SequenceStatus
from scheduler_steps import run


def make(num_blocks: int, num_cpu_blocks: int, mode: str = "swap") -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, preemption_mode=mode
    )
    return Scheduler(config, BlockManager(num_blocks, 4, watermark=0.0, num_cpu_blocks=num_cpu_blocks))


def add(scheduler: Scheduler, request_id: str, num_prompt: int, max_tokens: int = 6) -> Sequence:
    seq = Sequence(request_id, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(seq)
    return seq


def test_youngest_request_is_swapped_out_and_resumes_first() -> None:
    s = make(num_blocks=4, num_cpu_blocks=4)
    a, b = add(s, "a", 8), add(s, "b", 4)
    run(s)  # a: blocks [0, 1] full, b: block [2] full; each sampled one token
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    out = run(s)  # both need a new block: 1 free; b (younger) is swapped out, a grows
    assert b.status is SequenceStatus.SWAPPED and out.blocks_to_swap_out == [(2, 0)]
    assert out.freed_request_ids == ["b"] and [r.request_id for r in out.scheduled] == ["a"]
    assert a.block_table == [0, 1, 3] and s.num_swap_preemptions == 1
    c = add(s, "c", 2)  # arrives while b is swapped out: b must come back first
    s.finish(a, FinishReason.STOP)
    out = run(s)  # the pool is free again: b's CPU block 0 returns to device block 0, its start
    assert out.blocks_to_swap_in == [(0, 0)]
    first = out.scheduled[0]
    assert first.request_id == "b" and first.is_new and first.num_computed_tokens == 4
    assert first.token_ids == [7] and first.new_block_ids == b.block_table == [0, 1]
    assert first.computed_token_ids == [1, 2, 3, 4]
    assert [r.request_id for r in out.scheduled] == ["b", "c"]  # c admitted only after b resumed
    assert c.block_table == [2]
    assert s.block_manager.num_free_cpu_blocks == 4


def test_recompute_mode_frees_blocks_and_restarts_from_zero() -> None:
    s = make(num_blocks=4, num_cpu_blocks=4, mode="recompute")
    add(s, "a", 8)
    b = add(s, "b", 4)
    run(s)
    out = run(s)
    assert out.blocks_to_swap_out == [] and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == [] and s.num_recompute_preemptions == 1


def test_preemptions_warn_on_the_first_and_every_50th_and_each_is_logged_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three requests of 4 + 12 tokens in 6 blocks of 4, refilled as they finish, preempt each other
    120 times, by swap while the 3 CPU blocks have room and by recompute when they do not. A line per
    preemption flooded the log at INFO; now 3 warnings (the 1st, 50th and 100th) carry the counts so
    far, as the DEBUG lines before them tally them, and the remedy."""
    s = make(num_blocks=6, num_cpu_blocks=3)
    num_requests = 0
    with caplog.at_level(logging.DEBUG, logger="pagedserve.core.scheduler"):
        while s.num_preemptions < 120:
            while len(s.requests) < 3:
                add(s, f"r{num_requests}", 4, max_tokens=12)
                num_requests += 1
            run(s)
    assert s.num_preemptions == 120 and s.num_swap_preemptions and s.num_recompute_preemptions
    assert not [r for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 120
    assert all(
        re.fullmatch(r"preempted r\d+ by (swapping \d+ blocks to CPU|recompute) \(\d+ tokens\): .+", m)
        for m in debug
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    for n, warning in zip((1, 50, 100), warnings, strict=True):
        num_swaps = sum("by swapping" in m for m in debug[:n])
        assert debug[n - 1] in warning  # the n-th preemption's request, how, tokens and reason
        assert f"total_num_cumulative_preemption={n} (swap {num_swaps}, recompute {n - num_swaps})" in warning
        assert "raise --kv-cache-memory (or --swap-space)" in warning


def test_a_model_with_a_state_per_sequence_recomputes_and_forks_from_the_first_token() -> None:
    """Under `recurrent_state` (LFM2's convolutions, whose state only the steps computing a sequence
    build) a preempted sequence, of a parallel-sampling request too, is recomputed although the mode
    and the CPU pool would swap it, and a forked sibling shares none of its parent's blocks: the
    workers meet each again at its first token."""
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, recurrent_state=True
    )
    s = Scheduler(config, BlockManager(6, 4, watermark=0.0, num_cpu_blocks=8))
    a = Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=6))
    b = Sequence("b", list(range(1, 9)), SamplingParams(max_tokens=6))
    a.pending_forks = [b]
    a.is_multi_sequence = b.is_multi_sequence = True
    s.add(a)
    run(s)  # a's prompt computed: b forks from it, sharing none of its blocks
    assert b.block_table == [] and b.num_computed_tokens == 0
    out = run(s)
    assert b.block_table and not set(b.block_table) & set(a.block_table)
    (announced,) = [r for r in out.scheduled if r.request_id == "b"]
    assert (
        announced.is_new and announced.num_computed_tokens == 0 and announced.token_ids == a.prompt_token_ids
    )
    assert announced.computed_token_ids == []
    while not s.num_preemptions:  # 6 blocks of 4 for two sequences of 8 + 6 tokens: one gives way
        out = run(s)
    assert s.num_swap_preemptions == 0 and out.blocks_to_swap_out == []
    assert s.num_recompute_preemptions == 1 and s.block_manager.num_free_cpu_blocks == 8
    (victim,) = [seq for seq in (a, b) if seq.status is SequenceStatus.WAITING]
    assert victim.num_computed_tokens == 0 and victim.block_table == []
