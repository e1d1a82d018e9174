"""Seeded random workloads against the scheduler and block manager, with tiny pools and budgets,
and a few on the tiny real model where memory pressure must leave outputs unchanged.

A pure-Python stand-in for the workers keeps a simulated KV cache (one token id per slot), performs
the step's swap-out, swap-in and copies, writes every scheduled token into its slot and then reads
each request's whole context back through the block table it was told of: any block shared or
reused wrongly, any swap or copy-on-write missed, shows up as a context that differs from the
request's tokens. It also holds the workers' per-request state, so a request announced as new while
the workers already know it (or run without being announced) fails the step. The sampled token is
a function of the sequence and its context, so every sequence that finishes must produce exactly
what it would alone. After every step the pools and queues are checked against each other; at the
end nothing is held.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from pagedserve import LLM
from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import FinishReason, Sequence, SequenceStatus

EOS = 2


def next_token(seq_id: str, context: list[int]) -> int:
    """The model: deterministic in the sequence and its whole context (EOS now and then)."""
    return zlib.crc32(repr((seq_id, context)).encode()) % 97 + 2


def expected_output(seq_id: str, prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    while True:
        tokens.append(next_token(seq_id, tokens))
        num_output = len(tokens) - len(prompt)
        if num_output >= params.min_tokens and not params.ignore_eos and tokens[-1] == EOS:
            return tokens[len(prompt) :]
        if num_output >= params.max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt) :]


@dataclass
class WorkerState:
    block_table: list[int]
    num_tokens: int


@dataclass
class FakeWorkers:
    """What the workers see of the scheduler: plain `SchedulerOutput`s only."""

    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    states: dict[str, WorkerState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv: list[list[int | None]] = [[None] * self.block_size for _ in range(self.num_blocks)]
        self.cpu_kv: list[list[int | None]] = [[None] * self.block_size for _ in range(self.num_cpu_blocks)]

    def execute(self, out: SchedulerOutput, truth: dict[str, list[int]]) -> ModelRunnerOutput:
        for request_id in out.freed_request_ids:
            self.states.pop(request_id, None)
        for src, dst in out.blocks_to_swap_out:
            self.cpu_kv[dst] = list(self.kv[src])
        for src, dst in out.blocks_to_swap_in:
            self.kv[dst] = list(self.cpu_kv[src])
        sources = [list(self.kv[src]) for src, _ in out.blocks_to_copy]
        for (_, dst), data in zip(out.blocks_to_copy, sources):
            self.kv[dst] = data
        for req in out.scheduled:  # every token's K/V is written before any token attends
            tokens = truth[req.request_id]
            start, end = req.num_computed_tokens, req.num_computed_tokens + len(req.token_ids)
            assert req.token_ids == tokens[start:end], req
            if req.is_new:
                assert req.request_id not in self.states, f"{req.request_id} announced twice"
                assert req.computed_token_ids == tokens[:start]
                self.states[req.request_id] = WorkerState(list(req.new_block_ids), start)
            else:
                assert req.request_id in self.states, f"{req.request_id} unknown to the workers"
                self.states[req.request_id].block_table.extend(req.new_block_ids)
            state = self.states[req.request_id]
            assert state.num_tokens == start and len(state.block_table) * self.block_size >= end
            for pos in range(start, end):
                self.kv[state.block_table[pos // self.block_size]][pos % self.block_size] = tokens[pos]
            state.num_tokens = end
        request_ids, sampled = [], []
        for req in out.scheduled:
            table = self.states[req.request_id].block_table
            end = req.num_computed_tokens + len(req.token_ids)
            context = [self.kv[table[pos // self.block_size]][pos % self.block_size] for pos in range(end)]
            assert context == truth[req.request_id][:end], f"{req.request_id} read wrong KV"
            if req.do_sample:
                assert end == len(truth[req.request_id])
                request_ids.append(req.request_id)
                sampled.append(next_token(req.request_id, context))
        return ModelRunnerOutput(request_ids, sampled)


def check_invariants(s: Scheduler) -> None:
    bm = s.block_manager
    live = list(s.requests.values())
    queued = s.waiting + s.running + s.swapped
    assert len(queued) == len({id(q) for q in queued}), "a sequence in two queues"
    pending = [f for seq in live for f in seq.pending_forks]
    assert {q.request_id for q in queued} | {f.request_id for f in pending} == set(s.requests)
    for queue, status in ((s.waiting, SequenceStatus.WAITING), (s.running, SequenceStatus.RUNNING)):
        assert all(q.status is status for q in queue)
    assert all(q.status is SequenceStatus.SWAPPED for q in s.swapped)
    for queue in (s.waiting, s.running, s.swapped):
        assert [q.arrival_order for q in queue] == sorted(q.arrival_order for q in queue)
    assert len(s.running) <= s.config.max_num_seqs
    # device pool: ref counts are exactly the holders; free list and evictor hold the rest
    holders: dict[int, list[Sequence]] = {}
    for seq in s.running:
        assert len(set(seq.block_table)) == len(seq.block_table)
        assert seq.num_computed_tokens < seq.num_tokens
        num_blocks = len(seq.block_table)  # its computed tokens, and at most one more block
        assert (
            -(-seq.num_computed_tokens // bm.block_size) <= num_blocks <= -(-seq.num_tokens // bm.block_size)
        )
        for block_id in seq.block_table:
            holders.setdefault(block_id, []).append(seq)
    for seq in s.waiting + s.swapped + pending:
        assert not seq.block_table, seq
    for block_id in range(bm.num_blocks):
        assert bm.ref_counts[block_id] == len(holders.get(block_id, [])), block_id
    free, evictor = list(bm.free_block_ids), list(bm.evictor)
    assert len(free) == len(set(free)) and not set(free) & set(evictor) and not set(free) & set(holders)
    assert not set(evictor) & set(holders)
    assert len(free) + len(evictor) + len(holders) == bm.num_blocks
    assert bm._free_map[1:-1].nonzero()[0].tolist() == sorted(free)  # the map placement reads
    # a block shared by several sequences sits at the same index and holds the same tokens for each
    for block_id, seqs in holders.items():
        index = seqs[0].block_table.index(block_id)
        span = slice(index * bm.block_size, (index + 1) * bm.block_size)
        for seq in seqs[1:]:
            assert seq.block_table.index(block_id) == index
            num_computed = min(seq.num_computed_tokens, seqs[0].num_computed_tokens)
            common = min(num_computed - index * bm.block_size, bm.block_size)
            assert seq.token_ids[span][:common] == seqs[0].token_ids[span][:common]
    # prefix cache: names and blocks map one to one; uncached blocks are free or held
    assert all(bm.block_hashes[b] is not None for b in evictor)
    assert all(bm.block_hashes[b] is None for b in free)
    assert {bm.block_hashes[b]: b for b in range(bm.num_blocks) if bm.block_hashes[b]} == bm.cached_block_ids
    # CPU pool
    cpu_free = list(bm.free_cpu_block_ids)
    cpu_used = [b for table in bm.cpu_block_tables.values() for b in table]
    assert sorted(cpu_free + cpu_used) == list(range(bm.num_cpu_blocks))
    assert set(bm.cpu_block_tables) == {q.request_id for q in s.swapped}


@dataclass
class Workload:
    scheduler: Scheduler
    workers: FakeWorkers
    rng: random.Random
    truth: dict[str, list[int]] = field(default_factory=dict)
    request_seq_ids: dict[str, list[str]] = field(default_factory=dict)  # live client requests
    expected: dict[str, list[int]] = field(default_factory=dict)  # seq id -> output when alone
    ended: dict[str, FinishReason] = field(default_factory=dict)
    num_finished: int = 0
    num_aborted: int = 0
    num_rejected: int = 0

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        s = self.scheduler
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        single = replace(params, n=1)
        seqs = [Sequence(seq_id, prompt, single, frozenset({EOS})) for seq_id in seq_ids]
        seqs[0].pending_forks = seqs[1:]
        for seq in seqs:
            seq.is_multi_sequence = params.n > 1
        bm = s.block_manager
        max_num_tokens = min(len(prompt) + params.max_tokens, s.config.max_model_len)
        try:
            s.add(seqs[0])
        except InvalidRequestError:
            assert not bm.can_ever_fit(max_num_tokens)
            self.num_rejected += 1
            return
        assert bm.can_ever_fit(max_num_tokens)
        self.request_seq_ids[request_id] = seq_ids
        for seq_id in seq_ids:
            self.ended.pop(seq_id, None)
            self.truth[seq_id] = list(prompt)
            self.expected[seq_id] = expected_output(seq_id, prompt, single, s.config.max_model_len)

    def abort(self, request_id: str) -> None:
        for seq in self.scheduler.abort(self.request_seq_ids.get(request_id, [request_id])):
            self.end(seq)
            self.num_aborted += 1
        assert not self.scheduler.abort(self.request_seq_ids.get(request_id, [request_id]))  # twice: no-op
        check_invariants(self.scheduler)

    def end(self, seq: Sequence) -> None:
        assert seq.is_finished and seq.request_id not in self.ended, f"{seq.request_id} ended twice"
        assert seq.request_id not in self.scheduler.requests
        self.ended[seq.request_id] = seq.finish_reason  # type: ignore[assignment]
        if seq.finish_reason is not FinishReason.ABORTED:
            assert seq.output_token_ids == self.expected[seq.request_id], seq.request_id
            self.num_finished += 1
        request_id = seq.request_id.split("#")[0]
        if all(i in self.ended for i in self.request_seq_ids.get(request_id, [])):
            self.request_seq_ids.pop(request_id, None)

    def step(self) -> SchedulerOutput:
        """One engine step: like the engine, run the workers only for a non-empty output."""
        s = self.scheduler
        out = s.schedule()
        if out.is_empty:  # the engine drops it: it must carry no work for the workers
            assert not (out.freed_request_ids or out.blocks_to_swap_out or out.blocks_to_copy), out
            check_invariants(s)
            return out
        assert out.num_batched_tokens == sum(len(r.token_ids) for r in out.scheduled)
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        assert len({r.request_id for r in out.scheduled}) == len(out.scheduled)
        assert not (out.blocks_to_swap_in and out.blocks_to_swap_out)
        runner_output = self.workers.execute(out, self.truth)
        for request_id, token_id in zip(runner_output.request_ids, runner_output.sampled_token_ids):
            self.truth[request_id].append(token_id)
        for seq in s.update(out, runner_output):
            assert seq.token_ids == self.truth[seq.request_id]
            if seq.is_finished:
                self.end(seq)
        check_invariants(s)
        return out


def random_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(3, 24)
    max_num_seqs = rng.randint(1, 6)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max_num_seqs, 40),
        max_model_len=rng.randint(8, 64),
        preemption_mode=rng.choice(["swap", "recompute"]),
    )
    manager = BlockManager(
        num_blocks,
        block_size,
        watermark=rng.choice([0.0, 0.0, 0.1, 0.2]),
        num_cpu_blocks=rng.choice([0, 2, 8, 64]),
        enable_prefix_caching=rng.random() < 0.6,
    )
    workers = FakeWorkers(block_size, num_blocks, manager.num_cpu_blocks)
    return Workload(Scheduler(config, manager), workers, rng)


def random_request(w: Workload) -> tuple[list[int], SamplingParams]:
    rng, s = w.rng, w.scheduler
    prefixes = [[1] + [100] * 16, [1] + list(range(200, 216)), [1, 300]]
    prefix = rng.choice(prefixes)[: rng.randint(1, 17)]
    # lengths around block boundaries are the interesting ones
    size = rng.choice([s.block_manager.block_size * rng.randint(1, 4), rng.randint(1, 40)])
    prompt = (prefix + [rng.randrange(3, 99) for _ in range(size)])[:size]
    prompt = prompt[: s.config.max_model_len - 1]
    max_tokens = rng.randint(1, max(1, min(20, s.config.max_model_len - len(prompt))))
    params = SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]),
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.7,
        min_tokens=min(max_tokens, rng.choice([0, 0, 2])),
    )
    return prompt, params


def run_random_workload(seed: int) -> Workload:
    w = random_workload(seed)
    s, rng = w.scheduler, w.rng
    ids = [f"r{i}" for i in range(12)]  # few ids: finished ones are reused
    num_idle_steps = 0
    for _ in range(150):
        for _ in range(rng.choice([0, 0, 1, 2])):
            request_id = rng.choice(ids)
            if request_id not in w.request_seq_ids:
                w.add(request_id, *random_request(w))
        if w.request_seq_ids and rng.random() < 0.15:
            w.abort(rng.choice(sorted(w.request_seq_ids)))  # waiting, mid-prefill, running or swapped
        if rng.random() < 0.05:
            w.abort(rng.choice(ids))  # maybe finished, maybe never added
        if not s.has_unfinished_requests():  # the engine steps only while there is work
            continue
        num_idle_steps = 0 if w.step().scheduled else num_idle_steps + 1
        assert num_idle_steps <= 2, f"stuck: {s.waiting} {s.running} {s.swapped}"
    for _ in range(2000):  # drain: everything accepted finishes
        if not s.has_unfinished_requests():
            break
        out = w.step()
        num_idle_steps = 0 if out.scheduled else num_idle_steps + 1
        assert num_idle_steps <= 2, f"stuck: {s.waiting} {s.running} {s.swapped}"
    assert not s.has_unfinished_requests() and not w.request_seq_ids
    assert set(w.ended) == set(w.expected)
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert not any(bm.ref_counts) and not bm.seq_hashes and not bm.cpu_block_tables
    assert not s.waiting and not s.running and not s.swapped
    assert set(w.workers.states) <= set(s.schedule().freed_request_ids)  # told with the next step
    return w


@pytest.mark.parametrize("chunk", range(4))
def test_random_workloads_keep_invariants_and_outputs(chunk: int) -> None:
    totals = [0, 0, 0]
    for seed in range(chunk * 100, (chunk + 1) * 100):
        w = run_random_workload(seed)
        totals[0] += w.num_finished
        totals[1] += w.num_aborted
        totals[2] += w.scheduler.num_preemptions
    assert all(totals), totals  # the workloads do finish, abort and preempt


def make_workload(num_blocks: int, block_size: int, num_cpu_blocks: int = 0, mode: str = "swap") -> Workload:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, preemption_mode=mode
    )
    manager = BlockManager(num_blocks, block_size, watermark=0.0, num_cpu_blocks=num_cpu_blocks)
    workers = FakeWorkers(block_size, num_blocks, num_cpu_blocks)
    return Workload(Scheduler(config, manager), workers, random.Random(0))


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(r.request_id, r.num_computed_tokens, len(r.token_ids), r.is_new) for r in out.scheduled]


@pytest.mark.parametrize("mode, num_cpu_blocks", [("swap", 8), ("recompute", 0)])
def test_repro_a_sibling_preempted_before_its_first_step_is_announced_to_the_workers_once(
    mode: str, num_cpu_blocks: int
) -> None:
    # Once told a request is new, a worker takes a row for it; a second announcement without a free
    # took another row and lost the first, until a step failed with "pop from empty list".
    w = make_workload(num_blocks=3, block_size=4, num_cpu_blocks=num_cpu_blocks, mode=mode)
    w.add("a", [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True))
    w.add("b", [5, 6, 7], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    w.step()  # both prompts; b#1 forks from b#0
    out = w.step()  # a takes the last free block: b#1 is preempted before it ever ran
    assert plan(out) == [("a", 4, 1, False), ("b#0", 3, 1, False)] and out.freed_request_ids == ["b#1"]
    plans = [plan(w.step()) for _ in range(7)]
    runs_of_b1 = [entry for step_plan in plans for entry in step_plan if entry[0] == "b#1"]
    assert runs_of_b1 == [("b#1", 0, 3, True), ("b#1", 3, 1, False), ("b#1", 4, 1, False)]
    assert not w.scheduler.has_unfinished_requests() and w.num_finished == 3


@pytest.mark.parametrize(
    "num_prompt, shared, sibling_plan, copies",
    [
        (6, [0], ("b#1", 4, 2, True), []),  # last block partly filled: not shared, recomputed
        # full: shared, the sibling copies it on write, centred in the free run 3..7 for its 2 blocks
        (8, [0, 1], ("b#1", 7, 1, True), [(1, 4)]),
    ],
)
def test_repro_a_parent_never_writes_into_a_block_its_siblings_share(
    num_prompt: int, shared: list[int], sibling_plan: tuple, copies: list
) -> None:
    # The parent once shared its partly filled last block and then copied it on write, replacing a
    # block of a table the workers already held without telling them: they went on writing the
    # parent's tokens into the block its sibling kept, and each read the other's KV.
    w = make_workload(num_blocks=8, block_size=4)
    w.add("b", list(range(1, num_prompt + 1)), SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    w.step()
    parent, sibling = w.scheduler.running
    assert sibling.block_table == shared and parent.block_table == [0, 1]
    out = w.step()
    assert plan(out) == [("b#0", num_prompt, 1, False), sibling_plan]
    assert out.scheduled[0].new_block_ids == ([] if num_prompt % 4 else [2])
    assert parent.block_table[:2] == [0, 1] and out.blocks_to_copy == copies
    while w.scheduler.has_unfinished_requests():
        w.step()  # the workers' KV reads check both contexts
    assert w.num_finished == 2


def test_repro_a_request_whose_sequence_ids_are_taken_is_rejected() -> None:
    w = make_workload(num_blocks=8, block_size=4)
    w.add("a#1", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    seqs = [Sequence(f"a#{i}", [4, 5], SamplingParams(max_tokens=2)) for i in range(2)]
    seqs[0].pending_forks = seqs[1:]
    with pytest.raises(InvalidRequestError, match="'a#1' is already running"):
        w.scheduler.add(seqs[0])
    assert set(w.scheduler.requests) == {"a#1"}
    while w.scheduler.has_unfinished_requests():
        w.step()
    assert w.ended == {"a#1": FinishReason.LENGTH}


# -- the tiny real model -------------------------------------------------------------------------


def completions(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def ample(tiny_llama_dir: str) -> LLM:
    return LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=512, block_size=4, enable_prefix_caching=False
    )


@pytest.mark.slow
def test_parallel_samples_equal_single_samples_with_their_seeds(ample: LLM) -> None:
    prompt = [1] + list(range(2000, 2010))  # 11 tokens: the last block of 4 is partly filled
    many = completions(
        ample, [prompt], [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)]
    )
    single = [
        completions(
            ample, [prompt], [SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)]
        )[0][0]
        for seed in (5, 6, 7)
    ]
    assert many[0] == single and len({tuple(s) for s in single}) == 3


def pressure_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(1)
    system = [1] + list(range(3000, 3009))  # 10 tokens: 2 full blocks of 4, shared
    prompts = [
        (system if rng.random() < 0.5 else [1]) + [rng.randrange(3, 49152) for _ in range(rng.randint(2, 24))]
        for _ in range(12)
    ]
    params = [
        SamplingParams(
            n=rng.choice([1, 2, 3]),
            temperature=rng.choice([0.0, 1.0]),
            seed=i,
            max_tokens=rng.randint(4, 24),
            ignore_eos=True,
        )
        for i in range(12)
    ]
    return prompts, params


@pytest.mark.slow
@pytest.mark.parametrize("mode, num_cpu_blocks", [("swap", 64), ("recompute", 0)])
def test_memory_pressure_with_parallel_sampling_keeps_outputs(
    tiny_llama_dir: str, ample: LLM, mode: str, num_cpu_blocks: int
) -> None:
    # Prefix caching on, prompts chunked by a 32-token budget, 24 blocks of 4 for up to 36 sequences
    # of up to 58 tokens: the outputs (seeded sampling, n up to 3) equal the unconstrained run's.
    prompts, params = pressure_workload()
    tight = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=24,
        block_size=4,
        num_cpu_kv_blocks=num_cpu_blocks,
        preemption_mode=mode,
        max_num_seqs=6,
        max_num_batched_tokens=32,
    )
    assert completions(tight, prompts, params) == completions(ample, prompts, params)
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_hits > 0
    assert stats.num_free_blocks == 24 and stats.num_free_cpu_blocks == num_cpu_blocks
    runner = tight.engine.executor.worker.model_runner
    assert len(runner.free_rows) + len(runner.requests) == 6  # no worker row lost


@pytest.mark.slow
def test_a_failed_step_ends_every_completion_of_a_parallel_request(ample: LLM) -> None:
    # The prompt's step fails before the siblings fork: they end with it, or the request never
    # finishes (its stream hangs and its id stays taken).
    engine = ample.engine
    engine.add_request("p", [1, 2, 3, 4, 5], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    execute = engine.executor.execute

    def fail(output: Any) -> Any:
        raise RuntimeError("injected model fault")

    engine.executor.execute = fail  # type: ignore[method-assign]
    try:
        deltas = engine.step()
    finally:
        engine.executor.execute = execute  # type: ignore[method-assign]
    assert sorted(d.index for d in deltas) == [0, 1, 2] and all(d.error and d.finished for d in deltas)
    assert deltas[-1].request_finished and not engine.has_unfinished_requests()
    assert engine.stats().num_unfinished == 0
    engine.add_request("p", [1, 2, 3], SamplingParams(n=2, max_tokens=2, ignore_eos=True))  # the id is free
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.slow
def test_a_step_failing_one_forked_sibling_fails_the_whole_request(tiny_llama_dir: str) -> None:
    # Memory pressure preempts one of a's two forked completions; the step that runs the other alone
    # fails. Both completions end with the error (the other ran on to "length" for a caller that had
    # already been told the request failed), and request b, not in that step, goes on.
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=16,
        block_size=4,
        max_num_seqs=4,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    engine = llm.engine
    engine.add_request(
        "a", [1, 2, 3], SamplingParams(n=2, max_tokens=40, ignore_eos=True, temperature=1.0, seed=1)
    )
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=40, ignore_eos=True))
    execute, failed_steps = engine.executor.execute, []

    def fail_when_one_sibling_runs_alone(output: SchedulerOutput) -> Any:
        live = {s for s in ("a#0", "a#1") if s in engine.scheduler.requests}
        forked = len(live) == 2 and not engine.scheduler.requests["a#0"].pending_forks
        scheduled = {r.request_id for r in output.scheduled}
        if not failed_steps and forked and len(scheduled & live) == 1:
            failed_steps.append(scheduled)
            raise RuntimeError("injected model fault")
        return execute(output)

    engine.executor.execute = fail_when_one_sibling_runs_alone  # type: ignore[method-assign]
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert failed_steps and "b" not in failed_steps[0]
    ends = {(d.request_id, d.index): d for d in deltas if d.finished}
    assert {k: d.finish_reason for k, d in ends.items()} == {
        ("a", 0): "error",
        ("a", 1): "error",
        ("b", 0): "length",
    }
    assert all("injected model fault" in (ends["a", i].error or "") for i in range(2))
    assert [d.request_finished for d in deltas if d.request_id == "a" and d.finished] == [False, True]
    assert engine.stats().num_free_blocks == 16
