"""The chart with `tls.secretName` (and `tls.clientAuth`): the Secret mounted where the server's flags
point, probes that speak TLS (kubelet's gRPC probes do not), a Service and ServiceMonitor that say
https, and the values that cannot work refused at install. The last test runs the chart's own server
flags and probe commands against a real server with real certificates."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from deploy_helpers import CHART_DIR, LIVENESS_SERVICE, READINESS_SERVICE, by_name, render
from ports import free_port
from tls_certs import Ca

TLS_DIR = "/etc/pagedserve/tls"
SECRET = "demo-tls"


def container_and_pod(objects: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    return pod["containers"][0], pod


def probe_services(container: dict[str, Any]) -> dict[str, str]:
    return {
        name: next(a for a in container[name]["exec"]["command"] if a.startswith("--service=")).partition(
            "="
        )[2]
        for name in ("startupProbe", "readinessProbe", "livenessProbe")
    }


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mutual-tls"])
def test_tls_mounts_the_secret_where_the_server_flags_and_probes_read_it(client_auth: bool) -> None:
    objects = render({"tls": {"secretName": SECRET, "clientAuth": client_auth}}, release="demo")
    container, pod = container_and_pod(objects)
    assert by_name(pod["volumes"])["tls"] == {"name": "tls", "secret": {"secretName": SECRET}}
    assert by_name(container["volumeMounts"])["tls"] == {
        "name": "tls",
        "mountPath": TLS_DIR,
        "readOnly": True,
    }

    args = container["args"]
    assert f"--ssl-certfile={TLS_DIR}/tls.crt" in args and f"--ssl-keyfile={TLS_DIR}/tls.key" in args
    assert (f"--ssl-ca-certs={TLS_DIR}/ca.crt" in args) == client_auth

    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in container[name], f"{name}: kubelet's gRPC probe speaks no TLS"
        command = container[name]["exec"]["command"]
        assert command[:3] == ["pagedserve", "health", "--address=127.0.0.1:8001"]
        assert f"--ssl-ca-certs={TLS_DIR}/ca.crt" in command
        assert "--ssl-target-name=demo-pagedserve.serving.svc" in command  # the Service's in-cluster name
        assert (f"--ssl-certfile={TLS_DIR}/tls.crt" in command) == client_auth
        assert (f"--ssl-keyfile={TLS_DIR}/tls.key" in command) == client_auth
        assert f"--timeout={container[name]['timeoutSeconds'] - 1}" in command  # under kubelet's
    assert probe_services(container) == {
        "startupProbe": READINESS_SERVICE,
        "readinessProbe": READINESS_SERVICE,
        "livenessProbe": LIVENESS_SERVICE,
    }

    ports = by_name(objects["Service"]["spec"]["ports"])
    assert ports["grpc"]["appProtocol"] == "https" and ports["http"]["appProtocol"] == "https"


@pytest.mark.parametrize(
    ("tls", "grpc_line", "http_line"),
    [
        ({}, "gRPC  demo-pagedserve.serving.svc:8001\n", "HTTP  demo-pagedserve.serving.svc:8000"),
        ({"secretName": SECRET}, "8001 (TLS)\n", "HTTPS demo-pagedserve.serving.svc:8000"),
        ({"secretName": SECRET, "clientAuth": True}, "8001 (TLS, client certificates required)\n", "HTTPS"),
    ],
    ids=["plain", "tls", "mutual-tls"],
)
def test_install_notes_say_how_the_ports_are_reached(
    tls: dict[str, Any], grpc_line: str, http_line: str
) -> None:
    manifests = helm.Chart.load(CHART_DIR).render({"tls": tls}, name="demo", namespace="serving")
    notes = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    assert grpc_line in notes and http_line in notes, notes


def test_server_name_overrides_the_name_the_probes_check() -> None:
    container, _ = container_and_pod(render({"tls": {"secretName": SECRET, "serverName": "llm.example.com"}}))
    assert "--ssl-target-name=llm.example.com" in container["readinessProbe"]["exec"]["command"]


def test_without_tls_nothing_changes() -> None:
    objects = render()
    container, pod = container_and_pod(objects)
    assert "tls" not in by_name(pod["volumes"]) and "tls" not in by_name(container["volumeMounts"])
    assert not [a for a in container["args"] if a.startswith("--ssl-")]
    assert container["readinessProbe"]["grpc"] == {"port": 8001, "service": READINESS_SERVICE}
    assert by_name(objects["Service"]["spec"]["ports"])["grpc"]["appProtocol"] == "kubernetes.io/h2c"


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mutual-tls"])
def test_service_monitor_scrapes_over_https(client_auth: bool) -> None:
    values = {"tls": {"secretName": SECRET, "clientAuth": client_auth}, "serviceMonitor": {"enabled": True}}
    (endpoint,) = render(values)["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    assert tls["serverName"] == "demo-pagedserve.serving.svc"
    assert tls["ca"] == {"secret": {"name": SECRET, "key": "ca.crt"}}
    if client_auth:  # Prometheus presents the pods' own certificate
        assert tls["cert"] == {"secret": {"name": SECRET, "key": "tls.crt"}}
        assert tls["keySecret"] == {"name": SECRET, "key": "tls.key"}
    else:
        assert "cert" not in tls and "keySecret" not in tls
    plain = render({"serviceMonitor": {"enabled": True}})["ServiceMonitor"]["spec"]["endpoints"][0]
    assert "scheme" not in plain and "tlsConfig" not in plain


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"clientAuth": True}}, "tls.clientAuth needs tls.secretName"),
        (
            {"mode": "kserve", "kserve": {"storageUri": "pvc://m/x"}, "tls": {"secretName": SECRET}},
            "tls.secretName is for deployment mode",
        ),
        ({"server": {"extraArgs": ["--ssl-certfile=/x.pem"]}}, "overrides --ssl-certfile.*tls.secretName"),
        ({"server": {"extraArgs": ["--ssl-ca=/ca.pem"]}}, "overrides --ssl-ca-certs.*tls.clientAuth"),
    ],
    ids=["client-auth-without-secret", "kserve-mode", "extra-certfile", "extra-ca-abbreviated"],
)
def test_tls_values_that_cannot_work_fail_the_install(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


def test_a_misspelled_tls_value_fails_the_schema() -> None:
    with pytest.raises(helm.HelmValuesError, match="clientauth"):
        render({"tls": {"secretName": SECRET, "clientauth": True}})


def probe(command: list[str], secret: Path, port: int, drop: tuple[str, ...] = ()) -> int:
    """Run a probe's exec command as the kubelet would, with the Secret's files in `secret`."""
    args = [
        a.replace(TLS_DIR, str(secret)).replace("127.0.0.1:8001", f"127.0.0.1:{port}")
        for a in command[1:]  # `pagedserve` is this interpreter's package here
        if not a.startswith(drop)
    ]
    return subprocess.run(
        [sys.executable, "-m", "pagedserve", *args], capture_output=True, timeout=30
    ).returncode


@pytest.mark.slow
@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mutual-tls"])
def test_the_charts_probes_pass_against_the_charts_server(
    client_auth: bool, tiny_llama_dir: str, tmp_path: Path
) -> None:
    """The chart's own server flags and probe commands, the Secret's files made by a CA: the server
    starts, and every probe passes once it is ready (under mutual TLS only with the pod's certificate)."""
    secret = tmp_path / "secret"
    secret.mkdir()
    issued = Ca(tmp_path, "ca").issue("pod", hosts=("demo-pagedserve.serving.svc",), client_too=True)
    for source, name in ((issued.cert, "tls.crt"), (issued.key, "tls.key"), (issued.ca, "ca.crt")):
        shutil.copy(source, secret / name)
    container, _ = container_and_pod(render({"tls": {"secretName": SECRET, "clientAuth": client_auth}}))
    port = free_port()
    args = [
        a.replace(TLS_DIR, str(secret))
        for a in container["args"]
        if not a.startswith(("--model=", "--port=", "--http-port="))
    ]
    command = [sys.executable, "-m", "pagedserve", "serve", "--model", tiny_llama_dir, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--http-port", str(free_port()), "--enforce-eager", *args]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        readiness = container["readinessProbe"]["exec"]["command"]
        deadline = time.monotonic() + 180
        # each probe is a process start: none while the log says the server is still loading
        while "pagedserve ready" not in log.read_text() or probe(readiness, secret, port) != 0:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        for name in ("startupProbe", "livenessProbe"):
            assert probe(container[name]["exec"]["command"], secret, port) == 0, name
        if client_auth:  # the same probe without the pod's certificate is refused
            assert probe(readiness, secret, port, drop=("--ssl-certfile", "--ssl-keyfile")) == 1
        assert "(mutual TLS)" in log.read_text() if client_auth else "(TLS)" in log.read_text()
    finally:
        server.terminate()
        server.wait(timeout=60)
