"""Sampling checked against its definitions (vLLM's and transformers'): penalties, then temperature, then
top-k (ties at the k-th value kept), top-p (the smallest set holding at least p, with the ties of its
least likely token) and min-p; greedy rows the argmax of the penalized logits; logprobs of the raw model
output; seeds independent of the batch and of preemption; EOS and stop ids held back until min_tokens.
Every expectation is computed here, in plain numpy from the definition, never by the sampler's own
helpers."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.layers import sampler as sampler_module
from pagedserve.layers.sampler import Sampler, SamplerOutput, SamplingTensors
from pagedserve_kernels import cpu

NUM_DRAWS = 4000


@dataclass(frozen=True)
class Row:
    """One request's row of a sampling batch, as the model runner describes it to the sampler."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    banned: tuple[int, ...] = ()  # EOS and stop ids before min_tokens
    seed: int | None = None
    index: int = 0  # output index of a seeded row
    logprobs: int | None = None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def build(rows: list[Row], vocab: int) -> SamplingTensors:
    """The sampler's tensors for `rows`, by the conventions of `SamplingTensors` (what the model runner
    builds): an optional tensor only when some row uses it, neutral values in the other rows."""
    floats = lambda values: torch.tensor(values, dtype=torch.float32)  # noqa: E731
    repetition = any(r.repetition_penalty != 1.0 for r in rows)
    counts = any(r.presence_penalty != 0.0 or r.frequency_penalty != 0.0 for r in rows)

    def padded(lists: list[tuple[int, ...]]) -> torch.Tensor:
        width = max(1, *(len(ids) for ids in lists))
        return torch.tensor([[*ids, *[vocab] * (width - len(ids))] for ids in lists], dtype=torch.int64)

    logprobs = [r.logprobs for r in rows if r.logprobs is not None]
    return SamplingTensors(
        temperatures=floats([r.temperature for r in rows]),
        top_ks=torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows])
        if any(r.top_k > 0 for r in rows)
        else None,
        top_ps=floats([r.top_p for r in rows]) if any(r.top_p < 1.0 for r in rows) else None,
        min_ps=floats([r.min_p for r in rows]) if any(r.min_p > 0.0 for r in rows) else None,
        repetition_penalties=floats([r.repetition_penalty for r in rows]) if repetition else None,
        presence_penalties=floats([r.presence_penalty for r in rows]) if counts else None,
        frequency_penalties=floats([r.frequency_penalty for r in rows]) if counts else None,
        prompt_token_ids=padded([r.prompt_ids for r in rows]) if repetition else None,
        output_token_ids=padded([r.output_ids for r in rows]) if repetition or counts else None,
        banned_tokens=[(i, list(r.banned)) for i, r in enumerate(rows) if r.banned],
        seeded_rows=[
            (i, r.seed, r.index) for i, r in enumerate(rows) if r.seed is not None and r.temperature > 0
        ],
        max_num_logprobs=max(logprobs) if logprobs else None,
    )


