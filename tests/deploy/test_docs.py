"""The deployment commands in README.md and docs/deploy.md: every `helm install/upgrade` renders, and
the names, ports and model names the README's client commands use are the ones the chart renders."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import REPO, by_name, parse_serve_args, render

README = REPO / "README.md"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
KSERVE_GRPC_SERVICE_PORT = 80  # KServe's RawDeployment Service maps the first container port to 80


def helm_commands(path: Path) -> list[list[str]]:
    """Every `helm` command line in the file's ```bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.DOTALL)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith("helm ")]


def set_value(values: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        values = values.setdefault(key, {})
    values[leaf] = value


def scalar(text: str) -> Any:
    """`--set` typing, as Helm does it for the values these docs use."""
    if text in ("true", "false"):
        return text == "true"
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def helm_installs(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(release, values) of each `helm install`/`helm upgrade --reuse-values` in the file, in order."""
    installs: list[tuple[str, dict[str, Any]]] = []
    for argv in helm_commands(path):
        if argv[:2] not in (["helm", "install"], ["helm", "upgrade"]):
            continue
        release, chart = argv[2], argv[3]
        assert (REPO / chart).resolve() == REPO / "charts" / "pagedserve", argv
        values: dict[str, Any] = {}
        if "--reuse-values" in argv:
            [previous] = [v for r, v in installs if r == release][-1:]
            values = json.loads(json.dumps(previous))
        for flag, arg in zip(argv, argv[1:]):
            if flag in ("--set", "--set-json"):
                key, _, raw = arg.partition("=")
                set_value(values, key, json.loads(raw) if flag == "--set-json" else scalar(raw))
        installs.append((release, values))
    return installs


@pytest.mark.parametrize("path", [README, DEPLOY_DOC], ids=lambda p: p.name)
def test_every_documented_helm_command_renders(path: Path) -> None:
    installs = helm_installs(path)
    assert installs, f"no helm install in {path.name}"
    for release, values in installs:
        objects = render(values, release=release)
        assert "Deployment" in objects or "InferenceService" in objects


def readme_objects() -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """What the README's first plain and first KServe `helm install` render."""
    installs = [(r, v) for r, v in helm_installs(README) if r]
    plain = next(render(v, release=r) for r, v in installs if v.get("mode", "deployment") == "deployment")
    kserve = next(render(v, release=r) for r, v in installs if v.get("mode") == "kserve")
    return plain, kserve


def test_readme_addresses_and_model_names_match_the_rendered_chart() -> None:
    plain, kserve = readme_objects()
    text = README.read_text()
    service = plain["Service"]["metadata"]["name"]
    grpc_port = by_name(plain["Service"]["spec"]["ports"])["grpc"]["port"]
    isvc = kserve["InferenceService"]["metadata"]["name"]
    [container] = plain["Deployment"]["spec"]["template"]["spec"]["containers"]
    model_name = parse_serve_args(container["args"]).served_model_name
    assert model_name == isvc, "KServe serves under the InferenceService name ({{.Name}})"

    addresses = set(re.findall(r"\b([a-z0-9-]+-pagedserve(?:-predictor)?):(\d+)", text))
    assert addresses == {(service, str(grpc_port)), (f"{isvc}-predictor", str(KSERVE_GRPC_SERVICE_PORT))}
    assert f"deployment/{plain['Deployment']['metadata']['name']}" in text
    assert f"inferenceservice {isvc}" in text
    assert f'"name": "{model_name}"' in text  # grpcurl ModelReady
    assert f'client.infer("{model_name}"' in text  # tritonclient


def test_every_serve_flag_has_a_row_in_the_readme_settings_table() -> None:
    """The table is where operators look flags up: one added without a row (three had none) is one
    they only find in `--help`."""
    from pagedserve.rpc.cli import ServeSettings

    rows = [line for line in README.read_text().splitlines() if line.startswith("| `--")]
    documented = {flag for row in rows for flag in re.findall(r"`(--[a-z0-9-]+)", row.split(" | ")[0])}
    flags = {"--" + name.replace("_", "-") for name in ServeSettings.model_fields}
    assert sorted(flags - documented) == []


def documented_values_with_extra_args() -> list[dict[str, Any]]:
    """The chart values in docs/deploy.md's ```yaml blocks that pass server flags (`server.extraArgs`),
    but those naming files on the pod's volume (`/mnt/models/...`: not on this machine)."""
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOY_DOC.read_text(), flags=re.DOTALL)
    values = [yaml.safe_load(block) for block in blocks]
    return [
        v
        for v in values
        if isinstance(v, dict)
        and "extraArgs" in v.get("server", {})
        and not any("/mnt/" in arg for arg in v["server"]["extraArgs"])
    ]


@pytest.mark.parametrize(
    "values", documented_values_with_extra_args(), ids=lambda v: " ".join(v["server"]["extraArgs"])[:40]
)
def test_documented_extra_args_are_flags_the_server_takes(values: dict[str, Any]) -> None:
    """Each documented `server.extraArgs` renders into the server's arguments, and `pagedserve serve`
    parses them: the flags exist and their values pass the settings' checks (a speculative config's
    JSON, a LoRA list's name=path items)."""
    containers = render(values)["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = by_name(containers)["pagedserve"]["args"]
    assert all(arg in args for arg in values["server"]["extraArgs"])
    parse_serve_args(args)


def chart_owned_flags() -> set[str]:
    """The flags `pagedserve.checkExtraArgs` refuses in `server.extraArgs` (its `$owned` dict)."""
    helpers = (REPO / "charts" / "pagedserve" / "templates" / "_helpers.tpl").read_text()
    [owned] = re.findall(r"\$owned := dict ([^\n]*?) -\}\}", helpers)
    names = re.findall(r'"([^"]+)"', owned)[::2]  # key, value, key, value, ...
    return {f"--{name}" for name in names}


@pytest.mark.parametrize(
    ("path", "opening"),
    [
        (README, "`server.extraArgs` takes any other `pagedserve serve` flag"),
        (DEPLOY_DOC, "`server.extraArgs` takes any `pagedserve serve` flag except"),
        (REPO / "charts" / "pagedserve" / "values.yaml", "# More `pagedserve serve` flags"),
    ],
    ids=["README.md", "deploy.md", "values.yaml"],
)
def test_the_flags_the_chart_refuses_in_extra_args_are_all_documented(path: Path, opening: str) -> None:
    """Where the docs list the flags `server.extraArgs` refuses, they list every one the chart refuses
    (the three TLS flags were missing from all three lists)."""
    text = path.read_text()
    start = text.index(opening)
    paragraph = text[start : text.find("\n\n", start)]
    named = set(re.findall(r"--[a-z0-9-]+", paragraph))
    assert sorted(chart_owned_flags() - named) == []


METRIC_DOCS = [
    README,
    DEPLOY_DOC,
    REPO / "docs" / "kserve-triton.md",
    REPO / "charts" / "pagedserve" / "values.yaml",
]


def exported_metrics() -> dict[str, set[tuple[str, str]]]:
    """Every metric name /metrics can carry (families and their samples: `_total`, `_bucket`, ...),
    each with the (label, value) pairs its series carry, from a fresh EngineMetrics with the series
    that appear later (the cache's info, LoRA's) set as the engine sets them."""
    from pagedserve.telemetry import EngineMetrics

    metrics = EngineMetrics("m")
    metrics.set_cache_config_info({"block_size": "16", "num_gpu_blocks": "8", "num_cpu_blocks": "0"})
    metrics.set_num_lora_adapters(1)
    names: dict[str, set[tuple[str, str]]] = {}
    for family in metrics.registry.collect():
        names.setdefault(family.name, set())
        if family.type == "counter":  # exported once its first series is (spec decoding's: when on)
            names.setdefault(f"{family.name}_total", set())
        for sample in family.samples:
            pairs = set(sample.labels.items())
            for name in (family.name, sample.name):
                names.setdefault(name, set()).update(pairs)
    return names


@pytest.mark.parametrize("path", METRIC_DOCS, ids=lambda p: p.name)
def test_every_metric_the_docs_name_is_exported(path: Path) -> None:
    """A metric (and label value) named in the docs is one a dashboard or an alert is written against:
    each must be one the server exports, under that name."""
    exported = exported_metrics()
    named = re.findall(r"\b((?:vllm|pagedserve):[a-z_][a-z0-9_]*)(?:\{([^}]*)\})?", path.read_text())
    for name, labels in named:
        if name not in exported and not labels:  # a prefix to grep for (`grep vllm:num_requests`)
            assert any(e.startswith(f"{name}_") for e in exported), f"{path.name}: {name} is not exported"
            continue
        assert name in exported, f"{path.name}: {name} is not exported"
        for label, value in re.findall(r'(\w+)="([^"]*)"', labels):
            if "!" in labels or label in ("namespace", "pod"):  # a PromQL matcher, Prometheus' own labels
                continue
            assert (label, value) in exported[name], (
                f'{path.name}: {name}{{{label}="{value}"}} is not exported'
            )


def backticked_between(text: str, start: str, end: str) -> set[str]:
    """The lower-case `identifiers` of the text from `start` to the next `end`, but those in
    parentheses (what the docs say of an item)."""
    begin = text.index(start) + len(start)
    span = text[begin : text.index(end, begin)]
    while re.search(r"\([^()]*\)", span):
        span = re.sub(r"\([^()]*\)", "", span)
    return set(re.findall(r"`([a-z_]+)`", span))


def test_the_readme_lists_every_abort_cause_rejection_reason_and_finished_reason() -> None:
    """The README's lists of the label values of the request counters are the code's, all of them."""
    from pagedserve.telemetry import ABORT_CAUSES, FINISH_REASONS, REJECTION_REASONS

    text = README.read_text()
    causes = backticked_between(text, "`pagedserve:request_aborts_total` by cause:", "each request ends")
    assert causes == set(ABORT_CAUSES)
    reasons = backticked_between(text, "`pagedserve:request_rejections_total` by reason", "; and Prometheus'")
    assert reasons == set(REJECTION_REASONS)
    finished = backticked_between(text, "by vLLM's `finished_reason`:", "\n- ")
    assert finished == set(FINISH_REASONS)


def test_the_readme_model_table_names_every_architecture_served_and_no_other() -> None:
    """Supported models: the table's first column names each architecture models/registry.py serves
    (and the multimodal ones whose text decoder it serves), no more."""
    from pagedserve.config import MULTIMODAL_TEXT_DECODERS
    from pagedserve.models.registry import MODELS

    text = README.read_text()
    table = text[text.index("| architecture | families |") :]
    table = table[: table.index("\n\n")]
    names = r"`(\w+For\w+|\w+LMHeadModel)`"  # (GPT-2's class is `GPT2LMHeadModel`)
    named = {name for row in table.splitlines()[2:] for name in re.findall(names, row.split(" | ")[0])}
    assert named == set(MODELS) | set(MULTIMODAL_TEXT_DECODERS)


# The MLP's intermediate size of each model of docs/tensor-parallel.md's table (their config.json).
INTERMEDIATE_SIZES = {
    "SmolLM2-135M": 1536,
    "Llama 3 8B": 14336,
    "Llama 3 70B": 28672,
    "Qwen2.5 7B": 18944,
    "Qwen3 8B": 12288,
}


def test_the_tensor_parallel_sizes_table_lists_every_size_that_starts() -> None:
    """Each row's sizes are exactly those the start-up check takes for that model (the table had
    left out the replicated-KV sizes 16, 32 and 64 of Llama 3 70B)."""
    from types import SimpleNamespace

    from pagedserve.worker.executor import check_tensor_parallel_size

    text = (REPO / "docs" / "tensor-parallel.md").read_text()
    rows = re.findall(
        r"^\| ([^|]+?)(?: \([^|]*\))? \| (\d+) / (\d+) \| ([^|]+) \|$", text, flags=re.MULTILINE
    )
    assert {name for name, *_ in rows} == set(INTERMEDIATE_SIZES)
    for name, heads, kv_heads, cell in rows:
        listed = {int(n) for n in re.findall(r"\d+", re.sub(r"\([^)]*\)", "", cell))}
        model = SimpleNamespace(
            num_layers=1,  # (attention, whose heads are split)
            num_heads=int(heads),
            num_kv_heads=int(kv_heads),
            hf_config={"intermediate_size": INTERMEDIATE_SIZES[name]},
        )
        starts = set()
        for tp in range(1, int(heads) + 1):
            config = SimpleNamespace(model=model, parallel=SimpleNamespace(tensor_parallel_size=tp))
            try:
                check_tensor_parallel_size(config)
            except ValueError:
                continue
            starts.add(tp)
        assert listed == starts, name


def documented_default(text: str) -> tuple[bool, Any]:
    """(checkable, value) of a settings-table default: a number, a `word`, on / off / none; others
    (`the model's`, a sentence) are not checked."""
    text = re.sub(r" \([^)]*\)$", "", text.strip())  # `4 (GiB)`, `on (off under a launcher)`
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return True, float(text)
    if re.fullmatch(r"`[a-z0-9_.]+`|\d+\.\d+\.\d+\.\d+", text):
        return True, text.strip("`")
    if text in ("on", "off", "none"):
        return True, text
    return False, None


def test_the_readme_settings_table_gives_each_flags_default() -> None:
    """The table's defaults are the settings' (a number, a word, on for a switch that is on, off or
    none for one that is off or unset); rows that describe a computed default are left alone."""
    from pagedserve.rpc.cli import ServeSettings

    rows = [line for line in README.read_text().splitlines() if line.startswith("| `--")]
    checked = 0
    for row in rows:
        flag_cell, default_cell = row.split(" | ")[:2]
        flags = [f for f in re.findall(r"`--([a-z0-9-]+)`", flag_cell) if not f.startswith("no-")]
        values = (
            default_cell.split(", ")
            if len(flags) > 1 and ", " in default_cell
            else [default_cell] * len(flags)
        )
        for flag, value in zip(flags, values, strict=True):
            ok, documented = documented_default(value)
            if not ok:
                continue
            default = ServeSettings.model_fields[flag.replace("-", "_")].default
            if documented == "on":
                assert default is True or (flag == "engine-process" and default is None), flag
            elif documented in ("off", "none"):
                assert default in (None, False), flag
            else:
                assert default == documented, flag
            checked += 1
    assert checked >= 40, checked
