"""The `pagedserve serve` flags the chart derives from values: the grace period covers preStop plus the
shutdown timeout the server really ends up with, and server.extraArgs cannot override those flags."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
from deploy_helpers import parse_serve_args, parse_serve_container, prestop_sleep_seconds, render

STORAGE_URI = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"


def render_mode(mode: str, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if mode == "kserve":
        values = {"mode": "kserve", "kserve": {"storageUri": STORAGE_URI}, **values}
    return render(values)


def server_pod(mode: str, objects: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """(server container, terminationGracePeriodSeconds of the pods that run it)."""
    if mode == "kserve":
        [container] = objects["ServingRuntime"]["spec"]["containers"]
        return container, objects["InferenceService"]["spec"]["predictor"]["terminationGracePeriodSeconds"]
    spec = objects["Deployment"]["spec"]["template"]["spec"]
    [container] = spec["containers"]
    return container, spec["terminationGracePeriodSeconds"]


GRACE_CASES = [
    ("deployment", {}),
    ("deployment", {"server": {"shutdownTimeout": 120}, "lifecycle": {"preStopSleepSeconds": 30}}),
    ("deployment", {"server": {"shutdownTimeout": 0}, "lifecycle": {"preStopSleepSeconds": 0}}),
    (
        "deployment",
        {
            "server": {"shutdownTimeout": 60},
            "lifecycle": {"preStopSleepSeconds": 10, "terminationGracePeriodSeconds": 70},
        },
    ),
    # The server reads PAGEDSERVE_SHUTDOWN_TIMEOUT too, but the chart's flag takes precedence.
    (
        "deployment",
        {
            "server": {"extraArgs": ["--max-model-len=4096", "--no-warmup"]},
            "env": [{"name": "PAGEDSERVE_SHUTDOWN_TIMEOUT", "value": "600"}],
        },
    ),
    ("kserve", {}),
    ("kserve", {"server": {"shutdownTimeout": 300, "tensorParallelSize": 2}}),
    ("kserve", {"lifecycle": {"preStopSleepSeconds": 5, "terminationGracePeriodSeconds": 35}}),
    (
        "kserve",
        {
            "server": {"extraArgs": ["--dtype=bfloat16"]},
            "env": [{"name": "PAGEDSERVE_SHUTDOWN_TIMEOUT", "value": "600"}],
        },
    ),
]


@pytest.mark.parametrize(("mode", "values"), GRACE_CASES)
def test_grace_period_covers_prestop_and_the_parsed_shutdown_timeout(
    mode: str, values: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    container, grace = server_pod(mode, render_mode(mode, values))
    drain = parse_serve_container(container, monkeypatch).shutdown_timeout
    assert drain == values.get("server", {}).get("shutdownTimeout", 30)
    assert grace >= prestop_sleep_seconds(container) + drain


@pytest.mark.parametrize("mode", ["deployment", "kserve"])
def test_by_default_pods_sleep_before_draining(mode: str) -> None:
    """Endpoints drop the pod during preStop; only then does SIGTERM start the drain."""
    container, _ = server_pod(mode, render_mode(mode, {}))
    assert prestop_sleep_seconds(container) > 0
    assert parse_serve_args(container["args"]).shutdown_timeout > 0


# (server.extraArgs, the argument that overrides, the settings field it overrides, the value to set instead)
OVERRIDES = [
    (["--shutdown-timeout=300"], "--shutdown-timeout=300", "shutdown_timeout", "server.shutdownTimeout"),
    (["--shutdown-timeout", "300"], "--shutdown-timeout", "shutdown_timeout", "server.shutdownTimeout"),
    (["--shutdown=300"], "--shutdown=300", "shutdown_timeout", "server.shutdownTimeout"),  # abbreviated
    (
        ["--tensor-parallel-size=4"],
        "--tensor-parallel-size=4",
        "tensor_parallel_size",
        "server.tensorParallelSize",
    ),
    (["--dtype=bfloat16", "--tensor", "4"], "--tensor", "tensor_parallel_size", "server.tensorParallelSize"),
    (["--port=9001"], "--port=9001", "port", "server.grpcPort"),
    (["--http-port=9000"], "--http-port=9000", "http_port", "server.httpPort"),
    (["--model=/elsewhere"], "--model=/elsewhere", "model", "model.path"),
    (["--served-model-name", "other"], "--served-model-name", "served_model_name", "model.servedModelName"),
]


@pytest.mark.parametrize("mode", ["deployment", "kserve"])
@pytest.mark.parametrize(("extra_args", "culprit", "field", "value_name"), OVERRIDES)
def test_extra_args_cannot_override_flags_the_chart_sets(
    mode: str, extra_args: list[str], culprit: str, field: str, value_name: str
) -> None:
    container, _ = server_pod(mode, render_mode(mode, {}))
    chart_settings = parse_serve_args(container["args"])
    overridden = parse_serve_args([*container["args"], *extra_args])
    assert getattr(overridden, field) != getattr(chart_settings, field), "the parser's last flag wins"

    message = rf'server\.extraArgs: "{re.escape(culprit)}" overrides .*set {re.escape(value_name)} instead'
    with pytest.raises(helm.HelmRenderError, match=message):
        render_mode(mode, {"server": {"extraArgs": extra_args}})


@pytest.mark.parametrize("mode", ["deployment", "kserve"])
def test_extra_args_for_other_flags_reach_the_server(mode: str) -> None:
    extra_args = ["--max-model-len=4096", "--host", "::", "--otlp-traces-endpoint=http://otel:4317"]
    container, _ = server_pod(mode, render_mode(mode, {"server": {"extraArgs": extra_args}}))
    settings = parse_serve_args(container["args"])
    assert (settings.max_model_len, settings.host) == (4096, "::")
    assert settings.otlp_traces_endpoint == "http://otel:4317"
