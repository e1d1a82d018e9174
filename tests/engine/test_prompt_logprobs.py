"""prompt_logprobs: each prompt token's log-probability (and the top k there) under the raw model,
against a float32 transformers forward of the same tiny Llama, through chunked prefill, the prefix
cache, recompute preemption and parallel sampling."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import RequestDelta, RequestMetrics, TokenLogprobs

K = 3


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1, *(rng.randrange(3, 49152) for _ in range(length - 1))]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> Any:
    """log_softmax of a float32 transformers forward, in float64: row j scores the token at j + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)

    def forward(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1)

    return forward


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def assert_prompt_logprobs(
    got: list[TokenLogprobs | None] | None,
    prompt: list[int],
    reference: torch.Tensor,
    tokenizer: Any,
    k: int = K,
) -> None:
    """vLLM's shape: None for the first token, then per token the token itself with its rank and the
    k most likely tokens there (ranks 1..k), each with its text."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        entry, row, token = got[position], reference[position - 1], prompt[position]
        assert entry is not None
        top_values = row.topk(k + 1).values.tolist()
        assert token in entry and len(entry) in (k, k + 1)
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(row[token_id]), abs=1e-4), (position, token_id)
            # near-ties: between counting them or not
            above = row - row[token_id]
            assert 1 + int((above > 1e-4).sum()) <= logprob.rank <= 1 + int((above > -1e-4).sum())
            assert token_id == token or logprob.rank <= k
            assert logprob.decoded_token == tokenizer.decode([token_id])
        # every token clearly among the top k is listed
        clear = [t for t in row.topk(k).indices.tolist() if float(row[t]) > top_values[k] + 1e-4]
        assert set(clear) <= set(entry)


def record_scored_positions(llm: LLM) -> dict[str, list[int]]:
    """Wrap the engine's executor to record, per sequence id, every prompt position the workers score."""
    scored: dict[str, list[int]] = {}
    execute = llm.engine.executor.execute

    def recording(output: Any) -> Any:
        result = execute(output)
        for seq_id, (first, entries) in result.prompt_logprobs.items():
            scored.setdefault(seq_id, []).extend(range(first, first + len(entries)))
        return result

    llm.engine.executor.execute = recording  # type: ignore[method-assign]
    return scored


def make_llm(tiny_llama_dir: str, **settings: Any) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_num_seqs=8, **settings)


@pytest.mark.parametrize(
    ("length", "budget"),
    [(150, 32), (700, 2048)],  # chunked prefill; one chunk of 700 rows, scored in slices
    ids=["chunked", "long"],
)
def test_prompt_logprobs_are_the_models(
    tiny_llama_dir: str, reference: Any, tokenizer: Any, length: int, budget: int
) -> None:
    llm = make_llm(tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=budget)
    prompt = random_prompt(length, seed=length)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = llm.generate([prompt], greedy)[0]
    assert plain.prompt_logprobs is None
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=K)
    )[0]
    assert_prompt_logprobs(out.prompt_logprobs, prompt, reference(prompt), tokenizer)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.outputs[0].logprobs is None
    assert llm.engine.executor.worker.model_runner.prompt_token_ids == {}  # nothing left owed


