"""Prefix sharing within one step: a request admitted after another in the same step reuses the full
blocks the other is scheduled to compute, and a step that never ran leaves no block named."""

from __future__ import annotations

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import FinishReason, Sequence

SHARED = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]  # blocks of 4: two full blocks, then 2 tokens


def make(budget: int = 64, caching: bool = True) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64, preemption_mode="recompute"
    )
    return Scheduler(config, BlockManager(32, 4, watermark=0.0, enable_prefix_caching=caching))


def add(s: Scheduler, request_id: str, prompt: list[int]) -> Sequence:
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=4))
    s.add(seq)
    return seq


def run(s: Scheduler, out: SchedulerOutput) -> None:
    sampled = [r.request_id for r in out.scheduled if r.do_sample]
    s.update(out, ModelRunnerOutput(sampled, [9] * len(sampled)))


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(r.request_id, r.num_computed_tokens, len(r.token_ids)) for r in out.scheduled]


def test_a_request_admitted_in_the_same_step_reads_the_prefix_another_computes() -> None:
    s = make()
    a = add(s, "a", SHARED + [1, 2, 3])
    b = add(s, "b", SHARED + [4])
    c = add(s, "c", SHARED[:8] + [5, 6])
    out = s.schedule()
    # b and c start after the two full blocks a computes in this very step
    assert plan(out) == [("a", 0, 13), ("b", 8, 3), ("c", 8, 2)]
    assert b.block_table[:2] == c.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table and c.block_table[2] != b.block_table[2]
    bm = s.block_manager
    assert [bm.ref_counts[i] for i in a.block_table[:2]] == [3, 3]
    assert not bm.cached_block_ids  # named only once the step has run
    assert bm.num_prefix_hits == 2 * 8
    run(s, out)
    assert [bm.cached_block_ids[h] for h in bm.seq_hashes["a"][:2]] == a.block_table[:2]
    assert bm.seq_hashes["b"][:2] == bm.seq_hashes["c"][:2] == bm.seq_hashes["a"][:2]
    assert plan(s.schedule()) == [("a", 13, 1), ("b", 11, 1), ("c", 10, 1)]


def test_a_prompt_chunk_offers_the_blocks_it_fills_and_named_blocks_chain_with_them() -> None:
    s = make(budget=7)
    a = add(s, "a", SHARED + [1])
    b = add(s, "b", SHARED + [4])
    out = s.schedule()  # a's first chunk fills block 0 and 3 slots of block 1; no budget is left for b
    assert plan(out) == [("a", 0, 7)]
    assert list(s.block_manager.filling_block_ids.values()) == a.block_table[:1]
    run(s, out)
    out = s.schedule()  # b: block 0 named after the last step, block 1 filled by a in this one
    assert plan(out) == [("a", 7, 4), ("b", 8, 3)]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]


def test_a_step_that_never_ran_leaves_no_block_named() -> None:
    s = make()
    a = add(s, "a", SHARED + [1])
    b = add(s, "b", SHARED + [2])
    out = s.schedule()
    assert plan(out) == [("a", 0, 11), ("b", 8, 3)]
    shared = a.block_table[:2]
    s.finish(a, FinishReason.ERROR)  # what the engine does when the model step raises
    s.finish(b, FinishReason.ERROR)
    bm = s.block_manager
    assert not bm.cached_block_ids and not bm.evictor
    assert all(bm.ref_counts[i] == 0 and i in bm.free_block_ids for i in shared)
    add(s, "c", SHARED + [3])
    assert plan(s.schedule()) == [("c", 0, 11)]  # computed afresh: nothing was written for it


def test_without_prefix_caching_nothing_is_shared() -> None:
    s = make(caching=False)
    a = add(s, "a", SHARED + [1])
    b = add(s, "b", SHARED + [2])
    assert plan(s.schedule()) == [("a", 0, 11), ("b", 0, 11)]
    assert not set(a.block_table) & set(b.block_table)
