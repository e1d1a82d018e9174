"""The asyncio engine: the engine core steps the engine on the torch thread for as long as there is
work, each request reads its deltas from its own stream, and abort lives in the `finally` of the
per-request generator, so a client cancel, a broken connection, an expired deadline or a drain all
free the request's blocks before the next step.

The synchronous engine is not thread-safe: it is only changed on the torch thread (`in_torch_thread`,
which also builds the engine). Callers on the event loop put adds, aborts, LoRA changes and KV-event
subscriptions in an inbox (`Inbox`, under a lock); the core takes the inbox between steps, applies
it, steps, and hands the loop what it applied and what the step made (`Pass`), without waiting for
the loop to get to it: the next step starts at once. The loop hands out the deltas; a stream whose
reader (its gRPC writer) is behind gets the deltas that queue meanwhile merged into one, as vLLM's
front end does. Waiting for the loop between steps had the engine idle for as long as the writers of
the last step's tokens held the interpreter: with a step of a few milliseconds (a GPU, a small
model) the front end's one message a token set the pace.

With an `EngineFace` (`serve --engine-process`) the core runs in an engine process instead
(engine/core_process.py): `_kick` sends it the inbox, and a reader thread hands the loop its passes,
which the loop takes as it takes the torch thread's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pagedserve import logs
from pagedserve.beam_search import (
    BeamSearch,
    BeamSearchSequence,
    beam_deltas,
    step_candidates,
    step_params,
    text_token_ids,
)
from pagedserve.core.block_manager import KvEvent
from pagedserve.engine.core import Abort, Add, Inbox, LoraChange, Pass, run_pass
from pagedserve.engine.core_process import CorePass, EngineFace
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineDeadError, InvalidRequestError
from pagedserve.outputs import RequestDelta, RequestMetrics
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.threads import name_os_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Every torch call of a serving process runs on this one thread. libgomp gives each thread that enters
# a parallel region a thread team of its own, and once a process holds more OpenMP threads than cores
# its barriers stop spinning and sleep instead: with two threads running torch ops, each op ran 1.3x
# to 6x slower on 2 cores (an elementwise add 13 -> 71 us), and the server, stepping on asyncio's
# default executor, reached 63-65% of the offline engine's output throughput (bench/serving.py; 92%
# on this thread, which also builds the engine).
_TORCH_THREAD = ThreadPoolExecutor(1, "pagedserve-torch", name_os_thread)


async def in_torch_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_TORCH_THREAD, fn, *args)


# A front end's tokenizing (and chat templates) runs on this thread, off the event loop: a 4 MB prompt
# takes seconds to tokenize (or to find too long), and on the loop that stalls every stream. One
# thread, as vLLM does: a fast tokenizer is not safe to share between threads once one of them
# changes its settings.
_TOKENIZER_THREAD = ThreadPoolExecutor(1, "pagedserve-tokenizer", name_os_thread)


async def in_tokenizer_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, fn, *args)


# Structured outputs compile a request's schema, regex or grammar here (ms, up to a third of a second
# for the largest allowed): not on the tokenizer's thread, where every other request would wait.
_GRAMMAR_THREAD = ThreadPoolExecutor(1, "pagedserve-grammar", name_os_thread)


async def in_grammar_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_GRAMMAR_THREAD, fn, *args)


class QueueFullError(RuntimeError):
    """More requests are queued than --max-queued-requests allows."""


@dataclass
class _Stream:
    arrival_time: float  # time.monotonic() when generate() was called: queueing starts here
    num_prompt_tokens: int
    # what the reader has not taken yet: deltas (merged while the reader is behind) or an error
    items: list[RequestDelta | BaseException] = field(default_factory=list)
    reader: asyncio.Future[None] | None = None  # the reader, waiting for an item
    finished: bool = False  # the caller has been handed the request's final delta
    held: dict[int, RequestDelta] = field(default_factory=dict)  # by completion index: not yet sent
    last: RequestDelta | None = None  # the engine's latest delta: a dead engine's final delta builds on it

    @property
    def is_done_in_engine(self) -> bool:
        """The engine has ended the request (its final delta may still wait to be read): nothing is
        left to abort."""
        return self.last is not None and self.last.request_finished

    def put(self, item: RequestDelta | BaseException) -> None:
        """Queue an item for the reader. A delta of the same completion as the unread one before it,
        which did not end that completion, takes it in: a reader that is behind gets one message for
        the tokens of several steps."""
        previous = self.items[-1] if self.items else None
        if (
            isinstance(item, RequestDelta)
            and isinstance(previous, RequestDelta)
            and previous.index == item.index
            and not previous.finished
            and previous.error is None
        ):
            item.prepend(previous)
            self.items[-1] = item
        else:
            self.items.append(item)
        if self.reader is not None and not self.reader.done():
            self.reader.set_result(None)

    async def get(self) -> RequestDelta | BaseException:
        while not self.items:
            self.reader = asyncio.get_running_loop().create_future()
            await self.reader
        return self.items.pop(0)


class _BeamRequestEnded(Exception):
    """A beam's one-token request ended without its token: failed, or aborted (an Abort call, a drain)."""

    def __init__(self, delta: RequestDelta) -> None:
        super().__init__(delta.error or delta.finish_reason)
        self.delta = delta