def sample(logits: list[list[float]] | torch.Tensor, rows: list[Row], seed: int = 0) -> SamplerOutput:
    """One sampler call over `rows` (a fresh sampler: only unseeded random rows depend on `seed`)."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    return Sampler(seed)(logits.clone(), build(rows, logits.shape[-1]))


# -- the definitions ---------------------------------------------------------------------------------


def penalized(logits: np.ndarray, row: Row) -> np.ndarray:
    """vLLM: repetition over prompt and output (positive logits divided, negative multiplied), then
    frequency and presence over the output only (OpenAI)."""
    x = logits.astype(np.float64).copy()
    seen = sorted(set(row.prompt_ids) | set(row.output_ids))
    x[seen] = np.where(x[seen] > 0, x[seen] / row.repetition_penalty, x[seen] * row.repetition_penalty)
    counts = np.bincount(np.array(row.output_ids, dtype=np.int64), minlength=len(x))
    x = x - row.frequency_penalty * counts - row.presence_penalty * (counts > 0)
    x[list(row.banned)] = -np.inf
    return x


def expected_probs(logits: list[float], row: Row) -> np.ndarray:
    """The distribution a random row samples from, step by step as vLLM defines it."""
    x = penalized(np.array(logits), row) / row.temperature
    if row.top_k > 0:  # every token whose logit is at least the k-th largest
        kth = np.sort(x)[::-1][min(row.top_k, len(x)) - 1]
        x = np.where(x >= kth, x, -np.inf)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if row.top_p < 1.0:  # every token whose more likely tokens hold less than top_p (ties all stay)
        descending = np.sort(probs)[::-1]
        mass_before = np.concatenate(([0.0], np.cumsum(descending)))
        mass_above = mass_before[np.searchsorted(-descending, -probs, side="left")]  # of those > each
        probs = np.where(mass_above < row.top_p, probs, 0.0)
        probs /= probs.sum()
    if row.min_p > 0.0:
        probs = np.where(probs >= row.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def assert_distribution(token_ids: torch.Tensor, expected: np.ndarray) -> None:
    """No token of probability 0 drawn, and a chi-square statistic far below what a wrong distribution
    gives: with a fixed seed the draws are fixed, and the bound sits past the 1e-9 tail for df <= 8."""
    counts = np.bincount(token_ids.numpy(), minlength=len(expected))
    assert len(counts) == len(expected), f"a token outside the vocabulary: {counts}"
    impossible = counts[expected == 0].sum()
    assert impossible == 0, f"{impossible} draws of tokens of probability 0: {counts} vs {expected.round(3)}"
    kept = expected > 0
    wanted = expected[kept] * len(token_ids)
    chi2 = float(((counts[kept] - wanted) ** 2 / wanted).sum())
    df = max(1, int(kept.sum()) - 1)
    assert chi2 < df + 10 * math.sqrt(2 * df) + 10, f"chi2 {chi2:.1f}: {counts} vs {wanted.round(0)}"


# -- distributions -----------------------------------------------------------------------------------

LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]

CASES = {
    "temperature": (LOGITS, Row(temperature=0.8)),
    "top-k keeps ties at the k-th value": ([2.0, 1.2, 1.0, 1.0, 0.0], Row(temperature=0.5, top_k=3)),
    "top-k above the vocabulary": (LOGITS, Row(top_k=1000)),
    # probabilities exact in float32: 0.5 + 0.25 already holds 0.75, so the third token is out
    "top-p stops where the mass reaches p": (
        [math.log(p) for p in (0.5, 0.25, 0.125, 0.125)],
        Row(top_p=0.75),
    ),
    # 0.4 alone holds less than 0.5, so every 0.2 stays: a cut by rank would keep one of the three
    "top-p keeps every tie of its least likely token": (
        [math.log(p) for p in (0.2, 0.4, 0.2, 0.2)],
        Row(top_p=0.5),
    ),
    # a grammar's or a ban's row: top-k larger than what is allowed leaves the allowed tokens
    "top-k beyond the tokens allowed": (LOGITS, Row(top_k=5, top_p=0.95, banned=(0, 1, 2, 3))),
    # on the raw distribution the top token alone holds 0.64 >= 0.6; tempered it holds 0.43
    "temperature before top-p": ([3.0, 2.0, 1.0, 0.0, -1.0], Row(temperature=2.0, top_p=0.6)),
    "min-p on the tempered distribution": (LOGITS, Row(temperature=1.5, min_p=0.3)),
    "top-k, top-p and min-p together": (LOGITS, Row(temperature=1.2, top_k=4, top_p=0.9, min_p=0.1)),
    # penalized: 1.5, 0.3, 2.0, -1.8, 1.0, 0.5 -> the top 2 are tokens 2 and 0 (raw: 0 and 1)
    "penalties before temperature and top-k": (
        [3.0, 2.8, 2.0, -0.5, 1.0, 0.5],
        Row(
            temperature=0.8,
            top_k=2,
            repetition_penalty=2.0,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            prompt_ids=(0,),
            output_ids=(1, 3, 1),
        ),
    ),
    "negative penalties favour repeats": (
        LOGITS,
        Row(
            repetition_penalty=0.5,
            presence_penalty=-1.0,
            frequency_penalty=-0.5,
            prompt_ids=(5,),
            output_ids=(4, 4),
        ),
    ),
    "banned tokens (min_tokens)": (LOGITS, Row(banned=(0, 2))),
    # 1e39 overflows float32 to inf: the distribution is uniform over the tokens allowed
    "temperature beyond float32": (LOGITS, Row(temperature=1e39, banned=(0,))),
    "temperature 1e6": (LOGITS, Row(temperature=1e6, top_k=3)),
}


# A row cut by top-k, top-p or min-p looks among its most likely tokens, a few, then more, then all
# (`_TOP_WIDTHS`): the default widths exceed these vocabularies, so the tests run narrower ones too,
# where every cut lies beyond the first, or beyond all but the whole vocabulary.
TOP_WIDTHS = [sampler_module._TOP_WIDTHS, (1, 2), (3,)]


@pytest.fixture(params=TOP_WIDTHS, ids=lambda widths: "widths" + "-".join(map(str, widths)))
def top_widths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[int, ...]:
    monkeypatch.setattr(sampler_module, "_TOP_WIDTHS", request.param)
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_defined_distribution(case: str, top_widths: tuple[int, ...]) -> None:
    logits, row = CASES[case]
    out = sample([logits] * NUM_DRAWS, [row] * NUM_DRAWS)
    assert_distribution(out.token_ids, expected_probs(logits, row))


@pytest.mark.parametrize("case", list(CASES))
def test_the_cpp_kernel_s_draws_follow_the_defined_distribution(case: str) -> None:
    """The CPU engine's sampler draws the batches that change no logit in its C++ kernel
    (`cpu.sample_rows`), cut rows among them: the same definitions hold there."""
    if not cpu.load():
        pytest.skip("no C++ compiler to build the CPU kernels")
    logits, row = CASES[case]
    batch = torch.tensor([logits] * NUM_DRAWS, dtype=torch.float32)
    out = Sampler(0, sample_rows=cpu.sample_rows)(batch, build([row] * NUM_DRAWS, batch.shape[-1]))
    assert_distribution(out.token_ids, expected_probs(logits, row))


def test_seeded_draws_follow_the_distribution() -> None:
    """A seeded request draws from its own generator at each output index: across indices, the draws
    follow the distribution too."""
    row = Row(temperature=1.3, top_p=0.95, seed=7)
    rows = [replace(row, index=i) for i in range(NUM_DRAWS)]
    out = sample([LOGITS] * NUM_DRAWS, rows)
    assert_distribution(out.token_ids, expected_probs(LOGITS, row))


def test_draws_over_a_vocabulary_of_several_blocks_land_on_the_right_token() -> None:
    """Random rows draw in two levels (blocks of 256 tokens, then a token within one): the tokens
    allowed sit on both sides of block boundaries (255 | 256, 511 | 512) and at the end of a vocabulary
    of 700 (not a whole number of blocks), every other token banned; the draws follow the distribution
    and never land on a banned token, the first of a block or one past the vocabulary."""
    vocab = 700
    allowed = {3: 0.5, 255: 1.0, 256: 2.0, 511: 0.25, 512: 1.5, 699: 0.75}
    logits = [allowed.get(i, -math.inf) for i in range(vocab)]
    out = sample([logits] * NUM_DRAWS, [Row(temperature=1.0)] * NUM_DRAWS)
    expected = np.zeros(vocab)
    for token, logit in allowed.items():
        expected[token] = math.exp(logit)
    assert_distribution(out.token_ids, expected / expected.sum())


@pytest.mark.parametrize(
    "cut", [Row(temperature=0.9), Row(temperature=0.9, top_p=0.9), Row(temperature=0.9, top_k=5)]
)
def test_a_row_of_nan_draws_a_token_of_the_vocabulary_and_the_others_draw_as_alone(
    cut: Row, top_widths: tuple[int, ...]
) -> None:
    """A model that overflows gives a row of NaN logits: its draw is some token of the vocabulary (an
    index past it failed the whole step, every request in the batch), and the seeded rows beside it
    draw what they draw without it; also when the rows are cut by top-p or top-k."""
    vocab = 700
    rows = [replace(cut, seed=11), cut, replace(cut, seed=12)]
    logits = torch.randn(3, vocab)
    logits[1] = math.nan
    out = sample(logits, rows)
    assert 0 <= int(out.token_ids[1]) < vocab
    alone = sample(logits[[0, 2]], [rows[0], rows[2]])
    assert out.token_ids[[0, 2]].tolist() == alone.token_ids.tolist()


def test_cut_rows_of_a_real_vocabulary_sort_only_a_cut_beyond_their_widest_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sorting a row of 49,152 tokens takes 1.5-3 ms (64 rows cut by top-p made a 100 ms step): a row
    cut by top-k, top-p or min-p looks among its most likely tokens instead, and only a row whose cut
    lies beyond the widest look (here a flat row, its top 0.95 spanning ~45,000 tokens) sorts. Each
    row draws a token its cut keeps."""
    vocab = 49_152
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, vocab, generator=generator)
    logits[[0, 6], :10] = 12.0  # ten tokens hold nearly all the mass
    logits[2] = -math.inf  # a grammar's row: three tokens allowed, fewer than top-k's 50
    logits[2, [5, 700, 40_000]] = torch.tensor([1.0, 0.5, 0.0])
    logits[3, 1000:1500] = 8.0  # 500 tied tokens hold 0.95: top-p keeps all of them
    logits[4] *= 0.1  # flat
    rows = [
        Row(top_p=0.9),
        Row(top_k=50),
        Row(top_k=50, top_p=0.9),
        Row(top_p=0.9),
        Row(top_p=0.95),
        Row(top_k=3000),
        Row(min_p=0.1),
    ]
    sorted_rows = []
    sort = torch.Tensor.sort

    def counted_sort(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        if self.shape[-1] == vocab:  # a whole vocabulary (a look's ties are put in id order too)
            sorted_rows.append(self.shape[0] if self.dim() > 1 else 1)
        return sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counted_sort)
    for seed in range(5):
        out = sample(logits, rows, seed=seed)
        for i, row in enumerate(rows):
            expected = expected_probs(logits[i].tolist(), row)
            assert expected[int(out.token_ids[i])] > 0, f"row {i} drew a token its cut drops"
    assert sorted_rows == [1] * 5, sorted_rows  # row 4 alone, once a call


