"""TLS and mutual TLS on both ports (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs), with certificates
made here by a throwaway CA: bad files stop `serve` with exit 2 naming the flag before a model loads;
our gRPC API, real `tritonclient`, KServe v2 REST and /metrics work over TLS and nothing works without
it; mutual TLS refuses clients without a certificate of the configured CA on either port; rewritten
files reach new connections; `pagedserve health` answers probes over all of it.

The transport tests need no model: the real Server and HttpEndpoint bound with TLS and never given an
engine are live and not ready, for as long as a test needs (`TransportOnly`). The rest run a real
`pagedserve serve` on the tiny model."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_helpers import READINESS, ServerProcess, request
from pagedserve.__main__ import build_parser
from pagedserve.rpc.cli import ServeSettings
from pagedserve.rpc.tls import TlsFiles
from pagedserve.rpc.v1 import generate_pb2 as pb
from pagedserve.rpc.v1 import generate_pb2_grpc as pb_grpc
from pagedserve.settings import SettingsError, settings_from_args
from tls_certs import Ca, Issued, pem_key

MODEL = "tiny"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class Pki:
    """`server`/`client` from the CA the servers trust; `stranger_client` from another CA."""

    server: Issued
    client: Issued
    stranger_ca: Ca
    stranger_client: Issued


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, stranger = Ca(directory, "ca"), Ca(directory, "stranger-ca")
    return Pki(ca.issue("server"), ca.issue("client", ()), stranger, stranger.issue("stranger", ()))


def tls_flags(server: Issued, ca_certs: Path | None = None) -> list[str]:
    flags = ["--ssl-certfile", str(server.cert), "--ssl-keyfile", str(server.key)]
    return flags + (["--ssl-ca-certs", str(ca_certs)] if ca_certs else [])


# -- clients ----------------------------------------------------------------------------------------------


def tls_channel(port: int, ca: Path, client: Issued | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials)


def health_check(channel: grpc.Channel, service: str = "") -> int | grpc.StatusCode:
    """The health status, or the call's status code when it failed."""
    try:
        return int(
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            .status
        )
    except grpc.RpcError as exc:
        return exc.code()


def client_context(ca: Path, client: Issued | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


def https(
    port: int, path: str, context: ssl.SSLContext | None, body: dict[str, Any] | None = None
) -> tuple[int, str]:
    """(status, body) of a GET (a POST with a JSON `body`) through aiohttp; its exception when refused."""

    async def call() -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=60)
        scheme = "https" if context is not None else "http"
        url = f"{scheme}://127.0.0.1:{port}{path}"
        async with aiohttp.ClientSession(timeout=timeout) as session:
            method = (
                session.get(url, ssl=context) if body is None else session.post(url, json=body, ssl=context)
            )
            async with method as reply:
                return reply.status, await reply.text()

    return asyncio.run(call())


def peer_certificate(port: int, ca: Path, client: Issued | None = None, alpn: str | None = None) -> bytes:
    """The certificate a new connection to `port` is given (DER)."""
    context = client_context(ca, client)
    if alpn:
        context.set_alpn_protocols([alpn])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return der


