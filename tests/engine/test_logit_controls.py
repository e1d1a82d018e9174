"""vLLM's logit controls on the real engine: `logit_bias` moves what is sampled (greedy too), only
`allowed_token_ids` may be sampled, a `bad_words` word's tokens never follow each other; logprobs stay
the raw model's; requests without controls beside them are untouched; bad values are refused at
admission naming their field, and the engine keeps serving; with a grammar, the grammar applies first
and wins where the two leave no token; tensor-parallel ranks get the bad words' token ids."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams
from tiny_models import save_tiny_model

PROMPTS = [[1, 300, 301, 302], [1, 500, 600, 700, 800, 900], [1, 42], [1, *range(1000, 1030)]]
VOCAB = 49152
EOS = 2  # the tiny model's (tests/tiny_models.py)


def greedy(**extra: object) -> SamplingParams:
    settings: dict[str, object] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, **extra}
    return SamplingParams(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=16)


def token_ids(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


# -- logit_bias ------------------------------------------------------------------------------------------


def test_a_large_positive_bias_makes_greedy_pick_the_token_and_logprobs_stay_raw(llm: LLM) -> None:
    free = llm.generate([PROMPTS[0]], greedy(logprobs=1))[0].outputs[0]
    target = next(t for t in range(1000, 2000) if t not in free.token_ids)
    for bias in ({target: 100.0}, {str(target): 1e9}):  # JSON's string keys; clamped to 100 as OpenAI's
        out = llm.generate([PROMPTS[0]], greedy(logprobs=1, logit_bias=bias))[0].outputs[0]
        assert out.token_ids == [target] * 12
        first, free_first = out.logprobs[0], free.logprobs[0]  # type: ignore[index]
        # the raw model's: its own greedy token still ranks first, with the same logprob
        raw_top = free.token_ids[0]
        assert first[raw_top].rank == 1 and first[raw_top].logprob == free_first[raw_top].logprob
        assert first[target].rank > 1 and first[target].logprob < first[raw_top].logprob


def test_a_large_negative_bias_takes_the_raw_second_choice(llm: LLM) -> None:
    free = llm.generate([PROMPTS[1]], greedy(logprobs=2))[0].outputs[0]
    top = free.token_ids[0]
    out = llm.generate([PROMPTS[1]], greedy(logprobs=2, logit_bias={top: -100.0}))[0].outputs[0]
    second = next(t for t, lp in out.logprobs[0].items() if lp.rank == 2)  # type: ignore[index]
    assert out.token_ids[0] == second != top
    assert top not in out.token_ids  # every step


def test_bias_applies_to_sampled_rows(llm: LLM) -> None:
    """A seeded sampled request: the bias moves its draws (and a strong one decides them)."""
    params = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    free = token_ids(llm, [PROMPTS[2]], SamplingParams(**params))[0]  # type: ignore[arg-type]
    target = next(t for t in range(3000, 4000) if t not in free)
    biased = token_ids(llm, [PROMPTS[2]], SamplingParams(logit_bias={target: 100}, **params))[0]  # type: ignore[arg-type]
    assert biased == [target] * 12


# -- allowed_token_ids -----------------------------------------------------------------------------------


def test_only_allowed_tokens_are_sampled_greedy_and_random(llm: LLM) -> None:
    free = token_ids(llm, PROMPTS, greedy())
    allowed = [t for t in range(5000, 5008) if not any(t in ids for ids in free)]
    outs = token_ids(llm, PROMPTS, greedy(allowed_token_ids=allowed))
    sampled = token_ids(
        llm,
        PROMPTS,
        SamplingParams(temperature=1.5, seed=9, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed),
    )
    for ids in outs + sampled:
        assert set(ids) <= set(allowed)
    assert len(set().union(*map(set, sampled))) > 1  # sampled, not one forced token


def test_greedy_takes_the_best_allowed_token(llm: LLM) -> None:
    """The first token: of the allowed ones, the one the raw model ranks highest."""
    free = llm.generate([PROMPTS[3]], greedy(logprobs=5))[0].outputs[0]
    ranked = sorted(free.logprobs[0].items(), key=lambda item: item[1].rank)  # type: ignore[index]
    other = next(t for t in range(7000, 8000) if t not in dict(ranked))  # ranked lower still
    allowed = [ranked[4][0], ranked[2][0], other]  # the raw fifth and third choices, and another
    out = llm.generate([PROMPTS[3]], greedy(allowed_token_ids=allowed, logprobs=5))[0].outputs[0]
    assert out.token_ids[0] == ranked[2][0]
    assert out.logprobs[0][ranked[2][0]].rank == 3  # type: ignore[index]  # raw, not renormalized


# -- bad_words -------------------------------------------------------------------------------------------


def _two_token_word(llm: LLM, ids: list[int]) -> tuple[int, str]:
    """The first position i >= 1 whose two tokens ids[i:i+2] are how a bad word would be tokenized (as
    given or after a space), and that word; the pair occurs nowhere before i."""
    tokenizer = llm.engine.tokenizer
    for i in range(1, len(ids) - 1):
        span = ids[i : i + 2]
        word = tokenizer.decode(span).lstrip()
        forms = [tokenizer.encode(prefix + word, add_special_tokens=False) for prefix in ("", " ")]
        earlier = any(ids[j : j + 2] == span for j in range(i))
        if span in forms and not earlier:
            return i, word
    raise AssertionError(f"no two-token word in {ids}")


def test_a_multi_token_bad_word_is_never_completed(llm: LLM) -> None:
    for prompt in PROMPTS[:2]:
        free = token_ids(llm, [prompt], greedy(max_tokens=16))[0]
        i, word = _two_token_word(llm, free)
        out = token_ids(llm, [prompt], greedy(max_tokens=16, bad_words=[word]))[0]
        # the same up to the word's first token (not banned alone), then anything but its second
        assert out[: i + 1] == free[: i + 1]
        assert out[i + 1] != free[i + 1]
        assert all(out[j : j + 2] != free[i : i + 2] for j in range(len(out) - 1))


def _one_token_word(llm: LLM, ids: list[int]) -> tuple[int, str, set[int]]:
    """The first position of `ids` whose token is a word both as given and after a space ("word" and
    " word" one token each, one of them that token); that word, and its two tokens."""
    tokenizer = llm.engine.tokenizer
    for i, token_id in enumerate(ids):
        word = tokenizer.decode([token_id]).strip()
        forms = [tokenizer.encode(p + word, add_special_tokens=False) for p in ("", " ")] if word else []
        if [token_id] in forms and all(len(f) == 1 for f in forms) and forms[0] != forms[1]:
            return i, word, {f[0] for f in forms}
    raise AssertionError(f"no one-token word in {ids}")


def test_a_one_token_bad_word_is_banned_at_every_step_in_both_forms(llm: LLM) -> None:
    free = token_ids(llm, [PROMPTS[2]], greedy())[0]
    i, word, banned = _one_token_word(llm, free)
    out = token_ids(llm, [PROMPTS[2]], greedy(bad_words=[word]))[0]
    assert out[:i] == free[:i] and out[i] != free[i]
    assert not banned & set(out)


def test_sampled_completions_of_n_skip_bad_words(llm: LLM) -> None:
    """n = 3 seeded completions (each its own copy of the params, with the bad words' ids)."""
    params = {"n": 3, "temperature": 1.0, "seed": 1, "max_tokens": 24, "ignore_eos": True}
    free = [c.token_ids for c in llm.generate([PROMPTS[3]], SamplingParams(**params))[0].outputs]  # type: ignore[arg-type]
    _, word, banned = _one_token_word(llm, free[2])
    out = llm.generate([PROMPTS[3]], SamplingParams(bad_words=[word], **params))[0].outputs  # type: ignore[arg-type]
    assert all(not banned & set(c.token_ids) for c in out)
    assert out[0].token_ids != free[0] or out[1].token_ids != free[1] or out[2].token_ids != free[2]


# -- batches ---------------------------------------------------------------------------------------------


def test_requests_without_controls_are_untouched_by_those_beside_them(llm: LLM) -> None:
    plain = [greedy(), SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)]
    alone = token_ids(llm, PROMPTS[:2], plain)
    controlled = [
        greedy(logit_bias={1234: 100.0}),
        greedy(allowed_token_ids=[10, 11, 12]),
        greedy(bad_words=["the", "hello world"]),
        SamplingParams(
            temperature=1.0, seed=6, max_tokens=12, logit_bias={99: -50.0}, allowed_token_ids=[99, 98]
        ),
    ]
    mixed = token_ids(llm, [*PROMPTS[:2], *PROMPTS, PROMPTS[0]], [*plain, *controlled, greedy(min_tokens=3)])
    assert mixed[:2] == alone
    assert mixed[2] == [1234] * 12 and set(mixed[3]) <= {10, 11, 12} and set(mixed[5]) <= {98, 99}


