"""Shared by the deployment tests: render the Helm chart with Helm's own engine (helm-python-sdk,
offline), read the Dockerfile, and check container args against the real `pagedserve serve` parser."""

from __future__ import annotations

import argparse
import functools
import shlex
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
