"""The Helm chart in its default (Deployment) mode, rendered by Helm's own engine: what reaches the
cluster and what reaches the server's command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from deploy_helpers import (
    CHART_DIR,
    LIVENESS_SERVICE,
    READINESS_SERVICE,
    TRACING_ENV,
    assert_compile_cache,
    assert_shared_memory,
    assert_tracing_reaches_server,
    by_name,
    env_names,
    parse_serve_args,
    render,
    torch_build_dirs,
)

OTLP_ENDPOINT = "http://otel-collector.observability:4317"


def server_container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["pagedserve"]
    return containers[0]


def pod_spec(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return objects["Deployment"]["spec"]["template"]["spec"]


def test_default_values_render_deployment_and_service() -> None:
    objects = render()
    assert set(objects) == {"Deployment", "Service"}
    container = server_container(objects)
    assert "command" not in container  # the image's ENTRYPOINT (`pagedserve serve`) runs
    settings = parse_serve_args(container["args"])
    assert (settings.model, settings.port, settings.http_port) == ("/mnt/models", 8001, 8000)
    assert settings.served_model_name == "demo-pagedserve"
    assert settings.tensor_parallel_size == 1

    ports = by_name(container["ports"])
    assert ports["grpc"]["containerPort"] == settings.port
    assert ports["http"]["containerPort"] == settings.http_port
    service_ports = by_name(objects["Service"]["spec"]["ports"])
    assert set(service_ports) == {"grpc", "http"}
    assert service_ports["grpc"]["port"] == 8001 and service_ports["grpc"]["targetPort"] == "grpc"
    assert service_ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert service_ports["http"]["port"] == 8000 and service_ports["http"]["targetPort"] == "http"
    assert objects["Service"]["spec"]["selector"] == objects["Deployment"]["spec"]["selector"]["matchLabels"]


def test_probes_use_grpc_health_services_on_the_grpc_port() -> None:
    container = server_container(render())
    port = parse_serve_args(container["args"]).port
    assert container["startupProbe"]["grpc"] == {"port": port, "service": READINESS_SERVICE}
    assert container["readinessProbe"]["grpc"] == {"port": port, "service": READINESS_SERVICE}
    assert container["livenessProbe"]["grpc"] == {"port": port, "service": LIVENESS_SERVICE}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loads take minutes"


def test_grace_period_follows_longer_drains_and_rejects_short_explicit_values() -> None:
    values = {"server": {"shutdownTimeout": 120}, "lifecycle": {"preStopSleepSeconds": 30}}
    objects = render(values)
    assert pod_spec(objects)["terminationGracePeriodSeconds"] >= 150
    explicit = {"lifecycle": {"terminationGracePeriodSeconds": 200}}
    assert pod_spec(render(values | explicit))["terminationGracePeriodSeconds"] == 200
    with pytest.raises(helm.HelmRenderError, match="terminationGracePeriodSeconds"):
        render({"lifecycle": {"terminationGracePeriodSeconds": 20}})


def test_default_resources_one_gpu_and_shared_memory() -> None:
    objects = render()
    container = server_container(objects)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["memory"] == "8Gi"
    assert_shared_memory(container, pod_spec(objects)["volumes"], "8Gi")


def test_tensor_parallel_two_requests_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {
        "server": {"tensorParallelSize": 2},
        "sharedMemory": {"sizeLimit": "16Gi"},
        "tracing": {"otlpEndpoint": OTLP_ENDPOINT},
    }
    objects = render(values)
    container = server_container(objects)
    assert parse_serve_args(container["args"]).tensor_parallel_size == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["memory"] == "32Gi"  # user limits kept
    assert_shared_memory(container, pod_spec(objects)["volumes"], "16Gi")
    assert_tracing_reaches_server(container, OTLP_ENDPOINT, monkeypatch)


def test_cpu_only_requests_no_gpu() -> None:
    container = server_container(render({"gpu": {"enabled": False}}))
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


def test_hpa_scales_the_deployment_on_a_server_metric() -> None:
    values = {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}}
    objects = render(values)
    hpa = objects["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": objects["Deployment"]["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "5"}
    assert "replicas" not in objects["Deployment"]["spec"]  # the HPA owns the count
    with pytest.raises(helm.HelmRenderError, match="minReplicas"):
        render({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}})


def test_service_monitor_scrapes_the_http_port() -> None:
    objects = render({"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}})
    monitor = objects["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in by_name(objects["Service"]["spec"]["ports"])
    assert endpoint["path"] == "/metrics"
    service_labels = objects["Service"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service_labels.items()


def test_otlp_endpoint_reaches_the_server_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    container = server_container(render({"tracing": {"otlpEndpoint": OTLP_ENDPOINT}}))
    assert_tracing_reaches_server(container, OTLP_ENDPOINT, monkeypatch)
    assert not TRACING_ENV & env_names(server_container(render())), "no tracing env unless asked for"


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        ({}, {"emptyDir": {"sizeLimit": "1Gi"}}),  # the default
        ({"volume": "pvc", "claimName": "builds"}, {"persistentVolumeClaim": {"claimName": "builds"}}),
        ({"volume": "none"}, None),
    ],
    ids=["emptyDir", "pvc", "none"],
)
def test_the_build_caches_live_in_a_volume_of_their_own(
    cache: dict[str, Any], volume: dict[str, Any] | None, tmp_path: Path
) -> None:
    """The C++ kernels (~40 s to build) and the compiled forward pass (~45-50 s to SERVING cold, ~18 s
    from the cache) outlive a restart of the container: emptyDir by default, a claim shared by pods.
    torch takes both directories from the env the chart sets."""
    mount_path = str(tmp_path / "cache")
    objects = render({"compileCache": {**cache, "mountPath": mount_path}})
    container = server_container(objects)
    assert_compile_cache(container, pod_spec(objects)["volumes"], volume, mount_path)
    extensions, inductor = torch_build_dirs(container)
    if volume is None:
        assert not extensions.startswith(mount_path) and not inductor.startswith(mount_path)
    else:
        assert (
            Path(extensions).parent == tmp_path / "cache" / "torch_extensions" and Path(extensions).is_dir()
        )
        assert inductor == f"{mount_path}/inductor"


def test_extra_args_and_served_model_name_reach_the_server() -> None:
    values = {
        "model": {"servedModelName": "smollm2"},
        "server": {"extraArgs": ["--max-model-len=4096", "--dtype", "bfloat16", "--no-warmup"]},
    }
    settings = parse_serve_args(server_container(render(values))["args"])
    assert (settings.served_model_name, settings.max_model_len) == ("smollm2", 4096)
    assert (settings.dtype, settings.warmup) == ("bfloat16", False)


def test_a_flag_the_server_does_not_know_fails_the_args_check() -> None:
    args = server_container(render({"server": {"extraArgs": ["--no-such-flag=1"]}}))["args"]
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        parse_serve_args(args)


def test_model_from_init_container_download() -> None:
    spec = pod_spec(render())
    [init] = spec["initContainers"]
    env = {item["name"]: item["value"] for item in init["env"]}
    assert env["MODEL_DIR"] == "/mnt/models" and env["MODEL_ID"]
    assert by_name(init["volumeMounts"])["model"]["mountPath"] == "/mnt/models"
    assert "emptyDir" in by_name(spec["volumes"])["model"]


@pytest.mark.parametrize(
    ("model", "volume"),
    [
        (
            {"source": "pvc", "pvc": {"claimName": "weights", "subPath": "llama"}},
            {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
        ),
        (
            {"source": "hostPath", "hostPath": {"path": "/data/llama"}},
            {"hostPath": {"path": "/data/llama", "type": "Directory"}},
        ),
    ],
)
def test_model_from_pvc_or_host_path(model: dict[str, Any], volume: dict[str, Any]) -> None:
    objects = render({"model": model})
    spec = pod_spec(objects)
    assert "initContainers" not in spec
    assert by_name(spec["volumes"])["model"] == {"name": "model", **volume}
    mount = by_name(server_container(objects)["volumeMounts"])["model"]
    assert mount["mountPath"] == "/mnt/models" and mount["readOnly"] is True
    assert mount.get("subPath") == model.get("pvc", {}).get("subPath")


def test_model_source_none_mounts_nothing() -> None:
    objects = render({"model": {"source": "none", "path": "/models/baked"}})
    assert "model" not in by_name(pod_spec(objects)["volumes"])
    container = server_container(objects)
    assert "model" not in by_name(container["volumeMounts"])
    assert parse_serve_args(container["args"]).model == "/models/baked"


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"replicas": -1}, "/replicas"),
        ({"server": {"tensorParallelSize": 0}}, "/server/tensorParallelSize"),
        ({"server": {"grpcPort": 0}}, "/server/grpcPort"),
        ({"server": {"shutdownTimeout": -5}}, "/server/shutdownTimeout"),
        ({"mode": "serverless"}, "/mode"),
        ({"mode": "kserve"}, "/kserve/storageUri"),
        ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
        ({"compileCache": {"volume": "pvc"}}, "/compileCache/claimName"),
        ({"compileCache": {"volume": "hostPath"}}, "/compileCache/volume"),
        ({"compileCache": {"mountPath": "cache"}}, "/compileCache/mountPath"),
        ({"replica": 2}, "replica"),  # a typo is an error, not a silently ignored key
    ],
)
def test_schema_rejects_invalid_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=where):
        render(values)


def test_helm_lint_finds_no_warnings() -> None:
    report = helm.lint(CHART_DIR, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