def test_each_draw_is_the_token_a_float64_inversion_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inversion picks the first token whose cumulative probability reaches u * total. Half the mass on
    token 0, then 2,046 tokens of 3e-8 each, the rest on the last: a float32 running sum moves one step
    (6e-8 at 0.5) every other tail token, so it would hand some tail tokens twice their share and
    others none. With uniforms aimed at the middle of tail tokens' intervals (computed here in float64
    from the sampler's own float32 probabilities), every row must land on its token."""
    vocab, tiny = 2048, 3e-8
    probs = torch.full((vocab,), tiny, dtype=torch.float64)
    probs[0] = 0.5
    probs[-1] = 0.5 - tiny * (vocab - 2)
    logits = probs.log().float()
    cdf = torch.softmax(logits, dim=-1).double().cumsum(dim=-1)  # the probabilities the sampler draws from
    targets = list(range(1, vocab - 1, 7))
    uniforms = torch.tensor(
        [1.0 - float((cdf[j - 1] + cdf[j]) / 2 / cdf[-1]) for j in targets], dtype=torch.float64
    )
    monkeypatch.setattr(Sampler, "_uniforms", lambda self, rows, t, device: uniforms)
    out = sample(logits.expand(len(targets), vocab), [Row(temperature=1.0)] * len(targets))
    assert out.token_ids.tolist() == targets


