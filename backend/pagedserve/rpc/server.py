"""The gRPC server: `pagedserve.rpc.v1.Generation` (convert and delegate to the AsyncEngine, nothing
else), the standard `grpc.health.v1.Health`, reflection, and the serving lifecycle:

    starting ──warm-up done──▶ serving ──SIGTERM──▶ draining ──in-flight done, timeout or signal──▶ exit 0
       │                          └──engine loop or a worker died──▶ dead ──▶ exit 1
       └──SIGTERM/SIGINT──▶ exit 0 at once (`pagedserve serve` does not wait for a model load under way)

Liveness (health service "") is SERVING from the first moment until the engine dies; readiness
(service READINESS_SERVICE) only while serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.descriptor import FileDescriptor, ServiceDescriptor
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from pagedserve import __version__
from pagedserve.engine.async_engine import (
    AsyncEngine,
    KvEventsOverflow,
    QueueFullError,
    in_grammar_thread,
    in_tokenizer_thread,
)
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import (
    AdapterInUseError,
    AdapterLoadedError,
    AdapterNotLoadedError,
    EngineDeadError,
    InvalidRequestError,
)
from pagedserve.outputs import RequestDelta
from pagedserve.rpc import convert
from pagedserve.rpc.auth import ApiKey, ApiKeyInterceptor
from pagedserve.rpc.signals import catch_stop_signals
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.telemetry import RequestTracer
from pagedserve.tool_calls import ToolChoice

logger = logging.getLogger(__name__)

SERVICE_NAME = "pagedserve.rpc.v1.Generation"
READINESS_SERVICE = SERVICE_NAME
_REFUSAL_STATUS = {  # telemetry.REJECTION_REASONS' statuses
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "not_found": grpc.StatusCode.NOT_FOUND,
}
_HEALTH_POLL_S = 1.0
# The abort cause (pagedserve:request_aborts) of a stream given up by --stream-write-timeout.
STALLED_CLIENT = "stalled_client"

T = TypeVar("T")


@dataclass
class _Call:
    """One Generate/Complete call: what it asked for, when it was tokenized, the last delta it saw
    (a failed request's carries why: the engine ends it with finish reason error)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokenized: tuple[float, float]  # time.monotonic() before and after tokenizing
    priority: int = 0
    lora_name: str | None = None  # the LoRA adapter it runs through (None: the base model)
    outputs: convert.ChatOutputs | None = None  # a chat's parsers: reasoning and tool calls out of its text
    # sampling.use_beam_search: the search's parameters (`params` then holds n, the beam width)
    beam_search: BeamSearchParams | None = None
    last: RequestDelta | None = None
    stalled: bool = False  # given up by --stream-write-timeout: the abort's cause
    refused: bool = False  # the engine would not start it (`_refuse` traced it)

    def response(self, delta: RequestDelta) -> pb.GenerateResponse:
        out = convert.response(delta, self.prompt)
        if self.outputs is not None:
            self.outputs.apply(out, delta.finished)
        return out


@dataclass
class _Admitting:
    """What is known of a call's request while it is admitted, for the span of its refusal."""

    started: float  # time.monotonic() when the call came in
    model: str  # as the request names it ("": the served model)
    request_id: str = ""
    params: SamplingParams | None = None


def refusal_reason(exc: BaseException) -> str:
    """The telemetry.REJECTION_REASONS reason of an exception that refuses a request before it runs."""
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, EngineDeadError):
        return "unavailable"
    assert isinstance(exc, InvalidRequestError), exc
    return "invalid"


@dataclass
class ServerState:
    status: str = "starting"  # starting, serving, draining, dead
    allow_runtime_lora_updating: bool = False  # LoadLoRAAdapter / UnloadLoRAAdapter (the flag)
    tool_call_parser: str | None = None  # tool_choice auto's (--enable-auto-tool-choice on), else None
    reasoning_parser: str | None = None  # --reasoning-parser

    @property
    def ready(self) -> bool:
        return self.status == "serving"


