"""The HTTP port (--http-port; HTTPS with --ssl-certfile): Prometheus `/metrics`, health for HTTP
probes (`/health/live`, `/health/ready`), vLLM's runtime LoRA routes (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`), and whatever routes the adapters add (KServe v2 REST). Built on aiohttp,
so keep-alive clients, request bodies and server-sent events work as HTTP clients expect."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
import zlib
from collections.abc import Iterable
from typing import Any

from aiohttp import web, web_app
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from pagedserve.errors import AdapterInUseError, AdapterNotLoadedError, EngineDeadError, InvalidRequestError
from pagedserve.rpc.auth import http_middleware

logger = logging.getLogger(__name__)

_PROMETHEUS_TYPE = "text/plain; version=0.0.4"
MAX_BODY_SIZE = 64 * 1024 * 1024  # a request body's bytes, as sent and once its Content-Encoding is undone
_KEPT_ERROR_HEADERS = ("Allow", "Accept-Encoding")  # 405's methods, 415's codings
# content coding -> zlib's wbits for it (deflate: the zlib format; raw deflate is told apart by its header)
_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (no such route, a method the route lacks, a body past the size limit) and
    read_body's as the KServe v2 routes answer theirs, a JSON object with an `error`: tritonclient.http
    parses every error body as JSON, and choked on aiohttp's text ("Parse error at offset 3")."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{exc.reason}: {request.method} {request.path}" if exc.status in (404, 405) else exc.text
        headers = {name: exc.headers[name] for name in _KEPT_ERROR_HEADERS if name in exc.headers}
        return web.json_response({"error": message}, status=exc.status, headers=headers)


@functools.cache
def _starting_registry() -> CollectorRegistry:
    """This process's CPU, memory and file descriptors, for /metrics before the engine (and its
    registry, which has them too) exists."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


class _MalformedRequests(logging.Filter):
    """aiohttp logs an ERROR with a traceback for every request it cannot parse as HTTP (a request line
    or header past its limits, a Content-Length that is no number, bytes that are no HTTP at all: port
    scanners, broken clients, a TLS client on a plaintext port), and answers it 400 itself. The
    client's fault, no server error: one info line each, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            message = " ".join(str(exc.message).split())  # aiohttp points at the fault over several lines
            logger.info("answered a malformed HTTP request from %s with %d: %s", remote, exc.code, message)
            return False
        return True


def _quiet_malformed_requests() -> None:
    server_logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _MalformedRequests) for f in server_logger.filters):
        server_logger.addFilter(_MalformedRequests())


class HttpEndpoint:
    def __init__(self, server: Any, extra_routes: Iterable[web.AbstractRouteDef] = ()) -> None:
        _quiet_malformed_requests()
        self.grpc_server = server  # pagedserve.rpc.server.Server: its state and (once bound) engine
        api_key = getattr(server, "api_key", None)  # --api-key, on this port too
        middlewares = [json_errors] + ([http_middleware(api_key)] if api_key is not None else [])
        self.app = web.Application(client_max_size=MAX_BODY_SIZE, middlewares=middlewares)
        self.app.add_routes(
            [
                web.get("/metrics", self.metrics),
                web.get("/health/live", self.live),
                web.get("/health/ready", self.ready),
                web.post("/v1/load_lora_adapter", self.load_lora_adapter),
                web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
            ]
        )
        self.app.add_routes(list(extra_routes))
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on `host:port` (0: any free port), HTTPS with `ssl_context` (rpc/tls.py); the port."""
        # handler_cancellation: a client that hangs up cancels its handler, which aborts its request
        # even while the handler waits for tokens with nothing to write (adapters' rest.py);
        # auto_decompress off: read_body undoes a Content-Encoding, so that one it does not hold is a
        # JSON error, not aiohttp's text answer before any handler runs
        self.runner = web.AppRunner(
            self.app,
            access_log=None,
            shutdown_timeout=1.0,
            handler_cancellation=True,
            auto_decompress=False,
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=ssl_context)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        # aiohttp keeps each route's handler wrapped in the middlewares, for the life of the process, in
        # a cache keyed by the handler and its application: this endpoint's bound methods and the
        # adapters' routes, which hold the server and its engine. A server stopped and dropped in a
        # process that goes on (tests, embedders) kept its whole model alive. Live endpoints' entries
        # go too: the cache builds them again on their next request.
        cached = getattr(web_app, "_cached_build_middleware", None)  # aiohttp 3.9 and later
        if cached is not None:
            cached.cache_clear()

    async def metrics(self, request: web.Request) -> web.Response:
        """The engine's metrics; while the model loads, this process's own (`process_*`) alone, with
        200: a scrape that fails reads as the target down (Prometheus' `up` 0, TargetDown alerts on
        every rollout), and the memory a load takes is what one watches then. Readiness is the
        probes' to say."""
        if self.grpc_server.state.status == "starting":
            body = generate_latest(_starting_registry())
        else:
            body = self.grpc_server.engine.engine.metrics.render()
        return web.Response(body=body, content_type=_PROMETHEUS_TYPE.split(";")[0], charset="utf-8")

    async def live(self, request: web.Request) -> web.Response:
        return probe(self.grpc_server.state.status != "dead")

    async def ready(self, request: web.Request) -> web.Response:
        return probe(self.grpc_server.state.ready)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's route (`{"lora_name", "lora_path"}`), so that tools managing vLLM's adapters (a LoRA
        syncer beside the server, a controller) work unchanged; as the gRPC LoadLoRAAdapter."""
        return await self._change_lora(request, load=True)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's route (`{"lora_name"}`); as the gRPC UnloadLoRAAdapter."""
        return await self._change_lora(request, load=False)

    async def _change_lora(self, request: web.Request, load: bool) -> web.Response:
        """vLLM's answers: 200 with its success text, else its error object (400, 404 for an adapter
        not loaded), and 404 while runtime updating is off (vLLM has no such routes then); here also
        409 for an adapter requests still use and 503 for a server not serving."""
        state = self.grpc_server.state
        if not state.allow_runtime_lora_updating:
            return _lora_error(
                404,
                "NotFoundError",
                "LoRA adapters are not loaded or unloaded at run time here: start the server with "
                "--allow-runtime-lora-updating",
            )
        if state.status != "serving":
            return _lora_error(503, "ServiceUnavailableError", f"server is {state.status}")
        try:
            body = json.loads(await read_body(request))
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _lora_error(400, "InvalidUserInput", "the body must be a JSON object")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name) or (load and not (isinstance(path, str) and path)):
            wanted = "Both 'lora_name' and 'lora_path' must" if load else "'lora_name' must"
            return _lora_error(400, "InvalidUserInput", f"{wanted} be provided.")
        engine = self.grpc_server.engine
        try:
            await (engine.load_lora_adapter(name, path) if load else engine.unload_lora_adapter(name))
        except AdapterNotLoadedError as exc:
            return _lora_error(404, "NotFoundError", str(exc))
        except AdapterInUseError as exc:
            return _lora_error(409, "ConflictError", str(exc))
        except InvalidRequestError as exc:  # a name loaded already, an adapter that does not fit
            return _lora_error(400, "BadRequestError", str(exc))
        except EngineDeadError as exc:
            return _lora_error(503, "ServiceUnavailableError", str(exc))
        return web.Response(
            text=f"Success: LoRA adapter '{name}' {'added' if load else 'removed'} successfully."
        )