@pytest.mark.parametrize("temperature", [1e-5, 2e-5, 5e-5])
def test_tiny_temperatures_pick_the_maximum_without_overflow(temperature: float) -> None:
    """Logits 1e-3 apart are 20 to 100 apart at these temperatures: the maximum always wins (but for
    odds of 1e-8), and no logit overflows to inf or NaN."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randperm(500, generator=generator).float() * 1e-3 + 30.0
    logits = logits.expand(64, -1).clone()
    logits[::2] *= -1  # rows of negative logits too
    banned = Row(temperature=temperature, banned=(int(logits[1].argmax()),))
    rows = [Row(temperature=temperature), banned] * 32
    expected = [int(logits[0].argmax()), int(torch.topk(logits[1], 2).indices[1])] * 32
    assert sample(logits, rows).token_ids.tolist() == expected


def test_penalties_change_the_seen_tokens_alone_whatever_the_padding() -> None:
    """The penalties touch only the tokens a row has seen, through ids padded with the vocabulary size:
    every logit as the definition gives it, in rows with a prompt and no output, with an output and no
    prompt, with nothing seen, with ids repeated within and across prompt and output, and with the
    first and last tokens of the vocabulary seen; every other logit unchanged, bit for bit."""
    vocab = 50
    rows = [
        Row(
            repetition_penalty=1.5,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            prompt_ids=(0, 3, 3),
            output_ids=(49, 3, 7, 7, 7),
        ),
        Row(repetition_penalty=0.8, frequency_penalty=-1.0, prompt_ids=(5,)),
        Row(repetition_penalty=1.7, frequency_penalty=0.5),
        Row(repetition_penalty=1.2, presence_penalty=-0.5, output_ids=(49, 0, 49)),
        Row(repetition_penalty=2.0, prompt_ids=tuple(range(20)), output_ids=(19, 20)),
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(5)) * 3
    changed = logits.clone()
    sampler_module._apply_penalties(changed, build(rows, vocab))
    for i, row in enumerate(rows):
        expected = penalized(logits[i].double().numpy(), row)
        np.testing.assert_allclose(changed[i].numpy(), expected, rtol=1e-6, err_msg=f"row {i}")
        unseen = sorted(set(range(vocab)) - set(row.prompt_ids) - set(row.output_ids))
        assert torch.equal(changed[i, unseen], logits[i, unseen]), f"row {i}"


@pytest.mark.parametrize(
    "rows",
    [
        [Row(repetition_penalty=1.5, prompt_ids=(0, 3), output_ids=(3, 7, 7)), Row(prompt_ids=(9,))],
        [Row(presence_penalty=0.5, prompt_ids=(0, 3), output_ids=(3, 7, 7)), Row(frequency_penalty=-1.0)],
        [Row(frequency_penalty=0.25, output_ids=(49, 49, 2)), Row(repetition_penalty=0.8, output_ids=(5,))],
    ],
    ids=["repetition-alone", "presence-and-frequency-alone", "each-in-its-own-row"],
)
def test_a_batch_with_one_kind_of_penalty_gets_that_kind_alone(rows: list[Row]) -> None:
    """The runner gives the repetition penalties (and the prompts' ids) only where some row has one,
    the presence and frequency penalties only where some row has either: each kind's pass runs alone,
    and every logit is still the definition's."""
    vocab = 50
    tensors = build(rows, vocab)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(6)) * 3
    changed = logits.clone()
    sampler_module._apply_penalties(changed, tensors)
    for i, row in enumerate(rows):
        expected = penalized(logits[i].double().numpy(), row)
        np.testing.assert_allclose(changed[i].numpy(), expected, rtol=1e-6, err_msg=f"row {i}")


