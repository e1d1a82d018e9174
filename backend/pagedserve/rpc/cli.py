"""`pagedserve serve`: build the engine, then serve gRPC (our API and the KServe v2 / Triton adapter)
and HTTP (metrics, health, KServe v2 REST) until drained. SIGTERM or SIGINT before the server is
ready ends it at once, exit 0 (see rpc/server.py for the whole lifecycle)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from pydantic import Field

from pagedserve.settings import (
    EngineSettings,
    SettingsError,
    add_settings_arguments,
    config_error,
    flags_given,
    setting_source,
    settings_from_args,
)

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.rpc.http import HttpEndpoint
    from pagedserve.rpc.server import Server

logger = logging.getLogger("pagedserve.serve")


class ServeSettings(EngineSettings):
    host: str = Field("0.0.0.0", description="address to bind")
    port: int = Field(8001, ge=0, le=65535, description="gRPC port (0 = any free port)")
    http_port: int = Field(
        8000,
        ge=-1,
        le=65535,
        description="HTTP port for /metrics, health and KServe v2 REST (-1 = off, 0 = any free port)",
    )
    shutdown_timeout: float = Field(
        30.0, ge=0, description="seconds in-flight requests may finish after SIGTERM"
    )
    max_queued_requests: int = Field(
        1024, ge=1, description="waiting requests beyond which calls get RESOURCE_EXHAUSTED"
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="tokens per streamed response: a completion's first token is sent at once, then "
        "every N tokens and whatever is left at its end; N > 1 sends fewer messages (less CPU per token "
        "in server and client) at a coarser stream",
    )
    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP collector for request traces (e.g. http://otel:4317)"
    )
    traces_exporter: str | None = Field(
        None,
        description="otlp, console or none, comma separated (default: OTEL_TRACES_EXPORTER, else otlp "
        "when an endpoint is set; OTLP over OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc or http/protobuf)",
    )
    warmup: bool = Field(True, description="generate one token before reporting ready")
    grpc_keepalive_time: float = Field(
        30.0,
        ge=0,
        description="seconds a connection with calls in flight may stay silent before the server pings "
        "the client (0 = never): a client gone without closing its connection (a crashed host, a cut "
        "network, a hung process) is found out and its requests aborted",
    )
    grpc_keepalive_timeout: float = Field(
        20.0, gt=0, description="seconds the server waits for a ping's answer before it closes the connection"
    )


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the model over gRPC")
    add_settings_arguments(parser, ServeSettings)


@dataclass
class _Startup:
    """How far start-up got, for whatever ends it early."""

    llm: LLMEngine | None = None  # once built; the server owns it once bound (server.start)
    load_abandoned: bool = False  # stopped while the torch thread loads the model: it loads on


def run_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(ServeSettings, args)
    startup = _Startup()
    code = asyncio.run(_serve(settings, set(flags_given(ServeSettings, args)), startup))
    if startup.load_abandoned:
        _exit_now(code)
    return code


def _exit_now(code: int) -> NoReturn:
    """Exit without the model load still running in the torch thread: interpreter exit would join that
    thread, for as long as loading takes (minutes for a large model, up to the start-up timeout for a
    tensor-parallel rendezvous), while an orchestrator waits and then kills. Nothing it built needs
    more than the process's end, except the ranks it started."""
    from pagedserve.worker.multiproc_executor import stop_spawned_ranks

    for sig in (signal.SIGTERM, signal.SIGINT):  # already exiting: another signal must not cut this short
        signal.signal(sig, signal.SIG_IGN)
    stop_spawned_ranks()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(settings: ServeSettings, flags: set[str], startup: _Startup) -> int:
    from pagedserve.launch import launch_env
    from pagedserve.rpc.signals import catch_stop_signals

    # Under a launcher (torchrun) every process runs `serve` and ranks other than 0 become workers
    # inside the engine constructor, never to return: their signals stay the launcher's business
    # until this process is known to be rank 0. Otherwise signals stop the server from now on.
    try:
        under_launcher = launch_env() is not None
    except ValueError as exc:  # the launcher's own variables, half set or not numbers
        raise SettingsError(str(exc)) from None
    stop = None if under_launcher else catch_stop_signals()

    from pagedserve_adapters.grpc_service import SERVICE as INFERENCE_SERVICE
    from pagedserve_adapters.grpc_service import add_to_server as add_inference_service
    from pagedserve_adapters.llm_model import LLMModel
    from pagedserve_adapters.rest import routes as rest_routes

    from pagedserve.engine.async_engine import in_torch_thread
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.rpc.http import HttpEndpoint
    from pagedserve.rpc.server import Server, keepalive_options
    from pagedserve.telemetry import RequestTracer, configure_tracing
    from pagedserve.worker.multiproc_executor import StartupError

    try:
        provider = configure_tracing(settings.otlp_traces_endpoint, settings.traces_exporter)
    except (ValueError, RuntimeError) as exc:  # an unknown exporter or protocol, a missing exporter package
        raise SettingsError(str(exc)) from None
    tracer = RequestTracer(provider, settings.served_model_name or "")
    # Under a launcher build the engine before binding anything (see above). Otherwise open the
    # ports first, so probes see a live (not ready) server while the weights load.
    try:
        startup.llm = await in_torch_thread(LLMEngine.from_settings, settings) if under_launcher else None
    except ValueError as exc:  # what only the model can tell: its path, its context length
        raise config_error(exc, flags) from None
    server = Server(tracer, keepalive_options(settings.grpc_keepalive_time, settings.grpc_keepalive_timeout))
    model = LLMModel(server)
    add_inference_service(server.grpc, model)
    server.services.append(INFERENCE_SERVICE)
    http = HttpEndpoint(server, rest_routes(model))
    try:
        return await _run(server, http, startup, settings, flags, stop or catch_stop_signals())
    except StartupError as exc:  # a tensor-parallel rank died or never started: not a bug, no traceback
        logger.error("%s", exc)
        return 1
    finally:  # drained, dead, stopped or failed on the way up: nothing bound or started outlives this
        await http.stop()
        if not server.stopped.is_set():  # a grace, as in a drain: grpc logs a cancelled probe's traceback
            await server.stop()
        if startup.llm is not None and not hasattr(server, "engine"):  # built, never bound
            startup.llm.executor.shutdown()
        if provider is not None:
            provider.shutdown()