def _search_ended(
    request_id: str, beam_delta: RequestDelta, num_prompt_tokens: int, metrics: RequestMetrics
) -> RequestDelta:
    """The final delta of a search that a beam's request ended: its finish reason (error, aborted) and
    error, said of the search's request."""
    return replace(
        beam_delta,
        request_id=request_id,
        index=0,
        new_token_ids=[],
        new_text="",
        new_logprobs=None,
        finished=True,
        request_finished=True,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=0,
        metrics=metrics,
    )


# How many passes the core may run ahead of the loop handing out their deltas: it waits beyond that
# (a loop too busy, or blocked, to take them), so that a stuck loop cannot have it pile up deltas.
_MAX_PASSES_AHEAD = 16


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
        # what the core applies next; the lock guards it and the core's state below
        self._lock = threading.Lock()
        self._inbox = Inbox()
        self._core: asyncio.Future[None] | None = None  # the core's job on the torch thread, while it runs
        self._stopping = False  # the core returns at its next pass
        self._passes_ahead = threading.Semaphore(_MAX_PASSES_AHEAD)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        # aborts sent to the core, by request id, until the loop has handled the pass that applied them
        self._pending_aborts: dict[str, Abort] = {}
        self._num_pending_adds = 0  # adds asked for that the engine does not hold yet (under the lock)
        # ids held by front ends admitting their requests (see reserve): an Abort call's Abort, or None
        self._reserved: dict[str, Abort | None] = {}
        self._unread_finals: dict[str, RequestDelta] = {}  # by request id, oldest first
        # beam searches, by their own (reserved) id: the ids of the round under way (see beam_search)
        self._searches: dict[str, list[str]] = {}
        self.dead: BaseException | None = None
        self._kv_listeners: list[KvEventListener] = []
        self._new_kv_listeners: list[KvEventListener] = []  # their snapshot is taken between steps
        self._kv_sequence = 0  # of the last KV event batch published
        self._kv_recording = False  # asked of the core: the block manager records the cache's changes
        # the engine in a process of its own (engine/core_process.py): passes come from its reader thread
        self._face = engine if isinstance(engine, EngineFace) else None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._face is not None:
            threading.Thread(
                target=self._read_core_passes, name="pagedserve-core-reader", daemon=True
            ).start()
        self._kick()

    async def halt(self) -> None:
        """Stop stepping (the pass under way ends first), the engine kept: its executor runs on."""
        with self._lock:
            self._stopping = True
            lora_changes, self._inbox.lora_changes = self._inbox.lora_changes, []
        self._fail_lora_changes(lora_changes, EngineDeadError("the engine has stopped"))
        if self._face is None:
            await in_torch_thread(lambda: None)  # queued behind the core's job: it has returned

    async def stop(self) -> None:
        await self.halt()
        self.engine.executor.shutdown()

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._stopping and self.dead is None

    @property
    def num_live_requests(self) -> int:
        return len(self.live_request_ids())

    @property
    def num_in_flight(self) -> int:
        """The requests front ends are answering: the live ones (beam searches included) and those
        being admitted (reserved until the engine takes them)."""
        return len(self.live_request_ids()) + len(self._reserved.keys() - self._searches.keys())

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        """An id for a request whose caller chose none: random, so that no client's own id collides
        with it and no other client can guess it (to Abort it)."""
        return f"{prefix}-{uuid.uuid4().hex}"

    def live_request_ids(self) -> list[str]:
        """The requests running: a beam search under its own id (aborting it ends the search), not its
        rounds' requests, and also between two rounds (a drain waits for it)."""
        rounds = {rid for ids in self._searches.values() for rid in ids}
        return [rid for rid in self._streams if rid not in rounds] + list(self._searches)

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
        """`LLMEngine.load_lora_adapter`, run between steps by the engine core."""
        await self._change_lora("load_lora_adapter", name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        """`LLMEngine.unload_lora_adapter`, run between steps by the engine core."""
        await self._change_lora("unload_lora_adapter", name)

    async def _change_lora(self, method: str, *args: str) -> None:
        """The core runs LoRA changes on the torch thread between steps, after the requests queued
        before them are added (so an unload sees every request that could still use its adapter)."""
        if self.dead is not None or self._stopping:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._inbox.lora_changes.append((method, args, done))
        self._kick()
        await done

    @staticmethod
    def _fail_lora_changes(changes: list[LoraChange], error: BaseException) -> None:
        """No core runs these LoRA changes: their callers get `error`."""
        for _, _, done in changes:
            if done is not None and not done.done():
                done.set_exception(error)

    def kill(self, exc: BaseException) -> None:
        """The engine cannot continue (e.g. a worker rank died between steps): fail every request."""
        if self.dead is None:
            with self._lock:
                self._stopping = True  # the core returns at its next pass; its output is dropped
            self._die(exc)

    # -- requests ------------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cancel_cause: Callable[[], str | None] | None = None,
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
        and `unread_final_delta` gives its front end that delta. None, or a cause of None, counts
        nothing (the server's own requests and aborts).

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
        add = Add(request_id, prompt_token_ids, params, stream.arrival_time, priority, lora_name)
        with self._lock:
            self._inbox.adds.append(add)
            self._num_pending_adds += 1
        if aborted_while_admitted is not None:  # the core ends it before it runs, as any queued abort
            self._send_abort(request_id, aborted_while_admitted)
        self._kick()
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                stream.finished = item.request_finished
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished and stream.is_done_in_engine:  # the caller left, its final delta unread
                self._keep_unread_final(request_id, stream.last)
            elif not stream.finished and request_id not in self._pending_aborts:  # the caller went away
                cause = cancel_cause() if cancel_cause is not None else None
                self._send_abort(request_id, Abort(None, cause))
            self._streams.pop(request_id, None)

    def request_deltas(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cancel_cause: Callable[[], str | None] | None = None,
        priority: int = 0,
        lora_name: str | None = None,
        beam_search: BeamSearchParams | None = None,
    ) -> AsyncGenerator[RequestDelta, None]:
        """What a front end reads for a request: `generate`'s deltas, or with `beam_search` that search's
        (`beam_search`; `params` then hold what it honours, n its width)."""
        if beam_search is None:
            return self.generate(
                request_id, prompt_token_ids, params, cancel_cause, priority=priority, lora_name=lora_name
            )
        return self.beam_search(
            request_id,
            prompt_token_ids,
            params,
            beam_search,
            cancel_cause,
            priority=priority,
            lora_name=lora_name,
        )

    async def beam_search(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        params: BeamSearchParams,
        cancel_cause: Callable[[], str | None] | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncGenerator[RequestDelta, None]:
        """vLLM's online beam search (its `EngineClient.beam_search`), taken as `generate` is taken. Each
        round runs every live beam for one token through `generate`, all of them at once, and
        `BeamSearch` keeps the best; only the result is yielded: one final delta per beam, best first
        (`index` its rank), with its generated tokens and their text (decoded with `sampling`'s
        skip_special_tokens and spaces_between_special_tokens, off the event loop; an ending EOS's text left out unless `params.include_stop_str_in_output`) and
        finish reason eos or length (`beam_deltas`). The last one ends the request.

        `request_id` is held for the whole search, as `reserve` holds it (kept from a front end's
        admission, else reserved here): a second request under it is refused, and `abort` of it aborts
        the round under way, ending the search with an aborted delta. A round's requests are
        `{request_id}-beam-<random hex>-<round>.<beam>`. One refused at its start raises what generate
        raises; one the engine fails (or an Abort call or a drain aborts) ends the search with a final
        delta of that finish reason and error. Either way, and when the caller goes away, the round's
        other requests are aborted: nothing of the search is left running. The engine counts each
        round's requests as requests of their own, finished or failed; an abort is the search's, counted
        once (`cancel_cause` as generate's when its caller went away, the Abort's cause else)."""
        if request_id not in self._reserved:
            self.reserve(request_id)
        self._searches[request_id] = []
        try:
            search = BeamSearch(prompt_token_ids, None, params, self.engine.eos_token_ids)
            metrics = RequestMetrics(time.monotonic(), max_tokens=params.max_tokens, lora_name=lora_name)
            try:
                ended = await self._run_beam_search(request_id, search, metrics, priority, lora_name)
            except asyncio.CancelledError:  # its caller went away during a round (or between two)
                self._count_search_abort(cancel_cause() if cancel_cause is not None else None)
                raise
            if ended is not None:
                if ended.finish_reason == "aborted" and (abort := self._reserved.get(request_id)):
                    self._count_search_abort(abort.cause)  # an Abort call's, a drain's
                yield ended
                return
            output = search.best()
            flags = (
                params.include_stop_str_in_output,
                sampling.skip_special_tokens,
                sampling.spaces_between_special_tokens,
            )
            texts = await in_tokenizer_thread(
                self._beam_texts, output.sequences, len(prompt_token_ids), *flags
            )
            metrics.first_token_time = metrics.last_token_time = metrics.finished_time = time.monotonic()
            for delta in beam_deltas(request_id, output, len(prompt_token_ids), texts, metrics):
                yield delta
        finally:
            self._searches.pop(request_id, None)
            self.release(request_id)

    async def _run_beam_search(
        self,
        request_id: str,
        search: BeamSearch,
        metrics: RequestMetrics,
        priority: int,
        lora_name: str | None,
    ) -> RequestDelta | None:
        """Extend the beams a token a round until every beam has finished (an EOS, max_tokens, the
        context). None then; else the final delta the search ended with early (a round's request failed
        or was aborted, or `request_id` was aborted between rounds)."""
        step = step_params(search.params)
        base = self.new_request_id(f"{request_id}-beam")  # random: no client's id collides with a round's
        num_prompt_tokens = len(search.beams[0].tokens)
        for number in range(search.params.max_tokens):
            search.end_at_context(self.engine.config.model.max_model_len)
            if not search.beams:
                break
            if (abort := self._reserved.get(request_id)) is not None:
                return RequestDelta.aborted_before_output(
                    request_id, num_prompt_tokens, metrics, abort.message
                )
            ids = [f"{base}-{number}.{i}" for i in range(len(search.beams))]
            try:
                deltas = await self._run_beam_round(request_id, ids, search.beams, step, priority, lora_name)
            except _BeamRequestEnded as exc:
                return _search_ended(request_id, exc.delta, num_prompt_tokens, metrics)
            if number == 0:  # the prompt's own wait and prefix-cache hits
                metrics.first_scheduled_time = deltas[0].metrics.first_scheduled_time
                metrics.num_cached_tokens = deltas[0].metrics.num_cached_tokens
            search.extend([step_candidates(delta.new_logprobs) for delta in deltas])
        return None

    async def _run_beam_round(
        self,
        request_id: str,
        ids: list[str],
        beams: list[BeamSearchSequence],
        step: SamplingParams,
        priority: int,
        lora_name: str | None,
    ) -> list[RequestDelta]:
        """Each beam's request (`ids`) for one token, all at once: their final deltas, in order. The
        first that fails (refused at its start, or ended without its token: `_BeamRequestEnded`) ends
        the round, and every read is cancelled however the round ends; each read closes its request's
        generator (`_read_beam_step`), which aborts those still running, even when the wait for them
        here is cancelled (a deadline landing just as the round ends). Their aborts count nothing: the
        search counts its own (`_count_search_abort`)."""
        reads = [
            asyncio.ensure_future(self._read_beam_step(rid, beam.tokens, step, priority, lora_name))
            for rid, beam in zip(ids, beams, strict=True)
        ]
        self._searches[request_id] = ids
        try:
            return list(await asyncio.gather(*reads))
        finally:
            self._searches[request_id] = []
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)

    async def _read_beam_step(
        self, request_id: str, tokens: list[int], step: SamplingParams, priority: int, lora_name: str | None
    ) -> RequestDelta:
        """One beam's request of a round, read to its final delta (`_BeamRequestEnded` if it ends
        without its token). The read closes the request's generator itself however it ends (cancelled
        too, which aborts it if still running), so that a round cancelled while it collects its reads
        cannot leave one open; and it forgets the final delta the engine keeps for a caller gone before
        reading it (`unread_final_delta`), which no front end asks for a round's request."""
        deltas = self.generate(request_id, tokens, step, None, priority, lora_name)
        try:
            async for delta in deltas:
                if delta.finish_reason in ("error", "aborted"):
                    raise _BeamRequestEnded(delta)
                if delta.request_finished:
                    return delta
            raise AssertionError("generate ends with a final delta or an exception")
        finally:
            await deltas.aclose()
            self._unread_finals.pop(request_id, None)

    def _count_search_abort(self, cause: str | None) -> None:
        """A beam search that an abort ended (its caller gone, an Abort call, a drain) counts once in
        pagedserve:request_aborts, as any request does, under `cause` (None: not counted). Its rounds'
        one-token requests, aborted with it, count nothing: most of them have already finished in the
        engine when the abort comes, which would leave a cancelled search uncounted."""
        if cause is not None:
            self.engine.metrics.record_abort(cause)

    def _beam_texts(
        self,
        beams: list[BeamSearchSequence],
        num_prompt_tokens: int,
        include_stop: bool,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> list[str]:
        """The beams' generated text (on the tokenizer thread: `text_token_ids`)."""
        return [
            self.engine.decode(
                text_token_ids(beam, num_prompt_tokens, include_stop),
                skip_special_tokens,
                spaces_between_special_tokens,
            )
            for beam in beams
        ]

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
        if request_id in self._reserved:  # being admitted (ended once generate starts it), or a beam search
            self._reserved[request_id] = Abort(message, cause)
            for beam_request_id in self._searches.get(request_id, ()):  # its round, the search counts it
                self.abort(beam_request_id, message, None)
            return True
        stream = self._streams.get(request_id)
        if stream is None or stream.is_done_in_engine:
            return False
        self._send_abort(request_id, Abort(message, cause))
        return True

    def _send_abort(self, request_id: str, abort: Abort) -> None:
        """Have the core abort the request between steps (a later abort of it replaces this one)."""
        self._pending_aborts[request_id] = abort
        with self._lock:
            self._inbox.aborts[request_id] = abort
        self._kick()

    # -- KV events ---------------------------------------------------------------------------------

    def switch_logs(self, switches: logs.LogSwitches) -> None:
        """Write the records `switches` turns on from now on: here at once, and at the core's next pass
        (within milliseconds) in the engine process and the tensor-parallel ranks."""
        logs.switch(switches)
        with self._lock:
            self._inbox.log_switches = switches
        self._kick()

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
        self._kv_recording = True
        with self._lock:
            self._inbox.kv_snapshot, self._inbox.kv_stop = True, False
        self._kick()
        return listener

    def unsubscribe_kv_events(self, listener: KvEventListener) -> None:
        listener.closed = True  # (also set by a listener cut off: dropped when the loop next looks)
        self._update_kv_recording()

    def end_kv_listeners(self, message: str) -> None:
        """End every listener's feed (a drain: its router learns at once that this server goes away)."""
        for listener in self._kv_listeners + self._new_kv_listeners:
            if not listener.closed:
                listener.end(KvEventsEnded(message))
        self._update_kv_recording()

    def _publish_kv_events(self, done: Pass) -> None:
        """A pass's snapshot to the listeners waiting for one, then its step's changes to every
        listener; then the recording stops if nobody listens any more."""
        if done.kv_snapshot is not None:
            new = [listener for listener in self._new_kv_listeners if not listener.closed]
            self._new_kv_listeners = []
            for listener in new:
                listener.put(KvEventBatch(self._kv_sequence, time.time(), [], done.kv_snapshot))
            self._kv_listeners += new
        if done.kv_events:
            self._kv_sequence += 1
            batch = KvEventBatch(self._kv_sequence, time.time(), done.kv_events)
            for listener in self._kv_listeners:
                listener.put(batch)
        self._update_kv_recording()

    def _update_kv_recording(self) -> None:
        """Drop closed listeners; the last one gone, have the core stop recording the cache's changes
        (and take no snapshot that nobody waits for any more)."""
        self._kv_listeners = [listener for listener in self._kv_listeners if not listener.closed]
        self._new_kv_listeners = [listener for listener in self._new_kv_listeners if not listener.closed]
        if self._kv_recording and not self._kv_listeners and not self._new_kv_listeners:
            self._kv_recording = False
            with self._lock:
                self._inbox.kv_snapshot, self._inbox.kv_stop = False, True
            self._kick()

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
        if self.engine.stats().num_waiting + self._num_pending_adds >= self.max_queued_requests:
            raise QueueFullError(f"{self.max_queued_requests} requests are already queued; retry later")

    # -- the core: the torch thread's side ------------------------------------------------------------

    def _kick(self) -> None:
        """Start the core on the torch thread unless it runs (it returns when it has nothing to do);
        or send the inbox to the engine process."""
        if self._loop is None:
            return  # not started: start() kicks
        with self._lock:
            if self._core is not None or self._stopping or self.dead is not None:
                return
            if self._face is None:
                self._core = self._loop.run_in_executor(_TORCH_THREAD, self._run_core)
                self._core.add_done_callback(self._core_returned)
                return
            inbox, self._inbox = self._inbox, Inbox()
        if inbox:
            self._face.executor.send(inbox)

    def _core_returned(self, job: asyncio.Future[None]) -> None:
        """On the loop: the core's job has ended. An exception that escaped it (`run_pass` catches
        the engine's own; none other is known) fails the engine, rather than leave the core marked
        running, never to be started again, and every stream waiting."""
        if job.cancelled() or (exc := job.exception()) is None:
            return
        self.kill(EngineDeadError(f"the engine core failed: {exc!r}"))

    def _run_core(self) -> None:
        """Passes back to back while there is work: take the inbox, apply it, step, hand the pass to
        the loop. Returns when there is nothing to do (the next kick starts it again), when stopped,
        or after a fault."""
        assert self._loop is not None
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, Inbox()
                if self._stopping or not (inbox or self.engine.has_work()):
                    self._inbox = inbox  # (kept when stopped: halt fails its LoRA changes, _die all)
                    self._core = None
                    return
            done = run_pass(self.engine, inbox, self._added)
            while not self._passes_ahead.acquire(timeout=0.1):  # the loop is that far behind
                if self._stopping:
                    break
            try:
                self._loop.call_soon_threadsafe(self._on_pass, done)
            except RuntimeError:  # the event loop is closed: nobody takes passes any more
                done.fault = done.fault or EngineDeadError("the event loop has closed")
            if done.fault is not None:
                with self._lock:
                    self._stopping = True
                    self._core = None
                return
            if not done.deltas:
                time.sleep(0)  # a prompt chunk, or nothing the scheduler could run: let the loop in

    def _added(self, num_adds: int) -> None:
        """The core has put these adds in the engine's waiting queue (or dropped them): no longer pending."""
        with self._lock:
            self._num_pending_adds -= num_adds

    def _read_core_passes(self) -> None:
        """The engine process's passes, handed to the loop as the torch thread's core hands its own
        (at most _MAX_PASSES_AHEAD ahead: then the engine process waits to send). Its end is a fault."""
        assert self._face is not None and self._loop is not None
        name_os_thread()
        process = self._face.executor
        while True:
            try:
                core_pass = process.receive()
            except EngineDeadError as exc:
                core_pass = CorePass([], Pass(Inbox(), fault=exc), None)
            except Exception as exc:  # a pass that cannot be read: nothing after it can be trusted
                fault = EngineDeadError(f"a pass of the engine process could not be read: {exc!r}")
                core_pass = CorePass([], Pass(Inbox(), fault=fault), None)
            while not self._passes_ahead.acquire(timeout=0.1):
                if self._stopping:
                    break
            if self._stopping:
                return  # halted or killed: nobody takes passes any more
            try:
                self._loop.call_soon_threadsafe(self._on_core_pass, core_pass)
            except RuntimeError:  # the event loop is closed
                return
            if core_pass.done.fault is not None:
                return

    def _on_core_pass(self, core_pass: CorePass) -> None:
        """On the loop: a pass of the engine process, taken as `_on_pass` takes the torch thread's."""
        assert self._face is not None
        done = core_pass.done
        # a fault: the engine process applies nothing more, so every inbox sent goes with it
        done.inbox = self._face.executor.take_inboxes(core_pass.numbers if done.fault is None else None)
        with self._lock:
            self._num_pending_adds -= len(done.inbox.adds)
        if self.dead is None:
            self._face.follow(core_pass)
        self._on_pass(done)

    # -- the core: the loop's side ------------------------------------------------------------------

    def _on_pass(self, done: Pass) -> None:
        """On the loop: hand out what a pass applied and made, in the order it happened."""
        self._passes_ahead.release()
        inbox = done.inbox
        for request_id, abort in inbox.aborts.items():
            if self._pending_aborts.get(request_id) is abort:  # not asked again since
                del self._pending_aborts[request_id]
        if self.dead is not None:  # killed meanwhile: everyone has been failed
            self._fail_lora_changes(
                inbox.lora_changes, EngineDeadError(f"the engine has stopped: {self.dead}")
            )
            return
        self._end_aborted(inbox.aborts, {add.request_id for add in inbox.adds}, done.aborted)
        for request_id, exc in done.refused.items():
            if (stream := self._streams.get(request_id)) is not None:
                stream.put(exc)
        for (_, _, future), error in zip(inbox.lora_changes, done.lora_errors, strict=False):
            if future is None or future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        if done.fault is not None:
            self._die(done.fault)  # (and the LoRA changes the fault came before: failed with it)
            self._fail_lora_changes(
                inbox.lora_changes, EngineDeadError(f"the engine has stopped: {self.dead}")
            )
            return
        self._publish_kv_events(done)
        for delta in done.deltas:
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
            stream.put(delta)

    def _end_aborted(
        self, aborts: dict[str, Abort], never_added: set[str], deltas: list[RequestDelta]
    ) -> None:
        """The core aborted these requests (`deltas`: the engine's final deltas of those it held); a
        stream still read (an Abort call, a drain) gets the final deltas with the abort's message, also
        when its request never reached the engine. Each request ended here is counted under its abort's
        cause: here alone is it known that an abort ended a request."""
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
                stream.put(delta)
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
        with self._lock:  # what the core will not apply now
            inbox, self._inbox = self._inbox, Inbox()
        self._fail_lora_changes(inbox.lora_changes, error)
