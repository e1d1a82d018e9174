"""Engine semantics on a tiny random Llama: seeds, stops, limits, logprobs, penalties, abort, and
invalid requests rejected while the valid ones beside them keep running."""

from __future__ import annotations

import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import InvalidRequestError

PROMPTS = [[1, 300, 301, 302], [1, 500, 600, 700, 800, 900], [1, 42], [1] + list(range(1000, 1030))]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def engine(llm: LLM) -> LLMEngine:
    return llm.engine


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=30),
        SamplingParams(temperature=0.7, seed=9, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=12),
    ]
    batch = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]], [others[0], seeded, others[1], others[2]]
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=24)
    )
    assert other_seed[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 2**64 + 7, 10**30])
def test_any_integer_seed_samples_reproducibly_beside_others(llm: LLM, seed: int) -> None:
    """The edges of the gRPC field's int64 and the larger integers JSON clients send: a request's seed
    is mixed with its output index into torch's 64-bit seed, and once overflowed that range, failing
    the whole step, every request in the batch with it."""
    edge = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
    neighbour = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    neighbour_alone = llm.generate([PROMPTS[1]], neighbour)[0].outputs[0].token_ids
    first = llm.generate([PROMPTS[0], PROMPTS[1]], [edge, neighbour])
    again = llm.generate([PROMPTS[0]], edge)
    assert len(first[0].outputs[0].token_ids) == 8
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert first[1].outputs[0].token_ids == neighbour_alone


def test_max_tokens_and_length_finish(llm: LLM) -> None:
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [7, 7, 7, 7]
    assert {o.outputs[0].finish_reason for o in out} == {"length"}
    assert out[0].prompt_token_ids == PROMPTS[0]


def test_stop_strings_cut_text_exactly(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    full = llm.generate([PROMPTS[1]], greedy)[0].outputs[0].text
    stop = full[10:16]
    index = full.index(stop)
    cut = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    )
    assert cut[0].outputs[0].text == full[:index]
    assert cut[0].outputs[0].finish_reason == "stop"
    kept = llm.generate(
        [PROMPTS[1]],
        SamplingParams(
            temperature=0, max_tokens=32, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )
    assert kept[0].outputs[0].text == full[: index + len(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    ids = base[0].outputs[0].token_ids
    stop_id = ids[3]
    first = ids.index(stop_id)
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))
    assert out[0].outputs[0].token_ids == ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    # with min_tokens the stop token cannot be sampled before min_tokens outputs
    late = llm.generate(
        [PROMPTS[3]],
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id], min_tokens=first + 2),
    )
    late_ids = late[0].outputs[0].token_ids
    assert stop_id not in late_ids[: first + 2] and len(late_ids) > first + 1


def test_top_k_1_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    top_k = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))
    top_p = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, ignore_eos=True))
    expected = [o.outputs[0].token_ids for o in greedy]
    assert [o.outputs[0].token_ids for o in top_k] == expected
    assert [o.outputs[0].token_ids for o in top_p] == expected


def test_logprobs_match_hugging_face(llm: LLM, tiny_llama_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    out = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    )[0]
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPTS[1] + completion.token_ids])).logits[0]
    reference = torch.log_softmax(logits[len(PROMPTS[1]) - 1 : -1], dim=-1)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        top = reference[step].topk(3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        assert entry[token].rank == 1  # greedy picks the most likely token
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(reference[step, token_id]), abs=1e-4)
            assert logprob.decoded_token is not None