async def _run(
    server: Server,
    http: HttpEndpoint,
    startup: _Startup,
    settings: ServeSettings,
    flags: set[str],
    stop: asyncio.Event,
) -> int:
    """Bind, start (load the model unless built already, warm up) unless stopped first, serve until
    drained; the exit code."""
    from pagedserve.rpc.server import run_until_signalled

    address = f"{setting_source('host', flags)}, {setting_source('port', flags)}"
    try:
        port = server.add_port(f"{settings.host}:{settings.port}")
    except OSError as exc:
        raise SettingsError(f"{address}: {exc}") from None
    try:
        http_port = await http.start(settings.host, settings.http_port) if settings.http_port >= 0 else None
    except OSError as exc:
        raise SettingsError(f"{setting_source('http_port', flags)}: {exc}") from None
    await server.open()
    logger.info(
        "gRPC on %s:%d, HTTP on %s: live; loading the model",
        settings.host,
        port,
        f"{settings.host}:{http_port}" if http_port is not None else "off",
    )
    starting = asyncio.create_task(_start(server, startup, settings, flags))
    signal_wait = asyncio.create_task(stop.wait())
    await asyncio.wait((starting, signal_wait), return_when=asyncio.FIRST_COMPLETED)
    signal_wait.cancel()
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        stage = "loading the model" if startup.load_abandoned else "warming up"
        logger.info("signalled while starting (%s): exiting without serving", stage)
        return 0
    llm = await starting
    logger.info(
        "pagedserve ready: gRPC %s:%d (pagedserve.rpc.v1.Generation, inference.GRPCInferenceService, "
        "grpc.health.v1, reflection), HTTP KServe v2 REST, model %r",
        settings.host,
        port,
        llm.config.model.served_model_name,
    )
    return await run_until_signalled(server, settings.shutdown_timeout, stop)


async def _start(server: Server, startup: _Startup, settings: ServeSettings, flags: set[str]) -> LLMEngine:
    """Load the model (unless built already), bind it to the server and warm up: the engine, ready."""
    from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.errors import InvalidRequestError

    if startup.llm is None:
        try:
            startup.llm = await in_torch_thread(LLMEngine.from_settings, settings)
        except asyncio.CancelledError:  # the load itself cannot be cancelled: it goes on in its thread
            startup.load_abandoned = True
            raise
        except ValueError as exc:
            raise config_error(exc, flags) from None
    llm = startup.llm
    server.servicer.tracer.model_name = llm.config.model.served_model_name
    try:
        await server.start(
            AsyncEngine(llm, settings.max_queued_requests, settings.stream_interval), warmup=settings.warmup
        )
    except InvalidRequestError as exc:  # not even the warm-up's 2 tokens in, 1 out can ever run
        names = ", ".join(
            setting_source(n, flags) for n in ("max_model_len", "num_kv_blocks", "kv_cache_memory")
        )
        raise SettingsError(f"{names}: too small for any request (the warm-up's {exc})") from None
    return llm