# -- structured outputs ----------------------------------------------------------------------------------

CHOICES = ["red", "green", "blue", "yellow"]


def test_allowed_token_ids_narrow_a_grammar(llm: LLM) -> None:
    """The grammar's mask applies first, then allowed_token_ids: of the choices, only the one whose
    tokens are allowed can be completed."""
    tokenizer = llm.engine.tokenizer
    grammar = StructuredOutputsParams(choice=CHOICES)
    free = llm.generate([PROMPTS[0]], greedy(structured_outputs=grammar, ignore_eos=False))[0].outputs[0]
    assert free.text in CHOICES
    other = next(c for c in CHOICES if c != free.text)
    allowed = [*tokenizer.encode(other, add_special_tokens=False), EOS]
    params = greedy(structured_outputs=grammar, ignore_eos=False, allowed_token_ids=allowed)
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert (out.text, out.finish_reason) == (other, "eos")


def test_where_controls_leave_no_token_the_grammar_then_allowed_ids_win(llm: LLM) -> None:
    """A grammar and allowed_token_ids that share no token: the grammar's tokens are sampled (the
    request completes its grammar, no error); allowed_token_ids that min_tokens bans entirely (EOS
    alone): allowed_token_ids win over the ban. No step fails, and the engine keeps serving."""
    grammar = StructuredOutputsParams(choice=CHOICES)
    out = llm.generate(
        [PROMPTS[1]], greedy(structured_outputs=grammar, ignore_eos=False, allowed_token_ids=[7777])
    )
    assert out[0].outputs[0].text in CHOICES and out[0].outputs[0].finish_reason == "eos"
    eos_only = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6, min_tokens=3, allowed_token_ids=[EOS])
    )
    completion = eos_only[0].outputs[0]
    assert set(completion.token_ids) == {EOS} and completion.finish_reason == "eos"
    eos_word = llm.engine.tokenizer.decode([EOS])  # a bad word of one token, EOS
    banned = llm.generate([PROMPTS[1]], greedy(allowed_token_ids=[EOS, 7], bad_words=[eos_word]))
    assert set(banned[0].outputs[0].token_ids) == {7}
    banned_all = llm.generate([PROMPTS[1]], greedy(allowed_token_ids=[EOS], bad_words=[eos_word]))
    assert set(banned_all[0].outputs[0].token_ids) == {EOS}