def run_health(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pagedserve", "health", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def assert_health(done: subprocess.CompletedProcess[str], code: int, says: str = "") -> None:
    assert done.returncode == code, done.stderr
    if code == 0:
        assert done.stderr == "", done.stderr
    else:
        assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr, done.stderr


# -- settings: every bad one exits 2 naming its flag, before a model loads -------------------------------


# (flags, the flag the error must name); {cert} and {key} are the server's, {ca} its CA's
BAD_SETTINGS = {
    "certfile-without-keyfile": (["--ssl-certfile", "{cert}"], "--ssl-keyfile"),
    "keyfile-without-certfile": (["--ssl-keyfile", "{key}"], "--ssl-certfile"),
    "ca-certs-without-both": (["--ssl-ca-certs", "{ca}"], "--ssl-ca-certs"),
    "certfile-missing": (["--ssl-certfile", "{tmp}/absent.crt", "--ssl-keyfile", "{key}"], "--ssl-certfile"),
    "certfile-empty-path": (["--ssl-certfile", "", "--ssl-keyfile", "{key}"], "--ssl-certfile"),
    "keyfile-a-directory": (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{tmp}"], "--ssl-keyfile"),
    "certfile-not-pem": (["--ssl-certfile", "{junk}", "--ssl-keyfile", "{key}"], "--ssl-certfile"),
    "certfile-a-key": (["--ssl-certfile", "{key}", "--ssl-keyfile", "{key}"], "--ssl-certfile"),
    "keyfile-not-pem": (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{junk}"], "--ssl-keyfile"),
    "keyfile-a-certificate": (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{cert}"], "--ssl-keyfile"),
    "keyfile-of-another-certificate": (
        ["--ssl-certfile", "{cert}", "--ssl-keyfile", "{client_key}"],
        "--ssl-keyfile",
    ),
    "keyfile-encrypted": (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{encrypted}"], "--ssl-keyfile"),
    "ca-certs-missing": (
        ["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{tmp}/absent.crt"],
        "--ssl-ca-certs",
    ),
    "ca-certs-not-pem": (
        ["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{junk}"],
        "--ssl-ca-certs",
    ),
}


def bad_flags(case: str, pki: Pki, tmp: Path) -> tuple[list[str], str]:
    junk, encrypted = tmp / "junk.pem", tmp / "encrypted.key"
    junk.write_text("not PEM at all\n")
    key = serialization.load_pem_private_key(pki.server.key.read_bytes(), password=None)
    encrypted.write_bytes(pem_key(key, b"secret"))
    paths = {"cert": pki.server.cert, "key": pki.server.key, "ca": pki.server.ca, "tmp": tmp}
    paths.update(client_key=pki.client.key, junk=junk, encrypted=encrypted)
    flags, named = BAD_SETTINGS[case]
    return [flag.format(**paths) for flag in flags], named


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_a_bad_tls_setting_is_a_settings_error_naming_the_flag(pki: Pki, tmp_path: Path, case: str) -> None:
    flags, named = bad_flags(case, pki, tmp_path)
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(SettingsError) as info:
        settings_from_args(ServeSettings, args)
    # a flag left out is named with its variable: `--ssl-keyfile / PAGEDSERVE_SSL_KEYFILE: ...`
    assert re.match(rf"{named}( / PAGEDSERVE_SSL_\w+)?: \S", str(info.value)), str(info.value)
    assert "\n" not in str(info.value)


def test_tls_settings_from_the_environment_are_checked_and_named_as_variables(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_SSL_CERTFILE", str(pki.server.cert))
    monkeypatch.setenv("PAGEDSERVE_SSL_KEYFILE", str(pki.client.key))
    with pytest.raises(SettingsError, match=r"^PAGEDSERVE_SSL_KEYFILE: .* is not the key of the certificate"):
        settings_from_args(ServeSettings, build_parser().parse_args(["serve"]))
    monkeypatch.setenv("PAGEDSERVE_SSL_KEYFILE", str(pki.server.key))
    monkeypatch.setenv("PAGEDSERVE_SSL_CA_CERTS", str(pki.server.ca))
    settings = settings_from_args(ServeSettings, build_parser().parse_args(["serve"]))
    assert settings.tls_files == TlsFiles(str(pki.server.cert), str(pki.server.key), str(pki.server.ca))


@pytest.mark.slow
def test_a_bad_tls_setting_exits_2_before_the_model_loads(pki: Pki, tmp_path: Path) -> None:
    """The model path does not exist: only a check made before loading it can name the TLS flag."""
    flags, _ = bad_flags("keyfile-of-another-certificate", pki, tmp_path)
    command = [sys.executable, "-m", "pagedserve", "serve", "--model", str(tmp_path / "no-model"), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pagedserve serve: error: --ssl-keyfile: "), last_line
    assert "Traceback" not in done.stderr and "live; loading the model" not in done.stderr, done.stderr


# -- the transport alone: a live, never ready server ---------------------------------------------------


class TransportOnly:
    """`pagedserve serve`'s gRPC server and HTTP endpoint, bound (with TLS unless `files` is None) and
    opened as the CLI does, never given an engine: liveness SERVING, readiness NOT_SERVING."""

    def __init__(self, files: TlsFiles | None) -> None:
        from pagedserve.rpc.tls import ServerTls

        self.tls = ServerTls(files) if files is not None else None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="transport-only", daemon=True)

    def __enter__(self) -> TransportOnly:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)

    async def _start(self) -> None:
        from pagedserve.rpc.http import HttpEndpoint
        from pagedserve.rpc.server import Server

        self.server = Server()
        credentials = self.tls.grpc_credentials() if self.tls else None
        self.port = self.server.add_port("127.0.0.1:0", credentials)
        self.http = HttpEndpoint(self.server)
        self.http_port = await self.http.start("127.0.0.1", 0, self.tls.http_context() if self.tls else None)
        await self.server.open()

    async def _stop(self) -> None:
        await self.http.stop()
        await self.server.stop(grace=0)


@pytest.mark.slow
def test_a_plaintext_client_of_a_tls_port_is_refused_at_once_and_the_server_keeps_serving(pki: Pki) -> None:
    with TransportOnly(TlsFiles(str(pki.server.cert), str(pki.server.key))) as srv:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as plain:
            assert health_check(plain) == grpc.StatusCode.UNAVAILABLE  # not DEADLINE_EXCEEDED: refused
        with pytest.raises(aiohttp.ClientError):
            https(srv.http_port, "/health/live", None)
        with tls_channel(srv.port, pki.server.ca) as channel:
            assert health_check(channel) == SERVING
            assert health_check(channel, READINESS) == NOT_SERVING
        assert https(srv.http_port, "/health/live", client_context(pki.server.ca)) == (200, "ok\n")
        assert peer_certificate(srv.port, pki.server.ca, alpn="h2") == pki.server.der()


@pytest.mark.slow
def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca_on_both_ports(pki: Pki) -> None:
    with TransportOnly(TlsFiles(str(pki.server.cert), str(pki.server.key), str(pki.server.ca))) as srv:
        for client in (None, pki.stranger_client):
            with tls_channel(srv.port, pki.server.ca, client) as channel:
                assert health_check(channel) == grpc.StatusCode.UNAVAILABLE, client
            with pytest.raises(aiohttp.ClientError):
                https(srv.http_port, "/health/live", client_context(pki.server.ca, client))
        with tls_channel(srv.port, pki.server.ca, pki.client) as channel:
            assert health_check(channel) == SERVING
        assert https(srv.http_port, "/health/live", client_context(pki.server.ca, pki.client)) == (
            200,
            "ok\n",
        )


# -- rotation: files rewritten in place reach new connections ------------------------------------------


@pytest.mark.slow
def test_rewritten_files_reach_new_connections_on_both_ports(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As cert-manager renews: a new server certificate from a new CA, and (mutual TLS) client
    certificates of the new CA only. Connections already open keep going; files that do not fit
    together yet (the certificate rewritten before its key) leave the last good ones serving."""
    live = tmp_path / "live"
    live.mkdir()
    files = TlsFiles(str(live / "tls.crt"), str(live / "tls.key"), str(live / "ca.crt"))

    def install(server: Issued, ca: Path, key: Path | None = None) -> None:
        shutil.copyfile(server.cert, files.certfile)
        shutil.copyfile(key or server.key, files.keyfile)
        shutil.copyfile(ca, files.ca_certs)

    install(pki.server, pki.server.ca)
    new_ca = Ca(tmp_path, "renewed-ca")
    new_server, new_client = new_ca.issue("renewed-server"), new_ca.issue("renewed-client", ())
    caplog.set_level(logging.INFO, logger="pagedserve.rpc.tls")
    with TransportOnly(files) as srv, tls_channel(srv.port, pki.server.ca, pki.client) as opened:
        assert health_check(opened) == SERVING  # its connection is open from now on
        install(new_server, new_ca.path)
        for port, alpn in ((srv.port, "h2"), (srv.http_port, None)):
            assert peer_certificate(port, new_ca.path, new_client, alpn) == new_server.der()
        with tls_channel(srv.port, new_ca.path, new_client) as channel:
            assert health_check(channel) == SERVING
        with tls_channel(srv.port, new_ca.path, pki.client) as channel:  # the old CA's client: refused
            assert health_check(channel) == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(aiohttp.ClientError):
            https(srv.http_port, "/health/live", client_context(new_ca.path, pki.client))
        assert https(srv.http_port, "/health/live", client_context(new_ca.path, new_client)) == (200, "ok\n")
        assert health_check(opened) == SERVING  # the connection opened before the rewrite

        third = new_ca.issue("third-server")
        install(third, new_ca.path, key=new_server.key)  # the certificate is new, its key not yet
        for _ in range(3):
            for port, alpn in ((srv.port, "h2"), (srv.http_port, None)):
                assert peer_certificate(port, new_ca.path, new_client, alpn) == new_server.der()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "is not the key of the certificate" in warnings[0].getMessage(), (
            warnings
        )
        shutil.copyfile(third.key, files.keyfile)
        for port, alpn in ((srv.port, "h2"), (srv.http_port, None)):
            assert peer_certificate(port, new_ca.path, new_client, alpn) == third.der()


# -- `pagedserve health` -------------------------------------------------------------------------------


@pytest.mark.slow
def test_health_answers_for_a_plaintext_server(pki: Pki) -> None:
    with TransportOnly(None) as srv:
        address = f"127.0.0.1:{srv.port}"
        assert_health(run_health("--address", address), 0)
        assert_health(run_health("--address", address, "--service", READINESS), 1, "NOT_SERVING")
        assert_health(run_health("--address", address, "--service", "no.such.Service"), 1, "NOT_FOUND")
        assert_health(
            run_health("--address", address, "--ssl-ca-certs", str(pki.server.ca)), 1, "UNAVAILABLE"
        )
    assert_health(run_health("--address", address, "--timeout", "3"), 1, "UNAVAILABLE")  # closed now


@pytest.mark.slow
def test_health_over_tls_verifies_the_server(pki: Pki, tmp_path: Path) -> None:
    named = pki.stranger_ca.issue("named-server", hosts=("pagedserve.example",))
    with TransportOnly(TlsFiles(str(pki.server.cert), str(pki.server.key))) as srv:
        address, ca = f"127.0.0.1:{srv.port}", str(pki.server.ca)
        assert_health(run_health("--address", address, "--ssl-ca-certs", ca), 0)
        assert_health(run_health("--address", f"localhost:{srv.port}", "--ssl-ca-certs", ca), 0)
        assert_health(
            run_health("--address", address, "--ssl-ca-certs", ca, "--service", READINESS), 1, "NOT_SERVING"
        )
        wrong_ca = str(pki.stranger_ca.path)
        assert_health(run_health("--address", address, "--ssl-ca-certs", wrong_ca), 1, "UNAVAILABLE")
        assert_health(run_health("--address", address), 1, "UNAVAILABLE")  # plaintext
    with TransportOnly(TlsFiles(str(named.cert), str(named.key))) as srv:
        address, ca = f"127.0.0.1:{srv.port}", str(named.ca)
        assert_health(run_health("--address", address, "--ssl-ca-certs", ca), 1, "UNAVAILABLE")
        assert_health(
            run_health("--address", address, "--ssl-ca-certs", ca, "--ssl-target-name", "pagedserve.example"),
            0,
        )


@pytest.mark.slow
def test_health_under_mutual_tls_presents_its_certificate(pki: Pki) -> None:
    with TransportOnly(TlsFiles(str(pki.server.cert), str(pki.server.key), str(pki.server.ca))) as srv:
        base = ["--address", f"127.0.0.1:{srv.port}", "--ssl-ca-certs", str(pki.server.ca)]
        assert_health(
            run_health(*base, "--ssl-certfile", str(pki.client.cert), "--ssl-keyfile", str(pki.client.key)), 0
        )
        assert_health(run_health(*base), 1, "UNAVAILABLE")
        stranger = [
            "--ssl-certfile",
            str(pki.stranger_client.cert),
            "--ssl-keyfile",
            str(pki.stranger_client.key),
        ]
        assert_health(run_health(*base, *stranger), 1, "UNAVAILABLE")


@pytest.mark.slow
def test_health_gives_up_at_its_timeout_on_a_server_that_never_answers() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does), never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        done = run_health("--address", f"127.0.0.1:{silent.getsockname()[1]}", "--timeout", "2", timeout=30)
    assert_health(done, 1, "DEADLINE_EXCEEDED")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--ssl-certfile", "{client.cert}"], "--ssl-keyfile"),
        (["--ssl-ca-certs", "{tmp}/absent.crt"], "--ssl-ca-certs"),
        (["--ssl-certfile", "{client.cert}", "--ssl-keyfile", "{server.key}"], "--ssl-keyfile"),
        (["--timeout", "0"], "--timeout"),
        (["--timeout", "nan"], "--timeout"),
    ],
    ids=["certfile-without-keyfile", "ca-missing", "key-mismatch", "timeout-0", "timeout-nan"],
)
def test_health_with_bad_flags_exits_2_naming_the_flag(
    pki: Pki, tmp_path: Path, flags: list[str], named: str
) -> None:
    args = [f.format(client=pki.client, server=pki.server, tmp=tmp_path) for f in flags]
    done = run_health("--address", "127.0.0.1:1", *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith(f"pagedserve health: error: {named}: "), done.stderr


@pytest.mark.slow
def test_health_imports_no_torch() -> None:
    """What an exec probe runs every few seconds: no seconds of torch import."""
    code = "import sys; from pagedserve.__main__ import main; main(sys.argv[1:]); print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    done = subprocess.run(
        [sys.executable, "-c", code, "health", "--address", "127.0.0.1:1", "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


# -- a real `pagedserve serve` over TLS ----------------------------------------------------------------


def serve_tls(model_dir: str, log: Path, flags: list[str], ca: Path, client: Issued | None) -> ServerProcess:
    proc = ServerProcess(
        "--model", model_dir, "--dtype", "float32", "--served-model-name", MODEL, *flags, log=log
    )
    deadline = time.monotonic() + 180
    with tls_channel(proc.port, ca, client) as channel:
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.proc.returncode}:\n{log.read_text()[-3000:]}")
            if health_check(channel, READINESS) == SERVING:
                return proc
            time.sleep(0.1)
    proc.stop()
    raise TimeoutError(f"server not ready:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def tls_server(
    tiny_llama_dir: str, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tls-server") / "server.log"
    proc = serve_tls(tiny_llama_dir, log, tls_flags(pki.server), pki.server.ca, None)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def mtls_server(
    tiny_llama_dir: str, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("mtls-server") / "server.log"
    proc = serve_tls(tiny_llama_dir, log, tls_flags(pki.server, pki.server.ca), pki.server.ca, pki.client)
    yield proc
    proc.stop()


def generate(channel: grpc.Channel) -> list[pb.GenerateResponse]:
    return list(pb_grpc.GenerationStub(channel).Generate(request("Hello", max_tokens=6), timeout=60))


def triton_text(port: int, ca: Path, client: Issued | None = None) -> str:
    keys = {"private_key": str(client.key), "certificate_chain": str(client.cert)} if client else {}
    with tgrpc.InferenceServerClient(
        f"127.0.0.1:{port}", ssl=True, root_certificates=str(ca), **keys
    ) as triton:
        assert triton.is_server_ready()
        text = tgrpc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
        params = tgrpc.InferInput("sampling_parameters", [1], "BYTES")
        params.set_data_from_numpy(np.array([b'{"max_tokens": 4, "temperature": 0}'], dtype=object))
        return str(triton.infer(MODEL, [text, params]).as_numpy("text_output")[0].decode())


KSERVE_GENERATE = {"text_input": "Hello", "parameters": {"max_tokens": 4, "temperature": 0}}


@pytest.mark.slow
def test_serve_over_tls_streams_tokens_and_refuses_plaintext(tls_server: ServerProcess, pki: Pki) -> None:
    with tls_channel(tls_server.port, pki.server.ca) as channel:
        responses = generate(channel)
        assert len(responses) > 1 and sum(len(r.token_ids) for r in responses) == 6
        assert responses[-1].finish_reason == pb.LENGTH
    with grpc.insecure_channel(f"127.0.0.1:{tls_server.port}") as plain:
        assert health_check(plain) == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            generate(plain)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with tls_channel(tls_server.port, pki.server.ca) as channel:
        assert health_check(channel, READINESS) == SERVING  # still serving
    log = tls_server.log.read_text()
    live = f"gRPC on 127.0.0.1:{tls_server.port}, HTTPS on 127.0.0.1:{tls_server.http_port} (TLS): live"
    assert live in log and "HTTPS KServe v2 REST (TLS)" in log, log
    # gRPC core's INFO line for each refused handshake would let any scanner fill the log
    assert "Handshake failed" not in log, log


@pytest.mark.slow
def test_tritonclient_kserve_rest_and_metrics_over_tls(tls_server: ServerProcess, pki: Pki) -> None:
    assert triton_text(tls_server.port, pki.server.ca).startswith("Hello")
    context = client_context(pki.server.ca)
    status, body = https(tls_server.http_port, f"/v2/models/{MODEL}/generate", context, KSERVE_GENERATE)
    assert status == 200 and '"text_output"' in body, body
    status, body = https(tls_server.http_port, "/metrics", context)
    assert status == 200 and "vllm:request_success_total" in body
    with pytest.raises(aiohttp.ClientError):
        https(tls_server.http_port, "/metrics", None)


@pytest.mark.slow
def test_health_against_a_tls_server(tls_server: ServerProcess, pki: Pki) -> None:
    base = ["--address", f"127.0.0.1:{tls_server.port}", "--ssl-ca-certs", str(pki.server.ca)]
    assert_health(run_health(*base, "--service", READINESS), 0)
    assert_health(run_health(*base[:2], "--service", READINESS), 1, "UNAVAILABLE")


@pytest.mark.slow
def test_serve_under_mutual_tls_serves_only_clients_of_its_ca(mtls_server: ServerProcess, pki: Pki) -> None:
    for client in (None, pki.stranger_client):
        with tls_channel(mtls_server.port, pki.server.ca, client) as channel:
            with pytest.raises(grpc.RpcError) as info:
                generate(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(aiohttp.ClientError):
            https(mtls_server.http_port, "/metrics", client_context(pki.server.ca, client))
    with tls_channel(mtls_server.port, pki.server.ca, pki.client) as channel:
        assert sum(len(r.token_ids) for r in generate(channel)) == 6
    assert triton_text(mtls_server.port, pki.server.ca, pki.client).startswith("Hello")
    context = client_context(pki.server.ca, pki.client)
    assert https(mtls_server.http_port, "/metrics", context)[0] == 200
    status, body = https(mtls_server.http_port, f"/v2/models/{MODEL}/generate", context, KSERVE_GENERATE)
    assert status == 200 and '"text_output"' in body, body
    client = ["--ssl-certfile", str(pki.client.cert), "--ssl-keyfile", str(pki.client.key)]
    base = ["--address", f"127.0.0.1:{mtls_server.port}", "--ssl-ca-certs", str(pki.server.ca)]
    assert_health(run_health(*base, *client, "--service", READINESS), 0)
    assert_health(run_health(*base, "--service", READINESS), 1, "UNAVAILABLE")
    assert f"HTTPS on 127.0.0.1:{mtls_server.http_port} (mutual TLS): live" in mtls_server.log.read_text()
