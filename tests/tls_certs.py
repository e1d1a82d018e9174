"""A throwaway PKI for TLS tests: a CA (`Ca`) that issues server and client certificates into a
directory, as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    ca: Path  # the issuing CA's certificate

    def der(self) -> bytes:
        return x509.load_pem_x509_certificate(self.cert.read_bytes()).public_bytes(serialization.Encoding.DER)


class Ca:
    def __init__(self, directory: Path, name: str) -> None:
        self.directory, self.name = directory, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(name)
        builder = _builder(subject, subject, self.key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        self.cert = builder.sign(self.key, hashes.SHA256())
        self.path = directory / f"{name}.crt"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self, stem: str, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), client_too: bool = False
    ) -> Issued:
        """A server certificate for `hosts`, or a client certificate when `hosts` is empty; with
        `client_too` a server certificate that may also authenticate a client (as a pod's own
        certificate does when its probes present it under mutual TLS)."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(_name(stem), self.cert.subject, key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if hosts else []
        if client_too or not hosts:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if hosts:
            names = [_general_name(host) for host in hosts]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        issued = Issued(self.directory / f"{stem}.crt", self.directory / f"{stem}.key", self.path)
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(pem_key(key))
        return issued


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key: Any) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def pem_key(key: Any, password: bytes | None = None) -> bytes:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