# -- validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "settings"),
    [
        ("logit_bias", {"logit_bias": [[1, 2.0]]}),
        ("logit_bias", {"logit_bias": {"one": 1.0}}),
        ("logit_bias", {"logit_bias": {1.5: 1.0}}),
        ("logit_bias", {"logit_bias": {True: 1.0}}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("logit_bias", {"logit_bias": {1: math.inf}}),
        ("logit_bias", {"logit_bias": {1: math.nan}}),
        ("logit_bias", {"logit_bias": {1: "2"}}),
        ("logit_bias", {"logit_bias": {"9" * 5000: 1.0}}),
        ("logit_bias", {"logit_bias": {"-1": 1.0}}),
        ("logit_bias", {"logit_bias": {t: 1.0 for t in range(1025)}}),
        ("allowed_token_ids", {"allowed_token_ids": []}),
        ("allowed_token_ids", {"allowed_token_ids": "1 2"}),
        ("allowed_token_ids", {"allowed_token_ids": 5}),
        ("allowed_token_ids", {"allowed_token_ids": [1.0]}),
        ("allowed_token_ids", {"allowed_token_ids": [True]}),
        ("allowed_token_ids", {"allowed_token_ids": [-3]}),
        ("allowed_token_ids", {"allowed_token_ids": list(range(1025))}),
        ("bad_words", {"bad_words": "word"}),
        ("bad_words", {"bad_words": [""]}),
        ("bad_words", {"bad_words": ["  "]}),
        ("bad_words", {"bad_words": [3]}),
        ("bad_words", {"bad_words": ["w"] * 1025}),
        ("bad_words", {"bad_words": ["w" * 1025]}),
    ],
)
def test_malformed_controls_name_the_field(field: str, settings: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**settings)  # type: ignore[arg-type]
    assert exc.value.field == field


