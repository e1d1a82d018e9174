"""KServe mode of the chart (ServingRuntime + InferenceService) and the plain manifests in
charts/kserve/ for users without Helm."""

from __future__ import annotations

from typing import Any

import pytest
from deploy_helpers import (
    KSERVE_DIR,
    LIVENESS_SERVICE,
    READINESS_SERVICE,
    TRACING_ENV,
    assert_compile_cache,
    assert_shared_memory,
    assert_tracing_reaches_server,
    env_names,
    load_manifests,
    parse_serve_args,
    prestop_sleep_seconds,
    render,
)

STORAGE_URI = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"
OTLP_ENDPOINT = "http://otel-collector.observability:4317"


def render_kserve(**extra: Any) -> dict[str, dict[str, Any]]:
    return render({"mode": "kserve", "kserve": {"storageUri": STORAGE_URI}, **extra}, release="pagedserve")


def runtime_container(runtime: dict[str, Any]) -> dict[str, Any]:
    [container] = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"  # the name KServe's storage initializer targets
    return container


def plain_manifests() -> dict[str, dict[str, Any]]:
    objects = [obj for path in sorted(KSERVE_DIR.glob("*.yaml")) for obj in load_manifests(path)]
    return {obj["kind"]: obj for obj in objects}


@pytest.fixture(params=["chart", "plain"])
def kserve_objects(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    return render_kserve() if request.param == "chart" else plain_manifests()


def test_kserve_mode_renders_only_the_runtime_and_the_inference_service() -> None:
    assert set(render_kserve()) == {"ServingRuntime", "InferenceService"}


def test_runtime_serves_grpc_v2_on_a_port_named_h2c(kserve_objects: dict[str, dict[str, Any]]) -> None:
    runtime = kserve_objects["ServingRuntime"]
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert runtime["spec"]["protocolVersions"] == ["grpc-v2", "v2"]
    container = runtime_container(runtime)
    settings = parse_serve_args(container["args"])
    assert settings.model == "/mnt/models"  # where the storage initializer puts storageUri
    assert settings.served_model_name == "{{.Name}}"  # KServe fills in the InferenceService name
    first, second = container["ports"]
    assert (first["name"], first["containerPort"]) == ("h2c", settings.port)
    assert (second["name"], second["containerPort"]) == ("http", settings.http_port)
    # on the spec, which KServe copies to the predictor's pods; the object's own metadata reaches none
    annotations = runtime["spec"]["annotations"]
    assert annotations["prometheus.kserve.io/port"] == str(settings.http_port)
    assert annotations["prometheus.kserve.io/path"] == "/metrics"
    assert "prometheus.kserve.io/port" not in runtime["metadata"].get("annotations", {})


def test_runtime_probes_and_resources(kserve_objects: dict[str, dict[str, Any]]) -> None:
    container = runtime_container(kserve_objects["ServingRuntime"])
    settings = parse_serve_args(container["args"])
    assert container["startupProbe"]["grpc"] == {"port": settings.port, "service": READINESS_SERVICE}
    assert container["readinessProbe"]["grpc"] == {"port": settings.port, "service": READINESS_SERVICE}
    assert container["livenessProbe"]["grpc"] == {"port": settings.port, "service": LIVENESS_SERVICE}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == settings.tensor_parallel_size == 1
    assert_shared_memory(container, kserve_objects["ServingRuntime"]["spec"]["volumes"], "8Gi")
    assert not TRACING_ENV & env_names(container), "no tracing env unless asked for"
    volume = {"emptyDir": {"sizeLimit": "1Gi"}}
    assert_compile_cache(
        container, kserve_objects["ServingRuntime"]["spec"]["volumes"], volume, "/var/cache/pagedserve"
    )


def test_inference_service_uses_the_runtime(kserve_objects: dict[str, dict[str, Any]]) -> None:
    runtime, isvc = kserve_objects["ServingRuntime"], kserve_objects["InferenceService"]
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    model = isvc["spec"]["predictor"]["model"]
    assert model["protocolVersion"] == "grpc-v2"
    assert model["storageUri"] == STORAGE_URI
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = [f["name"] for f in runtime["spec"]["supportedModelFormats"]]
    assert model["modelFormat"]["name"] in formats


def test_inference_service_grace_period_covers_prestop_and_drain(
    kserve_objects: dict[str, dict[str, Any]],
) -> None:
    container = runtime_container(kserve_objects["ServingRuntime"])
    drain = parse_serve_args(container["args"]).shutdown_timeout
    grace = kserve_objects["InferenceService"]["spec"]["predictor"]["terminationGracePeriodSeconds"]
    assert grace >= prestop_sleep_seconds(container) + drain


def test_kserve_otlp_endpoint_reaches_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    container = runtime_container(render_kserve(tracing={"otlpEndpoint": OTLP_ENDPOINT})["ServingRuntime"])
    assert_tracing_reaches_server(container, OTLP_ENDPOINT, monkeypatch)


def test_kserve_tensor_parallel_two(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = render_kserve(
        server={"tensorParallelSize": 2},
        sharedMemory={"sizeLimit": "16Gi"},
        tracing={"otlpEndpoint": OTLP_ENDPOINT},
    )["ServingRuntime"]
    container = runtime_container(runtime)
    assert parse_serve_args(container["args"]).tensor_parallel_size == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert_shared_memory(container, runtime["spec"]["volumes"], "16Gi")
    assert_tracing_reaches_server(container, OTLP_ENDPOINT, monkeypatch)


def test_plain_manifests_match_the_chart() -> None:
    """charts/kserve/ is what the chart renders with default values (labels aside): no drift."""
    chart, plain = render_kserve(), plain_manifests()
    assert set(plain) == set(chart)
    for kind, obj in plain.items():
        assert obj["spec"] == chart[kind]["spec"], kind
        assert obj["metadata"]["name"] == chart[kind]["metadata"]["name"]
        assert obj["metadata"].get("annotations") == chart[kind]["metadata"].get("annotations")
