"""bench/throughput.py, the instrument of the offline throughput and KV-memory targets, run as its README
runs it, on the tiny model so that a run takes seconds: every peer generates the same forced tokens,
and the KV figures are the paged layout's against the contiguous ones at the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "throughput.py"

pytestmark = pytest.mark.slow


def test_every_peer_generates_the_same_tokens_and_paging_holds_more_real_tokens(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    command = [sys.executable, str(BENCH), "--model", tiny_llama_dir, "--num-requests", "4"]
    # transformers sizes its continuous batching cache from the memory free (~12 GB here), and its
    # warm-up then takes ~25 s; 8 blocks of 256 tokens hold this workload
    command += ["--hf-continuous-num-blocks", "8"]
    done = subprocess.run(
        [*command, "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["args"]["device"] == "cpu"  # no GPU here: every peer on the CPU
    peers = {row["peer"]: row for row in report["results"]}
    assert set(peers) == {"pagedserve", "hf-sequential", "hf-static", "hf-continuous"}
    for row in peers.values():
        assert row["available"], row
        assert row["num_output_tokens"] == 16 + 32 + 64 + 128  # the chat workload's forced lengths
        assert row["tokens_per_s"] == pytest.approx(row["num_output_tokens"] / row["seconds"])
    assert "; 8 KV blocks of 256; " in peers["hf-continuous"]["note"]
    for name in ("hf-sequential", "hf-static", "hf-continuous"):  # the table's ratio column
        ratio = peers["pagedserve"]["tokens_per_s"] / peers[name]["tokens_per_s"]
        assert f"| {name} | 240 |" in done.stdout and f"| {ratio:.2f}x |" in done.stdout
    peak = report["kv_peak"]
    # paged: the blocks in use hold the live tokens (a shared prefix once), less than a block's slack
    # a sequence; contiguous reservations of prompt + max_tokens a request hold more empty slots
    assert peak["num_filled_slots"] <= peak["num_used_blocks"] * peak["block_size"]
    assert peak["num_filled_slots"] / (peak["num_used_blocks"] * peak["block_size"]) > (
        peak["num_sequence_tokens"] / peak["num_reserved_exact"]
    )
    assert peak["num_reserved_exact"] <= peak["num_reserved_batch_max"] <= peak["num_reserved_model_len"]


def test_enforce_eager_builds_pagedserve_without_torch_compile(tiny_llama_dir: str, tmp_path: Path) -> None:
    """--enforce-eager wins over an environment asking for the compiled pass, and the note says so."""
    out = tmp_path / "out.json"
    command = [sys.executable, str(BENCH), "--model", tiny_llama_dir, "--num-requests", "4"]
    command += ["--peers", "pagedserve", "--enforce-eager", "--json-out", str(out)]
    env = {**os.environ, "PAGEDSERVE_ENFORCE_EAGER": "0"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["num_output_tokens"] == 240 and row["note"].endswith(" preemptions, eager"), row


def test_rounds_run_the_peers_in_turn_and_report_each_peer_s_median_round(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    """--rounds 3: every peer three times, in turn, on one engine whose prefix cache each round
    starts without; the main table shows each peer's median round, and every round's ratio follows."""
    out = tmp_path / "out.json"
    command = [sys.executable, str(BENCH), "--model", tiny_llama_dir, "--num-requests", "4"]
    command += ["--peers", "pagedserve,hf-static", "--rounds", "3", "--json-out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    rounds = report["rounds"]
    assert [len(rounds[peer]) for peer in ("pagedserve", "hf-static")] == [3, 3]
    order = [line.split(" (round")[0] for line in done.stdout.splitlines() if line.startswith("running ")]
    assert order == ["running pagedserve", "running hf-static"] * 3
    # every round the same steps (that a reset prefix cache computes every prompt afresh is
    # tests/engine/test_offline_api_audit.py's to show; the runner asserts each reset succeeded)
    assert len({r["note"] for r in rounds["pagedserve"]}) == 1
    for peer, row in zip(("pagedserve", "hf-static"), report["results"], strict=True):
        speeds = sorted(r["tokens_per_s"] for r in rounds[peer])
        assert row["peer"] == peer and row["tokens_per_s"] == speeds[1]
    ratio = report["results"][0]["tokens_per_s"] / report["results"][1]["tokens_per_s"]
    assert f"| {ratio:.2f}x |" in done.stdout
    for i, (ours, theirs) in enumerate(zip(rounds["pagedserve"], rounds["hf-static"], strict=True)):
        row = f"| {i + 1} | {ours['tokens_per_s']:.1f} | {theirs['tokens_per_s']:.1f} | "
        assert row + f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x |" in done.stdout


@pytest.mark.parametrize(
    ("cuts", "header"),
    [
        ([], "sampled at temperature 0.8\n"),
        (
            ["--top-k", "20", "--top-p", "0.9", "--repetition-penalty", "1.2"],
            "sampled at temperature 0.8, top-k 20, top-p 0.9, repetition penalty 1.2\n",
        ),
    ],
)
def test_every_peer_samples_at_a_temperature_and_makes_its_forced_tokens(
    tiny_llama_dir: str, tmp_path: Path, cuts: list[str], header: str
) -> None:
    """--temperature 0.8: every peer samples instead of decoding greedily, with top-k, top-p and the
    repetition penalty off or as given, and still makes exactly the forced number of tokens; the
    header says how the tokens were chosen."""
    out = tmp_path / "out.json"
    command = [
        sys.executable,
        str(BENCH),
        "--model",
        tiny_llama_dir,
        "--num-requests",
        "4",
        "--temperature",
        "0.8",
        *cuts,
    ]
    command += ["--peers", "pagedserve,hf-static,hf-continuous", "--hf-continuous-num-blocks", "8"]
    done = subprocess.run(
        [*command, "--json-out", str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "240 output tokens forced, " + header in done.stdout
    report = json.loads(out.read_text())
    assert report["args"]["temperature"] == 0.8
    for row in report["results"]:
        assert row["available"] and row["num_output_tokens"] == 240, row
    # a logits processor transformers' continuous batching drops (it says so on stderr) is named in
    # that peer's note: its tokens were chosen without it
    dropped = "RepetitionPenaltyLogitsProcessor isn't supported by CB. Dropping it" in done.stderr
    (continuous,) = [row for row in report["results"] if row["peer"] == "hf-continuous"]
    assert ("not applied: RepetitionPenaltyLogitsProcessor" in continuous["note"]) == dropped, continuous


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--temperature", "-0.5"], "--temperature: 0 (greedy) or a finite positive number"),
        (["--temperature", "inf"], "--temperature: 0 (greedy) or a finite positive number"),
        (["--temperature", "nan"], "--temperature: 0 (greedy) or a finite positive number"),
        (["--temperature", "1", "--top-k", "-1"], "--top-k: 0 (off) or a positive number of tokens"),
        (["--temperature", "1", "--top-p", "0"], "--top-p: above 0 and at most 1 (off)"),
        (["--temperature", "1", "--top-p", "1.5"], "--top-p: above 0 and at most 1 (off)"),
        (["--temperature", "1", "--top-p", "nan"], "--top-p: above 0 and at most 1 (off)"),
        (["--top-p", "0.9"], "--top-k and --top-p cut a sampled distribution: give --temperature above 0"),
        (["--repetition-penalty", "0"], "--repetition-penalty: a finite number above 0 (1: off)"),
        (["--repetition-penalty", "-1.1"], "--repetition-penalty: a finite number above 0 (1: off)"),
        (["--repetition-penalty", "inf"], "--repetition-penalty: a finite number above 0 (1: off)"),
        (["--repetition-penalty", "nan"], "--repetition-penalty: a finite number above 0 (1: off)"),
    ],
)
def test_a_bad_sampling_setting_is_refused(arguments: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_rounds_below_one_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--rounds", "0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and "--rounds: at least 1, got 0" in done.stderr


@pytest.mark.parametrize(
    "arguments", [["--rounds", "0"], ["--top-p", "0.9"], ["--device", "tpu"], ["--peers", "pagedserve,vllm"]]
)
def test_a_bad_argument_is_refused_before_torch_is_imported(arguments: list[str]) -> None:
    """At once, not after torch's ~3 s import (the module imported it first)."""
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(BENCH.parent)!r})\n"
        f"sys.argv = ['throughput.py', *{arguments!r}]\n"
        "import throughput\n"
        "try:\n"
        "    throughput.parse_args()\n"
        "except SystemExit as exc:\n"
        "    print('torch imported' if 'torch' in sys.modules else 'no torch', exc.code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.split() == ["no", "torch", "2"], done.stdout + done.stderr[-2000:]


