"""Continuous batching: which sequences run this step, and how many tokens each, under the token budget.

Owns the waiting and running queues. Counts tokens, not phases: every scheduled sequence runs
`min(num_tokens - num_computed_tokens, budget left)` tokens, so prefill, chunked prefill and
recompute after preemption are the same rule.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedserve.errors import InvalidRequestError
from pagedserve.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


def _by_arrival(seq: Sequence) -> int:
    return seq.arrival_order


class Scheduler:
    """Both queues are kept in arrival order: the oldest request runs first and the youngest
    running request is the preemption victim (preemption by recompute: its blocks are freed and its
    tokens are run again when it is readmitted)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._freed_request_ids: list[str] = []

    # -- requests in and out --------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{seq.request_id!r} is already running")
        max_tokens = min(seq.max_num_tokens, self.config.max_model_len)
        if not self.block_manager.can_ever_fit(max_tokens):
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens = {max_tokens} tokens can never fit the KV cache "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})",
            )
        self.requests[seq.request_id] = seq
        bisect.insort(self.waiting, seq, key=_by_arrival)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stopped, aborted or failed) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
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

    # -- one step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preemptions_before = self.num_preemptions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, num_new):
                continue
            new_block_ids = self.block_manager.append_slot(seq, num_new)
            scheduled.append(self._scheduled(seq, num_new, new_block_ids, is_new=False))
            budget -= num_new
        if (
            self.num_preemptions == num_preemptions_before
        ):  # admit new work only when nothing running had to make room
            budget = self._admit_waiting(budget, scheduled)
        freed, self._freed_request_ids = self._freed_request_ids, []
        return SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget, freed)

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Sequence]:
        """Advance computed tokens, append sampled tokens, finish token-level stops.

        Returns the sequences that received a token this step (finished ones included)."""
        for req in output.scheduled:
            seq = self.requests.get(req.request_id)
            if seq is not None:
                seq.num_computed_tokens += len(req.token_ids)
        updated = []
        for request_id, token_id in zip(runner_output.request_ids, runner_output.sampled_token_ids):
            seq = self.requests.get(request_id)
            if seq is None:
                continue
            seq.append_token(token_id)
            reason = seq.check_stop_token(self.config.max_model_len)
            if reason is not None:
                self.finish(seq, reason)
            updated.append(seq)
        return updated

    # -- helpers -------------------------------------------------------------------------------------

    def _make_room(self, seq: Sequence, num_new: int) -> bool:
        """Preempt the youngest running sequences until `seq` can grow; False if `seq` itself went."""
        while not self.block_manager.can_append_slot(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                break
            self.waiting.pop(0)
            block_ids = self.block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_by_arrival)
            scheduled.append(self._scheduled(seq, num_new, block_ids, is_new=True))
            budget -= num_new
        return budget

    def _scheduled(
        self, seq: Sequence, num_new: int, new_block_ids: list[int], is_new: bool
    ) -> ScheduledRequest:
        start = seq.num_computed_tokens
        return ScheduledRequest(
            request_id=seq.request_id,
            token_ids=seq.token_ids[start : start + num_new],
            num_computed_tokens=start,
            new_block_ids=new_block_ids,
            do_sample=start + num_new == seq.num_tokens,
            is_new=is_new,
            num_prompt_tokens=seq.num_prompt_tokens if is_new else 0,
            sampling_params=seq.sampling_params if is_new else None,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_by_arrival)
        logger.info(
            "preempted %s by recompute (%d tokens); KV cache is full: raise --kv-cache-memory or "
            "lower --max-num-seqs",
            seq.request_id,
            seq.num_tokens,
        )

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.free(seq)
        self._freed_request_ids.append(seq.request_id)
