"""`pagedserve serve`: build the engine, then serve gRPC (our API and the KServe v2 / Triton adapter)
and HTTP (metrics, health, KServe v2 REST), both over TLS when given a certificate, until drained.
SIGTERM or SIGINT before the server is ready ends it at once, exit 0 (see rpc/server.py for the whole
lifecycle). `pagedserve health`: the gRPC health check an exec probe or HEALTHCHECK runs (no torch)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import os
import signal
import socket
import stat
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NoReturn

from pydantic import Field, field_validator, model_validator

from pagedserve import logs
from pagedserve.logs import LogFormat, LogLevel
from pagedserve.rpc.tls import TlsFiles, check_client_files, server_context
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
    from pagedserve.rpc.tls import ServerTls

logger = logging.getLogger("pagedserve.serve")

_MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)


class ServeSettings(EngineSettings):
    host: str = Field("0.0.0.0", description="address to bind")
    port: int = Field(8001, ge=0, le=65535, description="gRPC port (0 = any free port)")
    uds: str | None = Field(
        None,
        description="serve gRPC on this Unix domain socket instead of --host/--port (as vLLM's --uds), for "
        "a client or proxy on the same host: a socket left by a server gone is replaced, one a server "
        "answers on is refused, and the socket is removed at exit. HTTP stays on --host/--http-port",
    )
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
    stream_write_timeout: float = Field(
        60.0,
        ge=0,
        description="seconds one streamed response may wait to be sent (0 = no limit): a client that "
        "keeps its stream open but stops reading has its requests aborted and its stream closed "
        "(a slow client that keeps reading is never cut)",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="take LoadLoRAAdapter / UnloadLoRAAdapter calls (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): "
        "LoRA adapters loaded from and dropped by any path the server can read, while it serves",
    )
    allow_client_shm: bool = Field(
        False,
        description="take Triton's system shared memory registrations (SystemSharedMemoryRegister, POST "
        "/v2/systemsharedmemory/region/NAME/register; Triton's flag): tensors in a client's shared memory "
        "objects, which the server opens read-write by the name a client gives",
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="take tool_choice auto (the default of a chat request with tools): the model decides "
        "whether to call tools, and --tool-call-parser finds its calls in its output (as vLLM's flag)",
    )
    tool_call_parser: (
        Literal[
            "hermes",
            "llama3_json",
            "pythonic",
            "granite",
            "phi4_mini_json",
            "openai",
            "olmo3",
            "mistral",
            "qwen3_coder",
            "glm45",
            "seed_oss",
            "deepseek_v3",
            "deepseek_v31",
            "kimi_k2",
        ]
        | None
    ) = Field(
        None,
        description="the model family's tool-call format: hermes (Qwen2.5, Qwen3, Hermes: <tool_call> "
        "JSON </tool_call>), llama3_json (Llama 3.1/3.2 JSON calls), pythonic ([f(x=1), g()]; Llama 3.2/4, "
        "Gemma 3 with a pythonic template), granite (Granite 3.x: <|tool_call|> or <tool_call>, then a JSON "
        "list of calls), phi4_mini_json (Phi-4-mini: functools[ then a JSON list of calls ]), openai "
        "(GPT-OSS: harmony messages to=functions.NAME; with --reasoning-parser openai_gptoss), olmo3 (OLMo 3: "
        "a pythonic call a line between <function_calls> and </function_calls>), mistral (Mistral: [TOOL_CALLS] then "
        "a JSON list of calls, or name{...} a call), qwen3_coder (Qwen3-Coder: <tool_call><function=NAME> with "
        "<parameter=KEY> values, typed by the tool's schema), glm45 (GLM-4.5/4.6: <tool_call>NAME then "
        "<arg_key>/<arg_value> pairs), seed_oss (Seed-OSS: qwen3_coder's XML in <seed:tool_call> tags), "
        "deepseek_v3 (DeepSeek-V3, R1: a call's name and its arguments in a json fence, in its special tokens), "
        "deepseek_v31 (DeepSeek-V3.1: a call's name, <｜tool▁sep｜>, its arguments), kimi_k2 (Kimi K2: "
        "functions.NAME:INDEX then its arguments, the id kept)",
    )
    reasoning_parser: (
        Literal[
            "deepseek_r1",
            "deepseek_v3",
            "glm45",
            "kimi_k2",
            "mistral",
            "olmo3",
            "openai_gptoss",
            "qwen3",
            "seed_oss",
        ]
        | None
    ) = Field(
        None,
        description="send a chat completion's reasoning (between <think> and </think>) as reasoning_content, "
        "apart from its text, as vLLM's flag: deepseek_r1 (DeepSeek-R1, QwQ), deepseek_v3 (DeepSeek-V3.1, "
        "thinking where its prompt says so), glm45 (GLM-4.5), kimi_k2 (Kimi K2 Thinking: its tags special "
        "tokens, kept; a tool call ends the reasoning too), olmo3 (OLMo 3 Think) or qwen3 (the same tags), mistral (Magistral: [THINK] and [/THINK]), seed_oss (Seed-OSS: "
        "<seed:think>), or openai_gptoss (GPT-OSS's harmony messages: the analysis channel's as reasoning, the "
        "final channel's as text, their special tokens dropped)",
    )
    triton_priority_levels: int = Field(
        3,
        ge=1,
        description="Triton's priority levels (ModelConfig dynamic_batching): under --scheduling-policy "
        "priority a KServe v2 / Triton request's `priority` 1 runs first, then 2, ... up to this",
    )
    triton_default_priority_level: int = Field(
        2,
        ge=1,
        description="the level of a Triton request without a priority (0) or with one above "
        "--triton-priority-levels, as Triton's default_priority_level",
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
    engine_process: bool | None = Field(
        None,
        description="step the engine in a process of its own, the front end (gRPC, HTTP, tokenizing, "
        "metrics) in this one, as vLLM serves: the two do not take turns on one interpreter, which "
        "costs most where steps are short (a GPU); an engine process that dies turns the server "
        "NOT_SERVING. Default: on, except under a launcher (torchrun), whose rank 0 steps the engine "
        "in the process the launcher started; --no-engine-process steps it on a thread of this one",
    )
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
    api_key: str | None = Field(
        None,
        description="calls on both ports need the header authorization: Bearer <key> (as vLLM's flag); "
        "gRPC health, reflection, /metrics and the health routes stay open for probes and scrapers. "
        "Prefer the environment variable (from a Secret) to the flag, which other processes can read",
    )
    log_level: LogLevel = Field(
        "info", description="the lowest level logged, by the server and the processes it starts"
    )
    log_format: LogFormat = Field(
        "text",
        description="text lines, or json: one JSON object a line (time, level, logger, process, message "
        "and the record's fields, a finished request's id, token counts, TTFT, ...) for log pipelines",
    )
    log_requests: bool = Field(
        True,
        description="one info line per finished request (id, tokens, TTFT, end-to-end time, finish "
        "reason); --no-log-requests drops them",
    )
    ssl_certfile: str | None = Field(
        None,
        description="PEM certificate (chain, leaf first): TLS on the gRPC and the HTTP port, with "
        "--ssl-keyfile; re-read when the file changes, for new connections",
    )
    ssl_keyfile: str | None = Field(None, description="PEM private key of --ssl-certfile (unencrypted)")
    ssl_ca_certs: str | None = Field(
        None,
        description="PEM CA bundle: mutual TLS, clients must present a certificate signed by one of these",
    )

    @model_validator(mode="after")
    def _check_tls(self) -> ServeSettings:
        """The files are read and matched now, before the model loads: not at the first handshake."""
        if self.tls_files.paths:
            server_context(self.tls_files)
        return self

    @model_validator(mode="after")
    def _check_priority_levels(self) -> ServeSettings:
        if self.triton_default_priority_level > self.triton_priority_levels:
            raise ValueError(
                f"triton_default_priority_level: must be at most --triton-priority-levels "
                f"({self.triton_priority_levels}), got {self.triton_default_priority_level}"
            )
        return self

    @field_validator("uds")
    @classmethod
    def _check_uds(cls, value: str | None) -> str | None:
        """A path a socket can have: the kernel takes at most 107 bytes (sun_path, its NUL aside)."""
        if value is None:
            return None
        if not value:
            raise ValueError("must be a path")
        path = os.path.abspath(value)
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
            raise ValueError(
                f"{len(os.fsencode(path))} bytes long as an absolute path: a Unix socket's may have at "
                f"most {_MAX_SOCKET_PATH}"
            )
        return path

    @model_validator(mode="after")
    def _check_uds_alone(self) -> ServeSettings:
        if self.uds is not None and "port" in self.model_fields_set:
            raise ValueError("uds: serves gRPC in place of the port setting: give one of them")
        return self

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower_case(cls, value: object) -> object:
        """PAGEDSERVE_LOG_LEVEL=INFO reads as info."""
        return value.lower() if isinstance(value, str) else value

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: str | None) -> str | None:
        """A header value: visible ASCII, no spaces. (rpc/auth.py, which checks it per call, imports grpc:
        not imported here, before `run_serve` sets GRPC_VERBOSITY.)"""
        if value is not None and not (value and all("!" <= ch <= "~" for ch in value)):
            raise ValueError("must be 1 or more visible ASCII characters, no spaces")
        return value

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ServeSettings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice: needs --tool-call-parser (the format of the model's calls)"
            )
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            raise ValueError(
                "tool_call_parser: openai reads the calls --reasoning-parser openai_gptoss passes on "
                "from GPT-OSS's harmony messages: add it"
            )
        return self

    @property
    def auto_tool_call_parser(self) -> str | None:
        """tool_choice auto's parser: --tool-call-parser's, with --enable-auto-tool-choice."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def tls_files(self) -> TlsFiles:
        return TlsFiles(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the model over gRPC")
    add_settings_arguments(parser, ServeSettings)


def add_health_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "health",
        help="ask a server's gRPC health service: exit 0 when SERVING, else 1 (exec probes, HEALTHCHECK)",
        description="Check a pagedserve server (or any gRPC server) through grpc.health.v1: exit 0 when "
        "the service is SERVING, 1 otherwise (not serving, unreachable, TLS refused) with one line on "
        "stderr. TLS when any --ssl-* flag is given.",
    )
    parser.add_argument(
        "--address", default="localhost:8001", help="gRPC host:port, or unix:PATH (default: %(default)s)"
    )
    parser.add_argument(
        "--service",
        default="",
        help='"" (default): liveness; pagedserve.rpc.v1.Generation: readiness (model loaded, warmed up)',
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the answer (default: %(default)s)"
    )
    parser.add_argument(
        "--ssl-ca-certs",
        help="PEM CA bundle to verify the server's certificate (default: the system's roots)",
    )
    parser.add_argument("--ssl-certfile", help="PEM client certificate for mutual TLS, with --ssl-keyfile")
    parser.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile")
    parser.add_argument(
        "--ssl-target-name",
        help="name the server's certificate must carry when it is not the host of --address "
        "(a certificate for a DNS name, probed at 127.0.0.1)",
    )