def hf_greedy_with_repetition_penalty(
    model_dir: str, prompt: list[int], num_tokens: int, penalty: float
) -> list[int]:
    """Hugging Face `generate`'s greedy tokens under a repetition penalty (float32)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        max_new_tokens=num_tokens, do_sample=False, repetition_penalty=penalty, pad_token_id=0
    )
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long)
        )
    return out[0, len(prompt) :].tolist()


def test_repetition_penalty_matches_hugging_face(llm: LLM, tiny_llama_dir: str) -> None:
    prompt = [1, 5, 5, 5, 5, 5, 5]  # without a penalty, greedy output repeats a token by the 14th
    theirs = hf_greedy_with_repetition_penalty(tiny_llama_dir, prompt, 20, 1.5)
    ours = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5, ignore_eos=True)
    )
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert ours[0].outputs[0].token_ids == theirs
    assert ours[0].outputs[0].token_ids != plain[0].outputs[0].token_ids


def test_repetition_penalty_over_a_prompt_prefilled_in_chunks_matches_hugging_face(
    tiny_llama_dir: str,
) -> None:
    """The penalty reads the whole prompt, also when it ran in chunks of 8 over several steps (the
    model runner reads each request's prompt once, at its first sampled token, and keeps it): here
    the unpenalized greedy output starts with a token only the first chunk holds."""
    prompt = [1, 33488, 37514, 35677, 33400, 18070, 31646, 43419]  # the first chunk
    prompt += [23, 88, 94, 28, 123, 11, 42, 135, 163, 76, 12, 3, 99, 89, 43, 143, 181, 40, 44, 47]
    chunked = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=8,
        max_num_seqs=8,
    )
    plain = chunked.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert plain[0].outputs[0].token_ids[0] == 33488  # what the penalty must weigh
    ours = chunked.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.8, ignore_eos=True)
    )
    assert ours[0].outputs[0].token_ids == hf_greedy_with_repetition_penalty(tiny_llama_dir, prompt, 16, 1.8)


def test_abort_frees_blocks_and_id_is_reusable(engine: LLMEngine) -> None:
    free = engine.stats().num_free_blocks
    engine.add_request("abort-me", PROMPTS[3], SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("keep-me", PROMPTS[0], SamplingParams(temperature=0, max_tokens=5))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_free_blocks < free
    engine.abort_request(["abort-me"])
    assert engine.stats().num_unfinished == 1
    assert run_to_end(engine)["keep-me"]
    assert engine.stats().num_free_blocks == free
    engine.add_request("abort-me", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    assert len(run_to_end(engine)["abort-me"]) == 3


INVALID_REQUESTS = [
    ("prompt", [], {}),
    ("prompt_token_ids[1]", [1, 49152], {}),  # the id named by its index
    ("prompt_token_ids[1]", [1, -1], {}),
    ("prompt", [1] * 1024, {}),
    ("max_tokens", [1] * 1000, {"max_tokens": 100}),
]


@pytest.mark.parametrize(("field", "prompt", "params"), INVALID_REQUESTS)
def test_invalid_requests_are_rejected_beside_valid_ones(
    engine: LLMEngine, field: str, prompt: list[int], params: dict[str, int]
) -> None:
    engine.add_request(
        "valid-before", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("invalid", prompt, SamplingParams(**params))
    assert info.value.field == field
    engine.add_request(
        "valid-after", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    tokens = run_to_end(engine)
    assert sorted(tokens) == ["valid-after", "valid-before"]
    assert len(tokens["valid-before"]) == len(tokens["valid-after"]) == 6
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_duplicate_live_request_id_is_rejected(engine: LLMEngine) -> None:
    engine.add_request("dup", PROMPTS[0], SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("dup", PROMPTS[1], SamplingParams(max_tokens=3))
    assert info.value.field == "request_id"
    assert list(run_to_end(engine)) == ["dup"]


def test_request_that_can_never_fit_is_rejected(tiny_llama_dir: str) -> None:
    small = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(InvalidRequestError) as info:
        small.generate([PROMPTS[0]], SamplingParams(max_tokens=100))
    assert info.value.field == "max_tokens"
    # The servers check before queueing (any thread), with the same reason and remedy
    with pytest.raises(InvalidRequestError) as info:
        small.engine.validate_request(PROMPTS[0], SamplingParams(max_tokens=100))
    assert info.value.field == "max_tokens" and "watermark" in str(info.value), info.value
    ok = small.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(ok[0].outputs[0].token_ids) == 20
