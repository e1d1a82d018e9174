"""`inference.GRPCInferenceService`: the Open Inference Protocol (KServe v2) over gRPC with Triton's
extensions, so `tritonclient.grpc` and KServe v2 clients use pagedserve unchanged.

Decoupled streaming (`ModelStreamInfer`), as Triton does it: every response echoes its request's `id`
and carries `triton_final_response` (true only on the last); a request that sets
`triton_enable_empty_final_response` ends with an extra data-less final response instead; errors go
out as `error_message` (with the failed request's `id` in an otherwise empty `infer_response`, so a
client with several requests on the stream knows which failed) and the stream stays open, unless the
client sent the `triton_grpc_error: true` header, which ends the stream with a gRPC status instead.
Every request gets its final response or its error. The stream closes once the client has
half-closed and every request on it is final; cancelling the call aborts them all, and so does a
client that stops reading, once a response has waited --stream-write-timeout to be sent.

Unary `ModelInfer` returns the whole completion. Triton rejects unary calls to decoupled models; we
answer them, which is what KServe v2 clients (which have no streaming RPC) need. A whole completion the
server cut short (a drain) is UNAVAILABLE, not a short text that reads as whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, NoReturn, cast

import grpc
from pagedserve import __version__
from pagedserve.errors import InvalidRequestError
from pagedserve.rpc.convert import parse_message
from pagedserve.rpc.server import (
    STALLED_CLIENT,
    StalledClientError,
    cancel_cause,
    give_up_stalled_call,
)

from pagedserve_adapters import log_settings, repository, tensors, trace_settings
from pagedserve_adapters.llm_model import (
    INPUTS,
    OUTPUTS,
    AdapterError,
    Completion,
    LLMModel,
    LLMRequest,
    Tensor,
    parse_request,
)
from pagedserve_adapters.shared_memory import Place, SharedMemory, WriteError
from pagedserve_adapters.v2 import inference_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE_NAME = SERVICE.full_name  # inference.GRPCInferenceService
EXTENSIONS = (
    "model_configuration",
    "statistics",
    "binary_tensor_data",
    "parameters",
    "generate",
    "schedule_policy",  # a request's priority and timeout parameters
    "logging",  # LogSettings, GET / POST /v2/logging (log_settings.py)
    "model_repository",  # the index, and load / unload of the one served model (repository.py)
    "system_shared_memory",  # tensors in client shared memory (shared_memory.py; --allow-client-shm)
    "trace",  # TraceSetting, GET / POST /v2/trace/setting (trace_settings.py)
)
MAX_DETAILS_BYTES = 2048  # percent-encoded in the trailers: at most 6 kB of a client's 8 KiB
_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "internal": grpc.StatusCode.INTERNAL,
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "aborted": grpc.StatusCode.UNAVAILABLE,  # for the client to retry elsewhere (a drain cut it short)
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
}
_CONFIG_TYPES = {
    "BYTES": pb.TYPE_STRING,
    "BOOL": pb.TYPE_BOOL,
    "UINT32": pb.TYPE_UINT32,
    "FP32": pb.TYPE_FP32,
}
_DONE = object()  # end of a stream's responses


class InferenceServicer:
    def __init__(self, model: LLMModel, shared_memory: SharedMemory) -> None:
        self.model = model
        self.shared_memory = shared_memory

    # -- health and metadata -------------------------------------------------------------------------

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.model.live)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.model.ready)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelReadyResponse:
        request = await _valid(request, context)
        return pb.ModelReadyResponse(ready=self.model.is_ready(request.name, request.version))

    async def ServerMetadata(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="pagedserve", version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        request = await _valid(request, context)
        await self._resolve(request.name, request.version, context)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.model.name,
            versions=[self.model.version],
            platform="pagedserve",
            inputs=[tensor(name=s.name, datatype=s.datatype, shape=s.dims) for s in INPUTS],
            outputs=[tensor(name=s.name, datatype=s.datatype, shape=s.dims) for s in OUTPUTS],
        )

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelConfigResponse:
        request = await _valid(request, context)
        await self._resolve(request.name, request.version, context)
        return pb.ModelConfigResponse(config=model_config(self.model))

    async def ModelStatistics(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        request = await _valid(request, context)
        if request.name:
            await self._resolve(request.name, request.version, context)
        return pb.ModelStatisticsResponse(model_stats=[model_statistics(self.model)])

    async def RepositoryIndex(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        request = await _valid(request, context)
        if not self.model.bound or (request.ready and not self.model.ready):
            return pb.RepositoryIndexResponse()
        state = "READY" if self.model.ready else "UNAVAILABLE"
        index = pb.RepositoryIndexResponse.ModelIndex(
            name=self.model.name, version=self.model.version, state=state
        )
        return pb.RepositoryIndexResponse(models=[index])

    async def RepositoryModelLoad(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        request = await _valid(request, context)
        name = _repository_model_name(request)
        try:
            repository.load(self.model, name, _repository_parameters(request))
        except AdapterError as exc:
            await _abort(context, _STATUS[exc.kind], str(exc))
        return pb.RepositoryModelLoadResponse(model_name=name, isLoaded=True)

    async def RepositoryModelUnload(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        request = await _valid(request, context)
        try:
            repository.unload(self.model, _repository_model_name(request), _repository_parameters(request))
        except AdapterError as exc:
            await _abort(context, _STATUS[exc.kind], str(exc))
        raise AssertionError("repository.unload always raises")

    async def SystemSharedMemoryRegister(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryRegisterResponse:
        request = await _valid(request, context)
        try:
            self.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        except AdapterError as exc:
            await _abort(context, _STATUS[exc.kind], str(exc))
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryStatus(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryStatusResponse:
        request = await _valid(request, context)
        try:
            regions = self.shared_memory.status(request.name)
        except AdapterError as exc:
            await _abort(context, _STATUS[exc.kind], str(exc))
        response = pb.SystemSharedMemoryStatusResponse()
        for region in regions:
            response.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region.name, key=region.key, offset=region.offset, byte_size=region.byte_size
                )
            )
        return response

    async def SystemSharedMemoryUnregister(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        request = await _valid(request, context)
        self.shared_memory.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def TraceSetting(self, request: Any, context: grpc.aio.ServicerContext) -> pb.TraceSettingResponse:
        request = await _valid(request, context)
        changes = {name: list(value.value) for name, value in request.settings.items()}
        try:
            settings = trace_settings.update(self.model, request.model_name, changes)
        except AdapterError as exc:
            await _abort(context, _STATUS[exc.kind], str(exc))
        response = pb.TraceSettingResponse()
        for name, values in settings.items():
            response.settings[name].value.extend(values)
        return response

    async def LogSettings(self, request: Any, context: grpc.aio.ServicerContext) -> pb.LogSettingsResponse:
        request = await _valid(request, context)
        try:
            changes = {name: _setting_value(name, value) for name, value in request.settings.items()}
            settings = log_settings.update(self.model, changes)
        except AdapterError as exc:
            await _abort(context, _STATUS[exc.kind], str(exc))
        response = pb.LogSettingsResponse()
        for name, value in settings.items():
            setattr(response.settings[name], _SETTING_KINDS[type(value)], value)
        return response

    async def _resolve(self, name: str, version: str, context: grpc.aio.ServicerContext) -> None:
        try:
            self.model.resolve(name, version)
        except AdapterError as exc:
            await _abort(context, _STATUS[exc.kind], str(exc))

    # -- inference -----------------------------------------------------------------------------------

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        started, carrier = time.monotonic(), _carrier(context)
        parsed: LLMRequest | None = None
        try:
            parsed, places = self._parse(request, stream=False)
            completion = Completion(parsed)
            async for delta in self.model.generate(parsed, carrier, partial(cancel_cause, context)):
                completion.add(delta)
            return self._response(request.id, completion.final_outputs(), None, places)
        except AdapterError as exc:
            if not isinstance(exc, WriteError):  # (one that ran was counted and traced as it ended)
                model, client_id = getattr(request, "model_name", ""), getattr(request, "id", "")
                self.model.refuse(exc, carrier, started, parsed, model, client_id)
            await _abort(context, _STATUS[exc.kind], str(exc))

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        """Writes its responses itself, each within --stream-write-timeout (see rpc/server.py
        WriteWatch): a client that stops reading has every request on the stream aborted."""
        grpc_errors = dict(context.invocation_metadata() or ()).get("triton_grpc_error") == "true"
        carrier = _carrier(context)
        ended_by = ""  # the server ended the stream: stream_error (triton_grpc_error) or stalled_client

        def cause() -> str:
            return ended_by or cancel_cause(context)

        responses: asyncio.Queue[Any] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def read_requests() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(self._stream_one(request, carrier, cause, responses))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:  # the client half-closed: finish what is in flight, then end the stream
                await asyncio.gather(*running, return_exceptions=True)
            responses.put_nowait(_DONE)

        def end_on_failure(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:  # the call broke while reading
                responses.put_nowait(_DONE)

        async def write(response: pb.ModelStreamInferResponse) -> None:
            await self.model.server.write_watch.send(context.write(response))

        reader = asyncio.create_task(read_requests())
        reader.add_done_callback(end_on_failure)
        try:
            while (item := await responses.get()) is not _DONE:
                if isinstance(item, pb.ModelInferResponse):
                    await write(pb.ModelStreamInferResponse(infer_response=item))
                    continue
                request_id, error = item
                if grpc_errors:
                    ended_by = "stream_error"
                    await _abort(context, _STATUS[error.kind], str(error))
                failed = pb.ModelInferResponse(id=request_id)
                await write(pb.ModelStreamInferResponse(error_message=str(error), infer_response=failed))
        except StalledClientError as exc:
            ended_by = STALLED_CLIENT
            await _cancel_all(reader, running)  # aborted as stalled_client, before anything else can happen
            give_up_stalled_call(context, "a ModelStreamInfer stream and its requests", exc)
        finally:  # the client cancelled or broke the call: abort every request on the stream
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def _stream_one(
        self, request: Any, carrier: dict[str, str], cause: Callable[[], str], responses: asyncio.Queue[Any]
    ) -> None:
        """One request on a stream: its responses, or one `(id, error)`, go onto the stream's queue."""
        request_id = "" if isinstance(request, InvalidRequestError) else request.id
        started = time.monotonic()
        parsed: LLMRequest | None = None
        try:
            parsed, places = self._parse(request, stream=True)
            completion = Completion(parsed)
            async for delta in self.model.generate(parsed, carrier, cause):
                completion.add(delta)
                final = delta.request_finished and not parsed.empty_final
                if parsed.stream:
                    outputs = completion.step_outputs(delta)
                    responses.put_nowait(self._response(request.id, outputs, final, places))
                elif final:
                    outputs = completion.final_outputs()
                    responses.put_nowait(self._response(request.id, outputs, True, places))
            if parsed.empty_final:
                if not parsed.stream:
                    outputs = completion.final_outputs()
                    responses.put_nowait(self._response(request.id, outputs, False, places))
                responses.put_nowait(self._response(request.id, [], True, places))
        except AdapterError as exc:
            if not isinstance(exc, WriteError):  # (one that ran was counted and traced as it ended)
                model, client_id = getattr(request, "model_name", ""), getattr(request, "id", "")
                self.model.refuse(exc, carrier, started, parsed, model, client_id)
            responses.put_nowait((request_id, exc))
        except Exception as exc:  # a bug, or a request too big to hold: still an answer, never a hang
            logger.exception("stream request %r failed", request_id)
            responses.put_nowait((request_id, AdapterError("internal", f"{type(exc).__name__}: {exc}")))

    def _parse(self, request: Any, stream: bool) -> tuple[LLMRequest, dict[str, Place]]:
        """Decode and validate one ModelInferRequest; also where its outputs in shared memory go."""
        if isinstance(request, InvalidRequestError):
            raise AdapterError("invalid", str(request))
        self.model.resolve(request.model_name, request.model_version)
        places = {}
        for output in request.outputs:
            given = {name: _parameter(p) for name, p in output.parameters.items()}
            if (place := self.shared_memory.place(f"outputs.{output.name}", given)) is not None:
                places[output.name] = place
        try:
            parameters = {name: _parameter(p) for name, p in request.parameters.items()}
            # a boolean: parse_request checks it with Triton's other reserved parameters
            empty_final = parameters.get("triton_enable_empty_final_response", False)
            parsed = parse_request(
                decode_inputs(request, self.shared_memory),
                parameters,
                [output.name for output in request.outputs],
                empty_final=empty_final and stream,
                make_params=self.model.sampling_params,
                client_id=request.id,
            )
        except InvalidRequestError as exc:
            raise AdapterError("invalid", str(exc)) from None
        return parsed, places

    def _response(
        self, request_id: str, outputs: list[Tensor], final: bool | None, places: dict[str, Place]
    ) -> pb.ModelInferResponse:
        """An output in `places` is written into its shared memory region; its tensor goes without
        data (an empty raw_output_contents entry, as Triton keeps one per output)."""
        response = pb.ModelInferResponse(
            model_name=self.model.name, model_version=self.model.version, id=request_id
        )
        for tensor in outputs:
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            raw = tensors.encode_raw(tensor.datatype, tensor.values)
            if (place := places.get(tensor.name)) is not None:
                place.write(f"outputs.{tensor.name}", raw)
                raw = b""
            response.raw_output_contents.append(raw)
        if final is not None:
            response.parameters["triton_final_response"].bool_param = final
        return response