def run_health(args: argparse.Namespace) -> int:
    """One Check RPC: 0 for SERVING, else 1 and one line on stderr. Unusable flags: SettingsError."""
    files = TlsFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    use_tls = bool(files.paths) or args.ssl_target_name is not None
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise SettingsError(f"--timeout: must be a number of seconds above 0 (got {args.timeout})")
    if use_tls:
        try:
            check_client_files(files)
        except ValueError as exc:  # `ssl_<setting>: what is wrong`; this command reads no environment
            setting, _, message = str(exc).partition(": ")
            raise SettingsError(f"--{setting.replace('_', '-')}: {message}") from None
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # its own log of a refused handshake: one line is ours
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.rpc.tls import channel_credentials

    if use_tls:
        options = [("grpc.ssl_target_name_override", args.ssl_target_name)] if args.ssl_target_name else []
        channel = grpc.secure_channel(args.address, channel_credentials(files), options=options)
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        try:
            request = health_pb2.HealthCheckRequest(service=args.service)
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            status = f"{exc.code().name}: {' '.join(str(exc.details()).split())}"
        else:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return 0
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    service = repr(args.service) if args.service else "liveness"
    print(f"pagedserve health: {args.address} {service}: {status}", file=sys.stderr)
    return 1


@dataclass
class _Startup:
    """How far start-up got, for whatever ends it early."""

    llm: LLMEngine | None = None  # once built; the server owns it once bound (server.start)
    load_abandoned: bool = False  # stopped while the torch thread loads the model: it loads on


