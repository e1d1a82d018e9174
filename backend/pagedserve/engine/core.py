"""The engine core's messages: what the front end asks of the engine between steps (`Inbox`) and
what one pass of the core applied and made (`Pass`), and the pass itself (`run_pass`). The core runs
on the front end's torch thread (engine/async_engine.py) or in a process of its own
(engine/core_process.py): the same inboxes and passes, pickled in between for the latter."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve import logs
from pagedserve.core.block_manager import KvEvent
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import RequestDelta
from pagedserve.sampling_params import SamplingParams


@dataclass
class Abort:
    """An abort the core applies between steps."""

    message: str | None  # for a stream still read (an Abort call, a drain); None: nobody reads it
    cause: str | None  # counted in pagedserve:request_aborts if it ends a request; None: not counted


@dataclass
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    lora_name: str | None


LoraChange = tuple[str, tuple[str, ...], "asyncio.Future[None] | None"]


@dataclass
class Inbox:
    """What the loop asks of the engine, applied by the core between steps (`run_pass`): the log
    switches and the KV snapshot or stop first, then the aborts, the adds and the LoRA changes."""

    aborts: dict[str, Abort] = field(default_factory=dict)  # by request id
    adds: list[Add] = field(default_factory=list)
    # LoRA adapter changes (the name of LLMEngine's method, its arguments, the caller's future: None
    # in a copy sent to an engine process), after the adds
    lora_changes: list[LoraChange] = field(default_factory=list)
    kv_snapshot: bool = False  # new KV event listeners wait for a snapshot (recording starts)
    kv_stop: bool = False  # the last listener went away: recording stops (never both set)
    # the front end's log switches, changed at run time (LogSettings): for an engine process's logging
    log_switches: logs.LogSwitches | None = None

    def __bool__(self) -> bool:
        return bool(
            self.aborts
            or self.adds
            or self.lora_changes
            or self.kv_snapshot
            or self.kv_stop
            or self.log_switches is not None
        )

    def take_in(self, later: Inbox) -> None:
        """Add what was asked after this inbox, as if asked of it: a later abort of a request replaces
        an earlier one, the later KV setting wins."""
        self.aborts.update(later.aborts)
        self.adds += later.adds
        self.lora_changes += later.lora_changes
        if later.kv_snapshot or later.kv_stop:
            self.kv_snapshot, self.kv_stop = later.kv_snapshot, later.kv_stop
        if later.log_switches is not None:
            self.log_switches = later.log_switches

    def for_sending(self) -> Inbox:
        """A copy for an engine process: the callers' futures stay here."""
        changes: list[LoraChange] = [(method, args, None) for method, args, _ in self.lora_changes]
        return Inbox(
            dict(self.aborts), list(self.adds), changes, self.kv_snapshot, self.kv_stop, self.log_switches
        )


@dataclass
class Pass:
    """One pass of the engine core: the inbox it applied, what applying it gave, and the step's
    output. `fault` set: the pass stopped there (the engine cannot go on)."""

    inbox: Inbox
    aborted: list[RequestDelta] = field(default_factory=list)  # LLMEngine.abort_request's
    refused: dict[str, InvalidRequestError] = field(default_factory=dict)  # adds the engine refused
    lora_errors: list[BaseException | None] = field(default_factory=list)  # one per LoRA change
    kv_snapshot: list[bytes] | None = None
    deltas: list[RequestDelta] = field(default_factory=list)
    kv_events: list[KvEvent] = field(default_factory=list)
    fault: BaseException | None = None


def run_pass(llm: LLMEngine, inbox: Inbox, added: Callable[[int], None]) -> Pass:
    """One pass of an engine core: apply the inbox (the log switches and the KV snapshot first, then
    aborts, adds and LoRA changes), then step. `added` is told how many adds the engine's queue holds
    (or dropped) as soon as it does. A fault (the engine cannot go on) ends the pass where it happened."""
    done = Pass(inbox)
    try:
        if inbox.log_switches is not None:
            logs.switch(inbox.log_switches)
            llm.executor.switch_logs(inbox.log_switches)  # its ranks'
        if inbox.kv_snapshot:
            done.kv_snapshot = llm.record_kv_events(True)
        elif inbox.kv_stop:
            llm.record_kv_events(False)
        done.aborted = llm.abort_request(list(inbox.aborts))
        for add in inbox.adds:
            if add.request_id in inbox.aborts:
                continue  # gone before it started
            try:
                llm.add_request(
                    add.request_id,
                    add.prompt_token_ids,
                    add.params,
                    add.arrival_time,
                    add.priority,
                    add.lora_name,
                )
            except InvalidRequestError as exc:
                done.refused[add.request_id] = exc
        added(len(inbox.adds))
        for method, args, _ in inbox.lora_changes:
            try:
                getattr(llm, method)(*args)
            except Exception as exc:  # a bad adapter, one in use; a dead rank fails the next step too
                done.lora_errors.append(exc)
            else:
                done.lora_errors.append(None)
        if llm.has_work():
            done.deltas = llm.step()
        done.kv_events = llm.take_kv_events()
    except Exception as exc:  # the engine cannot go on: fail everyone, never leave them hanging
        done.fault = exc
    return done
