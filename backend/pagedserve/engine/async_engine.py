"""The asyncio engine: one background loop steps the engine while there is work, each request reads
its deltas from its own queue, and abort lives in the `finally` of the per-request generator, so a
client cancel, a broken connection, an expired deadline or a drain all free the request's blocks
before the next step.

The synchronous engine is not thread-safe: adds and aborts are queued by callers and applied by the
loop between steps, and `step()` itself runs in a worker thread so the event loop keeps serving:
the torch thread (`in_torch_thread`), which also builds the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedserve.core.block_manager import KvEvent
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineDeadError, InvalidRequestError
from pagedserve.outputs import RequestDelta, RequestMetrics
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Every torch call of a serving process runs on this one thread. libgomp gives each thread that enters
# a parallel region a thread team of its own, and once a process holds more OpenMP threads than cores
# its barriers stop spinning and sleep instead: with two threads running torch ops, each op ran 1.3x
# to 6x slower on 2 cores (an elementwise add 13 -> 71 us), and the server, stepping on asyncio's
# default executor, reached 63-65% of the offline engine's output throughput (bench/serving.py; 92%
# on this thread, which also builds the engine).
_TORCH_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-torch")


async def in_torch_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_TORCH_THREAD, fn, *args)


# A front end's tokenizing (and chat templates) runs on this thread, off the event loop: a 4 MB prompt
# takes seconds to tokenize (or to find too long), and on the loop that stalls every stream. One
# thread, as vLLM does: a fast tokenizer is not safe to share between threads once one of them
# changes its settings.
_TOKENIZER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-tokenizer")


async def in_tokenizer_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, fn, *args)


# Structured outputs compile a request's schema, regex or grammar here (ms, up to a third of a second
# for the largest allowed): not on the tokenizer's thread, where every other request would wait.
_GRAMMAR_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-grammar")


async def in_grammar_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_GRAMMAR_THREAD, fn, *args)


class QueueFullError(RuntimeError):
    """More requests are queued than --max-queued-requests allows."""


@dataclass
class _Stream:
    arrival_time: float  # time.monotonic() when generate() was called: queueing starts here
    num_prompt_tokens: int
    queue: asyncio.Queue[RequestDelta | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False  # the caller has been handed the request's final delta
    held: dict[int, RequestDelta] = field(default_factory=dict)  # by completion index: not yet sent
    last: RequestDelta | None = None  # the engine's latest delta: a dead engine's final delta builds on it

    @property
    def is_done_in_engine(self) -> bool:
        """The engine has ended the request (its final delta may still wait to be read): nothing is
        left to abort."""
        return self.last is not None and self.last.request_finished


@dataclass
class _Abort:
    """An abort the loop applies between steps."""

    message: str | None  # for a stream still read (an Abort call, a drain); None: nobody reads it
    cause: str | None  # counted in pagedserve:request_aborts if it ends a request; None: not counted


@dataclass
class KvEventBatch:
    """One step's changes to the prefix cache, numbered from 1 in the order they happened; or, as a
    listener's first batch, a `snapshot`: every block hash the cache holds, to which the batches that
    follow it apply (its `sequence` is the last batch's before it)."""

    sequence: int
    timestamp: float  # time.time()
    events: list[KvEvent]
    snapshot: list[bytes] | None = None


class KvEventListener:
    """A subscriber's batches. One that falls `max_pending` batches behind is cut off (its queue ends
    with `KvEventsOverflow`): it must subscribe again and start from a new snapshot, rather than hold
    the server's memory or miss changes silently."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.queue: asyncio.Queue[KvEventBatch | BaseException] = asyncio.Queue()
        self.closed = False  # unsubscribed, or cut off: the loop drops it between steps

    def put(self, batch: KvEventBatch) -> None:
        if self.closed:
            return
        if self.queue.qsize() >= self.max_pending:
            self.end(KvEventsOverflow(f"fell {self.max_pending} batches behind; subscribe again"))
        else:
            self.queue.put_nowait(batch)

    def end(self, exc: BaseException) -> None:
        self.closed = True
        self.queue.put_nowait(exc)


class KvEventsEnded(RuntimeError):
    """The server ended a KV event listener's feed (it is shutting down)."""


class KvEventsOverflow(KvEventsEnded):
    """A KV event listener read too slowly and was cut off."""


# How many final deltas that callers went away without reading are kept (see unread_final_delta). A
# front end takes its own as its call ends: only one that never asks leaves any behind.
_MAX_NUM_UNREAD_FINALS = 256


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int = 1024, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval: must be at least 1, got {stream_interval}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.stream_interval = stream_interval
        self._streams: dict[str, _Stream] = {}
        self._pending_adds: list[tuple[str, list[int], SamplingParams, float, int, str | None]] = []
        # LoRA adapter changes asked for (LLMEngine's method, its arguments, the caller's future)
        self._pending_lora_changes: list[
            tuple[Callable[..., None], tuple[str, ...], asyncio.Future[None]]
        ] = []
        self._pending_aborts: dict[str, _Abort] = {}  # by request id
        # ids held by front ends admitting their requests (see reserve): an Abort call's _Abort, or None
        self._reserved: dict[str, _Abort | None] = {}
        self._unread_finals: dict[str, RequestDelta] = {}  # by request id, oldest first
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dead: BaseException | None = None
        self._kv_listeners: list[KvEventListener] = []
        self._new_kv_listeners: list[KvEventListener] = []  # their snapshot is taken between steps
        self._kv_sequence = 0  # of the last KV event batch published

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pagedserve-engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_lora_changes(EngineDeadError("the engine has stopped"))
        await in_torch_thread(lambda: None)  # a step under way ends before the model goes
        self.engine.executor.shutdown()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.dead is None

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        """An id for a request whose caller chose none: random, so that no client's own id collides
        with it and no other client can guess it (to Abort it)."""
        return f"{prefix}-{uuid.uuid4().hex}"

    def live_request_ids(self) -> list[str]:
        return list(self._streams)

    def reserve(self, request_id: str) -> None:
        """Hold `request_id` while a front end admits its request (tokenizing it, compiling its grammar:
        up to seconds), until `generate` starts it or `release`: a second request under the id is
        refused meanwhile (InvalidRequestError naming request_id), and `abort` of it ends the request
        as soon as generate starts it, before any token."""
        if request_id in self._streams or request_id in self._reserved:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self._reserved[request_id] = None

    def release(self, request_id: str) -> None:
        """A reserved request that will not start (its admission failed, its caller left)."""
        self._reserved.pop(request_id, None)

    def check(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Raise what generate() would raise before its first delta, without starting anything."""
        self._admit(request_id, prompt_token_ids, params, priority, lora_name)

    async def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> list[int]:
        """What every front end does between tokenizing a request and generate(): truncate the prompt
        as the engine runs it (returned: what the front end reports), compile a new constraint on
        the grammar thread and tokenize the bad words on the tokenizer thread (off the event loop:
        check() then finds both done), and check()."""
        llm = self.engine
        prompt = llm.truncate_prompt(prompt_token_ids, params)
        if params.structured_outputs is not None:
            await in_grammar_thread(llm.structured_outputs.compile, params.structured_outputs)
        if params.bad_words:
            await in_tokenizer_thread(llm.tokenize_bad_words, params)
        self.check(request_id, prompt, params, priority, lora_name)
        return prompt

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """`LLMEngine.load_lora_adapter`, run between steps by the engine loop."""
        await self._change_lora(self.engine.load_lora_adapter, name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        """`LLMEngine.unload_lora_adapter`, run between steps by the engine loop."""
        await self._change_lora(self.engine.unload_lora_adapter, name)

    async def _change_lora(self, change: Callable[..., None], *args: str) -> None:
        """The loop runs LoRA changes on the torch thread between steps, after the requests queued
        before them are added (so an unload sees every request that could still use its adapter)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_lora_changes.append((change, args, done))
        self._wakeup.set()
        await done

    async def _apply_lora_changes(self) -> None:
        changes, self._pending_lora_changes = self._pending_lora_changes, []
        for change, args, done in changes:
            try:
                await in_torch_thread(change, *args)
            except Exception as exc:  # a bad adapter, one in use; a dead rank fails the next step too
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(None)

    def _fail_lora_changes(self, error: BaseException) -> None:
        """No loop runs the LoRA changes still asked for: their callers get `error`."""
        changes, self._pending_lora_changes = self._pending_lora_changes, []
        for _, _, done in changes:
            if not done.done():
                done.set_exception(error)

    def kill(self, exc: BaseException) -> None:
        """The engine cannot continue (e.g. a worker rank died between steps): fail every request."""
        if self.dead is None:
            self._die(exc)
            if self._task is not None:
                self._task.cancel()

    # -- requests ------------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cancel_cause: Callable[[], str] | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestDelta, None]:
        """Deltas of one request until all its completions finish. Raises InvalidRequestError before
        the first delta for a request the engine would reject, QueueFullError when over the bound,
        and EngineDeadError when the engine has stopped. A request the engine fails under it (a model
        fault, or the engine dying) ends with a delta whose finish reason is error and whose `error`
        says why: every front end reports, traces and counts a failure from that one delta.

        Closing the generator early aborts the request; `cancel_cause` says why (an abort cause of
        `pagedserve:request_aborts`, e.g. deadline), counted only when the abort ends the request: a
        request the engine already finished (its final delta unread) is counted as finished alone,
        and `unread_final_delta` gives its front end that delta. None counts nothing (the server's
        own requests).

        With `stream_interval` N > 1 a completion's first token comes alone, at once, and after it a
        delta carries N tokens (the engine's deltas of N steps, joined), except the last, which carries
        what is left when the completion finishes: fewer, larger messages for the same tokens.

        `priority` (an int64, 0 by default) orders the request under --scheduling-policy priority:
        lower runs earlier and may preempt running requests of a higher value; any other value than 0
        is refused (InvalidRequestError naming `priority`) under the default fcfs policy. `lora_name`
        runs it through that LoRA adapter (--lora-modules; None or "" for the base model)."""
        aborted_while_admitted = self._reserved.pop(request_id, None)  # held until now, if reserved
        self._admit(request_id, prompt_token_ids, params, priority, lora_name)
        self._unread_finals.pop(request_id, None)  # an earlier request's under the same id
        stream = self._streams[request_id] = _Stream(time.monotonic(), len(prompt_token_ids))
        self._pending_adds.append(
            (request_id, prompt_token_ids, params, stream.arrival_time, priority, lora_name)
        )
        if aborted_while_admitted is not None:  # the loop ends it before it runs, as any queued abort
            self._pending_aborts[request_id] = aborted_while_admitted
        self._wakeup.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                stream.finished = item.request_finished
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished and stream.is_done_in_engine:  # the caller left, its final delta unread
                self._keep_unread_final(request_id, stream.last)
            elif not stream.finished:  # the caller went away or we failed
                cause = cancel_cause() if cancel_cause is not None else None
                self._pending_aborts.setdefault(request_id, _Abort(None, cause))
                self._wakeup.set()
            self._streams.pop(request_id, None)

    def unread_final_delta(self, request_id: str) -> RequestDelta | None:
        """The final delta of a request that the engine ended (finished, failed, or aborted by an
        Abort call or a drain) while its caller, gone now, had not read that delta: how the request
        really ended, as the metrics counted it. None for any other request. A front end asks once,
        after closing generate()'s generator, to trace it; the delta is forgotten then (the oldest
        also once more than _MAX_NUM_UNREAD_FINALS wait, and any under an id that is reused)."""
        return self._unread_finals.pop(request_id, None)

    def _keep_unread_final(self, request_id: str, delta: RequestDelta | None) -> None:
        assert delta is not None  # is_done_in_engine
        self._unread_finals[request_id] = delta
        while len(self._unread_finals) > _MAX_NUM_UNREAD_FINALS:  # a front end that never asks
            del self._unread_finals[next(iter(self._unread_finals))]

    def abort(self, request_id: str, message: str = "aborted", cause: str | None = None) -> bool:
        """Abort a live request; its stream ends with a final delta whose finish reason is aborted.
        False for an unknown request, or one the engine has already finished (its final delta not
        read yet): that one ends as it finished. `cause` is counted as generate()'s `cancel_cause` is."""
        if request_id in self._reserved:  # being admitted: ended once generate starts it
            self._reserved[request_id] = _Abort(message, cause)
            return True
        stream = self._streams.get(request_id)
        if stream is None or stream.is_done_in_engine:
            return False
        self._pending_aborts[request_id] = _Abort(message, cause)
        self._wakeup.set()
        return True

    # -- KV events ---------------------------------------------------------------------------------

    def subscribe_kv_events(self, max_pending: int = 1024) -> KvEventListener:
        """A listener to the prefix cache's changes (a KV-aware router's feed): its first batch is a
        snapshot, taken between steps, then each step's changes. `unsubscribe_kv_events` when done.
        The block manager records changes only while someone listens."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        if not self.engine.config.cache.enable_prefix_caching:
            raise InvalidRequestError("kv_events", "prefix caching is off (--no-enable-prefix-caching)")
        listener = KvEventListener(max_pending)
        self._new_kv_listeners.append(listener)
        self._wakeup.set()
        return listener

    def unsubscribe_kv_events(self, listener: KvEventListener) -> None:
        listener.closed = True  # dropped by the loop between steps, which alone may stop the recording
        self._wakeup.set()

    def end_kv_listeners(self, message: str) -> None:
        """End every listener's feed (a drain: its router learns at once that this server goes away)."""
        for listener in self._kv_listeners + self._new_kv_listeners:
            if not listener.closed:
                listener.end(KvEventsEnded(message))
        self._wakeup.set()

    def _update_kv_listeners(self) -> None:
        """Between steps: drop closed listeners, start new ones from a snapshot, and record the cache's
        changes exactly while anyone listens."""
        listening = bool(self._kv_listeners)
        self._kv_listeners = [listener for listener in self._kv_listeners if not listener.closed]
        new = [listener for listener in self._new_kv_listeners if not listener.closed]
        self._new_kv_listeners = []
        if new:
            snapshot = self.engine.record_kv_events(True)
            for listener in new:
                listener.put(KvEventBatch(self._kv_sequence, time.time(), [], snapshot))
            self._kv_listeners += new
        elif listening and not self._kv_listeners:
            self.engine.record_kv_events(False)

    def _publish_kv_events(self) -> None:
        events = self.engine.take_kv_events()
        if events:
            self._kv_sequence += 1
            batch = KvEventBatch(self._kv_sequence, time.time(), events)
            for listener in self._kv_listeners:
                listener.put(batch)

    def _admit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        lora_name: str | None,
    ) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if request_id in self._pending_aborts:  # a step under way may still hold the old request's tokens
            raise InvalidRequestError("request_id", f"{request_id!r} is still being cancelled; retry shortly")
        self.engine.validate_request(prompt_token_ids, params, priority, lora_name)
        if self.engine.stats().num_waiting + len(self._pending_adds) >= self.max_queued_requests:
            raise QueueFullError(f"{self.max_queued_requests} requests are already queued; retry later")

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
            self._apply_pending()
            if self._pending_lora_changes:
                await self._apply_lora_changes()
            if not self.engine.has_work():
                continue
            try:
                deltas = await in_torch_thread(self.engine.step)
            except Exception as exc:  # the engine cannot go on: fail everyone, never leave them hanging
                self._die(exc)
                return
            self._publish_kv_events()
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    self._deliver(stream, delta)

    def _deliver(self, stream: _Stream, delta: RequestDelta) -> None:
        """Hand a delta to its stream, or hold it back while its completion has fewer than
        `stream_interval` unsent tokens (never its first token, never its last delta)."""
        stream.last = delta
        held = stream.held.pop(delta.index, None)
        if held is not None:
            delta.prepend(held)
        num_new = len(delta.new_token_ids)
        first = delta.num_output_tokens == num_new
        if self.stream_interval > 1 and num_new < self.stream_interval and not delta.finished and not first:
            stream.held[delta.index] = delta
        else:
            stream.queue.put_nowait(delta)

    def _has_work(self) -> bool:
        return bool(
            self._pending_adds
            or self._pending_aborts
            or self._pending_lora_changes
            or self._new_kv_listeners
            or any(listener.closed for listener in self._kv_listeners)
            or self.engine.has_work()
        )

    def _apply_pending(self) -> None:
        self._update_kv_listeners()
        aborts, self._pending_aborts = self._pending_aborts, {}
        adds, self._pending_adds = self._pending_adds, []
        self._abort(aborts, never_added={add[0] for add in adds})
        for request_id, prompt_token_ids, params, arrival_time, priority, lora_name in adds:
            if request_id in aborts or request_id not in self._streams:
                continue  # gone before it started
            try:
                self.engine.add_request(
                    request_id, prompt_token_ids, params, arrival_time, priority, lora_name
                )
            except InvalidRequestError as exc:
                self._streams[request_id].queue.put_nowait(exc)

    def _abort(self, aborts: dict[str, _Abort], never_added: set[str]) -> None:
        """Abort in the engine; a stream still read (an Abort call, a drain) gets the final deltas with
        the abort's message, also when its request never reached the engine. Each request ended here
        is counted under its abort's cause: here alone is it known that an abort ended a request."""
        deltas = self.engine.abort_request(list(aborts))
        for delta in deltas:
            stream, message = self._streams.get(delta.request_id), aborts[delta.request_id].message
            if message is not None and stream is not None:
                delta.error = message
                self._deliver(stream, delta)  # with the tokens held back for it, if any
        aborted_unadded = never_added.intersection(aborts)
        ended = {delta.request_id for delta in deltas} | aborted_unadded
        for request_id in aborted_unadded:
            stream, message = self._streams.get(request_id), aborts[request_id].message
            if stream is None:
                continue
            metrics = RequestMetrics(arrival_time=stream.arrival_time, finished_time=time.monotonic())
            delta = RequestDelta.aborted_before_output(request_id, stream.num_prompt_tokens, metrics, message)
            self.engine.metrics.record_aborted(self.engine.stats(), [delta])  # its log line
            if message is not None:
                stream.queue.put_nowait(delta)
        for request_id in ended:
            if (cause := aborts[request_id].cause) is not None:
                self.engine.metrics.record_abort(cause)

    def _die(self, exc: BaseException) -> None:
        """Fail every live request with a final error delta, as a model fault fails a batch's."""
        logger.error("engine loop stopped: %r", exc)
        self.dead = exc
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine step failed: {exc!r}")
        message, now = f"engine failed: {error}", time.monotonic()
        deltas = [
            RequestDelta.ended_early(
                request_id, stream.last, stream.num_prompt_tokens, stream.arrival_time, message
            )
            for request_id, stream in self._streams.items()
            if not stream.is_done_in_engine  # else its final delta is queued
        ]
        self.engine.metrics.record_failed(deltas, now)  # no step records them
        for delta in deltas:
            self._deliver(self._streams[delta.request_id], delta)
        for request_id, abort in self._pending_aborts.items():  # their callers left: ended by the abort
            if request_id not in self._streams and abort.cause is not None:
                self.engine.metrics.record_abort(abort.cause)
        self._pending_aborts.clear()  # nothing applies them now
        for listener in self._kv_listeners + self._new_kv_listeners:
            listener.end(error)
        self._fail_lora_changes(error)