def run_serve(args: argparse.Namespace) -> int:
    # gRPC core logs to stderr past our logging, and at INFO it logs every failed TLS handshake (a
    # plaintext client, a port scanner, a load balancer's TCP check): its errors only, unless asked.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    settings = settings_from_args(ServeSettings, args)
    logs.configure(settings.log_level, settings.log_format, settings.log_requests)
    # and the same for the processes it starts (the engine process, tensor-parallel ranks)
    logs.export(settings.log_level, settings.log_format, settings.log_requests)
    startup = _Startup()
    code = asyncio.run(_serve(settings, set(flags_given(ServeSettings, args)), startup))
    if startup.load_abandoned:
        _exit_now(code)
    return code


def _exit_now(code: int) -> NoReturn:
    """Exit without the model load still running in the torch thread: interpreter exit would join that
    thread, for as long as loading takes (minutes for a large model, up to the start-up timeout for a
    tensor-parallel rendezvous), while an orchestrator waits and then kills. Nothing it built needs
    more than the process's end, except the ranks and the engine process it started."""
    from pagedserve.engine.core_process import stop_engine_processes
    from pagedserve.worker.processes import stop_spawned_ranks

    for sig in (signal.SIGTERM, signal.SIGINT):  # already exiting: another signal must not cut this short
        signal.signal(sig, signal.SIG_IGN)
    stop_spawned_ranks()
    stop_engine_processes()
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
    if under_launcher and settings.engine_process:
        raise SettingsError(
            f"{setting_source('engine_process', flags)}: not under a launcher (torchrun): its rank 0 "
            "steps the engine in the process the launcher started"
        )
    if settings.engine_process is None:
        settings.engine_process = not under_launcher
    stop = None if under_launcher else catch_stop_signals()

    from pagedserve_adapters.grpc_service import SERVICE as INFERENCE_SERVICE
    from pagedserve_adapters.grpc_service import add_to_server as add_inference_service
    from pagedserve_adapters.llm_model import LLMModel, PriorityLevels
    from pagedserve_adapters.rest import routes as rest_routes
    from pagedserve_adapters.shared_memory import SharedMemory

    from pagedserve.engine.async_engine import in_torch_thread
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.rpc.http import HttpEndpoint
    from pagedserve.rpc.server import Server, keepalive_options
    from pagedserve.rpc.tls import ServerTls
    from pagedserve.telemetry import RequestTracer, configure_tracing
    from pagedserve.worker.processes import StartupError

    try:
        provider = configure_tracing(settings.otlp_traces_endpoint, settings.traces_exporter)
    except (ValueError, RuntimeError) as exc:  # an unknown exporter or protocol, a missing exporter package
        raise SettingsError(str(exc)) from None
    tracer = RequestTracer(provider, settings.served_model_name or "")
    try:  # checked with the settings already: this fails only for files rewritten since
        tls = ServerTls(settings.tls_files) if settings.tls_files.paths else None
    except ValueError as exc:
        raise config_error(exc, flags) from None
    # Under a launcher build the engine before binding anything (see above). Otherwise open the
    # ports first, so probes see a live (not ready) server while the weights load.
    try:
        startup.llm = await in_torch_thread(LLMEngine.from_settings, settings) if under_launcher else None
    except ValueError as exc:  # what only the model can tell: its path, its context length
        raise config_error(exc, flags) from None
    server = Server(
        tracer,
        keepalive_options(settings.grpc_keepalive_time, settings.grpc_keepalive_timeout),
        settings.stream_write_timeout,
        settings.allow_runtime_lora_updating,
        settings.auto_tool_call_parser,
        settings.reasoning_parser,
        settings.api_key,
    )
    levels = PriorityLevels(settings.triton_priority_levels, settings.triton_default_priority_level)
    model = LLMModel(server, levels)
    shared_memory = SharedMemory(settings.allow_client_shm)  # one registry for gRPC and REST
    add_inference_service(server.grpc, model, shared_memory)
    server.services.append(INFERENCE_SERVICE)
    http = HttpEndpoint(server, rest_routes(model, shared_memory))
    try:
        return await _run(server, http, tls, startup, settings, flags, stop or catch_stop_signals())
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
        shared_memory.close()  # (the clients' shared memory objects stay: theirs to unlink)


