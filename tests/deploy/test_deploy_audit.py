"""Deployment defects found in an audit, one test each: signals reaching the server in the image, the
GPU base image matching torch's CUDA build, pod labels and annotations in KServe mode, what the model
download init container fetches, and port values the server or KServe cannot use."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from deploy_helpers import dockerfile_instructions, render
from huggingface_hub.utils import filter_repo_objects

STORAGE_URI = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"

# The CUDA version each pinned torch wheel on PyPI is built with (Linux x86_64): torch 2.13.0 requires
# cuda-toolkit==13.0.3 (its wheel metadata). Pinning another torch means looking this up again.
TORCH_CUDA = {"2.13.0": "13.0"}


def run_steps() -> list[str]:
    return [rest for keyword, rest in dockerfile_instructions() if keyword == "RUN"]


def test_entrypoint_runs_the_server_under_an_init_that_forwards_sigterm() -> None:
    """Linux drops a signal sent to a PID 1 that has no handler for it, and the server has none while
    Python starts (its handlers come right after): as PID 1 a pod deleted then would lose the SIGTERM
    and sit out the grace period. tini also reaps orphans (compiler, rank processes)."""
    [rest] = [rest for keyword, rest in dockerfile_instructions() if keyword == "ENTRYPOINT"]
    entrypoint = json.loads(rest)
    init, separator, *server = entrypoint
    assert (init, separator) == ("/usr/bin/tini", "--"), entrypoint  # Debian's tini package path
    assert server == ["pagedserve", "serve"]
    # `-g` would signal the whole process group: tensor-parallel workers killed in the middle of a drain.
    assert "-g" not in entrypoint
    [apt] = [run for run in run_steps() if "apt-get install" in run]
    assert re.search(r"\stini(\s|$)", apt), "the image must install the init it runs"


def test_gpu_base_image_cuda_matches_the_torch_build() -> None:
    """torch 2.13.0 from PyPI bundles CUDA 13.0 libraries; a CUDA 12.8 base declares (and has compat
    libraries for) 12.8, so on a node whose driver is too old for 13.0 the container started and torch
    found no usable GPU instead of the NVIDIA runtime refusing the node."""
    froms = [rest.split() for keyword, rest in dockerfile_instructions() if keyword == "FROM"]
    [image] = [words[0] for words in froms if words[-1] == "base-cuda"]
    base_cuda = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-runtime-ubuntu\d+\.\d+", image)
    assert base_cuda, image
    [torch_pin] = {pin for run in run_steps() for pin in re.findall(r"torch==([\w.]+)", run)}
    assert base_cuda.group(1) == TORCH_CUDA[torch_pin]


def test_pod_labels_and_annotations_reach_the_pods_in_both_modes() -> None:
    """In kserve mode they were dropped: KServe takes them from the predictor's labels/annotations."""
    values: dict[str, Any] = {
        "podLabels": {"team": "ml"},
        "podAnnotations": {"sidecar.istio.io/inject": "false"},
    }
    pod = render(values)["Deployment"]["spec"]["template"]["metadata"]
    assert pod["labels"]["team"] == "ml"
    assert pod["annotations"] == values["podAnnotations"]
    kserve = render({"mode": "kserve", "kserve": {"storageUri": STORAGE_URI}, **values})
    predictor = kserve["InferenceService"]["spec"]["predictor"]
    assert predictor["labels"] == values["podLabels"]
    assert predictor["annotations"] == values["podAnnotations"]


# Files of real Hugging Face repositories: Meta-Llama-3-8B-Instruct carries Meta's own checkpoint in
# original/ (another 16 GB), Mistral-7B-Instruct-v0.3 its consolidated.safetensors (another 14.5 GB,
# with names the server's loader does not know), older repositories pytorch_model*.bin copies.
SERVER_READS = {
    "config.json",
    "generation_config.json",
    "model-00001-of-00004.safetensors",
    "model-00002-of-00004.safetensors",
    "model.safetensors.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
}
UNREAD_WEIGHTS = {
    "original/consolidated.00.pth",
    "consolidated.safetensors",
    "pytorch_model-00001-of-00002.bin",
    "pytorch_model-00002-of-00002.bin",
}
REPO_FILES = [*SERVER_READS, *UNREAD_WEIGHTS, "original/params.json", "params.json"]


