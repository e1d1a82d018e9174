"""Shared by the deployment tests: render the Helm chart with Helm's own engine (helm-python-sdk,
offline), read the Dockerfile, and check container args against the real `pagedserve serve` parser."""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from pagedserve.__main__ import build_parser
from pagedserve.rpc import server
from pagedserve.rpc.cli import ServeSettings
from pagedserve.settings import settings_from_args

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "pagedserve"
KSERVE_DIR = REPO / "charts" / "kserve"
DOCKERFILE = REPO / "Dockerfile"

# grpc.health.v1 service names: "" (overall health) is liveness; readiness is the server's own name
# for it, taken from the server so the chart's probes cannot drift from what it reports.
LIVENESS_SERVICE = ""
READINESS_SERVICE = server.READINESS_SERVICE


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART_DIR)


def render(values: dict[str, Any] | None = None, release: str = "demo") -> dict[str, dict[str, Any]]:
    """Rendered objects by kind (the chart renders at most one object of each kind)."""
    manifests = _chart().render(values or {}, name=release, namespace="serving")
    objects = [
        obj
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")
        for obj in yaml.safe_load_all(text)
        if obj
    ]
    by_kind = {obj["kind"]: obj for obj in objects}
    assert len(by_kind) == len(objects), [obj["kind"] for obj in objects]
    return by_kind


def load_manifests(path: Path) -> list[dict[str, Any]]:
    return [obj for obj in yaml.safe_load_all(path.read_text()) if obj]


def parse_serve_args(args: list[str]) -> ServeSettings:
    """Parse `pagedserve serve ARGS` exactly as the server would, and validate the settings."""
    try:
        namespace: argparse.Namespace = build_parser().parse_args(["serve", *args])
    except SystemExit:
        pytest.fail(f"`pagedserve serve` rejects the args {args}")
    return settings_from_args(ServeSettings, namespace)


def parse_serve_container(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> ServeSettings:
    """Settings as the server in `container` ends up with them: its args, plus the PAGEDSERVE_*
    variables of its env (and none of this test process's own)."""
    for name in [name for name in os.environ if name.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in container_env(container).items():
        if name.startswith("PAGEDSERVE_"):
            assert name.removeprefix("PAGEDSERVE_").lower() in ServeSettings.model_fields, name
            monkeypatch.setenv(name, value)
    return parse_serve_args(container["args"])


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal env values (entries with valueFrom are left out)."""
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def assert_shared_memory(container: dict[str, Any], volumes: list[dict[str, Any]], size_limit: str) -> None:
    """/dev/shm is a memory-backed emptyDir (the container runtime's default is 64 MiB, too small for
    NCCL and the tensor-parallel worker processes)."""
    assert by_name(container["volumeMounts"])["dshm"]["mountPath"] == "/dev/shm"
    assert by_name(volumes)["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": size_limit}


TRACING_ENV = {"PAGEDSERVE_OTLP_TRACES_ENDPOINT", "POD_NAME", "POD_NAMESPACE", "OTEL_RESOURCE_ATTRIBUTES"}
CACHE_ENV = ("TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR")


def env_names(container: dict[str, Any]) -> set[str]:
    return {item["name"] for item in container.get("env", [])}


def assert_compile_cache(
    container: dict[str, Any], volumes: list[dict[str, Any]], volume: dict[str, Any] | None, mount_path: str
) -> None:
    """The C++ kernels' and inductor's caches are in the compile-cache volume (`volume`, its source;
    None: no such volume, and torch's defaults)."""
    env = container_env(container)
    if volume is None:
        assert "compile-cache" not in by_name(volumes)
        assert "compile-cache" not in by_name(container["volumeMounts"])
        assert not set(CACHE_ENV) & env.keys()
        return
    assert by_name(volumes)["compile-cache"] == {"name": "compile-cache", **volume}
    mount = by_name(container["volumeMounts"])["compile-cache"]
    assert mount == {"name": "compile-cache", "mountPath": mount_path}
    assert env["TORCH_EXTENSIONS_DIR"] == f"{mount_path}/torch_extensions"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{mount_path}/inductor"


def torch_build_dirs(container: dict[str, Any]) -> list[str]:
    """Where torch, in a process with the container's env (and none of this one's cache settings),
    builds a C++ extension (made on the way, as the server's build makes it) and keeps inductor's
    cache."""
    probe = (
        "from torch.utils.cpp_extension import _get_build_directory\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "print(_get_build_directory('probe', verbose=False)); print(cache_dir())"
    )
    clean = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    run = subprocess.run(
        [sys.executable, "-c", probe],
        env={**clean, **container_env(container)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def assert_tracing_reaches_server(
    container: dict[str, Any], endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {item["name"]: item for item in container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    attributes = env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
    assert attributes == "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"
    # Kubernetes expands $(VAR) only from variables defined earlier in the list.
    names = list(env)
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert names.index("POD_NAMESPACE") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert parse_serve_container(container, monkeypatch).otlp_traces_endpoint == endpoint


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


def prestop_sleep_seconds(container: dict[str, Any]) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def dockerfile_env(path: Path = DOCKERFILE) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env