async def _run(
    server: Server,
    http: HttpEndpoint,
    tls: ServerTls | None,
    startup: _Startup,
    settings: ServeSettings,
    flags: set[str],
    stop: asyncio.Event,
) -> int:
    """Bind, start (load the model unless built already, warm up) unless stopped first, serve until
    drained; the exit code."""
    from pagedserve.rpc.server import run_until_signalled

    credentials = tls.grpc_credentials() if tls else None
    if settings.uds is not None:
        try:
            grpc_address = _free_unix_socket(settings.uds)
            server.add_port(grpc_address, credentials)
        except OSError as exc:
            raise SettingsError(f"{setting_source('uds', flags)}: {exc}") from None
    else:
        address = f"{setting_source('host', flags)}, {setting_source('port', flags)}"
        try:
            port = server.add_port(f"{settings.host}:{settings.port}", credentials)
        except OSError as exc:
            raise SettingsError(f"{address}: {exc}") from None
        grpc_address = f"{settings.host}:{port}"
    try:
        http_port = (
            await http.start(settings.host, settings.http_port, tls.http_context() if tls else None)
            if settings.http_port >= 0
            else None
        )
    except OSError as exc:
        raise SettingsError(f"{setting_source('http_port', flags)}: {exc}") from None
    await server.open()
    https = "HTTPS" if tls and http_port is not None else "HTTP"
    security = f" ({tls.mode})" if tls else ""
    logger.info(
        "gRPC on %s, %s%s: live; loading the model",
        grpc_address,
        f"{https} on {settings.host}:{http_port}" if http_port is not None else "HTTP off",
        security,
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
        "pagedserve ready: gRPC %s (pagedserve.rpc.v1.Generation, inference.GRPCInferenceService, "
        "grpc.health.v1, reflection), %s KServe v2 REST%s, model %r",
        grpc_address,
        https,
        security,
        llm.config.model.served_model_name,
    )
    return await run_until_signalled(server, settings.shutdown_timeout, stop)


