"""A scheduler step without workers, for the scheduler's unit tests."""

from __future__ import annotations

from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


def run(scheduler: Scheduler) -> SchedulerOutput:
    """One step in which every sampling request gets token 7."""
    out = scheduler.schedule()
    sampled = [r.request_id for r in out.scheduled if r.do_sample]
    scheduler.update(out, ModelRunnerOutput(sampled, [7] * len(sampled)))
    return out
