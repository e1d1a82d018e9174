"""KServe v2 REST (the Open Inference Protocol over HTTP, with Triton's binary tensor extension) and the
generate extension (`/generate`, `/generate_stream` as server-sent events), as aiohttp routes on the
server's HTTP port. Health follows the same state machine as gRPC health.

Errors are `{"error": "..."}` with 400 (bad request), 404 (unknown model or route), 405 (a method the
route lacks), 413 (a body past the size limit), 415 (a Content-Encoding other than gzip or deflate),
429 (queue full), 503 (not ready) or 500; the HTTP endpoint's own errors (rpc/http.py) come in the
same form. On `/generate_stream` the status is fixed by the first event, so a later error arrives as
an `{"error": ...}` event inside the 200 response.

A client that hangs up aborts its request, as a cancelled gRPC call does: the HTTP endpoint runs
aiohttp with `handler_cancellation`, so a closed connection cancels its handler, and the cancel reaches
the engine's generator, whose `finally` aborts the request (rpc/http.py).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from aiohttp.http import HttpProcessingError
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from pagedserve import __version__
from pagedserve.errors import InvalidRequestError
from pagedserve.rpc.http import read_body
from pagedserve.rpc.server import STALLED_CLIENT, StalledClientError
from pagedserve.sampling_params import SamplingParams

from pagedserve_adapters import log_settings, repository, tensors, trace_settings
from pagedserve_adapters.grpc_service import EXTENSIONS, model_config, model_statistics
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

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    "invalid": 400,
    "not_found": 404,
    "unavailable": 503,
    "exhausted": 429,
    "internal": 500,
    "timeout": 504,
    "aborted": 503,  # for the client to retry elsewhere (a drain cut it short)
    "failed_precondition": 400,
    "permission_denied": 403,
    "already_exists": 409,
}
_HEADER_LENGTH = "Inference-Header-Content-Length"
_SWITCH_INPUTS = {spec.name: spec.datatype for spec in INPUTS if spec.name != "text_input"}


def routes(model: LLMModel, shared_memory: SharedMemory | None = None) -> list[web.RouteDef]:
    """`shared_memory`: the regions these routes share with gRPC (default: a registry of their own, off)."""
    api = RestApi(model, shared_memory or SharedMemory(allowed=False))
    defs = [
        web.get("/v2", api.server_metadata),
        web.get("/v2/health/live", api.live),
        web.get("/v2/health/ready", api.ready),
        web.post("/v2/repository/index", api.repository_index),
        web.post("/v2/repository/models/{model}/load", api.repository_load),
        web.post("/v2/repository/models/{model}/unload", api.repository_unload),
        web.get("/v2/systemsharedmemory/status", api.shared_memory_status),
        web.get("/v2/systemsharedmemory/region/{region}/status", api.shared_memory_status),
        web.post("/v2/systemsharedmemory/region/{region}/register", api.shared_memory_register),
        web.post("/v2/systemsharedmemory/unregister", api.shared_memory_unregister),
        web.post("/v2/systemsharedmemory/region/{region}/unregister", api.shared_memory_unregister),
        web.get("/v2/logging", api.log_settings),
        web.post("/v2/logging", api.update_log_settings),
        web.get("/v2/trace/setting", api.trace_setting),
        web.post("/v2/trace/setting", api.trace_setting),
        web.get("/v2/models/{model}/trace/setting", api.trace_setting),
        web.post("/v2/models/{model}/trace/setting", api.trace_setting),
        web.get("/v2/models", api.list_models),
        web.get("/v2/models/stats", api.all_model_stats),  # before /v2/models/{model} would take it
    ]
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        defs += [
            web.get(prefix, api.model_metadata),
            web.get(prefix + "/ready", api.model_ready),
            web.get(prefix + "/config", api.model_config),
            web.get(prefix + "/stats", api.model_stats),
            web.post(prefix + "/infer", api.infer),
            web.post(prefix + "/generate", api.generate),
            web.post(prefix + "/generate_stream", api.generate_stream),
        ]
    return defs


def _error(exc: AdapterError | InvalidRequestError) -> web.Response:
    status = _HTTP_STATUS[exc.kind] if isinstance(exc, AdapterError) else 400
    return web.json_response({"error": str(exc)}, status=status)


_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def triton_json(message: Message) -> dict[str, Any]:
    """A message as Triton's HTTP endpoint writes it (model config, statistics): every field, those at
    their default too (`max_batch_size: 0`), and 64-bit integers as JSON numbers, where protobuf's
    JSON mapping writes strings (`"dims": ["-1"]`; Triton's ModelConfigToJson turns them back)."""
    found = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _int64_as_numbers(message.DESCRIPTOR, found)


def _int64_as_numbers(descriptor: Descriptor, found: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        if field.name not in found:
            continue
        value = found[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]  # JSON keys stay strings
            found[field.name] = {key: _field_value(value_field, item) for key, item in value.items()}
        elif isinstance(value, list):  # a repeated field
            found[field.name] = [_field_value(field, item) for item in value]
        else:
            found[field.name] = _field_value(field, value)
    return found


def _field_value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        return _int64_as_numbers(field.message_type, value)
    return int(value) if field.type in _INT64_TYPES else value


class RestApi:
    def __init__(self, model: LLMModel, shared_memory: SharedMemory) -> None:
        self.model = model
        self.shared_memory = shared_memory

    # -- health and metadata -------------------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": self.model.live}, status=200 if self.model.live else 503)

    async def ready(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": self.model.ready}, status=200 if self.model.ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"name": "pagedserve", "version": __version__, "extensions": list(EXTENSIONS)}
        )

    async def log_settings(self, request: web.Request) -> web.Response:
        return web.json_response(log_settings.current())

    async def update_log_settings(self, request: web.Request) -> web.Response:
        """A JSON object of the settings to change (Triton's $log_setting_request)."""
        try:
            changes = _json_document(await _read(request))
            if not isinstance(changes, dict):
                raise AdapterError("invalid", "the body must be a JSON object of log settings")
            return web.json_response(log_settings.update(self.model, changes))
        except (AdapterError, InvalidRequestError) as exc:
            return _error(exc)

    async def trace_setting(self, request: web.Request) -> web.Response:
        """GET reads, POST changes (a JSON object of settings, each a string, a list of strings or
        null: back to its default); both answer every setting, trace_level as a list, the others as
        strings (Triton's $trace_setting_response)."""
        try:
            changes: dict[str, list[str]] = {}
            if request.method == "POST":
                body = _object(_json_document(await _read(request)), "request")
                for name, value in body.items():
                    values = [] if value is None else [value] if isinstance(value, str) else value
                    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                        raise InvalidRequestError(name[:64], "must be a string, a list of strings or null")
                    changes[name] = values
            settings = trace_settings.update(self.model, request.match_info.get("model", ""), changes)
        except (AdapterError, InvalidRequestError) as exc:
            return _error(exc)
        return web.json_response(
            {name: values if name == "trace_level" else "".join(values) for name, values in settings.items()}
        )

    async def model_ready(self, request: web.Request) -> web.Response:
        """200 ready, 503 not ready (yet, or any more), 404 for a model or version not served: a client
        that retries on 503 does not wait for one that will never be ready."""
        name, version = request.match_info["model"], request.match_info.get("version", "")
        try:
            self._resolve(request)
        except AdapterError as exc:
            if exc.kind == "not_found":
                return _error(exc)
        ready = self.model.is_ready(name, version)
        return web.json_response({"name": name, "ready": ready}, status=200 if ready else 503)

    async def model_metadata(self, request: web.Request) -> web.Response:
        try:
            self._resolve(request)
        except AdapterError as exc:
            return _error(exc)
        return web.json_response(
            {
                "name": self.model.name,
                "versions": [self.model.version],
                "platform": "pagedserve",
                "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.dims)} for s in INPUTS],
                "outputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.dims)} for s in OUTPUTS],
            }
        )

    async def model_config(self, request: web.Request) -> web.Response:
        try:
            self._resolve(request)
        except AdapterError as exc:
            return _error(exc)
        return web.json_response(triton_json(model_config(self.model)))

    async def model_stats(self, request: web.Request) -> web.Response:
        try:
            self._resolve(request)
        except AdapterError as exc:
            return _error(exc)
        return web.json_response({"model_stats": [triton_json(model_statistics(self.model))]})

    async def list_models(self, request: web.Request) -> web.Response:
        """KServe's model list (`GET /v2/models`): the served model's name, once it is loaded."""
        return web.json_response({"models": [self.model.name] if self.model.bound else []})

    async def all_model_stats(self, request: web.Request) -> web.Response:
        """Every model's statistics (Triton's `GET v2/models/stats`): the one served, once it is loaded."""
        models = [triton_json(model_statistics(self.model))] if self.model.bound else []
        return web.json_response({"model_stats": models})

    async def repository_index(self, request: web.Request) -> web.Response:
        """`{"ready": true}` lists only the models ready for inference, as the gRPC RPC's `ready`."""
        try:
            body = await _read(request)
            doc = _object(_json_document(body), "request") if body.strip() else {}
            ready_only = doc.get("ready", False)
            if not isinstance(ready_only, bool):
                raise InvalidRequestError("ready", f"must be a boolean, got {ready_only!r}")
        except InvalidRequestError as exc:
            return _error(exc)
        if not self.model.bound or (ready_only and not self.model.ready):
            return web.json_response([])
        state = "READY" if self.model.ready else "UNAVAILABLE"
        return web.json_response([{"name": self.model.name, "version": self.model.version, "state": state}])

    async def shared_memory_status(self, request: web.Request) -> web.Response:
        try:
            regions = self.shared_memory.status(request.match_info.get("region", ""))
        except AdapterError as exc:
            return _error(exc)
        return web.json_response(
            [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]
        )

    async def shared_memory_register(self, request: web.Request) -> web.Response:
        """`{"key": ..., "offset": ..., "byte_size": ...}` (offset 0 when left out)."""
        try:
            doc = _object(_json_document(await _read(request)), "request")
            key = doc.get("key")
            if not isinstance(key, str):
                raise InvalidRequestError("key", f"must be a string, got {key!r}")
            offset, byte_size = (
                _integer("offset", doc.get("offset", 0)),
                _integer("byte_size", doc.get("byte_size")),
            )
            self.shared_memory.register(request.match_info["region"], key, offset, byte_size)
        except (AdapterError, InvalidRequestError) as exc:
            return _error(exc)
        return web.json_response({})

    async def shared_memory_unregister(self, request: web.Request) -> web.Response:
        self.shared_memory.unregister(request.match_info.get("region", ""))
        return web.json_response({})

    async def repository_load(self, request: web.Request) -> web.Response:
        """Triton's load (an optional `{"parameters": {...}}` body); KServe's answer, which Triton's
        clients do not read."""
        name = request.match_info["model"]
        try:
            repository.load(self.model, name, await _repository_parameters(request))
        except (AdapterError, InvalidRequestError) as exc:
            return _error(exc)
        return web.json_response({"name": name, "load": True})

    async def repository_unload(self, request: web.Request) -> web.Response:
        try:
            parameters = await _repository_parameters(request)
            repository.unload(self.model, request.match_info["model"], parameters)
        except (AdapterError, InvalidRequestError) as exc:
            return _error(exc)
        raise AssertionError("repository.unload always raises")

    def _refused(
        self,
        exc: AdapterError | InvalidRequestError,
        request: web.Request,
        started: float,
        parsed: LLMRequest | None,
        client_id: str = "",
    ) -> web.Response:
        """An inference call's error answer, its refusal counted and traced (LLMModel.refuse) with the
        request's `id` once read (`client_id`)."""
        self.model.refuse(exc, request.headers, started, parsed, request.match_info["model"], client_id)
        return _error(exc)

    def _resolve(self, request: web.Request) -> None:
        self.model.resolve(request.match_info["model"], request.match_info.get("version", ""))

    # -- inference -----------------------------------------------------------------------------------

    async def infer(self, request: web.Request) -> web.Response:
        """`/infer`: JSON tensors, or Triton's binary extension (JSON header, then raw tensor data)."""
        started = time.monotonic()
        parsed: LLMRequest | None = None
        request_id = ""  # the request's `id`, once read
        try:
            self._resolve(request)
            doc, binary = await _infer_body(request)
            outputs_wanted = doc.get("outputs") or []
            if not isinstance(outputs_wanted, list) or not all(
                isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs_wanted
            ):
                raise InvalidRequestError("outputs", "must be a list of objects with a name")
            output_parameters = {
                str(o.get("name")): _object(
                    _or_empty(o.get("parameters")), f"outputs.{o.get('name')}.parameters"
                )
                for o in outputs_wanted
            }
            for name, given in output_parameters.items():
                if not isinstance(given.get("binary_data", False), bool):
                    raise InvalidRequestError(
                        f"outputs.{name}.parameters.binary_data",
                        f"must be a boolean, got {given['binary_data']!r}",
                    )
            request_id = _request_id(doc)
            parameters = _object(doc.get("parameters", {}), "parameters")
            places = {}
            for name, given in output_parameters.items():
                if (place := self.shared_memory.place(f"outputs.{name}", given)) is not None:
                    places[name] = place
            parsed = parse_request(
                _json_inputs(doc.get("inputs"), binary, self.shared_memory),
                parameters,
                [str(o.get("name")) for o in outputs_wanted],  # as asked: a name twice is refused
                make_params=self.model.sampling_params,
                client_id=request_id,
            )
            outputs = (await self._complete(parsed, request)).final_outputs()
        except (AdapterError, InvalidRequestError) as exc:
            return self._refused(exc, request, started, parsed, request_id)
        binary_default = parameters.get("binary_data_output") is True
        binary_outputs = {
            name: given.get("binary_data", binary_default) is True
            for name, given in output_parameters.items()
        }
        try:
            return _infer_response(self.model, request_id, outputs, binary_outputs, binary_default, places)
        except WriteError as exc:  # an output its region cannot take (the request ran: no refusal)
            return _error(exc)

    async def generate(self, request: web.Request) -> web.Response:
        """`/generate`: one JSON object with the whole completion."""
        started = time.monotonic()
        parsed: LLMRequest | None = None
        request_id = ""  # the request's `id`, once read
        try:
            self._resolve(request)
            doc = _object(await _json_body(request), "request")
            request_id = _request_id(doc)
            parsed = _generate_request(doc, False, self.model.sampling_params, request_id)
            if parsed.stream:
                raise InvalidRequestError(
                    "parameters.stream", "/generate sends one response; use /generate_stream"
                )
            outputs = (await self._complete(parsed, request)).final_outputs()
        except (AdapterError, InvalidRequestError) as exc:
            return self._refused(exc, request, started, parsed, request_id)
        return web.json_response(_generate_body(self.model, request_id, outputs))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """`/generate_stream`: server-sent events, one per step (or one in all when `stream` is false).
        An event that cannot be sent within --stream-write-timeout (the client stopped reading) aborts
        the request and resets the connection."""
        stalled = False
        started = time.monotonic()
        parsed: LLMRequest | None = None
        request_id = ""  # the request's `id`, once read

        def cause() -> str:
            return STALLED_CLIENT if stalled else "client_cancel"

        try:
            self._resolve(request)
            doc = _object(await _json_body(request), "request")
            request_id = _request_id(doc)
            parsed = _generate_request(doc, True, self.model.sampling_params, request_id)
            completion = Completion(parsed)
            deltas = self.model.generate(parsed, dict(request.headers), cause)
            first = await anext(deltas)
        except (AdapterError, InvalidRequestError) as exc:
            return self._refused(exc, request, started, parsed, request_id)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        send = self.model.server.write_watch.send
        try:
            await response.prepare(request)
            try:
                async for delta in _chain(first, deltas):
                    completion.add(delta)
                    if parsed.stream:
                        body = _generate_body(self.model, request_id, completion.step_outputs(delta))
                    elif delta.request_finished:
                        body = _generate_body(self.model, request_id, completion.final_outputs())
                    else:
                        continue
                    await send(response.write(f"data: {json.dumps(body)}\n\n".encode()))
            except AdapterError as exc:
                await send(response.write(f"data: {json.dumps({'error': str(exc)})}\n\n".encode()))
            await send(response.write_eof())
        except ConnectionResetError:  # the client went away: an everyday event, not a server error to log
            pass
        except StalledClientError as exc:
            stalled = True
            await deltas.aclose()  # aborted as stalled_client, before the connection goes
            logger.warning("gave up a %s event stream: %s", request.path, exc)
            _reset(request)
        finally:
            await deltas.aclose()  # a client that went away aborts the request here
        return response

    async def _complete(self, parsed: LLMRequest, request: web.Request) -> Completion:
        """The whole completion. A client that hangs up cancels this handler (handler_cancellation): a
        request nobody waits for is aborted, not generated to the end."""
        completion = Completion(parsed)
        deltas = self.model.generate(parsed, dict(request.headers))
        try:
            async for delta in deltas:
                completion.add(delta)
        finally:
            await deltas.aclose()  # aborts the request unless it finished
        return completion


def _reset(request: web.Request) -> None:
    """Close a stalled client's connection at once, with a reset: closed normally, its unsent bytes
    would keep the socket (and the kernel's buffers) for as long as the client reads nothing."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


async def _json_body(request: web.Request) -> Any:
    return _json_document(await _read(request))


async def _infer_body(request: web.Request) -> tuple[dict[str, Any], bytes]:
    """The JSON header and the binary tensor data after it: the body's first
    Inference-Header-Content-Length bytes, or the whole body without that header."""
    body = await _read(request)
    header_length = request.headers.get(_HEADER_LENGTH)
    if header_length is None:
        # binary tensor data after the JSON reads as "Extra data": the header is what is missing
        hint = f"; binary tensor data after the JSON needs the {_HEADER_LENGTH} header"
        return _object(_json_document(body, extra_data_hint=hint), "request"), b""
    # ASCII digits only (int() takes " 1" and "1_0"; isdigit() passes "²", which int() refuses), and no
    # more of them than the body's length has: int() refuses over 4,300 digits
    if not (header_length.isascii() and header_length.isdigit()):
        raise InvalidRequestError(
            _HEADER_LENGTH,
            f"must be the JSON header's length in bytes, a whole number, got {header_length!r}",
        )
    if len(header_length) > len(str(len(body))) or int(header_length) > len(body):
        raise InvalidRequestError(
            _HEADER_LENGTH, f"{header_length} bytes of JSON header, but the body has {len(body)} bytes in all"
        )
    size = int(header_length)
    what = f"the JSON header (the body's first {size} bytes, {_HEADER_LENGTH})"
    header = _json_document(body[:size], what)
    return _object(header, "request"), body[size:]


async def _read(request: web.Request) -> bytes:
    """The request's body, decoded (read_body: a Content-Encoding not held is a 415, one that does not
    decode a 400); one that cannot be read as sent (a broken chunk) is the request's fault."""
    try:
        return await read_body(request)
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        raise InvalidRequestError("request", f"the body cannot be read: {exc}") from None


def _json_document(body: bytes, what: str = "body", extra_data_hint: str = "") -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8, integers past 4300 digits, deep nesting
        extra = isinstance(exc, json.JSONDecodeError) and exc.msg == "Extra data"
        hint = extra_data_hint if extra else ""
        raise InvalidRequestError("request", f"{what} is not valid JSON: {exc}{hint}") from None


def _request_id(doc: dict[str, Any]) -> str:
    """The `id` to echo; a string, as Triton and KServe require."""
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequestError("id", f"must be a string, got {type(request_id).__name__}")
    return request_id


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(where, "must be a JSON object")
    return value


async def _repository_parameters(request: web.Request) -> dict[str, repository.Parameter]:
    """A load or unload body's `parameters` (none for an empty body). A bytes parameter comes base64
    encoded in JSON; its text is taken as it is, as only its name is ever read."""
    body = await _read(request)
    if not body.strip():
        return {}
    parameters = _or_empty(_object(_json_document(body), "request").get("parameters"))
    values = _object(parameters, "parameters")
    for key, value in values.items():
        if isinstance(value, (dict, list, float)) or value is None:
            raise InvalidRequestError(f"parameters.{key[:64]}", "must be a boolean, an integer or a string")
    return values


def _integer(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(field, f"must be an integer, got {value!r}")
    return value


def _or_empty(parameters: Any) -> Any:
    """An absent or null `parameters` is none given; anything else must be an object (0 and "" too)."""
    return {} if parameters is None else parameters


def _json_inputs(inputs: Any, binary: bytes, shared_memory: SharedMemory) -> list[Tensor]:
    """Input tensors from JSON `data`, from the binary section (`parameters.binary_data_size`), or
    from a shared memory region their parameters name."""
    if not isinstance(inputs, list) or not inputs:
        raise InvalidRequestError("inputs", "must be a non-empty list of tensors")
    decoded, offset = [], 0
    for i, item in enumerate(inputs):
        tensor = _object(item, f"inputs[{i}]")
        name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
        where = f"inputs.{name if isinstance(name, str) else i}"
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise InvalidRequestError(where, "needs a name and a datatype")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise InvalidRequestError(f"{where}.shape", "must be a list of integers")
        tensors.check_datatype(where, datatype)
        given = _object(_or_empty(tensor.get("parameters")), f"{where}.parameters")
        size = given.get("binary_data_size")
        place = shared_memory.place(where, given)
        if place is not None:
            if "data" in tensor or size is not None:
                raise InvalidRequestError(
                    f"{where}.{'data' if 'data' in tensor else 'parameters.binary_data_size'}",
                    "must not be set when the input is in shared memory",
                )
            values = tensors.decode_raw(where, datatype, shape, place.read(where))
        elif size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidRequestError(f"{where}.parameters.binary_data_size", "must be an integer >= 0")
            if offset + size > len(binary):
                raise InvalidRequestError(
                    f"{where}.parameters.binary_data_size", "runs past the end of the body"
                )
            values = tensors.decode_raw(where, datatype, shape, binary[offset : offset + size])
            offset += size
        elif "data" in tensor:
            values = tensors.decode_json(where, datatype, shape, tensor["data"])
        else:
            raise InvalidRequestError(f"{where}.data", "is missing")
        decoded.append(Tensor(name, datatype, shape, values))
    if offset != len(binary):  # as Triton refuses it: bytes no input claims are a malformed request
        raise InvalidRequestError(
            _HEADER_LENGTH,
            f"{len(binary) - offset} bytes of binary data follow the JSON header beyond the inputs' "
            f"binary_data_size ({offset} bytes in all)",
        )
    return decoded


def _infer_response(
    model: LLMModel,
    request_id: str,
    outputs: list[Tensor],
    binary: dict[str, bool],
    binary_default: bool,
    places: dict[str, Place],
) -> web.Response:
    """An output in `places` is written into its shared memory region and goes without data."""
    doc: dict[str, Any] = {"model_name": model.name, "model_version": model.version, "outputs": []}
    if request_id:
        doc["id"] = request_id
    chunks = []
    for tensor in outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
        if (place := places.get(tensor.name)) is not None:
            place.write(f"outputs.{tensor.name}", tensors.encode_raw(tensor.datatype, tensor.values))
        elif binary.get(tensor.name, binary_default):
            raw = tensors.encode_raw(tensor.datatype, tensor.values)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = tensors.encode_json(tensor.datatype, tensor.values)
        doc["outputs"].append(entry)
    header = json.dumps(doc).encode()
    if not chunks:
        return web.Response(body=header, content_type="application/json")
    return web.Response(
        body=header + b"".join(chunks),
        content_type="application/octet-stream",
        headers={_HEADER_LENGTH: str(len(header))},
    )


def _generate_request(
    doc: dict[str, Any],
    stream_default: bool,
    make_params: Callable[..., SamplingParams],
    client_id: str = "",
) -> LLMRequest:
    """Triton's generate extension: `text_input`, `parameters` (sampling parameters and switches), and
    any other top-level property: an input where it names one of the model's, else a parameter, as
    Triton maps them (`{"text_input": "Hi", "max_tokens": 8}` is `"parameters": {"max_tokens": 8}`;
    a name that is neither is refused as an unknown sampling parameter)."""
    if "text_input" not in doc:
        raise InvalidRequestError("text_input", "is required")
    inputs = [Tensor("text_input", "BYTES", [1], [doc["text_input"]])]
    parameters = dict(_object(doc.get("parameters", {}), "parameters"))
    for key, value in doc.items():
        if key in ("text_input", "parameters", "id"):
            continue
        if key not in _SWITCH_INPUTS:
            if key in parameters:
                raise InvalidRequestError(key, "given both as a top-level property and in `parameters`")
            parameters[key] = value
            continue
        if key == "sampling_parameters" and isinstance(value, dict):
            value = json.dumps(value)
        inputs.append(Tensor(key, _SWITCH_INPUTS[key], [1], [value]))
    if "stream" not in doc and "stream" not in parameters:
        parameters["stream"] = stream_default
    return parse_request(inputs, parameters, make_params=make_params, client_id=client_id)


def _generate_body(model: LLMModel, request_id: str, outputs: list[Tensor]) -> dict[str, Any]:
    """Each output tensor as a top-level property: its one element, or a list for several."""
    body: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    if request_id:
        body["id"] = request_id
    for tensor in outputs:
        values = tensors.encode_json(tensor.datatype, tensor.values)
        body[tensor.name] = values[0] if len(values) == 1 else values
    return body
