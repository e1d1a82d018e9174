"""`pagedserve serve` stopped before it is ready, on real processes: SIGTERM or SIGINT while the model
loads ends the process at once with exit 0 and one log line (no traceback, readiness never SERVING,
ports released), with --tensor-parallel-size 2 leaving no rank process behind; a spawned rank that dies
once it has reached the rendezvous fails start-up within seconds with exit 1 naming the rank (rank 0
used to wait for it up to the 30-minute start-up timeout); and Ctrl-C, which a terminal sends to the
whole process group, drains a tensor-parallel server instead of killing its rank 1 mid-stream. A
launcher's rank variables set wrong exit 2 naming the variable, as a bad flag does.

A drain's second signal is tested in test_lifecycle_audit.py, SIGTERM while serving in
test_grpc_server.py, a rank killed while serving in test_grpc_tensor_parallel.py."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from grpc_health.v1 import health_pb2
from grpc_helpers import ServerProcess, request, wait_until
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
# Bounds on waits that end in milliseconds when all is well: far below the load of the default model
# (about 10 s here) and the tensor-parallel start-up timeout (30 min), far above a busy machine's delays.
EXIT_WITHIN_S = 60.0


# rank 0 in an engine process of its own (the default) or in the server's process
LAYOUTS = pytest.mark.parametrize("layout", ["--engine-process", "--no-engine-process"])


def tensor_parallel_server(tiny_llama_dir: str, tmp_path: Path, *layout: str) -> ServerProcess:
    flags = ["--model", tiny_llama_dir, "--dtype", "float32", "--num-kv-blocks", "64", *layout]
    return ServerProcess(*flags, "--tensor-parallel-size", "2", log=tmp_path / "server.log")


def wait_live(proc: ServerProcess) -> None:
    """Until the gRPC port answers: the model is loading (or the test's premise is gone)."""
    assert wait_until(lambda: proc.readiness() is not None or proc.proc.poll() is not None, 120)
    assert proc.readiness() == NOT_SERVING, proc.log.read_text()[-3000:]


def spawned_rank(proc: ServerProcess) -> psutil.Process:
    """Rank 1, as soon as the server has started it."""

    def find() -> psutil.Process | None:
        ranks = proc.rank_processes()
        return ranks[0] if ranks else None

    assert wait_until(lambda: find() is not None or proc.proc.poll() is not None, 120)
    rank = find()
    assert rank is not None, proc.log.read_text()[-3000:]
    return rank


def listening_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == "LISTEN"}


def wait_exit(proc: ServerProcess) -> int:
    try:
        return proc.proc.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve still running {EXIT_WITHIN_S:.0f} s on:\n{proc.log.read_text()[-3000:]}")


def assert_ports_released(proc: ServerProcess) -> None:
    """Nothing listens on them (SO_REUSEADDR: closed connections may linger in TIME_WAIT)."""
    for port in (proc.port, proc.http_port):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()


def assert_gone(rank: psutil.Process) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):  # reaped; a zombie is gone too, not yet reaped
        assert rank.status() == psutil.STATUS_ZOMBIE, f"rank 1 (pid {rank.pid}) still runs"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_model_loads_exits_0_at_once(
    default_model_dir: str, tmp_path: Path, sig: signal.Signals
) -> None:
    """As Kubernetes stops a pod still loading (as PID 1 without tini the process would even have
    ignored it). It used to die of the signal (SIGTERM: -15) or, for SIGINT, wait for the load and
    exit 1 with a KeyboardInterrupt traceback."""
    proc = ServerProcess("--model", default_model_dir, "--dtype", "float32", log=tmp_path / "server.log")
    try:
        wait_live(proc)
        # while it loads, /metrics answers 200 with the process's own series (a failed scrape reads as
        # the target down): no engine series yet
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.http_port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            scraped = reply.read().decode()
        assert "\nprocess_resident_memory_bytes " in scraped and "vllm:" not in scraped, scraped[:500]
        proc.proc.send_signal(sig)
        statuses = set()
        deadline = time.monotonic() + EXIT_WITHIN_S
        while proc.proc.poll() is None and time.monotonic() < deadline:
            statuses.add(proc.readiness())
        code = wait_exit(proc)
    finally:
        proc.stop()
    log = proc.log.read_text()
    assert code == 0, log[-3000:]
    assert SERVING not in statuses
    assert log.count("signalled while starting (loading the model): exiting without serving") == 1, log
    assert "Traceback" not in log and "pagedserve ready" not in log, log[-3000:]
    assert "KV cache:" not in log, log  # logged once the weights are in: it did not wait for the load
    assert_ports_released(proc)


@LAYOUTS
def test_a_signal_while_tensor_parallel_ranks_start_leaves_no_rank_behind(
    tiny_llama_dir: str, tmp_path: Path, layout: str
) -> None:
    """Rank 1 is still importing torch when rank 0 is told to stop; rank 0 stops it before exiting.
    It used to die of the signal and leave rank 1 running, an orphan waiting for its rendezvous."""
    proc = tensor_parallel_server(tiny_llama_dir, tmp_path, layout)
    try:
        rank = spawned_rank(proc)
        proc.proc.send_signal(signal.SIGTERM)
        code = wait_exit(proc)
        assert_gone(rank)
    finally:
        proc.stop()
    log = proc.log.read_text()
    assert code == 0, log[-3000:]
    assert "signalled while starting (loading the model)" in log and "Traceback" not in log, log[-3000:]
    assert_ports_released(proc)