def test_the_runner_builds_only_the_penalties_some_row_has(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch with repetition penalties alone has no presence or frequency tensors and one with
    presence alone no repetition tensor and no prompts' ids: the sampler skips what no row asks for."""
    runner = llm.engine.executor.worker.model_runner  # type: ignore[attr-defined]
    built: list[SamplingTensors] = []
    original = runner._sampling_tensors

    def kept(*args: object) -> SamplingTensors:
        built.append(original(*args))
        return built[-1]

    monkeypatch.setattr(runner, "_sampling_tensors", kept)
    llm.generate([[1, 306, 4658]], SamplingParams(temperature=0, max_tokens=2, repetition_penalty=1.3))
    llm.generate([[1, 306, 4658]], SamplingParams(temperature=0, max_tokens=2, presence_penalty=0.4))
    assert len(built) == 4  # two steps each
    repetition, presence = built[0], built[-1]
    assert repetition.repetition_penalties is not None and repetition.prompt_token_ids is not None
    assert repetition.presence_penalties is None and repetition.frequency_penalties is None
    assert presence.presence_penalties is not None and presence.frequency_penalties is not None
    assert presence.repetition_penalties is None and presence.prompt_token_ids is None
    assert presence.output_token_ids is not None and presence.penalized and not presence.logits_unchanged


def test_the_runner_pads_the_penalized_rows_and_keeps_the_prompts_while_the_batch_holds(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's prompt and output ids are the rows' own, padded with vocab_size to the longest;
    the prompts' tensor is the last step's exactly when the rows are the same requests."""
    runner = llm.engine.executor.worker.model_runner  # type: ignore[attr-defined]
    steps: list[tuple[list[list[int]], list[list[int]], SamplingTensors]] = []
    original = runner._sampling_tensors

    def kept(rows: list, masks: dict) -> SamplingTensors:  # type: ignore[type-arg]
        prompts = [row.state.token_ids.span(0, row.state.num_prompt_tokens).tolist() for row in rows]
        steps.append((prompts, [row.output_token_ids.tolist() for row in rows], original(rows, masks)))
        return steps[-1][2]

    monkeypatch.setattr(runner, "_sampling_tensors", kept)
    prompts = [[1, 306, 4658], [1, 22, 33, 44, 55, 66], [1, 9]]
    outputs = llm.generate(
        prompts,
        [
            SamplingParams(temperature=0, max_tokens=n, repetition_penalty=1.3, ignore_eos=True)
            for n in (2, 5, 5)
        ],
    )
    completions = [list(out.outputs[0].token_ids) for out in outputs]

    def padded(rows: list[list[int]]) -> list[list[int]]:
        width = max(1, *map(len, rows))
        return [row + [runner.vocab_size] * (width - len(row)) for row in rows]

    assert len(steps) == 5 and [len(step[0]) for step in steps] == [3, 3, 2, 2, 2]
    for prompt_ids, output_ids, tensors in steps:
        # The rows' own ids as the runner keeps them: the requests' prompts and their outputs so far.
        for prompt, output in zip(prompt_ids, output_ids):
            completion = completions[prompts.index(prompt)]
            assert output == completion[: len(output)] and len(output) < len(completion)
        assert tensors.prompt_token_ids is not None and tensors.output_token_ids is not None
        assert tensors.prompt_token_ids.tolist() == padded(prompt_ids)
        assert tensors.output_token_ids.tolist() == padded(output_ids)
    kept_prompts = [a[2].prompt_token_ids is b[2].prompt_token_ids for a, b in zip(steps, steps[1:])]
    assert kept_prompts == [True, False, True, True]


@pytest.mark.parametrize("penalty", [1e-300, 5e-324, 1e300])
def test_an_extreme_repetition_penalty_keeps_the_row_finite(penalty: float) -> None:
    """A penalty near 0 (0 in float32) divided a seen token's positive logit to inf, a huge one (inf)
    multiplied a logit of 0 to NaN: the row's softmax was NaN and every draw token 0. Now the seen
    tokens with positive logits win outright under a tiny penalty, and a banned one stays banned."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 64)
    row = Row(temperature=1.0, seed=3, repetition_penalty=penalty, prompt_ids=(1, 2, 3, 6), banned=(4,))
    token_ids = sample(logits, [replace(row, index=i) for i in range(64)]).token_ids.tolist()
    if penalty < 1:  # seen 1 (2.0) and 3 (0.5) grow a millionfold, seen 2 (-1.0) shrinks to ~0
        assert set(token_ids) <= {1, 3}
    else:  # seen 1 and 3 shrink to ~0, seen 2 grows to -1e6, seen 6 stays 0 (not NaN)
        assert set(token_ids) <= {0, 1, 3, 5, 6} and 0 in token_ids
    greedy = sample(logits[:1], [replace(row, temperature=0.0)]).token_ids.tolist()
    assert greedy == ([1] if penalty < 1 else [0])


# -- greedy rows, and rows in a batch ----------------------------------------------------------------


def random_row(generator: np.random.Generator, vocab: int) -> Row:
    return Row(
        repetition_penalty=float(generator.uniform(0.5, 2.0)),
        presence_penalty=float(generator.uniform(-2.0, 2.0)),
        frequency_penalty=float(generator.uniform(-2.0, 2.0)),
        prompt_ids=tuple(generator.integers(0, vocab, size=int(generator.integers(0, 8))).tolist()),
        output_ids=tuple(generator.integers(0, vocab, size=int(generator.integers(0, 8))).tolist()),
    )


def test_greedy_rows_take_the_argmax_of_the_penalized_logits() -> None:
    """Greedy applies every penalty first (vLLM) and ignores top-k, top-p, min-p and the seed."""
    generator = np.random.default_rng(0)
    vocab, num_rows = 40, 256
    logits = generator.normal(0.0, 3.0, size=(num_rows, vocab))
    rows = [
        replace(random_row(generator, vocab), temperature=0.0, top_k=2, top_p=0.1, min_p=0.9, seed=i)
        for i in range(num_rows)
    ]
    expected = [int(np.argmax(penalized(logits[i], rows[i]))) for i in range(num_rows)]
    raw_argmax = logits.argmax(axis=1).tolist()
    assert sum(e != r for e, r in zip(expected, raw_argmax)) > num_rows // 10  # the penalties matter
    assert sample(torch.from_numpy(logits), rows).token_ids.tolist() == expected


MIXED = [
    Row(temperature=0.0, repetition_penalty=1.8, prompt_ids=(3, 4), output_ids=(5,), top_p=0.3, seed=1),
    Row(temperature=0.0),
    Row(temperature=1.0, seed=11),
    Row(temperature=0.7, seed=12, top_k=3, presence_penalty=1.0, frequency_penalty=0.5, output_ids=(1, 1, 2)),
    Row(temperature=1.5, seed=13, min_p=0.2, index=9),
    Row(temperature=1.0, seed=14, banned=(0, 1, 2), top_p=0.8),
    Row(temperature=0.0, banned=(7,), logprobs=2),
    Row(temperature=1e39, seed=15, logprobs=0),
    Row(temperature=0.9, seed=16, repetition_penalty=0.7, prompt_ids=(9, 10, 11), top_p=0.99999),
]


@pytest.mark.parametrize(
    "order", [list(range(len(MIXED))), list(reversed(range(len(MIXED)))), [4, 0, 8, 2, 6, 1, 7, 3, 5]]
)
def test_each_row_of_a_mixed_batch_samples_as_it_would_alone(
    order: list[int], top_widths: tuple[int, ...]
) -> None:
    """Greedy and seeded random rows, with and without penalties, top-k/top-p/min-p, banned tokens and
    logprobs: each row's token (and logprobs) as in a batch of that row alone, whatever the order."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(len(MIXED), 64, generator=generator) * 2
    alone = [sample(logits[i : i + 1], [MIXED[i]]) for i in range(len(MIXED))]
    batch = sample(logits[order], [MIXED[i] for i in order], seed=99)
    for position, i in enumerate(order):
        assert int(batch.token_ids[position]) == int(alone[i].token_ids[0]), f"row {i}"
        if MIXED[i].logprobs is not None:
            k = MIXED[i].logprobs + 1
            assert batch.logprob_token_ids is not None and batch.logprobs is not None
            assert (
                batch.logprob_token_ids[position, :k].tolist() == alone[i].logprob_token_ids[0, :k].tolist()
            )
            assert torch.equal(batch.logprobs[position, :k], alone[i].logprobs[0, :k])


def test_a_seed_gives_its_own_draws_and_another_seed_others() -> None:
    logits = torch.zeros(20, 64)  # uniform: two seeds agree on 20 draws with probability 64**-20
    draws = {
        seed: sample(logits, [Row(seed=seed, index=i) for i in range(20)], seed=0).token_ids.tolist()
        for seed in (1, 2, 3, -1)
    }
    again = sample(logits, [Row(seed=1, index=i) for i in range(20)], seed=5).token_ids.tolist()
    assert again == draws[1]
    assert len({tuple(d) for d in draws.values()}) == len(draws)


# -- logprobs ----------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits_and_report_the_sampled_token_outside_the_top_k() -> None:
    """The penalty turns greedy to token 3, banned tokens and temperature change the sampled row:
    reported values stay those of the raw model output, the sampled token first with its raw rank."""
    logits = torch.tensor([[5.0, 4.9, 4.8, 1.0, 0.0, -1.0], [5.0, 4.9, 4.8, 1.0, 0.0, -1.0]])
    rows = [
        Row(temperature=0.0, repetition_penalty=10.0, prompt_ids=(0, 1, 2), logprobs=2),
        Row(temperature=0.5, banned=(0, 1, 2, 3), seed=3, logprobs=1),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.token_ids.tolist()[0] == 3
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.sampled_ranks is not None
    for row in range(2):
        token = int(out.token_ids[row])
        assert token not in (0, 1, 2)
        assert out.logprob_token_ids[row].tolist() == [token, 0, 1]
        assert out.logprobs[row].double().tolist() == pytest.approx(
            raw[row, [token, 0, 1]].tolist(), abs=1e-6
        )
        assert int(out.sampled_ranks[row]) == token + 1  # logits fall with the token id


def test_the_sampled_token_s_rank_counts_every_more_likely_token_wherever_it_lies() -> None:
    """A rank is 1 + the number of tokens more likely than the sampled one (its ties not counted):
    for a token among the few most likely and for one far down the vocabulary alike."""
    vocab = 40
    logits = -0.1 * torch.arange(vocab, dtype=torch.float32)
    logits[11] = logits[10]  # tied: token 11's rank counts tokens 0-9 alone
    rows = [
        Row(temperature=0.5, banned=tuple(range(25)), seed=1, logprobs=2),  # down the vocabulary
        Row(temperature=0.5, banned=(0, 1), seed=2, logprobs=0),
        Row(temperature=0.0, banned=tuple(range(11)), logprobs=1),  # greedy: token 11
        Row(temperature=1.0, seed=3, logprobs=3),
    ]
    out = sample(logits.expand(len(rows), vocab), rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.sampled_ranks is not None and int(out.token_ids[2]) == 11
    assert int(out.token_ids[0]) >= 25
    for row in range(len(rows)):
        token = int(out.token_ids[row])
        assert int(out.sampled_ranks[row]) == 1 + int((raw > raw[token]).sum()), f"row {row}, token {token}"


# -- the engine --------------------------------------------------------------------------------------

PROMPTS = [[1, 300, 301, 302], [1, 500, 600, 700, 800, 900], [1, 42], [1, *range(1000, 1030)]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=16)


def test_logprobs_with_n_and_penalties_are_the_raw_model_distribution(llm: LLM, tiny_llama_dir: str) -> None:
    """n = 2 completions sampled hot with penalties: each token's entry holds the sampled token and the
    top 2 of the raw model output (no penalty, no temperature), with their raw ranks."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(
        n=2, temperature=3.0, seed=5, max_tokens=8, logprobs=2, repetition_penalty=1.5,
        presence_penalty=1.0, frequency_penalty=0.5, ignore_eos=True,
    )  # fmt: skip
    prompt = PROMPTS[1]
    out = llm.generate([prompt], params)[0]
    assert len(out.outputs) == 2 and out.outputs[0].token_ids != out.outputs[1].token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    num_outside_top_2 = 0
    for completion in out.outputs:
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
        reference = torch.log_softmax(logits[len(prompt) - 1 : -1].double(), dim=-1)
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            top = reference[step].topk(2).indices.tolist()
            num_outside_top_2 += token not in top
            assert set(entry) == {token, *top}
            for token_id, logprob in entry.items():
                assert logprob.logprob == pytest.approx(float(reference[step, token_id]), abs=1e-4)
                # ranks far down the vocabulary meet near-ties: between those counting them or not
                above = reference[step] - reference[step, token_id]
                assert 1 + int((above > 1e-4).sum()) <= logprob.rank <= 1 + int((above > -1e-4).sum())
    assert num_outside_top_2 > 0  # the case where the sampled token is reported beside the top-k


MIXED_REQUESTS = [
    SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, top_p=0.5, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=21, max_tokens=10, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(temperature=0.8, seed=22, max_tokens=14, top_k=5, min_p=0.05, min_tokens=6),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(
        temperature=1.2, seed=23, top_p=0.9, max_tokens=11, repetition_penalty=0.8, ignore_eos=True
    ),
]


def test_mixed_requests_in_a_batch_get_what_they_get_alone(llm: LLM) -> None:
    alone = [
        llm.generate([p], s)[0].outputs[0].token_ids for p, s in zip(PROMPTS + PROMPTS[:1], MIXED_REQUESTS)
    ]
    together = llm.generate(PROMPTS + PROMPTS[:1], MIXED_REQUESTS)
    assert [o.outputs[0].token_ids for o in together] == alone
    order = [3, 1, 4, 0, 2]
    shuffled = llm.generate([(PROMPTS + PROMPTS[:1])[i] for i in order], [MIXED_REQUESTS[i] for i in order])
    assert [o.outputs[0].token_ids for o in shuffled] == [alone[i] for i in order]


def test_parallel_samples_are_requests_seeded_seed_plus_index(llm: LLM) -> None:
    """n = 3 with a seed and penalties: completion i is the request with seed + i alone (vLLM's child
    seeds), each forked sibling counting its own output for the penalties."""
    params = SamplingParams(
        n=3, temperature=1.0, seed=70, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
        presence_penalty=0.5, frequency_penalty=1.0,
    )  # fmt: skip
    parallel = llm.generate([PROMPTS[2]], params)[0].outputs
    alone = llm.generate([PROMPTS[2]] * 3, [replace(params, n=1, seed=70 + i) for i in range(3)])
    assert [c.token_ids for c in parallel] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in parallel}) == 3


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_seeded_penalized_sampling_survives_preemption(
    llm: LLM, tiny_llama_dir: str, preemption_mode: str
) -> None:
    """A resumed request rebuilds the token history the penalties count and the output index its seed
    draws with: 6 requests of 3 blocks each, in 8 blocks, give the tokens they give with room."""
    prompts = [[1, *range(100 + 40 * i, 112 + 40 * i)] for i in range(6)]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=40 + i,
            max_tokens=30,
            ignore_eos=True,
            repetition_penalty=1.4,
            frequency_penalty=0.4 if i % 2 else 0.0,
            top_k=50 if i % 3 == 0 else -1,
        )  # fmt: skip
        for i in range(6)
    ]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = LLM(
        model=tiny_llama_dir, dtype="float32", num_kv_blocks=8, block_size=16, preemption_mode=preemption_mode
    )
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.engine.scheduler.num_preemptions > 0


