"""Speculative decoding by n-gram lookup (`speculative_config={"method": "ngram", ...}`) changes no
output: on the default model, prompts that repeat themselves (so drafts are proposed and accepted),
the tokens and logprobs of greedy and seeded requests equal an engine's without drafts, whatever
controls a request sets (penalties, bad words, min_tokens, logit bias, stop strings and token ids,
max_tokens) or grammar, across preemption by swap and by recompute, and with the prefix cache
reading blocks a drafting request wrote. The proposer on its own. The tests on the default model
are marked slow; those with an oracle's drafts on the tiny model are not.

Float32 on both sides, but a step that verifies drafts runs more decode rows than one without, so
logits may move by rounding: a difference passes only where rounding can flip a draw
(tests/rounding_flips.py), and the rest of that completion is not compared."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.spec_decode import SpeculativeConfig
from rounding_flips import first_difference, is_rounding_flip

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
LOGPROB_ATOL = 1e-3
PROMPTS = [
    "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Copy: apple, banana, cherry,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Repeat after me three times. One two three four five six. One two three four five six. One",
    "The capital of France is",  # nothing to look up at first: drafts come later or never
]


def engine(**settings: object) -> LLM:
    return LLM(dtype="float32", num_kv_blocks=256, block_size=8, enable_prefix_caching=False, **settings)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return engine()


@pytest.fixture(scope="module")
def drafting() -> LLM:
    return engine(speculative_config=NGRAM)


def assert_same_outputs(ours: list, theirs: list, *, greedy: bool = True) -> None:
    """Equal tokens up to a draw that rounding can flip (the rest of that completion not compared),
    logprobs within rounding, for every completion of every request."""
    completions = [
        (a, b)
        for mine, reference in zip(ours, theirs, strict=True)
        for a, b in zip(mine.outputs, reference.outputs, strict=True)
    ]
    for a, b in completions:
        pos = first_difference(a.token_ids, b.token_ids)
        if pos is not None:
            assert a.logprobs and b.logprobs, f"outputs part at token {pos} and no logprobs to tell a tie"
            mine_lp, their_lp = a.logprobs[pos][a.token_ids[pos]], b.logprobs[pos][b.token_ids[pos]]
            assert is_rounding_flip(
                a.token_ids[pos],
                b.token_ids[pos],
                greedy=greedy,
                our_logprob=mine_lp.logprob,
                reference_logprob=their_lp.logprob,
            ), f"outputs part at token {pos}, not by rounding: {a.logprobs[pos]} against {b.logprobs[pos]}"
            a_lps, b_lps = a.logprobs[:pos], b.logprobs[:pos]
        else:
            assert a.token_ids == b.token_ids
            assert a.text == b.text and a.finish_reason == b.finish_reason
            a_lps, b_lps = a.logprobs or [], b.logprobs or []
        for mine_lp, their_lp in zip(a_lps, b_lps, strict=True):
            assert mine_lp.keys() == their_lp.keys()
            for token_id, logprob in mine_lp.items():
                assert math.isclose(logprob.logprob, their_lp[token_id].logprob, abs_tol=LOGPROB_ATOL)


def accepted(llm: LLM) -> int:
    return llm.engine.stats().num_accepted_draft_tokens


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40, logprobs=2),
    "seeded-n-2": SamplingParams(n=2, temperature=0.7, top_k=20, seed=5, max_tokens=40, logprobs=2),
    "penalties-min-tokens": SamplingParams(
        temperature=0.0,
        max_tokens=40,
        logprobs=2,
        repetition_penalty=1.3,
        frequency_penalty=0.2,
        presence_penalty=0.1,
        min_tokens=25,
    ),
    "bad-words-logit-bias": SamplingParams(
        temperature=0.0, max_tokens=40, logprobs=2, bad_words=[" banana", " five six"], logit_bias={28: 2.0}
    ),
    "stops": SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, stop=["grape.", "return a *"]),
    "stop-token-odd-max": SamplingParams(temperature=0.0, max_tokens=7, logprobs=2, stop_token_ids=[2335]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARAMS))
def test_outputs_equal_decoding_without_drafts(plain: LLM, drafting: LLM, name: str) -> None:
    before = drafting.engine.stats()
    theirs = plain.generate(PROMPTS, PARAMS[name])
    ours = drafting.generate(PROMPTS, PARAMS[name])
    assert_same_outputs(ours, theirs, greedy=PARAMS[name].temperature == 0.0)
    after = drafting.engine.stats()
    assert after.num_draft_tokens > before.num_draft_tokens, "no drafts: the test did not exercise them"
    if name not in ("penalties-min-tokens", "stop-token-odd-max"):  # repeats penalized; a few tokens
        assert after.num_accepted_draft_tokens > before.num_accepted_draft_tokens, "no draft accepted"


@pytest.mark.slow
def test_steps_verify_up_to_num_speculative_tokens_and_count_them(drafting: LLM) -> None:
    """vLLM's counters, from which dashboards plot the acceptance rate (accepted / draft tokens)."""
    from prometheus_client.parser import text_string_to_metric_families

    drafting.generate(PROMPTS[:1], PARAMS["greedy"])
    stats = drafting.engine.stats()
    assert stats.num_spec_drafts > 0
    assert stats.num_draft_tokens <= 4 * stats.num_spec_drafts
    assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(drafting.engine.metrics.render().decode())
        for sample in family.samples
    }
    assert samples["vllm:spec_decode_num_drafts_total"] == stats.num_spec_drafts
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_draft_tokens


