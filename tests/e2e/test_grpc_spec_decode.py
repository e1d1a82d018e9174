"""Speculative decoding behind the gRPC server (`--speculative-config`): a step that accepts drafts
streams its tokens in one response, each with its logprobs, and the stream's tokens and text are an
engine's without drafts; the Prometheus endpoint counts drafts and accepted tokens.

One in-process server (the CLI's assembly, real sockets, a real grpc client) on the default model,
float32 (eager, as the offline engine it is held to)."""

from __future__ import annotations

import pytest
from inprocess_server import InProcessServer, scrape
from pagedserve import LLM, SamplingParams
from pagedserve.rpc.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
TEXT = "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Copy: apple, banana,"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(default_model_dir: str) -> InProcessServer:
    srv = InProcessServer(
        default_model_dir, provider=None, dtype="float32", num_kv_blocks=128, speculative_config=NGRAM
    ).start()
    yield srv
    srv.stop()


def test_a_stream_carries_the_accepted_drafts_and_equals_decoding_without_them(
    server: InProcessServer, default_model_dir: str
) -> None:
    params = pb.SamplingParameters(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    responses = list(server.stub.Generate(pb.GenerateRequest(text=TEXT, sampling=params), timeout=120))
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == MAX_TOKENS == responses[-1].completion_tokens
    assert max(len(r.token_ids) for r in responses) > 1, "no step accepted a draft"
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    assert all(entry.sampled.token_id == t for r in responses for entry, t in zip(r.logprobs, r.token_ids))

    plain = LLM(model=default_model_dir, dtype="float32", num_kv_blocks=128)
    [theirs] = plain.generate([TEXT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert tokens == theirs.outputs[0].token_ids
    assert "".join(r.text for r in responses) == theirs.outputs[0].text

    samples = {name: value for (name, _), value in scrape(server).items()}
    drafts = samples["vllm:spec_decode_num_draft_tokens_total"]
    accepted = samples["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts >= accepted >= sum(len(r.token_ids) - 1 for r in responses) > 0