async def _cancel_all(reader: asyncio.Task[None], running: set[asyncio.Task[None]]) -> None:
    """Stop reading requests and cancel each one in flight, and wait for them: their engine
    generators close, so the requests are aborted now."""
    tasks = [reader, *running]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def decode_inputs(request: Any, shared_memory: SharedMemory) -> list[Tensor]:
    """Inputs in shared memory (their parameters name a region), then the others given raw (one
    `raw_input_contents` entry per input not in shared memory, in order) or as typed contents."""
    raw = list(request.raw_input_contents)
    places = [
        shared_memory.place(
            f"inputs.{tensor.name or i}", {name: _parameter(p) for name, p in tensor.parameters.items()}
        )
        for i, tensor in enumerate(request.inputs)
    ]
    num_in_messages = places.count(None)
    if raw and len(raw) != num_in_messages:
        raise InvalidRequestError(
            "raw_input_contents",
            f"has {len(raw)} entries for {num_in_messages} inputs (one per input not in shared memory)",
        )
    decoded = []
    for i, (tensor, place) in enumerate(zip(request.inputs, places, strict=True)):
        where = f"inputs.{tensor.name or i}"
        tensors.check_datatype(where, tensor.datatype)
        shape = list(tensor.shape)
        if (raw or place is not None) and tensor.HasField("contents"):  # one form per input, as Triton checks
            used = "raw_input_contents is used" if place is None else "the input is in shared memory"
            raise InvalidRequestError(f"{where}.contents", f"must not be set when {used}")
        if place is not None:
            values = tensors.decode_raw(where, tensor.datatype, shape, place.read(where))
        elif raw:
            values = tensors.decode_raw(where, tensor.datatype, shape, raw.pop(0))
        else:
            values = tensors.decode_contents(where, tensor.datatype, shape, tensor.contents)
        decoded.append(Tensor(tensor.name, tensor.datatype, shape, values))
    return decoded


