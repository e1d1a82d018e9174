"""Continuous batching: which sequences run this step, and how many tokens each, under the token budget.

Owns the waiting, running and swapped queues. Counts tokens, not phases: every scheduled sequence
runs `min(num_tokens - num_computed_tokens, budget left)` tokens, so prefill, chunked prefill,
prefix-cache hits and recompute after preemption are the same rule.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedserve.errors import InvalidRequestError
from pagedserve.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

# A preemption warns on the first and every this many after (as vLLM's); each one is logged at DEBUG.
PREEMPTION_WARNING_INTERVAL = 50
# why a request is preempted, and what leaves fewer to preempt
KV_CACHE_FULL = (
    "the KV cache is full; raise --kv-cache-memory (or --swap-space), or lower --max-num-seqs / "
    "--max-num-batched-tokens"
)


def _by_arrival(seq: Sequence) -> int:
    return seq.arrival_order


def _by_priority(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival_order


def _owes_prompt_logprobs(seq: Sequence) -> bool:
    """Asks for prompt logprobs and has sampled nothing yet: once it has, they were all returned (in the
    step that sampled its first token), and a recompute after a preemption need not score them again."""
    return seq.sampling_params.prompt_logprobs is not None and seq.num_output_tokens == 0


class Scheduler:
    """All queues are kept in arrival order (fcfs), or under the priority policy by (priority, arrival):
    the head of a queue goes first and the last running request (the youngest, or the least urgent) is
    the preemption victim. A victim is swapped out (its blocks copied to the CPU pool) when the mode
    and the pool allow, else recomputed (blocks freed, tokens run again when readmitted). Under fcfs
    swapped requests resume before any new request is admitted; under priority the more urgent of
    the two heads goes first, and a waiting head that does not fit preempts less urgent running
    requests (`_preempt_for_priority`)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.is_priority = config.scheduling_policy == "priority"
        self._key: Callable[[Sequence], Any] = _by_priority if self.is_priority else _by_arrival
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_recompute_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        # speculative decoding: steps a sequence ran drafts in, drafts run, drafts accepted
        self.num_spec_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self._freed_request_ids: list[str] = []
        self._swap_out: list[tuple[int, int]] = []
        self._forked_ids: set[str] = set()

    # -- requests in and out --------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        for request_id in [seq.request_id, *(sibling.request_id for sibling in seq.pending_forks)]:
            if request_id in self.requests:  # a client's id may be another request's sequence id
                raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self.check_can_ever_fit(seq.num_prompt_tokens, seq.max_tokens)
        self.requests[seq.request_id] = seq
        for sibling in seq.pending_forks:  # parallel sampling: queued when the parent forks them
            self.requests[sibling.request_id] = sibling
        bisect.insort(self.waiting, seq, key=self._key)

    def check_can_ever_fit(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject a request that could never run, even alone: admission keeps the watermark free in
        an empty pool too, so such a request would wait forever and hold up every request behind it."""
        block_manager = self.block_manager
        max_num_tokens = min(num_prompt_tokens + max_tokens, self.config.max_model_len)
        if block_manager.can_ever_fit(max_num_tokens):
            return
        field = "max_tokens" if block_manager.can_ever_fit(num_prompt_tokens + 1) else "prompt"
        raise InvalidRequestError(
            field,
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) can never fit the KV cache: "
            f"it needs {block_manager.num_blocks_to_hold(max_num_tokens)} blocks of "
            f"{block_manager.block_size} tokens, and one request may hold at most "
            f"{block_manager.max_num_blocks_per_seq} ({block_manager.num_blocks} blocks less a watermark "
            f"of {block_manager.watermark_blocks} kept free for running requests to grow); "
            "lower max_tokens or give the KV cache more memory",
        )

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stopped, aborted or failed) and free its blocks."""
        if seq.is_finished:
            return
        queue = self._queue(seq)
        if seq in queue:  # a sibling not forked yet is in no queue
            queue.remove(seq)
        for sibling in seq.pending_forks:  # never forked: they end with it
            self.finish(sibling, reason)
        seq.pending_forks = []
        self._forked_ids.discard(seq.request_id)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]

    def abort(self, request_ids: Iterable[str]) -> list[Sequence]:
        aborted = [self.requests[rid] for rid in request_ids if rid in self.requests]
        for seq in aborted:
            self.finish(seq, FinishReason.ABORTED)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_freed_requests(self) -> bool:
        """Requests freed since the last schedule(): the workers drop their state with the next step."""
        return bool(self._freed_request_ids)

    def requeue_freed(self, request_ids: list[str]) -> None:
        """Freed requests a step took to its workers that may not have reached them (the step was cut
        short): they go again with the next step; a worker ignores an id it no longer holds."""
        self._freed_request_ids[:0] = request_ids

    # -- one step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        swap_in: list[tuple[int, int]] = []
        self.block_manager.forget_filling()
        if self.is_priority:  # before the running requests are scheduled: a victim is in no batch
            self._preempt_for_priority()
        num_preemptions_before = self.num_preemptions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, num_new):
                continue
            drafts = self._drafts(seq, num_new, budget)
            new_block_ids = self.block_manager.append_slot(seq, num_new + len(drafts))
            is_new = seq.request_id in self._forked_ids  # a forked sibling the workers do not know yet
            if is_new:
                self._forked_ids.discard(seq.request_id)
                new_block_ids = list(seq.block_table)
            scheduled.append(self._scheduled(seq, num_new, new_block_ids, is_new, drafts))
            budget -= num_new + len(drafts)
        # Resume swapped requests, then admit new ones, only when nothing running had to make room:
        # so one step never both swaps out and swaps in, which keeps the workers' order (out, in,
        # copy) safe. Priority preemption came first, so its swap-outs are known here: after one,
        # swapped requests wait a step (`_admit_by_priority`), while new requests may take the room.
        if self.num_preemptions == num_preemptions_before:
            if self.is_priority:
                budget = self._admit_by_priority(budget, scheduled, swap_in)
            else:
                budget = self._resume_swapped(budget, scheduled, swap_in)
                if not self.swapped:
                    budget = self._admit_waiting(budget, scheduled)
        freed, self._freed_request_ids = self._freed_request_ids, []
        swap_out, self._swap_out = self._swap_out, []
        copies, self.block_manager.blocks_to_copy = self.block_manager.blocks_to_copy, []
        return SchedulerOutput(
            scheduled,
            self.config.max_num_batched_tokens - budget,
            freed,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=copies,
        )

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Sequence]:
        """Advance computed tokens, append sampled tokens, finish token-level stops, and finish the
        embedding requests whose prompt is all computed (they sample nothing).

        Returns the sequences that received a token this step (finished ones included), after the
        embedding requests it finished."""
        updated = []
        for req in output.scheduled:
            seq = self.requests.get(req.request_id)
            if seq is not None:
                seq.num_computed_tokens += len(req.token_ids) - req.num_spec_tokens  # drafts: below
                self.block_manager.cache_full_blocks(seq)
                if req.num_spec_tokens:
                    self.num_spec_drafts += 1
                    self.num_draft_tokens += req.num_spec_tokens
                if seq.sampling_params.pooling is not None and seq.num_computed_tokens == seq.num_tokens:
                    self.finish(seq, FinishReason.STOP)
                    updated.append(seq)
        for request_id, token_id in zip(runner_output.request_ids, runner_output.sampled_token_ids):
            seq = self.requests.get(request_id)
            if seq is None:
                continue
            if seq.pending_forks:
                self._fork(seq)
            accepted = runner_output.accepted_drafts.get(request_id, [])
            self.num_accepted_draft_tokens += len(accepted)
            seq.num_new_tokens = 0
            for token in [*accepted, token_id]:  # stops at the first that ends the sequence
                seq.append_token(token)
                seq.num_new_tokens += 1
                if seq.num_new_tokens <= len(accepted):  # an accepted draft: its KV was written this step
                    seq.num_computed_tokens += 1
                reason = seq.check_stop_token(self.config.max_model_len)
                if reason is not None:
                    if reason is FinishReason.STOP:  # one of its stop_token_ids
                        seq.stop_reason = token
                    self.finish(seq, reason)
                    break
            if accepted and not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)
            updated.append(seq)
        return updated

    # -- helpers -------------------------------------------------------------------------------------

    def _drafts(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """Speculative decoding: the drafts a decoding sequence runs this step beside its last token,
        within the token budget, its max_tokens and the context (the step emits one token more than it
        accepts), and the free blocks above the watermark (a draft never preempts). None for an
        embedding (it samples nothing), nor while more requests than `disable_by_batch_size` are in
        the engine. A grammar's request drafts too: the engine masks each draft's row with the
        grammar's state after the drafts before it."""
        spec = self.config.speculative
        if spec is None or num_new != 1 or seq.num_tokens - seq.num_computed_tokens != 1:
            return []
        if spec.disable_by_batch_size is not None and len(self.requests) > spec.disable_by_batch_size:
            return []
        params = seq.sampling_params
        if params.pooling is not None:
            return []
        room = min(
            budget - 1,
            seq.max_tokens - seq.num_output_tokens - 1,
            self.config.max_model_len - seq.num_tokens - 1,
        )
        drafts = spec.propose(seq.token_ids, room)
        bm = self.block_manager  # drafts take no block of the watermark kept for running requests to grow
        if drafts and bm.num_required_blocks(seq, 1 + len(drafts)) > bm.num_free_blocks - bm.watermark_blocks:
            return []
        return drafts

    def _make_room(self, seq: Sequence, num_new: int) -> bool:
        """Preempt the last running sequences (the youngest; under priority the least urgent) until
        `seq` can grow; False if `seq` itself went."""
        while not self.block_manager.can_append_slot(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            num_new = self._admit(budget, scheduled)
            if num_new is None:
                break
            budget -= num_new
        return budget

    def _resume_swapped(
        self, budget: int, scheduled: list[ScheduledRequest], swap_in: list[tuple[int, int]]
    ) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            num_new = self._resume(budget, scheduled, swap_in)
            if num_new is None:
                break
            budget -= num_new
        return budget

    def _admit_by_priority(
        self, budget: int, scheduled: list[ScheduledRequest], swap_in: list[tuple[int, int]]
    ) -> int:
        """The more urgent of the waiting and the swapped head goes next, until one does not fit: a
        waiting request more urgent than every swapped one does not wait for them to resume. In a
        step that swapped out for priority, a swapped head waits for the next step (and so does
        everything behind it), so that the step does not swap in too."""
        can_swap_in = not self._swap_out
        while (self.waiting or self.swapped) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self.swapped and (not self.waiting or self._key(self.swapped[0]) < self._key(self.waiting[0])):
                num_new = self._resume(budget, scheduled, swap_in) if can_swap_in else None
            else:
                num_new = self._admit(budget, scheduled)
            if num_new is None:
                break
            budget -= num_new
        return budget

    def _admit(self, budget: int, scheduled: list[ScheduledRequest]) -> int | None:
        """Admit the waiting head with up to `budget` tokens; its number of tokens, None if it does not fit."""
        seq = self.waiting[0]
        fit = self._fit(seq, budget)
        if fit is None:
            return None
        cached_block_ids, num_new = fit
        self.waiting.pop(0)
        block_ids = self.block_manager.allocate(seq, num_new, cached_block_ids)
        seq.num_computed_tokens = len(cached_block_ids) * self.block_manager.block_size
        self._start_running(seq)
        scheduled.append(self._scheduled(seq, num_new, block_ids, is_new=True))
        return num_new

    def _resume(
        self, budget: int, scheduled: list[ScheduledRequest], swap_in: list[tuple[int, int]]
    ) -> int | None:
        """Swap the swapped head back in with up to `budget` tokens; its number of tokens, None if it
        does not fit."""
        seq = self.swapped[0]
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not self.block_manager.can_swap_in(seq, num_new):
            return None
        self.swapped.pop(0)
        mapping = self.block_manager.swap_in(seq)
        swap_in.extend(mapping)
        self.num_swapped_in_blocks += len(mapping)
        self.block_manager.append_slot(seq, num_new)
        self._start_running(seq)
        scheduled.append(self._scheduled(seq, num_new, list(seq.block_table), is_new=True))
        return num_new

    def _preempt_for_priority(self) -> None:
        """vLLM's priority preemption: while the waiting head cannot be admitted (no free seat or too
        few blocks) and is strictly more urgent than the least urgent running request, preempt that
        one (swap or recompute, as `_make_room` does). A swapped head ahead of the waiting one
        preempts nothing: it resumes as room frees. The victims queue behind the head, so they never
        come back before it, and equal priorities never preempt each other: no ping-pong."""
        if not self.waiting or (self.swapped and self._key(self.swapped[0]) < self._key(self.waiting[0])):
            return
        head = self.waiting[0]
        reason = (
            f"{head.request_id} (priority {head.priority}) is more urgent and needs its seat or blocks; "
            "raise --max-num-seqs or --kv-cache-memory"
        )
        while self.running and self.running[-1].priority > head.priority and not self._can_admit(head):
            self._preempt(self.running[-1], reason)

    def _can_admit(self, seq: Sequence) -> bool:
        """Whether the waiting head would be admitted now: a free seat, and blocks for the tokens the
        budget gives it after the running requests' tokens (at least one, the smallest chunk)."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        num_running_tokens = sum(s.num_tokens - s.num_computed_tokens for s in self.running)
        return self._fit(seq, max(self.config.max_num_batched_tokens - num_running_tokens, 1)) is not None

    def _fit(self, seq: Sequence, budget: int) -> tuple[list[int], int] | None:
        """A waiting sequence's prefix-cache hits and the tokens it would run with up to `budget`,
        None when the blocks for them are not free."""
        block_manager = self.block_manager
        cached_block_ids = block_manager.match_prefix(seq)
        num_new = min(seq.num_tokens - len(cached_block_ids) * block_manager.block_size, budget)
        if not block_manager.can_allocate(seq, num_new, cached_block_ids):
            return None
        return cached_block_ids, num_new

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self._key)

    def _scheduled(
        self,
        seq: Sequence,
        num_new: int,
        new_block_ids: list[int],
        is_new: bool,
        drafts: list[int] | None = None,
    ) -> ScheduledRequest:
        if self.waiting:  # a request admitted later this step may share what this one computes
            self.block_manager.note_filling(seq, num_new)
        start = seq.num_computed_tokens
        return ScheduledRequest(
            request_id=seq.request_id,
            token_ids=seq.token_ids[start : start + num_new] + (drafts or []),
            num_computed_tokens=start,
            new_block_ids=new_block_ids,
            do_sample=start + num_new == seq.num_tokens and seq.sampling_params.pooling is None,
            is_new=is_new,
            num_prompt_tokens=seq.num_prompt_tokens if is_new else 0,
            sampling_params=seq.sampling_params if is_new else None,
            computed_token_ids=seq.token_ids[:start] if is_new else [],
            prompt_token_ids=seq.prompt_token_ids if is_new and _owes_prompt_logprobs(seq) else None,
            lora_name=seq.lora_name if is_new else None,
            num_spec_tokens=len(drafts or []),
        )

    def _fork(self, parent: Sequence) -> None:
        """The parent's prompt is computed: its siblings share its full blocks and each recomputes the
        tokens after them (at least the last prompt token, into a copy-on-write copy of the last
        block when that one is full) to sample its own first token. A partly filled last block is
        not shared: the parent writes on into it, and a copy-on-write there would replace a block in
        a table the workers already hold, which they never learn of. Siblings that do not fit the
        batch wait and are prefilled on their own."""
        block_size = self.block_manager.block_size
        num_shared_tokens = min(
            parent.num_computed_tokens - 1, parent.num_computed_tokens // block_size * block_size
        )
        if self.config.recurrent_state:  # the parent's state is its own: each sibling computes its prompt
            num_shared_tokens = 0
        for sibling in parent.pending_forks:
            if sibling.is_finished:
                continue
            if len(self.running) < self.config.max_num_seqs:
                sibling.num_computed_tokens = num_shared_tokens
                self.block_manager.fork(parent, sibling)
                self._forked_ids.add(sibling.request_id)
                self._start_running(sibling)
            else:
                bisect.insort(self.waiting, sibling, key=self._key)
        parent.pending_forks = []

    def _preempt(self, seq: Sequence, reason: str = KV_CACHE_FULL) -> None:
        self.running.remove(seq)
        self._forked_ids.discard(seq.request_id)  # announced to the workers when it resumes instead
        seq.num_preemptions += 1
        self.num_preemptions += 1
        swap = not self.config.recurrent_state and (
            self.config.preemption_mode == "swap" or seq.is_multi_sequence
        )
        if swap and self.block_manager.can_swap_out(seq):
            mapping = self.block_manager.swap_out(seq)
            self._swap_out.extend(mapping)
            self._freed_request_ids.append(seq.request_id)
            self.num_swap_preemptions += 1
            self.num_swapped_out_blocks += len(mapping)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=self._key)
            how = f"by swapping {len(mapping)} blocks to CPU"
            seq.preemption_events.append((time.monotonic(), "swap"))
        else:
            self._release(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.num_recompute_preemptions += 1
            bisect.insort(self.waiting, seq, key=self._key)
            how = "by recompute"
            seq.preemption_events.append((time.monotonic(), "recompute"))
        self._log_preemption(seq, how, reason)

    def _log_preemption(self, seq: Sequence, how: str, reason: str) -> None:
        """Each preemption at DEBUG; a WARNING on the first and every 50th, with the counts so far and
        the remedy (as vLLM's total_num_cumulative_preemption): under load a line per preemption
        floods the log, and what the operator acts on is the trend, not each victim."""
        logger.debug("preempted %s %s (%d tokens): %s", seq.request_id, how, seq.num_tokens, reason)
        n = self.num_preemptions
        if n != 1 and n % PREEMPTION_WARNING_INTERVAL:
            return
        logger.warning(
            "preempted %s %s (%d tokens): %s. total_num_cumulative_preemption=%d (swap %d, recompute %d); "
            "logged at the first and every %dth, each one at DEBUG",
            seq.request_id,
            how,
            seq.num_tokens,
            reason,
            n,
            self.num_swap_preemptions,
            self.num_recompute_preemptions,
            PREEMPTION_WARNING_INTERVAL,
        )

    def _queue(self, seq: Sequence) -> list[Sequence]:
        queues = {SequenceStatus.RUNNING: self.running, SequenceStatus.SWAPPED: self.swapped}
        return queues.get(seq.status, self.waiting)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._freed_request_ids.append(seq.request_id)
