"""truncate_prompt_tokens (vLLM's): a request runs with its prompt's last k tokens, exactly as if it
had been sent that tail; -1 keeps as many as leave max_tokens of room in the context."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=8, max_model_len=MAX_MODEL_LEN)


def prompt(length: int) -> list[int]:
    rng = random.Random(length)
    return [1, *(rng.randrange(3, 49152) for _ in range(length - 1))]


def greedy(max_tokens: int = 6, **given: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **given)


def test_the_last_k_tokens_run_as_that_prompt_would(llm: LLM) -> None:
    long = prompt(40)
    [truncated, tail] = llm.generate(
        [{"prompt_token_ids": long}, {"prompt_token_ids": long[-10:]}],
        [greedy(truncate_prompt_tokens=10, prompt_logprobs=0), greedy(prompt_logprobs=0)],
    )
    assert truncated.prompt_token_ids == long[-10:]
    assert truncated.outputs[0].token_ids == tail.outputs[0].token_ids
    assert truncated.prompt_logprobs is not None and len(truncated.prompt_logprobs) == 10
    assert [next(iter(e)) for e in truncated.prompt_logprobs[1:]] == long[-9:]  # type: ignore[union-attr]
    [short] = llm.generate([{"prompt_token_ids": long[:5]}], greedy(truncate_prompt_tokens=10))
    assert short.prompt_token_ids == long[:5]  # shorter than k: unchanged


def test_minus_one_keeps_what_leaves_max_tokens_of_room(llm: LLM) -> None:
    """A prompt longer than the context fits with -1: MAX_MODEL_LEN - max_tokens tokens remain."""
    too_long = prompt(100)
    with pytest.raises(InvalidRequestError, match="context length"):
        llm.generate([{"prompt_token_ids": too_long}], greedy(8))
    [out] = llm.generate([{"prompt_token_ids": too_long}], greedy(8, truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == too_long[-(MAX_MODEL_LEN - 8) :]
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize("bad", [0, -2, 1.5, "3", True])
def test_a_bad_value_names_the_field(bad: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(truncate_prompt_tokens=bad)
    assert caught.value.field == "truncate_prompt_tokens"


def test_more_than_the_context_length_is_refused(llm: LLM) -> None:
    """vLLM refuses it too: such a k truncates nothing the context could hold."""
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate(["Hi", "Hello"], [greedy(), greedy(truncate_prompt_tokens=MAX_MODEL_LEN + 1)])
    assert caught.value.field == "truncate_prompt_tokens"
    assert "(prompts[1])" in caught.value.message