def _parameter(parameter: Any) -> Any:
    kind = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, kind) if kind else None


def _carrier(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with `code` and `message`, cut to MAX_DETAILS_BYTES of UTF-8: the details travel
    in the trailers, of which a client takes 8 KiB, and past that it gets RESOURCE_EXHAUSTED instead
    of the refusal (a message echoing a client's 100 kB input name, datatype or JSON key did)."""
    if len(message.encode()) > MAX_DETAILS_BYTES:
        message = message.encode()[: MAX_DETAILS_BYTES - 3].decode(errors="ignore") + "..."
    await context.abort(code, message)
    raise AssertionError("context.abort raises")


async def _valid(request: Any, context: grpc.aio.ServicerContext) -> Any:
    if isinstance(request, InvalidRequestError):
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(request))
    return request


_SETTING_KINDS = {bool: "bool_param", int: "uint32_param", str: "string_param"}  # LogSettings' values


def _repository_model_name(request: Any) -> str:
    """A load or unload request's model: Triton's model_name (field 2), or KServe's in-tree layout's
    (field 1, Triton's repository_name) when field 2 is empty."""
    return str(request.model_name or request.repository_name)


def _repository_parameters(request: Any) -> dict[str, repository.Parameter]:
    """A load or unload request's parameters, each the one value it holds (AdapterError for none)."""
    values: dict[str, repository.Parameter] = {}
    for key, value in request.parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if kind is None:
            raise AdapterError("invalid", f"parameters.{key[:64]}: no value given")
        values[key] = getattr(value, kind)
    return values


def _setting_value(name: str, value: Any) -> bool | int | str:
    """A LogSettings value: the one of its three kinds it holds (which log_settings checks)."""
    kind = value.WhichOneof("parameter_choice")
    if kind is None:
        raise AdapterError(
            "invalid", f"{name[:64]}: no value given (bool_param, uint32_param or string_param)"
        )
    return cast(bool | int | str, getattr(value, kind))


def model_config(model: LLMModel) -> pb.ModelConfig:
    """A decoupled model that batches internally (`max_batch_size: 0`), as Triton's vLLM backend reports;
    under the priority scheduling policy, with the priority levels its requests' `priority` picks from."""
    config = model.server.engine.engine.config
    levels = model.priority_levels
    return pb.ModelConfig(
        dynamic_batching=pb.ModelDynamicBatching(
            priority_levels=levels.levels, default_priority_level=levels.default
        )
        if model.schedules_by_priority
        else None,
        name=model.name,
        backend="pagedserve",
        max_batch_size=0,
        input=[
            pb.ModelInput(name=s.name, data_type=_CONFIG_TYPES[s.datatype], dims=s.dims, optional=s.optional)
            for s in INPUTS
        ],
        output=[
            pb.ModelOutput(name=s.name, data_type=_CONFIG_TYPES[s.datatype], dims=s.dims) for s in OUTPUTS
        ],
        model_transaction_policy=pb.ModelTransactionPolicy(decoupled=True),
        parameters={
            "max_model_len": pb.ModelParameter(string_value=str(config.model.max_model_len)),
            "dtype": pb.ModelParameter(string_value=str(config.model.dtype)),
        },
    )


def model_statistics(model: LLMModel) -> pb.ModelStatistics:
    """Triton's statistics of the model. Every duration is set, those we do not measure at zero (no
    output tensor timing apart from the request's, no response cache), so that REST's JSON has every
    field Triton's has: tritonclient.http users index `inference_stats.compute_infer.ns`."""
    stats = model.stats
    duration = pb.StatisticDuration
    return pb.ModelStatistics(
        name=model.name,
        version=model.version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.success_count,
        execution_count=stats.executions,
        inference_stats=pb.InferStatistics(
            success=duration(count=stats.success_count, ns=stats.success_ns),
            fail=duration(count=stats.fail_count, ns=stats.fail_ns),
            queue=duration(count=stats.success_count, ns=stats.queue_ns),
            compute_input=duration(count=stats.success_count, ns=stats.compute_input_ns),
            compute_infer=duration(count=stats.success_count, ns=stats.compute_infer_ns),
            compute_output=duration(),
            cache_hit=duration(),
            cache_miss=duration(),
        ),
    )


def add_to_server(
    server: grpc.aio.Server, model: LLMModel, shared_memory: SharedMemory | None = None
) -> InferenceServicer:
    """Register the servicer with deserializers that turn undecodable requests into named errors.
    `shared_memory`: the regions it shares with the REST routes (default: a registry of its own, off)."""
    servicer = InferenceServicer(model, shared_memory or SharedMemory(allowed=False))

    def handler(kind: Any, method: Any, request_type: Any, response_type: Any) -> Any:
        return kind(
            method,
            request_deserializer=partial(parse_message, request_type),
            response_serializer=response_type.SerializeToString,
        )

    unary = grpc.unary_unary_rpc_method_handler
    rpcs = {
        "ServerLive": (unary, pb.ServerLiveRequest, pb.ServerLiveResponse),
        "ServerReady": (unary, pb.ServerReadyRequest, pb.ServerReadyResponse),
        "ModelReady": (unary, pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": (unary, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": (unary, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelInfer": (unary, pb.ModelInferRequest, pb.ModelInferResponse),
        "ModelStreamInfer": (
            grpc.stream_stream_rpc_method_handler,
            pb.ModelInferRequest,
            pb.ModelStreamInferResponse,
        ),
        "ModelConfig": (unary, pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ModelStatistics": (unary, pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
        "RepositoryIndex": (unary, pb.RepositoryIndexRequest, pb.RepositoryIndexResponse),
        "LogSettings": (unary, pb.LogSettingsRequest, pb.LogSettingsResponse),
        "TraceSetting": (unary, pb.TraceSettingRequest, pb.TraceSettingResponse),
        "RepositoryModelLoad": (unary, pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse),
        "RepositoryModelUnload": (unary, pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse),
        "SystemSharedMemoryStatus": (
            unary,
            pb.SystemSharedMemoryStatusRequest,
            pb.SystemSharedMemoryStatusResponse,
        ),
        "SystemSharedMemoryRegister": (
            unary,
            pb.SystemSharedMemoryRegisterRequest,
            pb.SystemSharedMemoryRegisterResponse,
        ),
        "SystemSharedMemoryUnregister": (
            unary,
            pb.SystemSharedMemoryUnregisterRequest,
            pb.SystemSharedMemoryUnregisterResponse,
        ),
    }
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE_NAME,
                {
                    name: handler(kind, getattr(servicer, name), request_type, response_type)
                    for name, (kind, request_type, response_type) in rpcs.items()
                },
            ),
        )
    )
    return servicer
