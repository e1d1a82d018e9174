"""TLS for the serving ports (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs) and for `pagedserve health`:
the PEM files checked once, before anything loads, with errors naming the setting at fault; gRPC
server credentials and the HTTP port's SSLContext built from them and re-read whenever the files change
(cert-manager and Kubernetes secret volumes rewrite them in place), so every new connection gets the
current certificate without a restart. grpc is imported inside functions: `pagedserve --help` and
`pagedserve health` stay quick."""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

logger = logging.getLogger(__name__)

# (st_mtime_ns, st_ino, st_size) of each file: a rewrite in place changes the first, an atomic swap
# (a secret volume's `..data` symlink, `mv new old`) the second, even within one mtime tick.
Signature = tuple[tuple[int, int, int], ...]


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    """OpenSSL asks for a password only for an encrypted key: say so instead of prompting on a tty."""
    raise _EncryptedKey


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a certificate (chain), its key and, for mutual TLS, the CA bundle peers must be signed by."""

    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None

    @property
    def paths(self) -> list[str]:
        return [p for p in (self.certfile, self.keyfile, self.ca_certs) if p is not None]

    def signature(self) -> Signature:
        stats = [os.stat(path) for path in self.paths]
        return tuple((s.st_mtime_ns, s.st_ino, s.st_size) for s in stats)

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(certificate chain, key, CA bundle) as PEM bytes, None where not set."""
        return _read(self.certfile), _read(self.keyfile), _read(self.ca_certs)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The HTTP port's context (TLS 1.2 at least; client certificates required under mutual TLS).
    Raises ValueError `ssl_<setting>: what is wrong` for a bad setting: building it is the check."""
    _check_pair(files)
    if files.certfile is None or files.keyfile is None:
        raise ValueError(
            "ssl_ca_certs: mutual TLS needs the server's own --ssl-certfile and --ssl-keyfile too"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, files.certfile, files.keyfile)
    if files.ca_certs is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        _load_ca(context, files.ca_certs)
    return context


def check_client_files(files: TlsFiles) -> None:
    """A client's files (`pagedserve health`), checked as the server's: ValueError `ssl_<setting>: ...`."""
    _check_pair(files)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if files.certfile is not None and files.keyfile is not None:
        _load_chain(context, files.certfile, files.keyfile)
    if files.ca_certs is not None:
        _load_ca(context, files.ca_certs)


def _check_pair(files: TlsFiles) -> None:
    """A certificate and its key: both or neither."""
    if files.certfile is not None and files.keyfile is None:
        raise ValueError("ssl_keyfile: not set, and --ssl-certfile needs the certificate's key")
    if files.keyfile is not None and files.certfile is None:
        raise ValueError("ssl_certfile: not set, and --ssl-keyfile needs the key's certificate")


def _load_chain(context: ssl.SSLContext, certfile: str, keyfile: str) -> None:
    _check_readable("ssl_certfile", certfile)
    _check_readable("ssl_keyfile", keyfile)
    try:  # the certificate alone first, so a bad one is not blamed on the key
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=certfile)
    except ssl.SSLError:
        raise ValueError(f"ssl_certfile: {certfile} holds no PEM certificate") from None
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_password)
    except _EncryptedKey:
        raise ValueError(f"ssl_keyfile: {keyfile} is encrypted: give the key unencrypted") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"ssl_keyfile: {keyfile} is not the key of the certificate in {certfile}"
            ) from None
        raise ValueError(f"ssl_keyfile: {keyfile} holds no PEM private key") from None


def _load_ca(context: ssl.SSLContext, ca_certs: str) -> None:
    _check_readable("ssl_ca_certs", ca_certs)
    try:
        context.load_verify_locations(cafile=ca_certs)
    except ssl.SSLError:
        raise ValueError(f"ssl_ca_certs: {ca_certs} holds no PEM certificate") from None


def _check_readable(setting: str, path: str) -> None:
    try:
        _read(path)
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class _Loaded:
    """One consistent reading of the files: what each port serves until they change."""

    signature: Signature
    context: ssl.SSLContext
    pems: tuple[bytes | None, bytes | None, bytes | None]

    def grpc_config(self) -> Any:
        import grpc

        chain, key, ca = self.pems
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)


class _InFlux(Exception):
    """The files changed while being read: read them again on the next connection."""


def _load(files: TlsFiles) -> _Loaded:
    signature = files.signature()
    context = server_context(files)
    pems = files.read()
    if files.signature() != signature:
        raise _InFlux
    return _Loaded(signature, context, pems)


class ServerTls:
    """The serving ports' certificate, key and client CA, re-read when the files change. Every new
    connection asks (gRPC core's threads through the credentials' fetcher, the event loop through the
    SSLContext's handshake callback): a stat of each file, a read only after a change. Files that
    cannot be used (a key that does not match yet, mid-rotation) leave the previous ones serving, with
    one warning per change. Connections already open keep the certificate they started with, and a
    client that resumes a TLS session on the HTTP port keeps the access it had (OpenSSL's session cache
    lives in the first context; Python cannot flush it): to shut out a CA's clients at once, restart."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()  # gRPC core threads and the event loop ask at once
        self._loaded = _load(files)  # a ValueError names the setting; nothing is serving yet
        self._unusable: Signature | None = None
        self._sent_to_grpc = self._loaded

    @property
    def mode(self) -> str:
        return "mutual TLS" if self.files.ca_certs is not None else "TLS"

    def current(self) -> _Loaded:
        with self._lock:
            try:
                signature = self.files.signature()
            except OSError:  # a file missing for a moment in a rotation
                return self._loaded
            if signature in (self._loaded.signature, self._unusable):
                return self._loaded
            try:
                self._loaded = _load(self.files)
            except _InFlux:
                pass
            except (ValueError, OSError) as exc:
                self._unusable = signature
                logger.warning("TLS files changed but cannot be used; serving the previous ones: %s", exc)
            else:
                logger.info("TLS files changed: new connections get the new certificate")
            return self._loaded

    def grpc_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.dynamic_ssl_server_credentials(
            self._loaded.grpc_config(),
            self._fetch_grpc_config,
            require_client_authentication=self.files.ca_certs is not None,
        )

    def _fetch_grpc_config(self) -> Any:
        """gRPC core calls this before each new connection's handshake: None keeps what it has."""
        loaded = self.current()
        if loaded is self._sent_to_grpc:
            return None
        self._sent_to_grpc = loaded
        return loaded.grpc_config()

    def http_context(self) -> ssl.SSLContext:
        """The first context, which hands each new connection the current one while its handshake
        starts (OpenSSL calls the server-name callback for every ClientHello, with SNI or without)."""
        first = self._loaded.context

        def use_current(connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
            current = self.current().context
            if current is not context:
                connection.context = current

        first.sni_callback = use_current
        return first


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A client's: the server verified against `ca_certs` (else the system's roots), and under mutual
    TLS the certificate and key presented to it. Check the files with check_client_files first."""
    import grpc

    chain, key, ca = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
