"""Streaming deltas from a real server concatenate to exactly the offline LLM.generate result."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_helpers import ServerProcess
from pagedserve import LLM, SamplingParams
from pagedserve.rpc.v1 import generate_pb2 as pb


@pytest.mark.slow
def test_streamed_deltas_equal_offline_generate(default_model_dir: str, tmp_path: Path) -> None:
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    offline = LLM(dtype="float32").chat(question, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    proc = ServerProcess("--dtype", "float32", log=tmp_path / "server.log").wait_ready()
    try:
        messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question[0]["content"])])
        req = pb.GenerateRequest(
            messages=messages, sampling=pb.SamplingParameters(temperature=0, max_tokens=40)
        )
        responses = list(proc.stub.Generate(req, timeout=120))
    finally:
        proc.stop()
    assert "".join(r.text for r in responses) == offline.text
    assert [t for r in responses for t in r.token_ids] == offline.token_ids
    assert "Paris" in offline.text and len(responses) > 1  # streamed in pieces
