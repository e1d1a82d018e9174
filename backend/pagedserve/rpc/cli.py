"""`pagedserve serve`: build the engine, then serve gRPC (our API and the KServe v2 / Triton adapter)
and HTTP (metrics, health, KServe v2 REST) until drained."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

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


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the model over gRPC")
    add_settings_arguments(parser, ServeSettings)


def run_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(ServeSettings, args)
    return asyncio.run(_serve(settings, set(flags_given(ServeSettings, args))))


async def _serve(settings: ServeSettings, flags: set[str]) -> int:
    from pagedserve_adapters.grpc_service import SERVICE as INFERENCE_SERVICE
    from pagedserve_adapters.grpc_service import add_to_server as add_inference_service
    from pagedserve_adapters.llm_model import LLMModel
    from pagedserve_adapters.rest import routes as rest_routes

    from pagedserve.distributed import launch_env
    from pagedserve.engine.async_engine import in_torch_thread
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.rpc.http import HttpEndpoint
    from pagedserve.rpc.server import Server
    from pagedserve.telemetry import RequestTracer, configure_tracing

    try:
        provider = configure_tracing(settings.otlp_traces_endpoint, settings.traces_exporter)
    except (ValueError, RuntimeError) as exc:  # an unknown exporter or protocol, a missing exporter package
        raise SettingsError(str(exc)) from None
    tracer = RequestTracer(provider, settings.served_model_name or "")
    # Under a launcher (torchrun) every process runs `serve` and ranks other than 0 become workers
    # inside the engine constructor: build the engine before binding anything. Otherwise open the
    # ports first, so probes see a live (not ready) server while the weights load.
    under_launcher = launch_env() is not None
    try:
        llm = await in_torch_thread(LLMEngine.from_settings, settings) if under_launcher else None
    except ValueError as exc:  # what only the model can tell: its path, its context length
        raise config_error(exc, flags) from None
    server = Server(tracer)
    model = LLMModel(server)
    add_inference_service(server.grpc, model)
    server.services.append(INFERENCE_SERVICE)
    http = HttpEndpoint(server, rest_routes(model))
    try:
        return await _run(server, http, llm, settings, flags)
    finally:  # drained, dead, or failed on the way up: nothing bound or started outlives this
        await http.stop()
        if not server.stopped.is_set():
            await server.stop(grace=0)
        if llm is not None and not hasattr(server, "engine"):  # built under a launcher, never bound
            llm.executor.shutdown()
        if provider is not None:
            provider.shutdown()


async def _run(
    server: Server, http: HttpEndpoint, llm: LLMEngine | None, settings: ServeSettings, flags: set[str]
) -> int:
    """Bind, load the model (unless built already), serve until drained; the exit code."""
    from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.errors import InvalidRequestError
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
    if llm is None:
        try:
            llm = await in_torch_thread(LLMEngine.from_settings, settings)
        except ValueError as exc:
            raise config_error(exc, flags) from None
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
    logger.info(
        "pagedserve ready: gRPC %s:%d (pagedserve.rpc.v1.Generation, inference.GRPCInferenceService, "
        "grpc.health.v1, reflection), HTTP KServe v2 REST, model %r",
        settings.host,
        port,
        llm.config.model.served_model_name,
    )
    return await run_until_signalled(server, settings.shutdown_timeout)