async def read_body(request: web.Request) -> bytes:
    """The request's body with its Content-Encoding undone: gzip or deflate, which tritonclient.http's
    `request_compression_algorithm` sends. Any other coding is a 415 naming it (aiohttp took `foo` for
    no coding at all, and refused zstd in text before any handler ran), a body its coding does not
    decode a 400, and one past MAX_BODY_SIZE a 413, sent (aiohttp's check) or decoded (a small gzip
    body can hold gigabytes). As HTTP errors, which json_errors answers in JSON."""
    header = request.headers.get("Content-Encoding", "")
    codings = [c.strip().lower() for c in header.split(",") if c.strip().lower() not in ("", "identity")]
    for coding in codings:
        if coding not in _CODINGS:
            raise web.HTTPUnsupportedMediaType(
                text=f"Content-Encoding {coding!r} is not supported; send gzip, deflate or identity",
                headers={"Accept-Encoding": "gzip, deflate"},  # RFC 9110 15.5.16
            )
    if request.content_length is not None and request.content_length > MAX_BODY_SIZE:
        # refused on its header: aiohttp read 64 MiB of it first, and a client that declared more than
        # it sent waited for a reply until it timed out
        raise web.HTTPRequestEntityTooLarge(
            MAX_BODY_SIZE,
            request.content_length,
            text=f"Maximum request body size {MAX_BODY_SIZE} exceeded: Content-Length {request.content_length}.",
        )
    body = await request.read()
    for coding in reversed(codings):  # the codings in the order they were applied
        if body:
            body = await asyncio.to_thread(_decode, coding, body)
    return body


def _decode(coding: str, body: bytes) -> bytes:
    wbits = _CODINGS[coding]
    if coding == "deflate" and not _is_zlib_header(body):
        wbits = -zlib.MAX_WBITS  # raw deflate, as some clients send it
    decoder = zlib.decompressobj(wbits)
    try:
        decoded = decoder.decompress(body, MAX_BODY_SIZE + 1)
    except zlib.error as exc:
        raise web.HTTPBadRequest(text=f"Content-Encoding {coding}: the body does not decode: {exc}") from None
    if len(decoded) > MAX_BODY_SIZE:
        raise web.HTTPRequestEntityTooLarge(
            MAX_BODY_SIZE,
            len(decoded),
            text=f"Maximum request body size {MAX_BODY_SIZE} exceeded once its {coding} coding is undone.",
        )
    if not decoder.eof:
        raise web.HTTPBadRequest(
            text=f"Content-Encoding {coding}: the body ends before its compressed data does"
        )
    return decoded


def _is_zlib_header(data: bytes) -> bool:
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


def _lora_error(status: int, kind: str, message: str) -> web.Response:
    """vLLM's ErrorResponse."""
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "code": status}, status=status
    )


def probe(ok: bool) -> web.Response:
    return web.Response(text="ok\n") if ok else web.Response(status=503, text="unavailable\n")