@pytest.mark.slow
def test_preemption_by_swap_and_recompute_changes_nothing(plain: LLM) -> None:
    """Four requests of 100+ tokens in 32 blocks of 8 (256 tokens) preempt each other."""
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, logprobs=2)
    theirs = plain.generate(PROMPTS, params)
    for mode in ("swap", "recompute"):
        small = LLM(
            dtype="float32",
            num_kv_blocks=32,
            block_size=8,
            max_num_seqs=4,
            preemption_mode=mode,
            speculative_config=NGRAM,
        )
        ours = small.generate(PROMPTS, params)
        assert small.engine.stats().num_preemptions > 0, mode
        assert accepted(small) > 0
        assert_same_outputs(ours, theirs)


@pytest.mark.slow
def test_the_prefix_cache_holds_only_accepted_tokens() -> None:
    """A request that repeats a drafting request's prompt and output hits the blocks it filled: those
    hold the KV of the tokens it kept, never of drafts it ran and rejected."""
    cached = LLM(dtype="float32", num_kv_blocks=256, block_size=8, speculative_config=NGRAM)
    reference = engine()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    first = cached.generate(PROMPTS[:3], params)
    assert cached.engine.stats().num_draft_tokens > cached.engine.stats().num_accepted_draft_tokens > 0
    again = [list(out.prompt_token_ids) + list(out.outputs[0].token_ids[:40]) for out in first]
    ours = cached.generate(again, params)
    assert all(out.num_cached_tokens >= 40 for out in ours)
    assert_same_outputs(ours, reference.generate(again, params))


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "colors": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "colors"],
}
JSON_ECHO = (
    'Return JSON with name "apple banana cherry" and colors red, green, yellow, red, green, yellow. Copy '
    'exactly: {"name": "apple banana cherry", "colors": ["red", "green", "yellow", "red", "green", "yellow"]}'
)


@pytest.mark.slow
def test_requests_with_a_grammar_draft_under_it(plain: LLM, drafting: LLM) -> None:
    """Each draft's row is masked with the grammar's state after the drafts before it: a JSON answer
    that echoes its prompt accepts drafts and is the answer without them."""
    params = SamplingParams(
        temperature=0.0, max_tokens=80, logprobs=2, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    messages = [{"role": "user", "content": JSON_ECHO}]
    before = drafting.engine.stats()
    [ours], [theirs] = drafting.chat(messages, params), plain.chat(messages, params)
    assert_same_outputs([ours], [theirs])
    assert json.loads(ours.outputs[0].text)["colors"] == ["red", "green", "yellow"] * 2
    after = drafting.engine.stats()
    assert after.num_accepted_draft_tokens - before.num_accepted_draft_tokens >= 10


@pytest.mark.parametrize("seed", [None, 3])
def test_drafts_the_grammar_rejects_are_never_accepted(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch, seed: int | None
) -> None:
    """Drafts from an oracle (the run without drafts, every third one off by one, which the regex's
    lowercase letters mostly refuse): the tokens are the run's without drafts, greedy or seeded."""
    from spec_drafts import oracle_proposer

    regex = StructuredOutputsParams(regex="[a-z]+( [a-z]+){6,12}[.]")
    params = SamplingParams(
        temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=40, structured_outputs=regex
    )
    prompts = [[1, *range(300 + 40 * i, 320 + 40 * i)] for i in range(3)]
    theirs = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64).generate(prompts, params)
    reference = [(p, list(out.outputs[0].token_ids)) for p, out in zip(prompts, theirs, strict=True)]
    monkeypatch.setattr(SpeculativeConfig, "propose", oracle_proposer(reference))
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, speculative_config=NGRAM)
    ours = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert all(re.fullmatch(r"[a-z ]+[.]?", o.outputs[0].text) for o in ours)
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0


