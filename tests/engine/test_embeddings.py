"""Embeddings (vLLM's `LLM.embed`): the final-normed hidden state of the last prompt token, or the mean
over the prompt, normalized unless asked not to, against a float32 transformers forward of the same
tiny Llama (`last_hidden_state`), through chunked prefill, the prefix cache, preemption and batches
shared with generation."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from pagedserve import LLM, PoolingParams, SamplingParams
from pagedserve.errors import InvalidRequestError


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1, *(rng.randrange(3, 49152) for _ in range(length - 1))]


@pytest.fixture(scope="module")
def hidden_states(tiny_llama_dir: str) -> Any:
    """A prompt's last_hidden_state rows, from a float32 transformers forward, in float64."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32)

    def forward(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([prompt])).last_hidden_state[0].double()

    return forward


def expected(rows: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    vector = rows[-1] if pooling == "last" else rows.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_close(got: list[float], want: torch.Tensor) -> None:
    """vLLM's check_embeddings_close: cosine similarity >= 1 - 1e-3; and the same scale."""
    got_t = torch.tensor(got, dtype=torch.float64)
    assert got_t.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got_t, want, dim=0) >= 1 - 1e-3
    assert got_t.norm().item() == pytest.approx(want.norm().item(), rel=1e-3)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    # a budget of 32 tokens chunks the longer prompts; 16-token blocks
    return LLM(
        model=tiny_llama_dir,
        dtype="float32",
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=256,
    )


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_are_the_models_hidden_states(
    llm: LLM, hidden_states: Any, pooling: str, normalize: bool
) -> None:
    prompts = [random_prompt(length, seed) for seed, length in enumerate([1, 7, 40, 100])]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling, normalize))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt and out.finished
        assert_close(out.outputs.embedding, expected(hidden_states(prompt), pooling, normalize))
        if normalize:
            assert math.fsum(v * v for v in out.outputs.embedding) == pytest.approx(1.0, abs=1e-6)


def test_the_prefix_cache_serves_last_pooling_and_mean_pooling_runs_the_whole_prompt(
    llm: LLM, hidden_states: Any
) -> None:
    """The second run of a 100-token prompt finds 96 tokens in the cache with "last" (its last token
    still runs) and none with "mean"; both give the model's vector."""
    prompt = random_prompt(100, 99)
    reference = hidden_states(prompt)
    for pooling, cached in (("last", 96), ("mean", 0)):
        llm.embed([prompt], PoolingParams(pooling))
        engine = llm.engine
        before = engine.stats().num_prefix_hits
        [out] = llm.embed([prompt], PoolingParams(pooling))
        assert engine.stats().num_prefix_hits - before == cached
        assert_close(out.outputs.embedding, expected(reference, pooling, True))


def test_embeddings_share_batches_with_generation(llm: LLM, hidden_states: Any) -> None:
    """Generation and embeddings added to one engine and stepped together: the generated tokens are
    those of a run alone, and the vectors the model's."""
    engine = llm.engine
    prompts = [random_prompt(30, seed) for seed in (11, 12, 13)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [alone] = llm.generate([{"prompt_token_ids": prompts[0]}], greedy)
    engine.add_request("gen", prompts[0], greedy)
    engine.add_request("last", prompts[1], PoolingParams("last").as_sampling_params())
    engine.add_request("mean", prompts[2], PoolingParams("mean").as_sampling_params())
    tokens, vectors, steps = [], {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for delta in engine.step():
            if delta.embedding is not None:
                assert delta.finished and delta.finish_reason == "stop" and not delta.new_token_ids
                vectors[delta.request_id] = delta.embedding
            tokens.extend(delta.new_token_ids if delta.request_id == "gen" else [])
    assert tokens == alone.outputs[0].token_ids
    assert_close(vectors["last"], expected(hidden_states(prompts[1]), "last", True))
    assert_close(vectors["mean"], expected(hidden_states(prompts[2]), "mean", True))
    llm._drop_worker_state()
    assert not engine.executor.worker.model_runner.pooling_request_ids  # type: ignore[attr-defined]


def test_a_prompt_may_fill_the_whole_context(llm: LLM, hidden_states: Any) -> None:
    """Nothing is generated, so 256 tokens fit a 256-token context (a generation request needs room);
    truncate_prompt_tokens=-1 keeps the last 256 of a longer prompt."""
    prompt = random_prompt(300, 7)
    with pytest.raises(InvalidRequestError, match="exceed the context length"):
        llm.embed([prompt])
    [whole, truncated] = llm.embed(
        [prompt[-256:], prompt], [PoolingParams(), PoolingParams(truncate_prompt_tokens=-1)]
    )
    assert truncated.prompt_token_ids == prompt[-256:]
    assert whole.outputs.embedding == pytest.approx(truncated.outputs.embedding, abs=1e-6)
    assert_close(whole.outputs.embedding, expected(hidden_states(prompt[-256:]), "last", True))


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"pooling": "cls"}, "pooling"),
        ({"pooling": 3}, "pooling"),
        ({"normalize": "yes"}, "normalize"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_pooling_params_name_the_field(given: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        PoolingParams(**given)
    assert caught.value.field == field


def test_bad_embed_calls_name_what_is_wrong(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        llm.embed(["a", "b"], [PoolingParams()])
    assert caught.value.field == "pooling_params"
    with pytest.raises(InvalidRequestError, match="got 0 for 2 prompts"):  # not the defaults for all
        llm.embed(["a", "b"], [])
    with pytest.raises(InvalidRequestError) as caught:
        llm.embed(["a"], SamplingParams())  # type: ignore[arg-type]
    assert caught.value.field == "pooling_params"
    with pytest.raises(InvalidRequestError) as caught:
        llm.embed([[1, 10**9]])
    assert caught.value.field == "prompt_token_ids[1]"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_embeddings_are_unchanged(tiny_llama_dir: str, hidden_states: Any, mode: str) -> None:
    """A KV cache of 30 blocks of 8 tokens for 8 generations of 40 + 40 tokens and 8 embeddings of 60
    prompt tokens, prefilled 24 tokens a step: embeddings are preempted mid-prompt (swapped out with
    their computed blocks, or run again from the start), and their vectors are still the model's."""
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=30,
        block_size=8,
        num_cpu_kv_blocks=200,
        preemption_mode=mode,
        max_num_seqs=16,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = {f"e{i}": random_prompt(60, 100 + i) for i in range(8)}
    for i in range(8):
        engine.add_request(f"g{i}", random_prompt(40, 200 + i), greedy)
        pooling = PoolingParams("mean" if i % 2 else "last")
        engine.add_request(f"e{i}", prompts[f"e{i}"], pooling.as_sampling_params())
    preempted, vectors = 0, {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.embedding is not None:
                vectors[delta.request_id] = delta.embedding
                preempted += delta.metrics.num_preemptions
    assert preempted > 0
    for i in range(8):
        pooling = "mean" if i % 2 else "last"
        assert_close(vectors[f"e{i}"], expected(hidden_states(prompts[f"e{i}"]), pooling, True))
    assert engine.stats().num_free_blocks == 30
