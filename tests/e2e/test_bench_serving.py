"""bench/serving.py, the instrument of the serving throughput target, run as its README runs it: spawned
servers on loopback, the offline engine beside them, twin servers with a setting apart, and the exit
status a failed call gives. On the tiny model, so that a run takes seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serving.py"

pytestmark = pytest.mark.slow


def run_bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The bench in a session of its own: past `timeout` it is killed with the servers it spawned,
    which its own exit would have stopped (a killed bench left them serving, idle, holding memory)."""
    command = [sys.executable, str(BENCH), *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def run_ok(json_out: Path, *args: str) -> dict[str, Any]:
    """The JSON report, with what the run printed as `stdout`."""
    done = run_bench(*args, "--json-out", str(json_out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {**json.loads(json_out.read_text()), "stdout": done.stdout}


def test_compare_offline_reports_the_share_of_interleaved_rounds(tiny_llama_dir: str, tmp_path: Path) -> None:
    """One spawned server and the offline engine beside it (one run for what would be three: a
    spawn costs seconds):
    - timed rounds interleaved with the offline engine's, the share taken against its lower middle;
    - untimed warm-up rounds first on both sides (a GPU captures a CUDA graph the first time a batch
      size and context length come up: they leave that out of the rounds compared);
    - --lora-adapters 2: the server and the offline engine load two adapters, and three of four
      requests name one (a0, a1, base, a0): a name either side lacked would fail its calls."""
    out = run_ok(
        tmp_path / "out.json",
        *("--spawn", "--model", tiny_llama_dir, "--compare-offline", "--num-requests", "4", "--rounds", "2"),
        *("--warmup-rounds", "1", "--lora-adapters", "2", "--lora-rank", "4"),
    )
    assert out["args"]["client_loop"] == "uvloop"  # installed with the project's bench extra
    summary = out["summary"]
    assert summary["num_completed"] == 4 and summary["num_failed_all_rounds"] == 0
    assert summary["num_output_tokens"] == 16 + 32 + 64 + 128  # the chat workload's forced lengths
    assert len(summary["rounds_output_tokens_per_s"]) == 2
    assert len(summary["offline_rounds_tokens_per_s"]) == 2
    offline = sorted(summary["offline_rounds_tokens_per_s"])[0]  # the lower middle of two
    assert summary["share_of_offline"] == pytest.approx(summary["output_tokens_per_s"] / offline)
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert 0 < summary[name]["p50"] <= summary[name]["p99"] <= summary[name]["max"]
    # the spawned server's CPU over its median round: its own process's and its engine process's
    assert summary["server_cpu_s"]["front_end_s"] > 0 and summary["server_cpu_s"]["engine_s"] > 0
    lines = out["stdout"].splitlines()
    assert "server CPU time: its own process (the front end) " in out["stdout"]
    untimed = [line.split(":")[0] for line in lines if "untimed round" in line]
    assert untimed == ["untimed round 1", "offline engine, untimed round"]
    assert "2 LoRA adapters of rank 4" in out["stdout"]
    spawned = next(line for line in lines if line.startswith("spawning: "))
    assert "--lora-modules a0=" in spawned and ",a1=" in spawned


def test_twin_servers_differ_only_by_the_twin_arguments(tiny_llama_dir: str, tmp_path: Path) -> None:
    """B alone gets --stream-interval=4 and a Unix socket: B gets no port (the server refuses --uds
    beside one) and its calls go to unix:PATH, where alone it listens; A serves loopback TCP."""
    with tempfile.TemporaryDirectory(prefix="ps-bench-", dir="/tmp") as folder:  # short: <= 107 bytes
        uds = f"{folder}/b.sock"
        out = run_ok(
            tmp_path / "out.json",
            *("--spawn", "--model", tiny_llama_dir, "--num-requests", "4", "--rounds", "2"),
            *("--twin-server-arg=--stream-interval=4", f"--twin-server-arg=--uds={uds}"),
            *("--client-loop", "asyncio"),
        )
    assert out["args"]["client_loop"] == "asyncio"
    a, b = out["servers"]
    assert (a["server"], a["server_args"]) == ("A", [])
    assert (b["server"], b["server_args"]) == ("B", ["--stream-interval=4", f"--uds={uds}"])
    for side in (a, b):
        assert side["num_failed_all_rounds"] == 0 and len(side["rounds_output_tokens_per_s"]) == 2
        assert side["num_output_tokens"] == 16 + 32 + 64 + 128
    # the argument reached B alone: one response a token from A (a few merged when its client read
    # more slowly than the engine stepped), four tokens a response from B after each first token:
    # 5 + 9 + 17 + 33 responses at most for the four completions of 16, 32, 64 and 128 tokens
    assert 64 < a["num_token_responses"] <= a["num_output_tokens"]
    assert b["num_token_responses"] <= 64
    spawned = [line for line in out["stdout"].splitlines() if line.startswith("spawning: ")]
    assert "--port" in spawned[0] and f"--uds={uds}" not in spawned[0]
    assert "--port" not in spawned[1] and f"--uds={uds}" in spawned[1]


def test_failed_calls_give_a_nonzero_exit_and_their_errors(tiny_llama_dir: str) -> None:
    done = run_bench(
        *("--spawn", "--model", tiny_llama_dir, "--num-requests", "4", "--num-warmup", "0"),
        *("--timeout", "0.02", "--twin-server-arg=--stream-interval=2"),
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "server A error: DEADLINE_EXCEEDED" in done.stdout
    assert "server B error: DEADLINE_EXCEEDED" in done.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU for the engine, one for the rest")
@pytest.mark.parametrize(
    ("layout", "engine"),
    [(["--server-arg=--no-engine-process"], "the server's torch thread"), ([], "the engine process")],
)
def test_engine_cores_put_the_engine_on_cpus_of_its_own(
    tiny_llama_dir: str, tmp_path: Path, layout: list[str], engine: str
) -> None:
    """--engine-cores: the engine (its threads found by name, or its process) on the CPU given, the
    rest of the server on the others, each pinning read back from the kernel; the run completes."""
    cpu = max(os.sched_getaffinity(0))
    done = run_bench(
        *("--spawn", "--model", tiny_llama_dir, "--compare-offline", "--num-requests", "4"),
        *("--engine-cores", str(cpu), "--json-out", str(tmp_path / "out.json"), *layout),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    placed = next(line for line in done.stdout.splitlines() if line.startswith("placed: "))
    assert f"engine ({engine}; " in placed and f") on CPUs {cpu}, the rest" in placed
    assert int(placed.split(" threads) on CPUs")[0].rsplit(" ", 1)[1]) >= 1
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["num_completed"] == 4 and len(summary["offline_rounds_tokens_per_s"]) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--twin-server-arg=--stream-interval=2"], "--twin-server-arg starts its own servers: add --spawn"),
        (
            ["--spawn", "--compare-offline", "--twin-server-arg=--stream-interval=2"],
            "--twin-server-arg compares two servers: leave out --compare-offline",
        ),
        (["--compare-tracing"], "--compare-tracing starts its own servers: add --spawn"),
        (["--rounds", "0"], "--rounds: must be at least 1, not 0"),
        (["--warmup-rounds", "-1"], "--warmup-rounds: must be at least 0, not -1"),
        (["--lora-adapters", "2"], "--lora-adapters starts its own server: add --spawn"),
        (["--engine-cores", "0"], "--engine-cores places the servers it starts: add --spawn"),
        (["--spawn", "--engine-cores", "one"], "--engine-cores: 'one' is no CPU list"),
        (["--spawn", "--engine-cores", "0-4095"], "'0-4095' must name some but not all of the CPUs"),
    ],
)
def test_contradictory_flags_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    done = run_bench(*args, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize("caller", [None, "", "-event_engine_listener"])
def test_the_clients_grpc_setting_stays_out_of_the_spawned_servers(caller: str | None) -> None:
    """The load generator sets grpc's client-side experiment for itself, before grpc loads, unless
    its caller set GRPC_EXPERIMENTS (even empty); the servers it spawns get the caller's environment."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if caller is not None:
        env["GRPC_EXPERIMENTS"] = caller
    probe = "import os, serving; print(repr(os.environ['GRPC_EXPERIMENTS']), repr(serving.SERVER_ENV.get('GRPC_EXPERIMENTS')))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=BENCH.parent, env=env, capture_output=True, text=True, check=True
    )
    own, servers = done.stdout.split()
    assert own == repr("-event_engine_client" if caller is None else caller)
    assert servers == repr(caller)