@pytest.mark.parametrize(
    ("tokens", "max_drafts", "expected"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 4, [9, 1, 2, 3]),  # the 3-gram [1, 2, 3] occurred at 0
        ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),
        ([5, 1, 2, 7, 7, 1, 2, 8, 1, 2], 3, [8, 1, 2]),  # the latest earlier occurrence of [1, 2]
        ([4, 5, 6, 7], 4, []),  # nothing repeats
        ([7, 7], 4, [7]),
        ([2, 3, 4, 9, 7, 4, 8, 2, 3, 4], 4, [9, 7, 4, 8]),  # the longest suffix first: [2, 3, 4], not [4]
    ],
)
def test_the_proposer_continues_the_latest_longest_match(
    tokens: list[int], max_drafts: int, expected: list[int]
) -> None:
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    assert config.propose(tokens, max_drafts) == expected


def test_the_proposer_needs_prompt_lookup_min_tokens_of_match() -> None:
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2)
    assert config.propose([1, 2, 9, 3, 2], 4) == []  # only [2] repeats
    assert config.propose([1, 2, 9, 3, 1, 2], 4) == [9, 3, 1, 2]


@pytest.mark.parametrize("name", ["seeded", "penalties-min-tokens", "bad-words-logit-bias"])
def test_drafts_accepted_and_rejected_leave_sampled_outputs_unchanged(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Drafts from an oracle (the run without drafts, every third one wrong): the rows after an
    accepted draft sample with the draft counted as an output token (penalties, bad words, the seed's
    output index), and the rows after a rejected one are dropped."""
    from spec_drafts import oracle_proposer

    prompts = [[1, *range(300 + 40 * i, 320 + 40 * i)] for i in range(3)]
    plain_llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    theirs = plain_llm.generate(prompts, PARAMS[name])
    reference = [(p, list(out.outputs[0].token_ids)) for p, out in zip(prompts, theirs, strict=True)]
    monkeypatch.setattr(SpeculativeConfig, "propose", oracle_proposer(reference))
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, speculative_config=NGRAM)
    assert_same_outputs(llm.generate(prompts, PARAMS[name]), theirs, greedy=PARAMS[name].temperature == 0.0)
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0


@pytest.mark.parametrize(
    ("given", "lookup"),
    [({}, (4, 1)), ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 2}, (2, 2))],
)
def test_one_lookup_size_given_alone_sets_both(given: dict, lookup: tuple[int, int]) -> None:
    """As vLLM reads them: `{"prompt_lookup_max": 4}` (its documentation's example) means 4-grams."""
    config = SpeculativeConfig.parse({"num_speculative_tokens": 2, **given})
    assert config is not None and (config.prompt_lookup_max, config.prompt_lookup_min) == lookup


@pytest.mark.slow
def test_no_drafts_while_more_requests_than_disable_by_batch_size(plain: LLM) -> None:
    """Under load drafts stop (rejected ones would cost the busy steps throughput), and come back as
    the engine drains: 4 requests with a limit of 2 draft only once two have finished."""
    limited = engine(speculative_config={**NGRAM, "disable_by_batch_size": 2})
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 12, 40, 40)]
    scheduled: list[tuple[int, int]] = []
    schedule = limited.engine.scheduler.schedule

    def recording() -> object:
        num_requests = len(limited.engine.scheduler.requests)
        out = schedule()
        scheduled.extend((num_requests, r.num_spec_tokens) for r in out.scheduled)
        return out

    limited.engine.scheduler.schedule = recording  # type: ignore[method-assign]
    try:
        ours = limited.generate(PROMPTS, params)
    finally:  # the closure over `limited` is a cycle, which the LLM's frozen heap would keep
        del limited.engine.scheduler.schedule
    assert all(n == 0 for num_requests, n in scheduled if num_requests > 2)
    assert any(n > 0 for num_requests, n in scheduled if num_requests <= 2)
    assert [o.outputs[0].token_ids for o in ours] == [
        o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)
    ]


def naive_proposal(config: SpeculativeConfig, tokens: list[int], max_drafts: int) -> list[int]:
    """The proposer's definition, spelled out: for n from prompt_lookup_max down to prompt_lookup_min,
    the latest earlier occurrence of the last n tokens (ending before the last token), and what
    followed it."""
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + min(max_drafts, config.num_speculative_tokens)]
    return []


def test_the_proposer_matches_its_definition_on_random_tokens() -> None:
    rng = random.Random(0)
    for case in range(400):
        config = SpeculativeConfig(
            num_speculative_tokens=rng.randint(1, 5), prompt_lookup_max=rng.randint(2, 5), prompt_lookup_min=1
        )
        if case % 2:
            config = SpeculativeConfig(config.num_speculative_tokens, config.prompt_lookup_max, 2)
        tokens = [rng.randrange(4 if case % 3 else 12) for _ in range(rng.randint(1, 40))]
        max_drafts = rng.randint(0, 6)
        assert config.propose(tokens, max_drafts) == naive_proposal(config, tokens, max_drafts), (
            config,
            tokens,
        )