def test_model_download_fetches_only_what_the_server_reads(tmp_path: Path) -> None:
    """Runs the init container's command with a stand-in `huggingface_hub` that records the call,
    then filters a real repository listing with huggingface_hub's own pattern matching."""
    [init] = render()["Deployment"]["spec"]["template"]["spec"]["initContainers"]
    env = {item["name"]: item["value"] for item in init["env"]}
    stub = tmp_path / "stub" / "huggingface_hub"
    stub.mkdir(parents=True)
    record = tmp_path / "call.json"
    stub.joinpath("__init__.py").write_text(
        "import json, os\n"
        "def snapshot_download(repo_id, **kwargs):\n"
        "    with open(os.environ['RECORD'], 'w') as f:\n"
        "        json.dump({'repo_id': repo_id, **kwargs}, f)\n"
    )
    assert init["command"][0] == "python"  # the server image's venv python: run it with this one
    subprocess.run(
        [sys.executable, *init["command"][1:]],
        env={**os.environ, **env, "PYTHONPATH": str(stub.parent), "RECORD": str(record)},
        check=True,
        timeout=60,
    )
    call = json.loads(record.read_text())
    assert (call["repo_id"], call["revision"], call["local_dir"]) == (
        env["MODEL_ID"],
        env["MODEL_REVISION"],
        env["MODEL_DIR"],
    )
    fetched = set(
        filter_repo_objects(
            REPO_FILES, allow_patterns=call.get("allow_patterns"), ignore_patterns=call.get("ignore_patterns")
        )
    )
    assert fetched >= SERVER_READS
    assert not fetched & UNREAD_WEIGHTS


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"server": {"grpcPort": 9000, "httpPort": 9000}}, "both 9000"),
        ({"mode": "kserve", "kserve": {"storageUri": STORAGE_URI}, "server": {"httpPort": 80}}, "80"),
    ],
)
def test_ports_the_server_or_kserve_cannot_use_fail_the_install(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=rf"server\.(grpcPort|httpPort).*{message}"):
        render(values)
    # An HTTP port of 80 is fine where the chart makes the Service itself.
    assert render({"server": {"httpPort": 80}})["Service"]


def restricted_violations(pod: dict[str, Any], containers: list[dict[str, Any]]) -> list[str]:
    """What the Pod Security Standard "restricted" would refuse in a pod (the controls the chart sets:
    non-root, no privilege escalation, all capabilities dropped, a RuntimeDefault or Localhost seccomp
    profile on the pod or on every container)."""
    found = []
    pod_context = pod.get("securityContext", {})
    pod_seccomp = pod_context.get("seccompProfile", {}).get("type")
    for container in containers:
        context, name = container.get("securityContext", {}), container["name"]
        if not (context.get("runAsNonRoot") or pod_context.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation")
        if context.get("capabilities", {}).get("drop") != ["ALL"]:
            found.append(f"{name}: capabilities.drop")
        if context.get("seccompProfile", {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
    return found


@pytest.mark.parametrize("source", ["initContainer", "pvc"])
def test_pods_meet_the_restricted_pod_security_standard(source: str) -> None:
    """A namespace labelled pod-security.kubernetes.io/enforce=restricted refused the pods: no seccomp
    profile was set, though every other restricted control was."""
    model: dict[str, Any] = {"source": source}
    if source == "pvc":
        model["pvc"] = {"claimName": "models"}
    pod = render({"model": model})["Deployment"]["spec"]["template"]["spec"]
    containers = pod["containers"] + pod.get("initContainers", [])
    assert len(containers) == (2 if source == "initContainer" else 1)
    assert restricted_violations(pod, containers) == []
    # KServe mode: the predictor's pod context and the runtime's container
    kserve = render({"mode": "kserve", "kserve": {"storageUri": STORAGE_URI}})
    predictor = kserve["InferenceService"]["spec"]["predictor"]
    assert restricted_violations(predictor, kserve["ServingRuntime"]["spec"]["containers"]) == []


@pytest.mark.parametrize(
    ("values", "arg"),
    [
        ({"model": {"servedModelName": "llama: 8b"}}, "--served-model-name=llama: 8b"),
        ({"model": {"servedModelName": "team-a #prod"}}, "--served-model-name=team-a #prod"),
        (
            {"model": {"source": "pvc", "path": "/mnt/models #1", "pvc": {"claimName": "m"}}},
            "--model=/mnt/models #1",
        ),
    ],
)
def test_values_that_read_as_yaml_reach_the_server_whole(values: dict[str, Any], arg: str) -> None:
    """Unquoted, ": " made the argument a YAML mapping and " #" cut the rest off as a comment."""
    container = render(values)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert arg in container["args"]
    if values["model"].get("path"):
        assert {"name": "model", "mountPath": "/mnt/models #1"}.items() <= next(
            m for m in container["volumeMounts"] if m["mountPath"].startswith("/mnt/models")
        ).items()