def test_prompt_logprobs_zero_lists_the_prompt_token_alone(tiny_llama_dir: str, reference: Any) -> None:
    llm = make_llm(tiny_llama_dir, num_kv_blocks=32)
    prompt = random_prompt(20, seed=3)
    out = llm.generate([prompt, [1]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    ref = reference(prompt)
    got = out[0].prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    for position in range(1, len(prompt)):
        entry = got[position]
        assert entry is not None and list(entry) == [prompt[position]]
        assert entry[prompt[position]].logprob == pytest.approx(
            float(ref[position - 1, prompt[position]]), abs=1e-4
        )
    assert out[1].prompt_logprobs == [None]  # a one-token prompt: nothing to score


def test_prompt_logprobs_skip_the_prefix_cache_but_fill_it(
    tiny_llama_dir: str, reference: Any, tokenizer: Any
) -> None:
    """A prompt whose blocks are cached is still computed whole (else its first positions had no logits);
    what it computes is cached for requests without prompt logprobs."""
    llm = make_llm(tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=48, enable_prefix_caching=True)
    cached, fresh = random_prompt(100, seed=11), random_prompt(100, seed=12)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K)
    assert llm.generate([cached], SamplingParams(max_tokens=1))[0].num_cached_tokens == 0
    out = llm.generate([cached], params)[0]
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs(out.prompt_logprobs, cached, reference(cached), tokenizer)
    first = llm.generate([fresh], params)[0]
    assert_prompt_logprobs(first.prompt_logprobs, fresh, reference(fresh), tokenizer)
    again = llm.generate([fresh], SamplingParams(temperature=0, max_tokens=3))[0]
    assert again.num_cached_tokens == 96  # the full blocks the prompt-logprobs request computed
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_prompt_logprobs_survive_preemption(
    tiny_llama_dir: str, reference: Any, tokenizer: Any, preemption_mode: str
) -> None:
    """Two decodes hold 20 of 24 blocks: a younger request's chunked prompt runs out of room in its
    middle and is preempted. Recomputed (again and again until the decodes finish), it runs its prompt
    again each time, and each prompt position is reported once; swapped out, it goes on where it was."""
    llm = make_llm(
        tiny_llama_dir, num_kv_blocks=24, max_num_batched_tokens=40, preemption_mode=preemption_mode
    )
    decodes = [random_prompt(150, seed=20 + i) for i in range(2)]
    scored = [random_prompt(90, seed=30 + i) for i in range(2)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0, max_tokens=1 + 7 * i, ignore_eos=True, prompt_logprobs=K)
        for i in range(2)
    ]
    positions = record_scored_positions(llm)
    outs = llm.generate(decodes + scored, params)
    # a request of max_tokens 1 preempted was preempted before its one token: in the middle of its prompt
    assert outs[2].metrics is not None and outs[2].metrics.num_preemptions > 0
    stats = llm.engine.stats()
    if preemption_mode == "recompute":
        assert stats.num_swap_preemptions == 0
        assert len(positions[outs[2].request_id]) > len(scored[0]) - 1  # scored again after a preemption
    else:
        assert stats.num_recompute_preemptions == 0
        assert positions[outs[2].request_id] == list(range(1, len(scored[0])))
    for prompt, out in zip(scored, outs[2:], strict=True):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, reference(prompt), tokenizer)
    roomy = make_llm(tiny_llama_dir, num_kv_blocks=128)
    assert [o.outputs[0].token_ids for o in roomy.generate(decodes + scored, params)] == [
        o.outputs[0].token_ids for o in outs
    ]


def test_parallel_samples_report_prompt_logprobs_once(
    tiny_llama_dir: str, reference: Any, tokenizer: Any
) -> None:
    """n = 2: the prompt is scored once, and only completion 0's first delta with tokens carries it."""
    llm = make_llm(tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=32)
    prompt = random_prompt(70, seed=40)
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, prompt_logprobs=K)
    out = llm.generate([prompt], params)[0]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert_prompt_logprobs(out.prompt_logprobs, prompt, reference(prompt), tokenizer)

    positions = record_scored_positions(llm)
    llm.engine.add_request("stream", prompt, params)
    deltas: list[RequestDelta] = []
    for _ in range(100):
        deltas.extend(llm.engine.step())
        if deltas and deltas[-1].request_finished:
            break
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].index == 0
    assert carrying[0] is next(d for d in deltas if d.index == 0 and d.new_token_ids)
    assert_prompt_logprobs(carrying[0].prompt_logprobs, prompt, reference(prompt), tokenizer)
    assert positions == {"stream#0": list(range(1, len(prompt)))}  # the sibling scored nothing


def test_a_held_back_first_delta_keeps_its_prompt_logprobs() -> None:
    first = RequestDelta(
        "r", [5], "x", None, False, None, 3, 1, RequestMetrics(0.0), prompt_logprobs=[None, {}, {}]
    )
    later = RequestDelta("r", [6], "y", None, False, None, 3, 2, RequestMetrics(0.0))
    later.prepend(first)
    assert later.prompt_logprobs == [None, {}, {}] and later.new_token_ids == [5, 6]


def test_an_early_end_does_not_repeat_the_prompt_logprobs() -> None:
    first = RequestDelta(
        "r", [5], "x", None, False, None, 3, 1, RequestMetrics(0.0), prompt_logprobs=[None, {}, {}]
    )
    assert RequestDelta.ended_early("r", first, 3, 0.0, None).prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_bad_prompt_logprobs_are_refused_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
    assert caught.value.field == "prompt_logprobs"


def test_tensor_parallel_prompt_logprobs_are_the_models(
    tiny_llama_dir: str, reference: Any, tokenizer: Any
) -> None:
    """Two ranks each score a chunk's rows (the LM head gathers the vocabulary across them); rank 0's
    are returned."""
    llm = make_llm(tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=24, tensor_parallel_size=2)
    try:
        prompt = random_prompt(60, seed=50)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K))[0]
        assert_prompt_logprobs(out.prompt_logprobs, prompt, reference(prompt), tokenizer)
    finally:
        llm.engine.executor.shutdown()
