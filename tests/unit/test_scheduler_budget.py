"""Scheduler budgets with tiny capacities: token budget, max_num_seqs, chunked prefill, FCFS admission,
decodes before admissions, the youngest request as the recompute victim, rejection of what can never fit."""

from __future__ import annotations

import pytest
from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 16, budget: int = 16, max_seqs: int = 4) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64, preemption_mode="recompute"
    )
    return Scheduler(config, BlockManager(num_blocks, 4, watermark=0.0))


def add(s: Scheduler, request_id: str, num_prompt: int, max_tokens: int = 8) -> Sequence:
    seq = Sequence(request_id, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens))
    s.add(seq)
    return seq


def step(s: Scheduler, token: int = 9) -> SchedulerOutput:
    out = s.schedule()
    sampled = [r.request_id for r in out.scheduled if r.do_sample]
    s.update(out, ModelRunnerOutput(sampled, [token] * len(sampled)))
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(r.request_id, r.num_computed_tokens, len(r.token_ids), r.do_sample) for r in out.scheduled]


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget() -> None:
    s = make(budget=8)
    a = add(s, "a", 20)
    assert plan(step(s)) == [("a", 0, 8, False)]
    assert plan(step(s)) == [("a", 8, 8, False)]
    assert a.num_computed_tokens == 16 and a.block_table == [0, 1, 2, 3]
    assert plan(step(s)) == [("a", 16, 4, True)]  # the last chunk samples
    assert a.output_token_ids == [9] and plan(step(s)) == [("a", 20, 1, True)]


def test_running_decodes_come_before_new_admissions_and_share_the_budget() -> None:
    s = make(budget=6)
    add(s, "a", 5)
    step(s)
    add(s, "b", 7)
    add(s, "c", 2)
    out = step(s)  # a decodes (1 token), b gets the 5 left; c waits (budget spent)
    assert plan(out) == [("a", 5, 1, True), ("b", 0, 5, False)]
    assert out.num_batched_tokens == 6
    assert plan(step(s)) == [("a", 6, 1, True), ("b", 5, 2, True), ("c", 0, 2, True)]


def test_max_num_seqs_caps_the_batch_in_arrival_order() -> None:
    s = make(max_seqs=2)
    for name in ("a", "b", "c"):
        add(s, name, 2)
    assert [r[0] for r in plan(step(s))] == ["a", "b"]
    assert [seq.request_id for seq in s.waiting] == ["c"]


def test_youngest_running_request_is_preempted_by_recompute() -> None:
    s = make(num_blocks=4)
    a, b = add(s, "a", 8), add(s, "b", 4)
    step(s)  # a: [0, 1], b: [2]; free: [3]
    out = step(s)  # both need a block, 1 is free: b (younger) is preempted, a grows into 3
    assert plan(out) == [("a", 8, 1, True)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert out.freed_request_ids == ["b"] and a.block_table == [0, 1, 3]
    assert s.block_manager.ref_counts == [1, 1, 0, 1] and s.num_recompute_preemptions == 1
    assert b.num_tokens == 5  # its sampled token is kept and recomputed with the prompt


def test_nothing_is_admitted_in_a_step_that_preempted() -> None:
    s = make(num_blocks=4)
    add(s, "a", 8)
    add(s, "b", 4)
    step(s)
    add(s, "c", 1)
    out = step(s)
    assert [r[0] for r in plan(out)] == ["a"]


def test_requests_that_can_never_fit_are_rejected() -> None:
    s = make(num_blocks=4)  # 16 token slots; the last sampled token never takes one
    with pytest.raises(InvalidRequestError) as info:
        add(s, "big", 10, max_tokens=8)
    assert info.value.field == "max_tokens" and "big" not in s.requests
    with pytest.raises(InvalidRequestError) as prompt:
        add(s, "long", 17, max_tokens=1)
    assert prompt.value.field == "prompt"
    add(s, "ok", 10, max_tokens=7)
    with pytest.raises(InvalidRequestError) as dup:
        add(s, "ok", 2)
    assert dup.value.field == "request_id"


def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    s = make(num_blocks=8, max_seqs=1)
    add(s, "a", 6)
    add(s, "b", 3)
    step(s)
    assert s.block_manager.num_free_blocks == 6
    aborted = s.abort(["a", "b", "unknown"])
    assert [q.request_id for q in aborted] == ["a", "b"]
    assert s.block_manager.num_free_blocks == 8 and not s.has_unfinished_requests()
    assert all(q.finish_reason is not None and q.finish_reason.value == "aborted" for q in aborted)
