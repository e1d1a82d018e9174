"""vLLM's detokenization flags through the engine on the tiny Llama: `detokenize=False` gives the same
tokens with no text and no decoding at all (text "", logprobs' decoded tokens None, as vLLM gives
them); `spaces_between_special_tokens` reaches the decode: the text is transformers' decode of the
same ids with the same flags, over many steps with special tokens between the words."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.engine import llm_engine
from spaced_tokenizer import SpacedSpecialTokens
from transformers import AutoTokenizer

NUM_SPECIAL = 17  # ids 0..16 are the tokenizer's special tokens
SPECIAL = [0, 1, 2, 4, 12]  # <|endoftext|>, <|im_start|>, <|im_end|> (EOS), <reponame>, <jupyter_text>
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _words(tokenizer: Any) -> list[int]:
    return [t for w in (" hello", " world", ".", "\n", "é") for t in tokenizer.encode(w)]


def _no_decoding(*args: object, **kwargs: object) -> None:
    raise AssertionError("decoded a request with detokenize=False")


def test_without_detokenize_the_same_tokens_come_with_no_text(
    llm: LLM, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(
        n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    texted = llm.generate([PROMPT], params)[0]
    # no decoding work: no detokenizer made, no logprob's token decoded
    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", _no_decoding)
    monkeypatch.setattr(llm.engine, "token_text", _no_decoding)
    bare = llm.generate([PROMPT], replace(params, detokenize=False))[0]

    assert bare.prompt == PROMPT and bare.prompt_token_ids == texted.prompt_token_ids
    for with_text, without in zip(texted.outputs, bare.outputs, strict=True):
        assert without.token_ids == with_text.token_ids and len(without.token_ids) == 12
        assert with_text.text == tokenizer.decode(with_text.token_ids) != ""
        assert without.text == "" and without.finish_reason == "length"
        assert without.cumulative_logprob == with_text.cumulative_logprob
        assert without.logprobs is not None and with_text.logprobs is not None
        for mine, theirs in zip(without.logprobs, with_text.logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(lp.decoded_token is None for lp in mine.values())
            assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in theirs.items())
    assert bare.prompt_logprobs is not None and bare.prompt_logprobs[0] is None
    assert all(lp.decoded_token is None for entry in bare.prompt_logprobs[1:] for lp in entry.values())  # type: ignore[union-attr]


def test_without_detokenize_every_delta_and_an_abort_carry_no_text(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed step by step, then aborted mid-stream (which sends the text held back, when there is
    text): tokens in every delta, text in none."""
    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", _no_decoding)
    prompt = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, detokenize=False)
    llm.engine.add_request("bare", prompt, params)
    deltas = [d for _ in range(6) for d in llm.engine.step()]
    deltas += llm.engine.abort_request(["bare"])
    assert [len(d.new_token_ids) for d in deltas[:6]] == [1] * 6
    assert deltas[-1].finished and deltas[-1].finish_reason == "aborted"
    assert all(d.new_text == "" for d in deltas)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("spaces", [False, True])
def test_special_tokens_text_is_transformers_decode_with_the_same_flag(
    llm: LLM, tokenizer: Any, spaces: bool
) -> None:
    """The model may say only special tokens and a few words: 48 steps of text with special tokens
    between them, streamed delta by delta into the output, equal transformers' decode of the ids."""
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=48,
        ignore_eos=True,
        allowed_token_ids=[*SPECIAL, *_words(tokenizer)],
        skip_special_tokens=False,
        spaces_between_special_tokens=spaces,
    )
    outputs = llm.generate([PROMPT], params)[0].outputs
    for output in outputs:
        assert len(output.token_ids) == 48
        assert sum(t < NUM_SPECIAL for t in output.token_ids) >= 5  # special tokens between words
        assert sum(t >= NUM_SPECIAL for t in output.token_ids) >= 5
        expected = tokenizer.decode(
            output.token_ids, skip_special_tokens=False, spaces_between_special_tokens=spaces
        )
        assert output.text == expected
    # shown or skipped, the special tokens follow skip_special_tokens, whatever the spaces
    skipped = llm.generate([PROMPT], replace(params, skip_special_tokens=True))[0].outputs
    for output, shown in zip(skipped, outputs, strict=True):
        assert output.token_ids == shown.token_ids
        assert output.text == tokenizer.decode(output.token_ids, skip_special_tokens=True) != shown.text


def test_spaces_between_special_tokens_reaches_the_tokenizer_s_decode(
    llm: LLM, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a tokenizer that reads the flag (transformers 4's slow ones did): the engine's text is its
    decode of the ids with the flag, spaced or not. The first token is no special token: one would
    take the space that joins it to the prompt's last token (as vLLM's detokenizer gives it too)."""
    spaced = SpacedSpecialTokens.from_pretrained(tiny_llama_dir)
    monkeypatch.setattr(llm.engine, "tokenizer", spaced)
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=32,
        ignore_eos=True,
        allowed_token_ids=[*SPECIAL, *_words(spaced)],
        skip_special_tokens=False,
    )
    texts = {}
    for spaces in (True, False):
        prompt = spaced.encode(PROMPT)
        output = llm.generate([prompt], replace(params, spaces_between_special_tokens=spaces))[0].outputs[0]
        assert output.token_ids[0] not in SPECIAL and sum(t in SPECIAL for t in output.token_ids) >= 5
        texts[spaces] = output.text
        assert output.text == spaced.decode(output.token_ids, spaces_between_special_tokens=spaces)
    assert texts[True] != texts[False] and texts[True].replace(" ", "") == texts[False].replace(" ", "")