def test_a_device_other_than_cpu_or_cuda_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--device", "tpu"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "--device: cpu, cuda or cuda:N, got 'tpu'" in done.stderr


PYTHON = ["--vllm-python", sys.executable]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "the vllm peer needs --vllm-python: the Python of an environment with vLLM"),
        (["--vllm-python", "/nonexistent/python"], "--vllm-python: no executable at '/nonexistent/python'"),
        ([*PYTHON, "--vllm-arg", "max_num_seqs"], "--vllm-arg: KEY=VALUE, got 'max_num_seqs'"),
        (
            [*PYTHON, "--vllm-arg", "max_num_seqs=lots"],
            "--vllm-arg: the value of 'max_num_seqs=lots' is not JSON",
        ),
        ([*PYTHON, "--vllm-env", "OMP_NUM_THREADS"], "--vllm-env: KEY=VALUE, got 'OMP_NUM_THREADS'"),
    ],
)
def test_bad_vllm_options_are_refused(extra: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--peers", "pagedserve,vllm", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_python_without_vllm_ends_the_run_with_that_reason(tiny_llama_dir: str) -> None:
    """This environment has no vLLM: the peer's child says so and the run stops, with no table."""
    command = [sys.executable, str(BENCH), "--model", tiny_llama_dir, "--num-requests", "2"]
    command += ["--peers", "pagedserve,vllm", "--vllm-python", sys.executable]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"vLLM is not importable in {sys.executable}: No module named 'vllm'" in done.stderr
    assert "the vLLM peer exited with status 1" in done.stderr
    assert "| peer |" not in done.stdout


VLLM_PYTHON = os.environ.get("PAGEDSERVE_BENCH_VLLM_PYTHON")


@pytest.mark.skipif(
    not VLLM_PYTHON,
    reason="PAGEDSERVE_BENCH_VLLM_PYTHON names no Python with vLLM (bench/README.md: the vllm peer)",
)
@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9"]])
def test_the_vllm_peer_generates_the_same_tokens_in_its_own_environment(
    default_model_dir: str, tmp_path: Path, sampling: list[str]
) -> None:
    """vLLM runs in its own Python, rounds in turn with pagedserve's; its idle CPU between rounds is
    reported, and its tokens, greedy or sampled with top-k and top-p, are counted like every peer's.
    On the default model: vLLM's CPU attention has no kernel for the tiny model's head size of 16."""
    out = tmp_path / "out.json"
    command = [sys.executable, str(BENCH), "--model", default_model_dir, "--num-requests", "4", *sampling]
    command += ["--peers", "pagedserve,vllm", "--rounds", "2", "--vllm-python", str(VLLM_PYTHON)]
    command += ["--vllm-arg", "max_num_seqs=4", "--json-out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    for row in report["rounds"]["vllm"]:
        assert row["num_output_tokens"] == 16 + 32 + 64 + 128
        assert row["note"].startswith("vllm ") and " CPU-s while idle before this round" in row["note"]
    order = [line.split(" (round")[0] for line in done.stdout.splitlines() if line.startswith("running ")]
    assert order == ["running pagedserve", "running vllm"] * 2


def test_the_hf_continuous_peer_runs_without_autograd_and_collects_dropped_processors() -> None:
    """run_hf_continuous keeps its no_grad decorator (once moved onto the class written above it, the
    class was decorated, with torch's FutureWarning, and the peer ran with autograd on), and
    DroppedProcessors collects the processors transformers' log names."""
    check = (
        "import inspect, logging, throughput as t\n"
        "assert inspect.isclass(t.DroppedProcessors)\n"
        "assert inspect.unwrap(t.run_hf_continuous) is not t.run_hf_continuous\n"
        "handler = t.DroppedProcessors()\n"
        "log = logging.getLogger('ContinuousBatchingLogger')\n"
        "log.addHandler(handler)\n"
        'log.warning("Processor RepetitionPenaltyLogitsProcessor isn\'t supported by CB. Dropping it.")\n'
        "log.warning('something else')\n"
        "assert handler.names == ['RepetitionPenaltyLogitsProcessor'], handler.names\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", check],
        cwd=BENCH.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