def test_stop_token_ids_wait_for_min_tokens_then_stop(llm: LLM) -> None:
    """Near-uniform draws over 1,000 allowed tokens of which 40% are stop ids (as many as a request may
    give): without min_tokens a stop comes within a few tokens; with min_tokens=8 none comes before the
    8th, and one ends the output after."""
    allowed = list(range(1000, 2000))
    stop_ids = allowed[::5] + allowed[1::5]
    stops = set(stop_ids)
    base = dict(temperature=1e4, max_tokens=40, stop_token_ids=stop_ids, allowed_token_ids=allowed)
    early = llm.generate([PROMPTS[0]] * 6, [SamplingParams(seed=s, **base) for s in range(6)])
    assert min(len(o.outputs[0].token_ids) for o in early) < 8
    held = llm.generate([PROMPTS[0]] * 6, [SamplingParams(seed=s, min_tokens=8, **base) for s in range(6)])
    for late in (o.outputs[0] for o in held):
        assert not stops & set(late.token_ids[:8])
        assert late.finish_reason == "stop" and late.token_ids[-1] in stops and len(late.token_ids) > 8


def test_eos_waits_for_min_tokens(tiny_llama_dir: str, tmp_path: Path) -> None:
    """The greedy first token made an EOS (generation_config.json): it ends the output at once, unless
    min_tokens holds it back."""
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=32, block_size=16)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = plain.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids[0]
    model_dir = tmp_path / "eos"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, first]}))
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=32, block_size=16)
    stopped = llm.generate([PROMPTS[3]], replace(greedy, ignore_eos=False))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "eos"
    held = llm.generate([PROMPTS[3]], replace(greedy, ignore_eos=False, min_tokens=5))[0].outputs[0]
    assert first not in held.token_ids[:5] and len(held.token_ids) >= 5
    if first in held.token_ids:  # after min_tokens an EOS ends the output again
        assert held.token_ids.index(first) == len(held.token_ids) - 1 and held.finish_reason == "eos"
