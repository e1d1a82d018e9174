"""A hybrid model (Nemotron-H: Mamba2 layers with a state per request beside attention) behind a real
`pagedserve serve` on loopback: concurrent streams give the offline engine's greedy tokens, and a client
that vanishes mid-stream leaves no state behind for the request that takes its row next (the rows are
reset when a request starts, not when one ends)."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from grpc_helpers import ServerProcess, request
from pagedserve import LLM, SamplingParams
from tiny_models import save_tiny_model, tiny_hybrid_config

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Mamba layers keep"]


@pytest.fixture(scope="module")
def nemotron_h_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    config = tiny_hybrid_config("nemotron-h")
    return save_tiny_model(tmp_path_factory.mktemp("nemotron-h"), default_model_dir, config)


def test_concurrent_streams_and_a_vanished_client_leave_the_offline_tokens(
    nemotron_h_dir: str, tmp_path: Path
) -> None:
    offline = LLM(model=nemotron_h_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [list(out.outputs[0].token_ids) for out in offline.generate(PROMPTS, params)]
    proc = ServerProcess(
        "--model", nemotron_h_dir, "--dtype", "float32", "--max-num-seqs", "4", log=tmp_path / "log"
    )
    try:
        proc.wait_ready()

        def stream(prompt: str) -> list[int]:
            replies = proc.stub.Generate(request(prompt, max_tokens=24), timeout=120)
            return [token for reply in replies for token in reply.token_ids]

        def concurrently() -> list[list[int]]:
            results: list[list[int]] = [[] for _ in PROMPTS]
            threads = [
                threading.Thread(target=lambda i=i: results.__setitem__(i, stream(PROMPTS[i])))
                for i in range(len(PROMPTS))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            return results

        assert concurrently() == expected
        # a client takes a row, reads one message and vanishes; the next requests reuse the rows
        call = proc.stub.Generate(request(PROMPTS[0], max_tokens=400), timeout=120)
        next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert proc.engine_idle(timeout=30)
        assert concurrently() == expected
    finally:
        proc.stop()