def _free_unix_socket(path: str) -> str:
    """The gRPC address of a Unix socket at `path` once it is free to bind: absent, or a socket nobody
    answers on (a server's that was killed), which gRPC replaces. Anything else is an OSError saying
    what holds the path: gRPC would replace a live server's socket without a word, and both servers
    would run with the first one cut off from new clients."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise OSError(f"{path}: no directory {folder}")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return f"unix:{path}"
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)  # (a listener whose backlog is full: held, not refused)
        try:
            probe.connect(path)
        except ConnectionRefusedError:  # left by a server gone
            return f"unix:{path}"
    raise OSError(f"{path}: a server already listens on it")


async def _start(server: Server, startup: _Startup, settings: ServeSettings, flags: set[str]) -> LLMEngine:
    """Load the model (unless built already), bind it to the server and warm up: the engine, ready."""
    from pagedserve.engine.async_engine import AsyncEngine, in_torch_thread
    from pagedserve.engine.core_process import EngineFace
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.errors import InvalidRequestError

    if startup.llm is None:
        build = EngineFace.from_settings if settings.engine_process else LLMEngine.from_settings
        try:
            startup.llm = await in_torch_thread(build, settings)
        except asyncio.CancelledError:  # the load itself cannot be cancelled: it goes on in its thread
            startup.load_abandoned = True
            raise
        except ValueError as exc:
            raise config_error(exc, flags) from None
    llm = startup.llm
    freeze_startup_heap()
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


def freeze_startup_heap() -> None:
    """Take what start-up built (the model's modules, compiled code, the tokenizer: ~600,000-800,000
    objects for the default model) out of the garbage collector's scans. Otherwise a full collection
    walks all of it, ~0.3-0.5 s holding the GIL with every stream and the engine stopped, whenever
    objects surviving into the oldest generation since the last one number a quarter of it (CPython's
    rule). Frozen objects are still freed when their last reference goes; cycles among them would
    stay, and a `serve` process builds one engine. After the model loads and before the warm-up."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "start-up heap frozen: %d objects out of the garbage collector's scans (a full collection took %.0f ms)",
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1e3,
    )
