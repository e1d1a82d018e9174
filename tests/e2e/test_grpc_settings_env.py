"""`pagedserve serve` configured by PAGEDSERVE_* environment variables alone (as a Kubernetes pod spec
configures it): the values reach the engine, a flag still wins over its variable, and a bad value stops
the server before it serves, with a message saying what to fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_helpers import ServerProcess, request
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow


def test_pagedserve_env_vars_reach_the_engine(tiny_llama_dir: str, tmp_path: Path) -> None:
    env = {
        "PAGEDSERVE_MODEL": tiny_llama_dir,
        "PAGEDSERVE_SERVED_MODEL_NAME": "from-env",
        "PAGEDSERVE_MAX_NUM_SEQS": "3",
        "PAGEDSERVE_BLOCK_SIZE": "32",
        "PAGEDSERVE_NUM_KV_BLOCKS": "40",
        "PAGEDSERVE_MAX_MODEL_LEN": "512",
        "PAGEDSERVE_DTYPE": "bfloat16",  # overridden by the flag below
    }
    # Host and ports come from PAGEDSERVE_HOST/PORT/HTTP_PORT too: answering on them is part of the test.
    proc = ServerProcess("--dtype", "float32", env=env, address_from_env=True, log=tmp_path / "server.log")
    try:
        proc.wait_ready()
        info = proc.stub.ModelInfo(pb.ModelInfoRequest())
        named = request(max_tokens=4)
        named.model = "from-env"  # the served name from the variable is the one requests must use
        reply = list(proc.stub.Generate(named, timeout=60))
    finally:
        proc.stop()
    got = (info.model_name, info.max_num_seqs, info.block_size, info.num_kv_blocks, info.max_context_length)
    assert got == ("from-env", 3, 32, 40, 512)
    assert info.kv_capacity_tokens == 40 * 32
    assert info.dtype == "float32"  # the flag wins over PAGEDSERVE_DTYPE
    assert reply[-1].finish_reason == pb.LENGTH and reply[-1].completion_tokens == 4


# (variable, bad value, what the error must say): not an integer at all; an integer out of range (block
# sizes are powers of two); a model path that only loading the model can find wrong (after the ports
# are open: they must be closed again, quietly).
INVALID_ENV = [
    ("PAGEDSERVE_MAX_NUM_SEQS", "many", "(got 'many')"),
    ("PAGEDSERVE_BLOCK_SIZE", "24", "must be a power of two in [1, 256], got 24"),
    ("PAGEDSERVE_STREAM_INTERVAL", "0", "greater than or equal to 1 (got '0')"),
    ("PAGEDSERVE_MAX_QUEUED_REQUESTS", "0", "greater than or equal to 1 (got '0')"),
    ("PAGEDSERVE_MODEL", "/no/such/model", "'/no/such/model' is not a Hugging Face model directory"),
]


def start_with_env(model_dir: str, name: str, value: str) -> subprocess.CompletedProcess[str]:
    """`pagedserve serve` with one bad variable; it must exit on its own, long before the timeout."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDSERVE_MODEL": model_dir, name: value}
    command = [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", "--port", "0"]
    return subprocess.run(
        [*command, "--http-port", "0"], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(("name", "value", "says"), INVALID_ENV, ids=[n for n, _, _ in INVALID_ENV])
def test_invalid_env_value_stops_startup_naming_the_variable(
    tiny_llama_dir: str, name: str, value: str, says: str
) -> None:
    result = start_with_env(tiny_llama_dir, name, value)
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"pagedserve serve: error: {name}: ") and says in error, error
    assert "Traceback" not in result.stderr and "pagedserve ready" not in result.stderr, result.stderr