@pytest.mark.parametrize(
    ("field", "settings"),
    [
        ("logit_bias", {"logit_bias": {VOCAB: 1.0}}),
        ("logit_bias", {"logit_bias": {str(VOCAB): 1.0}}),
        ("allowed_token_ids", {"allowed_token_ids": [5, VOCAB]}),
    ],
)
def test_out_of_vocab_token_ids_are_refused_at_admission(
    llm: LLM, field: str, settings: dict[str, object]
) -> None:
    engine = llm.engine
    params = greedy(**settings)
    for admit in (
        lambda: engine.validate_request(PROMPTS[0], params),
        lambda: engine.add_request("bad", PROMPTS[0], params),
    ):
        with pytest.raises(InvalidRequestError) as exc:
            admit()
        assert exc.value.field == field and "out-of-vocab token id" in exc.value.message
    assert not engine.has_unfinished_requests()
    assert token_ids(llm, [PROMPTS[0]], greedy(logit_bias={VOCAB - 1: 100.0}))[0] == [VOCAB - 1] * 12


def test_an_empty_bad_word_is_refused_as_empty_not_as_too_long() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(bad_words=["ok", ""])
    assert str(exc.value) == "bad_words: must not be empty or only spaces"


def test_bad_words_index_the_requests_own_token_lists() -> None:
    """Each sequence of a request builds its own index, on the thread that steps everyone: copies of
    1,024 long words (2,048 lists) took 43 ms a sequence, 5.5 s for n = 128. It holds the lists
    themselves and bans a word's last token exactly where the output ends with the rest of it."""
    from pagedserve.worker.model_runner import BadWords

    ids = [[5], [7, 8, 9], [3, 8, 4], [6, 1]]
    words = BadWords.build(ids)
    held = [word for by_token in words.by_last_token.values() for word in by_token]
    assert len(held) == 3 and all(any(word is own for own in ids) for word in held)
    output = lambda *ids: np.array(ids, np.int64)  # noqa: E731  (as the runner keeps them)
    assert words.banned(output()) == [5]
    assert words.banned(output(8)) == [5]  # both two-token prefixes ending in 8 are longer than the output
    assert sorted(words.banned(output(1, 7, 8))) == [5, 9]
    assert sorted(words.banned(output(3, 8))) == [4, 5]
    assert sorted(words.banned(output(2, 6))) == [1, 5]


def test_bad_words_beyond_the_model_vocabulary_are_refused(tmp_path: Path, default_model_dir: str) -> None:
    """A model whose vocabulary is smaller than its tokenizer's: a word whose tokens lie past it."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    small = LLM(model=save_tiny_model(tmp_path, default_model_dir, config), dtype="float32", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError) as exc:
        small.engine.validate_request(PROMPTS[2], greedy(bad_words=["hello"]))
    assert exc.value.field == "bad_words" and "out-of-vocab token id" in exc.value.message
    assert token_ids(small, [PROMPTS[2]], greedy(bad_words=["in"]))[0]  # ids 254, " in" 281


def test_bad_words_are_tokenized_at_admission_both_ways(llm: LLM) -> None:
    """The ids travel in the params (pickled to tensor-parallel ranks); a caller's own are replaced."""
    tokenizer = llm.engine.tokenizer
    params = greedy(bad_words=[" hello", "hello world"], _bad_words_token_ids=[[5]])
    llm.engine.validate_request(PROMPTS[0], params)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert params.bad_words_token_ids == [
        encode("hello"),
        encode(" hello"),
        encode("hello world"),
        encode(" hello world"),
    ]


# -- tensor parallel -------------------------------------------------------------------------------------


def test_tensor_parallel_ranks_apply_the_controls(tiny_llama_dir: str, llm: LLM) -> None:
    free = token_ids(llm, [PROMPTS[0]], greedy(max_tokens=16))[0]
    _, word = _two_token_word(llm, free)
    params = [
        greedy(max_tokens=16, bad_words=[word]),
        SamplingParams(
            temperature=1.0, seed=4, max_tokens=16, ignore_eos=True, allowed_token_ids=list(range(100, 140))
        ),
        greedy(logit_bias={free[0]: -100.0, 4321: 5.0}),
    ]
    expected = token_ids(llm, [PROMPTS[0]] * 3, params)
    tp2 = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=16, tensor_parallel_size=2)
    try:
        assert token_ids(tp2, [PROMPTS[0]] * 3, params) == expected
    finally:
        tp2.engine.executor.shutdown()
    assert expected[0] != free