class GenerationServicer:
    """Every RPC checks the server state first, so nothing touches the engine before it is bound."""

    def __init__(self, state: ServerState, tracer: RequestTracer, write_watch: WriteWatch) -> None:
        self.state = state
        self.tracer = tracer
        self.write_watch = write_watch

    def bind(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.llm = engine.engine
        self.model_name = self.llm.config.model.served_model_name

    # -- generation ----------------------------------------------------------------------------------

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Writes its responses itself (not an async generator, whose writes grpc awaits with no
        time limit), so that a write a stalled client keeps from completing can be given up."""
        call = await self._admit(request, context)
        deltas = self._deltas(call, context)
        try:
            async for delta in deltas:
                for response in split_prompt_logprobs(call.response(delta)):
                    await self.write_watch.send(context.write(response))
        except StalledClientError as exc:
            call.stalled = True
            await deltas.aclose()  # aborted as stalled_client, before anything else can happen
            give_up_stalled_call(context, f"the stream of request {call.request_id}", exc)
        finally:  # a caller that went away aborts its request here (the engine counts it)
            await deltas.aclose()
            self._trace(call, context)

    async def Complete(self, request: Any, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        call = await self._admit(request, context)
        completions = [pb.GenerateResponse(request_id=call.request_id, index=i) for i in range(call.params.n)]
        deltas = self._deltas(call, context)
        try:
            async for delta in deltas:
                _merge(completions[delta.index], call.response(delta))
        finally:
            await deltas.aclose()
            self._trace(call, context)
        return pb.CompleteResponse(completions=completions)

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        call = await self._admit(request, context, convert.pooling_params)
        deltas = self._deltas(call, context)
        try:
            async for delta in deltas:
                call.last = delta
        finally:
            await deltas.aclose()
            self._trace(call, context)
        if call.last is None or call.last.embedding is None:  # aborted (an Abort call, a drain timeout)
            error = call.last.error if call.last is not None else None
            await context.abort(grpc.StatusCode.CANCELLED, error or "the request was aborted")
            raise AssertionError("context.abort raises")
        return convert.embed_response(call.last)

    async def _admit(
        self,
        request: Any,
        context: grpc.aio.ServicerContext,
        params_of: Callable[[Any], SamplingParams] | None = None,
    ) -> _Call:
        """Check and tokenize a call's request; `params_of` makes its parameters (default: the
        Generate request's sampling). Its id is held from here until the engine starts the request
        (`AsyncEngine.reserve`): tokenizing and compiling a grammar take up to seconds, in which a
        second request under the id is refused and an Abort call ends this one."""
        known = _Admitting(time.monotonic(), getattr(request, "model", ""))
        if self.state.status != "serving":
            await self._refuse(context, "unavailable", f"server is {self.state.status}", known)
        held: list[str] = []
        try:
            return await self._admit_held(request, context, params_of, held, known)
        except BaseException:
            for rid in held:  # refused or cancelled here: the engine never starts it
                self.engine.release(rid)
            raise

    async def _admit_held(
        self,
        request: Any,
        context: grpc.aio.ServicerContext,
        params_of: Callable[[Any], SamplingParams] | None,
        held: list[str],
        known: _Admitting,
    ) -> _Call:
        tools: ToolChoice | None = None
        beam_search = None
        try:
            if isinstance(request, InvalidRequestError):
                raise request
            lora_name = self._lora_name(request)
            rid = known.request_id = convert.request_id(request, self.engine.new_request_id())
            self.engine.reserve(rid)
            held.append(rid)
            if params_of is not None:
                params = params_of(request)
            elif request.sampling.use_beam_search:  # (no tools: refused with it)
                params, beam_search = convert.beam_search_params(request, self.llm)
                params = convert.keep_special_tokens(request, params, self.state.reasoning_parser)
            else:
                tools = convert.request_tool_choice(request, self.state.tool_call_parser)
                params = convert.sampling_params(request.sampling, self.llm, tools)
                convert.check_text_free(request, params, tools, self.state.reasoning_parser)
                params = convert.keep_special_tokens(request, params, self.state.reasoning_parser, tools)
            known.params = params
            prompt = await in_tokenizer_thread(convert.prompt_token_ids, request, self.llm)
            try:
                prompt = await self.engine.prepare(rid, prompt, params, request.priority, lora_name=lora_name)
            except InvalidRequestError as exc:  # the tools' schema, which the request did not write as one
                if tools is None or tools.schema is None or not exc.field.startswith("structured_outputs"):
                    raise
                compile_grammar = self.llm.structured_outputs.compile
                raise await in_grammar_thread(
                    convert.tool_schema_error, tools, exc, compile_grammar
                ) from None
        except (InvalidRequestError, QueueFullError, EngineDeadError) as exc:
            await self._refuse(context, refusal_reason(exc), str(exc), known)
        outputs = None
        if params_of is None:
            outputs = convert.chat_outputs(
                request,
                tools,
                self.state.reasoning_parser,
                params.structured_outputs is not None,
                lambda: str(self.llm.tokenizer.decode(prompt[-16:])),
            )
        tokenized = (known.started, time.monotonic())
        return _Call(
            rid, prompt, params, tokenized, request.priority, lora_name, outputs, beam_search=beam_search
        )

    async def _refuse(
        self, context: grpc.aio.ServicerContext, reason: str, message: str, known: _Admitting | _Call
    ) -> NoReturn:
        """End a call whose request will not run, counted by `reason` (telemetry.REJECTION_REASONS) in
        pagedserve:request_rejections once the engine is bound (while it loads there are no metrics),
        and traced with what is `known` of it."""
        if hasattr(self, "llm"):
            self.llm.metrics.record_rejection(reason)
        if isinstance(known, _Call):  # traced here, not as an aborted request at the call's end (`_trace`)
            known.refused = True
            known = _Admitting(known.tokenized[0], "", known.request_id, known.params)
        if self.tracer.enabled:  # (its metadata read only then)
            self.tracer.refuse(
                context.invocation_metadata(),
                reason,
                message,
                known.started,
                known.request_id,
                known.params,
                known.model[:256],  # as a refusal's message quotes it
            )
        await context.abort(_REFUSAL_STATUS[reason], message)
        raise AssertionError("context.abort raises")

    def _lora_name(self, request: Any) -> str | None:
        """The request's LoRA adapter: `lora_name`, or a `model` naming an adapter (as vLLM's OpenAI
        server serves each adapter as a model of its name, which routers such as the Gateway API
        inference extension pick adapters by). The served model's own name comes first."""
        model, lora_name = request.model, request.lora_name or None
        if not model or model == self.model_name:
            return lora_name
        adapters = self.llm.lora_names
        if model not in adapters:
            served = f" and the LoRA adapters {', '.join(adapters)}" if adapters else ""
            raise InvalidRequestError(
                "model", f"unknown model {model[:256]!r}; this server serves {self.model_name!r}{served}"
            )
        if lora_name is not None and lora_name != model:
            raise InvalidRequestError(
                "lora_name", f"{lora_name[:256]!r} is not the adapter model {model!r} names"
            )
        return model

    async def _deltas(
        self, call: _Call, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[RequestDelta, None]:
        """The engine's deltas (a beam search's: its beams' final deltas); closing this closes the
        engine's generator at once, which aborts a request its caller left (left to the garbage
        collector, the abort waited for it)."""

        def cause() -> str:
            return STALLED_CLIENT if call.stalled else cancel_cause(context)

        deltas = self.engine.request_deltas(
            call.request_id, call.prompt, call.params, cause, call.priority, call.lora_name, call.beam_search
        )
        try:
            async for delta in deltas:
                call.last = delta
                if delta.finish_reason == "error":
                    await context.abort(grpc.StatusCode.INTERNAL, delta.error or "generation failed")
                yield delta
        except (InvalidRequestError, QueueFullError, EngineDeadError) as exc:  # refused at its start
            await self._refuse(context, refusal_reason(exc), str(exc), call)
        finally:
            await deltas.aclose()

    def _trace(self, call: _Call, context: grpc.aio.ServicerContext) -> None:
        """After the engine's generator is closed: a request the engine ended while its caller left
        is traced as it ended (its final delta unread), as the metrics count it."""
        if call.refused:
            return
        last = self.engine.unread_final_delta(call.request_id) or call.last
        metadata = context.invocation_metadata()
        self.tracer.finish_request(
            metadata, call.request_id, call.params, last, call.tokenized, len(call.prompt)
        )

    # -- control -------------------------------------------------------------------------------------

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._require_engine(context)
        if isinstance(request, InvalidRequestError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        aborted = [
            rid
            for rid in dict.fromkeys(request.request_ids)  # an id given twice is one request
            if self.engine.abort(rid, "aborted by an Abort call", "abort_rpc")
        ]
        return pb.AbortResponse(aborted_request_ids=aborted)

    async def LoadLoRAAdapter(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.LoRAAdaptersResponse:
        await self._allow_lora_change(request, context)
        path = request.lora_path
        if not path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: must not be empty")
        await self._change_lora(context, self.engine.load_lora_adapter, request.lora_name, path)
        return pb.LoRAAdaptersResponse(lora_adapters=self.llm.lora_names)

    async def UnloadLoRAAdapter(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.LoRAAdaptersResponse:
        await self._allow_lora_change(request, context)
        await self._change_lora(context, self.engine.unload_lora_adapter, request.lora_name)
        return pb.LoRAAdaptersResponse(lora_adapters=self.llm.lora_names)

    async def _allow_lora_change(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        await self._require_engine(context)
        if not self.state.allow_runtime_lora_updating:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "LoRA adapters are not loaded or unloaded at run time here: start the server with "
                "--allow-runtime-lora-updating (it reads any adapter path the server can)",
            )
        if self.state.status == "draining":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if isinstance(request, InvalidRequestError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))

    async def _change_lora(self, context: grpc.aio.ServicerContext, change: Any, *args: str) -> None:
        """Run a LoRA change, its refusals said with the status that fits them."""
        try:
            await change(*args)
        except AdapterLoadedError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except AdapterNotLoadedError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except AdapterInUseError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def KvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """The prefix cache's changes (see the proto); written under --stream-write-timeout, as
        Generate's responses are: a router that stops reading is given up, not waited for."""
        await self._require_engine(context)
        if self.state.status == "draining":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if isinstance(request, InvalidRequestError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        if not self.llm.config.cache.enable_prefix_caching:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "kv_events: prefix caching is off (--no-enable-prefix-caching)",
            )
        listener = self.engine.subscribe_kv_events()
        block_size = self.llm.config.cache.block_size
        try:
            while True:
                item = await listener.queue.get()
                if isinstance(item, BaseException):  # fell behind, ended by a drain, or the engine died
                    slow = isinstance(item, KvEventsOverflow)
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED if slow else grpc.StatusCode.UNAVAILABLE
                    await context.abort(code, f"kv_events: {item}")
                    raise AssertionError("context.abort raises")
                batch = convert.kv_event_batch(item, block_size)
                await self.write_watch.send(context.write(batch))
        except StalledClientError as exc:
            give_up_stalled_call(context, "a KvEvents subscriber", exc)
        finally:
            self.engine.unsubscribe_kv_events(listener)

    async def _require_engine(self, context: grpc.aio.ServicerContext) -> None:
        if self.state.status in ("starting", "dead"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"server is {self.state.status}")

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        if self.state.status == "starting":
            return pb.HealthResponse(ready=False, status="starting")
        stats = self.llm.stats()
        ready = self.state.ready
        if ready and not isinstance(request, InvalidRequestError) and request.deep:
            ready = await deep_check(self.engine)
        usage = 1.0 - stats.num_free_blocks / max(1, stats.num_total_blocks)
        return pb.HealthResponse(
            ready=ready,
            status=self.state.status,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=usage,
            num_in_flight=self.engine.num_in_flight,
        )

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        return await self._convert_on_tokenizer_thread(convert.tokenize, request, context)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        return await self._convert_on_tokenizer_thread(convert.detokenize, request, context)

    async def _convert_on_tokenizer_thread(
        self, conversion: Callable[[Any, LLMEngine], T], request: Any, context: grpc.aio.ServicerContext
    ) -> T:
        await self._require_engine(context)
        try:
            if isinstance(request, InvalidRequestError):
                raise request
            return await in_tokenizer_thread(conversion, request, self.llm)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("context.abort raises") from exc

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        await self._require_engine(context)
        config, executor = self.llm.config, self.llm.executor
        return pb.ModelInfoResponse(
            model_name=self.model_name,
            max_context_length=config.model.max_model_len,
            num_kv_blocks=executor.num_kv_blocks,
            block_size=config.cache.block_size,
            kv_capacity_tokens=executor.num_kv_blocks * config.cache.block_size,
            tensor_parallel_size=executor.tensor_parallel_size,
            dtype=config.model.dtype,
            version=__version__,
            max_num_seqs=config.scheduler.max_num_seqs,
            scheduling_policy=config.scheduler.scheduling_policy,
            lora_adapters=self.llm.lora_names,
            tool_call_parser=self.state.tool_call_parser or "",
            reasoning_parser=self.state.reasoning_parser or "",
        )


# The server's copy of a call's deadline starts when its headers arrive, after the client's: a client
# whose own deadline fired cancels the call while the server's still has a few milliseconds left
# (0-3 ms seen on this 2-core host under load; more while the process is starved). A cancel this
# close to the deadline counts as the deadline.
DEADLINE_SLACK_S = 0.1


def cancel_cause(context: grpc.aio.ServicerContext) -> str:
    """Why a gRPC call was cut short, as `pagedserve:request_aborts` counts it: its deadline passed
    (to within DEADLINE_SLACK_S), or the client went away (every gRPC front end counts the same way)."""
    remaining = context.time_remaining()
    return "deadline" if remaining is not None and remaining <= DEADLINE_SLACK_S else "client_cancel"


# A stream's response past this size has its prompt logprobs sent ahead in messages of their own: a
# long prompt's (16,000 tokens at prompt_logprobs 20: 9 MB in one message) was past the 4 MiB a gRPC
# client takes by default, so that no default client could ever read the request's answer.
MAX_PROMPT_LOGPROBS_BYTES = 1 << 20


def split_prompt_logprobs(response: pb.GenerateResponse) -> list[pb.GenerateResponse]:
    """`response`, or where its prompt logprobs make it larger than MAX_PROMPT_LOGPROBS_BYTES: messages
    of those logprobs alone, in order, each about that size at most, then `response` with the last of
    them and all else it carries. A client concatenates `prompt_logprobs` over the responses, as it does
    `text`. Nothing changes for the many responses that carry no prompt logprobs (one length read)."""
    max_bytes = MAX_PROMPT_LOGPROBS_BYTES
    if len(response.prompt_logprobs) < 2 or response.ByteSize() <= max_bytes:
        return [response]
    entries = list(response.prompt_logprobs)
    per_entry = -(-sum(entry.ByteSize() + 4 for entry in entries) // len(entries))  # with its field tag
    chunk = max(1, max_bytes // per_entry)
    pieces = [entries[i : i + chunk] for i in range(0, len(entries), chunk)]
    ahead = [
        pb.GenerateResponse(
            request_id=response.request_id,
            index=response.index,
            prompt_tokens=response.prompt_tokens,
            prompt_logprobs=piece,
        )
        for piece in pieces[:-1]
    ]
    del response.prompt_logprobs[:]
    response.prompt_logprobs.extend(pieces[-1])
    return [*ahead, response]


class StalledClientError(Exception):
    """A stream's response could not be sent within --stream-write-timeout: its client keeps the
    connection open but stopped reading (a stuck consumer, a paused process)."""


class WriteWatch:
    """Gives up the streams whose client stopped reading: a write that has waited `timeout` seconds
    (--stream-write-timeout; 0: never) raises StalledClientError in its writer. Per write, not per
    stream: a client that reads slowly but keeps reading lets each write complete and is never cut.
    Without it a stalled client's handler waited until shutdown, while the engine generated its
    request to the end into an unbounded queue.

    A write is stamped, not timed: one checker looks at the stamps four times per timeout (at most
    once a second) while writes are in flight, and cancels a late writer's task, as asyncio.timeout
    would. On the per-token path that costs a dict entry a write, where an asyncio.timeout per write
    cost 3.6 us (a /tmp microbenchmark of 200,000 awaits)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._writing: dict[asyncio.Task[Any], float] = {}  # writer -> loop time its write began
        self._stalled: set[asyncio.Task[Any]] = set()  # writers the checker cancelled
        self._checker: asyncio.Task[None] | None = None

    async def send(self, write: Awaitable[None]) -> None:
        """Await one write of a stream (the writer is suspended here whenever the checker looks)."""
        if not self.timeout:
            await write
            return
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        self._writing[task] = loop.time()
        if self._checker is None:
            self._checker = loop.create_task(self._check(), name="pagedserve-write-watch")
        try:
            await write
        except asyncio.CancelledError:
            if task not in self._stalled:
                raise
            task.uncancel()
            raise StalledClientError(
                f"a response could not be sent for {self.timeout:g} s (--stream-write-timeout): "
                "the client stopped reading"
            ) from None
        finally:
            del self._writing[task]
            self._stalled.discard(task)

    def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()

    async def _check(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._writing:  # ends with the last write in flight; the next write starts it again
                await asyncio.sleep(min(self.timeout / 4, 1.0))
                late = loop.time() - self.timeout
                for task, began in list(self._writing.items()):
                    if began <= late and task not in self._stalled:
                        self._stalled.add(task)
                        task.cancel()
        finally:
            self._checker = None


def give_up_stalled_call(context: grpc.aio.ServicerContext, what: str, exc: StalledClientError) -> None:
    """End a gRPC stream whose write timed out, its requests already aborted. grpc.aio cannot cancel
    a call from the server side; the status goes out behind the responses still queued in the
    transport (for a client that reads on: it learns why), and the call ends when its client reads
    or goes away, or at shutdown. Meanwhile only the transport's bounded flow-control buffer is held:
    no handler, no engine request, no KV blocks."""
    logger.warning("gave up %s: %s", what, exc)
    context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
    context.set_details(str(exc))


def _merge(into: pb.GenerateResponse, delta: pb.GenerateResponse) -> None:
    into.text += delta.text
    into.tool_calls.extend(delta.tool_calls)
    into.reasoning_content += delta.reasoning_content
    into.token_ids.extend(delta.token_ids)
    into.logprobs.extend(delta.logprobs)
    into.prompt_logprobs.extend(delta.prompt_logprobs)
    for name in (
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "time_in_queue_s",
        "time_to_first_token_s",
        "error",
        "cached_tokens",
    ):
        if getattr(delta, name):
            setattr(into, name, getattr(delta, name))


def probe_request(engine: AsyncEngine) -> tuple[list[int], SamplingParams]:
    """The deep check's (and the warm-up's) request: BOS and one more token in, one token out."""
    bos = engine.engine.tokenizer.bos_token_id
    return [bos if bos is not None else 0, 1], SamplingParams(temperature=0.0, max_tokens=1)


async def deep_check(engine: AsyncEngine, timeout: float = 30.0) -> bool:
    """Generate one token through the whole engine: weights, KV cache, sampler and the loop."""
    rid = engine.new_request_id("health")
    prompt, params = probe_request(engine)
    unmetered = engine.engine.metrics.unmetered_request_ids  # not a client's request
    unmetered.add(rid)
    try:
        async with asyncio.timeout(timeout):
            async for delta in engine.generate(rid, prompt, params):
                if delta.request_finished:
                    if delta.finish_reason == "error":
                        logger.warning("deep health check: not ready: %s", delta.error)
                    return delta.finish_reason in ("length", "eos", "stop")
    except (QueueFullError, EngineDeadError, TimeoutError) as exc:
        # An answer, not a fault: probes come every few seconds, so one line each and no traceback.
        logger.warning("deep health check: not ready: %s", str(exc) or f"no token within {timeout:g} s")
    except Exception:  # a bug: its traceback is what finds it
        logger.exception("deep health check failed")
    finally:
        unmetered.discard(rid)
    return False


def _handlers(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """Method handlers with forgiving deserializers (see convert.parse_message)."""

    def handler(kind: Any, method: Any, request_type: Any, response_type: Any) -> Any:
        return kind(
            method,
            request_deserializer=partial(convert.parse_message, request_type),
            response_serializer=response_type.SerializeToString,
        )

    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Generate": handler(stream, servicer.Generate, pb.GenerateRequest, pb.GenerateResponse),
            "Complete": handler(unary, servicer.Complete, pb.GenerateRequest, pb.CompleteResponse),
            "Abort": handler(unary, servicer.Abort, pb.AbortRequest, pb.AbortResponse),
            "Health": handler(unary, servicer.Health, pb.HealthRequest, pb.HealthResponse),
            "Tokenize": handler(unary, servicer.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
            "Detokenize": handler(unary, servicer.Detokenize, pb.DetokenizeRequest, pb.DetokenizeResponse),
            "ModelInfo": handler(unary, servicer.ModelInfo, pb.ModelInfoRequest, pb.ModelInfoResponse),
            "Embed": handler(unary, servicer.Embed, pb.EmbedRequest, pb.EmbedResponse),
            "KvEvents": handler(stream, servicer.KvEvents, pb.KvEventsRequest, pb.KvEventBatch),
            "LoadLoRAAdapter": handler(
                unary, servicer.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest, pb.LoRAAdaptersResponse
            ),
            "UnloadLoRAAdapter": handler(
                unary, servicer.UnloadLoRAAdapter, pb.UnloadLoRAAdapterRequest, pb.LoRAAdaptersResponse
            ),
        },
    )


def reflection_pool(services: list[ServiceDescriptor]) -> DescriptorPool:
    """One pool with the files of every served service and their imports: the adapters' stubs live
    in a pool of their own (see scripts/gen_protos.py), the rest in protobuf's default pool."""
    pool = DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        pool.AddSerializedFile(file.serialized_pb)
        added.add(file.name)

    for service in services:
        add(service.file)
    return pool


def keepalive_options(time_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """gRPC server arguments: ping a client whose connection has calls in flight and has sent nothing
    for `time_s`, and close the connection, cancelling its calls (so aborting their requests), when no
    answer comes within `timeout_s`. A client gone without closing its connection (a crashed host, a
    cut network, a stopped process) otherwise held its requests, KV blocks and all: one still queued
    or held back by --stream-interval for good, one streaming until it finished. gRPC times the answer
    with its ping timeout (keepalive_timeout_ms alone left it at 60 s)."""
    if time_s == 0:
        return []
    timeout_ms = max(1, round(timeout_s * 1000))
    return [
        ("grpc.keepalive_time_ms", max(1, round(time_s * 1000))),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    ]


# gRPC core's bounds on calls it has received but not yet handed to the server's code: past 1,000
# (its default) it cancelled calls of a burst at random with CANCELLED, which clients read as their own
# cancel and do not retry, before pagedserve saw them (no log line, no metric; health checks too): 3,000
# calls at once lost 412 to 682 (the tiny model). Raised well past --max-queued-requests, so that
# overload reaches the engine's own bound, RESOURCE_EXHAUSTED "... retry later", and the probes answer.
PENDING_CALL_OPTIONS = [
    ("grpc.server.max_pending_requests", 32768),
    ("grpc.server.max_pending_requests_hard_limit", 65536),
]

# gRPC core binds with SO_REUSEPORT by default on Linux: a second server (another pagedserve, any gRPC
# server) on a port one already serves bound it too, and the kernel split new connections between the
# two, instead of the start-up failing on a port in use (exit 2 naming --port).
EXCLUSIVE_PORT_OPTIONS = [("grpc.so_reuseport", 0)]


class _ClientGoneWrites(logging.Filter):
    """grpc.aio logs an ERROR with a traceback when a streaming handler's response cannot be sent
    because the client has just gone (cancelled, hung up): grpc notices the write fail before it marks
    the call closed. Clients leaving is everyday traffic, no server error: logged at debug instead."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        logger.debug("%s: its client went away as a response was being sent", message)
        return False


def _quiet_client_gone_writes() -> None:
    grpc_logger = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, _ClientGoneWrites) for f in grpc_logger.filters):
        grpc_logger.addFilter(_ClientGoneWrites())


class Server:
    """Owns the grpc.aio server, the health servicer and the lifecycle around an AsyncEngine."""

    def __init__(
        self,
        tracer: RequestTracer | None = None,
        options: list[tuple[str, int]] | None = None,
        stream_write_timeout: float = 60.0,
        allow_runtime_lora_updating: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        api_key: str | None = None,
    ) -> None:
        """`stream_write_timeout`: seconds a streamed response may wait to be sent before its stream is
        given up (--stream-write-timeout; 0 = no limit). Every front end's streams honour it.
        `api_key`: calls on both ports need it (--api-key; rpc/auth.py)."""
        self.state = ServerState(
            allow_runtime_lora_updating=allow_runtime_lora_updating,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        self.health = health.aio.HealthServicer()
        _quiet_client_gone_writes()
        self.api_key = ApiKey(api_key) if api_key is not None else None
        interceptors = [ApiKeyInterceptor(self.api_key)] if self.api_key is not None else None
        self.grpc = grpc.aio.server(
            options=[*PENDING_CALL_OPTIONS, *EXCLUSIVE_PORT_OPTIONS, *(options or [])],
            interceptors=interceptors,
        )
        self.write_watch = WriteWatch(stream_write_timeout)  # every front end's streams write through it
        self.servicer = GenerationServicer(self.state, tracer or RequestTracer(None, ""), self.write_watch)
        self.grpc.add_generic_rpc_handlers((_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        # Services described by reflection; whoever adds a service (the adapters) appends its descriptor.
        self.services: list[ServiceDescriptor] = [
            pb.DESCRIPTOR.services_by_name["Generation"],
            health_pb2.DESCRIPTOR.services_by_name["Health"],
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
        ]
        self.stopped = asyncio.Event()

    def add_port(self, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
        """Bind `address`: plaintext, or TLS with `credentials` (rpc/tls.py ServerTls)."""
        try:
            if credentials is None:
                port = self.grpc.add_insecure_port(address)
            else:
                port = self.grpc.add_secure_port(address, credentials)
        except RuntimeError:  # grpc's own message says only to set GRPC_VERBOSITY=debug
            port = 0
        if port == 0:
            raise OSError(f"could not bind gRPC address {address} (in use, or no address of this host)")
        return port

    async def open(self) -> None:
        """Serve health at once: live, not ready (the engine may still be loading)."""
        names = [service.full_name for service in self.services]
        reflection.enable_server_reflection(names, self.grpc, pool=reflection_pool(self.services))
        await self._set_health(liveness=True, ready=False)
        await self.grpc.start()

    async def start(self, engine: AsyncEngine, warmup: bool = True) -> None:
        """Ready once the engine loop runs and a warm-up generation is done. Raises InvalidRequestError
        when the engine could never run the warm-up request (its context or KV cache is too small)."""
        self.engine = engine
        self.servicer.bind(engine)
        self.engine.start()
        if warmup:
            engine.engine.validate_request(*probe_request(engine))
            if not await deep_check(self.engine):
                raise RuntimeError("warm-up generation failed")
        self.state.status = "serving"
        await self._set_health(liveness=True, ready=True)

    async def watch_engine(self) -> None:
        """Between steps, notice a dead engine loop or worker rank and flip health to NOT_SERVING."""
        while self.state.status != "dead":
            if self.engine.dead is None:
                try:
                    self.engine.engine.executor.check_health()
                except EngineDeadError as exc:
                    self.engine.kill(exc)
            if self.engine.dead is not None:
                self.state.status = "dead"
                await self._set_health(liveness=False, ready=False)
                return
            await asyncio.sleep(_HEALTH_POLL_S)

    async def drain(self, timeout: float, cut_short: asyncio.Event | None = None) -> None:
        """Stop accepting, let in-flight requests finish up to `timeout` (or until `cut_short` is set),
        abort the rest with a message."""
        if self.state.status == "serving":
            self.state.status = "draining"
        await self._set_health(liveness=True, ready=False)
        self.engine.end_kv_listeners("server shutting down")  # routers stop sending here at once
        deadline = time.monotonic() + timeout
        while self.engine.num_live_requests and time.monotonic() < deadline:
            if cut_short is not None and cut_short.is_set():
                logger.info(
                    "signalled again: aborting %d in-flight requests now", self.engine.num_live_requests
                )
                break
            await asyncio.sleep(0.05)
        for rid in self.engine.live_request_ids():
            self.engine.abort(rid, "server shutting down", "drain")
        for _ in range(100):  # give aborted streams a moment to deliver their final message
            if not self.engine.num_live_requests:
                break
            await asyncio.sleep(0.02)

    async def stop(self, grace: float = 1.0) -> None:
        await self.grpc.stop(grace)
        self.write_watch.stop()
        if hasattr(self, "engine"):  # bound by start(); absent when start-up failed before it
            await self.engine.stop()
        self.stopped.set()

    async def _set_health(self, liveness: bool, ready: bool) -> None:
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        await self.health.set("", serving if liveness else not_serving)
        for name in self._inference_services():  # (READINESS_SERVICE among them)
            await self.health.set(name, serving if ready else not_serving)

    def _inference_services(self) -> list[str]:
        """The services that serve the model (ours, and each adapter's, such as KServe v2's
        inference.GRPCInferenceService): each reports SERVING to a health check naming it while the
        server is ready (a probe or a mesh checks the service it routes to by its name)."""
        plumbing = {
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name,
        }
        return [service.full_name for service in self.services if service.full_name not in plumbing]


async def run_until_signalled(
    server: Server, shutdown_timeout: float, signalled: asyncio.Event | None = None
) -> int:
    """Serve until SIGTERM/SIGINT (drain, exit 0; a second signal aborts what is still in flight) or
    until the engine dies (exit 1). `signalled`: from catch_stop_signals(), when caught already."""
    if signalled is None:
        signalled = catch_stop_signals()
    watcher = asyncio.create_task(server.watch_engine())
    signal_wait = asyncio.create_task(signalled.wait())
    await asyncio.wait((watcher, signal_wait), return_when=asyncio.FIRST_COMPLETED)
    if server.state.status == "dead":
        logger.error("engine died: %s; exiting so the orchestrator restarts this server", server.engine.dead)
        await asyncio.sleep(0.5)  # let failing streams deliver their errors
        signal_wait.cancel()
        await server.stop(grace=0.5)
        return 1
    logger.info(
        "draining: waiting up to %.0f s for %d in-flight requests (signal again to abort them now)",
        shutdown_timeout,
        server.engine.num_live_requests,
    )
    watcher.cancel()
    signalled.clear()  # a second SIGTERM/SIGINT (an impatient operator) ends the grace period
    await server.drain(shutdown_timeout, signalled)
    await server.stop()
    logger.info("drained; bye")
    return 0