@LAYOUTS
def test_a_rank_whose_rank_0_is_killed_while_it_starts_exits(
    tiny_llama_dir: str, tmp_path: Path, layout: str
) -> None:
    """Rank 0's process killed (an OOM kill) while rank 1 still imports torch: rank 1 used to wait out
    the start-up timeout (30 minutes) for a rendezvous that could not come, holding its memory."""
    proc = tensor_parallel_server(tiny_llama_dir, tmp_path, layout)
    try:
        rank = spawned_rank(proc)
        os.kill(rank.ppid(), signal.SIGKILL)  # the engine process, or the server itself

        def gone() -> bool:
            try:
                return rank.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        assert wait_until(gone, 10), f"rank 1 (pid {rank.pid}) still runs"
    finally:
        proc.stop()
    assert "its rank 0" in proc.log.read_text() and "has gone; exiting" in proc.log.read_text()


@LAYOUTS
def test_a_rank_dead_after_reaching_the_rendezvous_fails_start_up_at_once(
    tiny_llama_dir: str, tmp_path: Path, layout: str
) -> None:
    """A rank that dies (an OOM kill, a crash) between setting its started key and joining the process
    groups: rank 0 went on into the rendezvous and waited there for it until the start-up timeout.

    To land in that window every time: rank 1 is frozen as soon as it exists, its started key is set
    for it in rank 0's store (the one listening port that is neither gRPC nor HTTP), and it is killed
    once rank 0, seeing the key, has opened its own rendezvous socket."""
    from datetime import timedelta

    from pagedserve.worker.multiproc_executor import _started_key
    from torch.distributed import TCPStore

    proc = tensor_parallel_server(tiny_llama_dir, tmp_path, layout)
    try:
        rank = spawned_rank(proc)
        rank.suspend()
        rank_0 = rank.ppid()  # the engine process (the server itself with --no-engine-process)
        (store_port,) = listening_ports(rank_0) - {proc.port, proc.http_port}
        store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=30))
        store.set(_started_key(1), "1")
        known = {proc.port, proc.http_port, store_port}
        assert wait_until(lambda: bool(listening_ports(rank_0) - known), EXIT_WITHIN_S)
        rank.kill()
        code = wait_exit(proc)
    finally:
        proc.stop()
    log = proc.log.read_text()
    assert code == 1, log[-3000:]
    named = f"tensor-parallel start-up failed: tensor-parallel rank 1 (pid {rank.pid}) was killed by SIGKILL"
    assert named in log and "Traceback" not in log, log[-3000:]
    assert_ports_released(proc)


def test_ctrl_c_drains_a_tensor_parallel_server(tiny_llama_dir: str, tmp_path: Path) -> None:
    """A terminal's Ctrl-C sends SIGINT to every process of its foreground group: rank 0 and the rank
    it spawned. Rank 1 used to die of a KeyboardInterrupt, failing the stream and the drain (exit 1)."""
    proc = tensor_parallel_server(tiny_llama_dir, tmp_path).wait_ready()
    try:
        rank = spawned_rank(proc)
        call = proc.stub.Generate(request(max_tokens=400), timeout=120)
        num_tokens = len(next(call).token_ids)
        for pid in (proc.proc.pid, rank.pid):
            os.kill(pid, signal.SIGINT)
        rest = list(call)
        num_tokens += sum(len(r.token_ids) for r in rest)
        code = wait_exit(proc)
        assert_gone(rank)
    finally:
        proc.stop()
    log = proc.log.read_text()
    assert rest[-1].finish_reason == pb.LENGTH and num_tokens == 400, rest[-1]
    assert code == 0 and "drained; bye" in log, log[-3000:]
    assert "KeyboardInterrupt" not in log and "Traceback" not in log, log[-3000:]


LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
BAD_LAUNCH = [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not a rank of WORLD_SIZE=2"),
]


@pytest.mark.parametrize(("variables", "message"), BAD_LAUNCH, ids=[m for _, m in BAD_LAUNCH])
def test_launcher_variables_set_wrong_exit_2_naming_the_variable(
    tiny_llama_dir: str, variables: dict[str, str], message: str
) -> None:
    """These used to end `serve` with a ValueError traceback, exit 1 (RANK past the world: a wait)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    command = [sys.executable, "-m", "pagedserve", "serve", "--model", tiny_llama_dir, "--port", "0"]
    done = subprocess.run(
        [*command, "--http-port", "-1"], env={**env, **variables}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"pagedserve serve: error: {message}" in done.stderr and "Traceback" not in done.stderr, (
        done.stderr
    )


def test_serve_catches_stop_signals_before_it_imports_torch() -> None:
    """Until its handlers are in place a signal ends `serve` by the default action (or, as PID 1, is
    lost); importing torch took the first 1.3 s of every start. The command's modules up to the
    handlers (`_serve` installs them first thing) import no torch."""
    code = (
        "import sys\n"
        "import pagedserve.__main__, pagedserve.launch, pagedserve.rpc.signals\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False"
