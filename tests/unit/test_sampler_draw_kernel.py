"""Random rows drawn straight from the logits in the C++ CPU kernel (`cpu.sample_rows`,
`Sampler(sample_rows=...)`): each draw lands in its token's interval of the float64 distribution
softmax(logits / T) at the row's uniform, and on the token the torch path draws wherever the target is
not within float32 rounding of an interval's edge; never a token of weight 0; the float64 sums that
keep a tiny token's share; greedy rows beside random ones; a row of NaN confined to itself; the inputs
it refuses; and which batches the sampler sends through it."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from draw_reference import Cut, check_draws, masked_rows
from pagedserve.layers import sampler as sampler_module
from pagedserve.layers.sampler import Sampler
from pagedserve_kernels import cpu
from sampling_tensors import sampling_tensors

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernels"
)

BLOCK = sampler_module._INVERSION_BLOCK


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


def check_uncut_draws(
    tokens: torch.Tensor, logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Asserts each row's token holds the row's target in its interval (draw_reference.check_draws, no
    row cut); returns whether the target lies within float32 rounding of that interval's edge."""
    return torch.tensor(check_draws(tokens, logits, temperatures, uniforms, [None] * len(tokens)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1, 3, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 17, 49_152])
def test_each_draw_lands_in_its_interval_and_on_the_torch_path_s_token(
    vocab: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(vocab)
    rows = 64
    scales = torch.rand(rows, 1, generator=generator) * 10  # flat rows to peaked ones
    logits = (torch.randn(rows, vocab, generator=generator) * scales).to(dtype)
    temperatures = torch.rand(rows, generator=generator) * 3 + 0.05
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    uniforms[0], uniforms[1] = 0.0, 1.0 - 2**-53  # the target at the total, and just above 0
    ours = cpu.sample_rows(logits, temperatures, uniforms, BLOCK)
    assert ours.dtype == torch.int64 and ours.shape == (rows,)
    near = check_uncut_draws(ours, logits, temperatures, uniforms)
    probs = torch.softmax(logits.float() / temperatures.unsqueeze(1), dim=-1)
    torch_path = sampler_module._draw(probs, uniforms)
    differ = ours != torch_path
    assert not bool((differ & ~near).any())


def test_tokens_of_weight_zero_are_never_drawn_at_any_uniform() -> None:
    """-inf logits (a grammar's mask) before, between and after the tokens that can be drawn, across
    block edges; uniforms spread over [0, 1), 0 among them (the target at the total: the last token
    that can be drawn, not the -inf ones after it)."""
    rows, allowed, uniforms = masked_rows(BLOCK, 1001)
    temperatures = torch.full((len(uniforms),), 0.7)
    ours = cpu.sample_rows(rows, temperatures, uniforms, BLOCK)
    assert set(ours.tolist()) == set(allowed)
    assert int(ours[0]) == allowed[-1]
    check_uncut_draws(ours, rows, temperatures, uniforms)


def test_a_tiny_token_keeps_its_share_after_a_large_one() -> None:
    """The most likely token first (weight 1), then tokens of weight exp(-17) (3.8e-8: a float32 sum
    beside 1 would lose them): uniforms aimed at the middle of tail tokens' intervals, computed here in
    float64, land on exactly those tokens."""
    vocab = 2048
    logits = torch.full((vocab,), -17.0)
    logits[0] = 0.0
    weights = torch.exp(logits.double())
    cdf = weights.cumsum(dim=-1)
    targets = list(range(1, vocab - 1, 7))
    uniforms = torch.tensor(
        [1.0 - float((cdf[j - 1] + cdf[j]) / 2 / cdf[-1]) for j in targets], dtype=torch.float64
    )
    rows = logits.expand(len(targets), vocab).contiguous()
    ours = cpu.sample_rows(rows, torch.ones(len(targets)), uniforms, BLOCK)
    assert ours.tolist() == targets


@pytest.mark.parametrize("gap", [0.01, 0.3, 1.0, 2.5, 7.0, 15.0])
def test_a_weight_is_exp_within_a_few_ulp(gap: float) -> None:
    """Two tokens, logits 0 and -gap at temperature 1: token 1 is drawn exactly while u < w / (1 + w),
    w its weight. Uniforms 2e-6 (relative) either side of that edge, w = exp(-gap) in float64, find
    the kernel's weight within 2e-6 of it (a few float32 ulp), where an error spread evenly over a
    whole row would cancel in its normalization and pass the tests above. (Beyond a gap of ~20, 1 + w
    is 1 in float64: no uniform tells the weight apart.)"""
    logits = torch.tensor([[0.0, -gap]])
    weight = math.exp(float(logits[0, 1]))  # the float32 logit's exact weight
    edge = weight / (1.0 + weight)
    for side, token in ((1 - 2e-6, 1), (1 + 2e-6, 0)):
        uniforms = torch.tensor([edge * side], dtype=torch.float64)
        assert int(cpu.sample_rows(logits, torch.ones(1), uniforms, BLOCK)[0]) == token, (side, token)


def test_greedy_rows_take_the_argmax_beside_random_ones() -> None:
    """Temperature 0 (or below, or so small that 1 / T is inf: the limit) takes the row's first
    maximum, as `argmax_rows`; the random rows beside them draw what they draw alone."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 1000, generator=generator).bfloat16()
    logits[2, [10, 20]] = 9.0  # a tie: the first wins
    temperatures = torch.tensor([0.0, 0.8, 0.0, 1.5, -1.0, 0.3, 1e-39])
    uniforms = torch.rand(7, dtype=torch.float64, generator=generator)
    ours = cpu.sample_rows(logits, temperatures, uniforms, BLOCK)
    greedy = [0, 2, 4, 6]
    assert ours[greedy].tolist() == cpu.argmax_rows(logits[greedy]).tolist()
    assert int(ours[2]) == 10
    random = [1, 3, 5]
    alone = cpu.sample_rows(logits[random], temperatures[random], uniforms[random], BLOCK)
    assert ours[random].tolist() == alone.tolist()


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_row_of_nan_draws_a_token_of_the_vocabulary_and_the_others_as_alone(poison: float) -> None:
    """A model's overflow: a NaN or +inf logit makes the torch path's softmax a row of NaN, which draws
    some token; here too, and the rows beside it draw what they draw without it."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1000, generator=generator)
    temperatures = torch.full((4,), 0.9)
    uniforms = torch.rand(4, dtype=torch.float64, generator=generator)
    alone = cpu.sample_rows(logits, temperatures, uniforms, BLOCK)
    logits[2, 500] = poison
    ours = cpu.sample_rows(logits, temperatures, uniforms, BLOCK)
    assert 0 <= int(ours[2]) < 1000
    assert ours[[0, 1, 3]].tolist() == alone[[0, 1, 3]].tolist()


def test_rows_with_a_stride_draw_as_contiguous_ones() -> None:
    generator = torch.Generator().manual_seed(2)
    wide = torch.randn(8, 2 * 700, generator=generator).bfloat16()
    temperatures = torch.full((8,), 1.1)
    uniforms = torch.rand(8, dtype=torch.float64, generator=generator)
    rows = wide[:, :700]  # every row's start 1,400 values apart
    expected = cpu.sample_rows(rows.contiguous(), temperatures, uniforms, BLOCK)
    assert torch.equal(cpu.sample_rows(rows, temperatures, uniforms, BLOCK), expected)
    columns = wide.t().contiguous().t()[:, :700]  # a column stride: copied first
    assert torch.equal(cpu.sample_rows(columns, temperatures, uniforms, BLOCK), expected)


U2 = torch.rand(2, dtype=torch.float64)
T2 = torch.ones(2)


@pytest.mark.parametrize(
    ("logits", "temperatures", "uniforms", "block", "message"),
    [
        (torch.rand(5), T2, U2, BLOCK, r"\[rows, n\]"),
        (torch.rand(2, 0), T2, U2, BLOCK, "n > 0"),
        (torch.randint(0, 5, (2, 5)), T2, U2, BLOCK, "float32, bfloat16 or float16"),
        (torch.rand(2, 5), torch.ones(3), U2, BLOCK, "temperatures"),
        (torch.rand(2, 5), torch.ones(2, dtype=torch.float64), U2, BLOCK, "temperatures must be float32"),
        (torch.rand(2, 5), T2, torch.rand(3, dtype=torch.float64), BLOCK, "uniforms"),
        (torch.rand(2, 5), T2, torch.rand(2), BLOCK, "float64"),
        (torch.rand(2, 5), T2, U2, 0, "block"),
    ],
)
def test_refuses_inputs_it_would_misread(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor, block: int, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu.sample_rows(logits, temperatures, uniforms, block)


class CountingDraws:
    """The real kernel, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: torch.Tensor | int | None) -> torch.Tensor:
        self.calls += 1
        return cpu.sample_rows(*args)  # type: ignore[arg-type]


ROWS, VOCAB = 6, 3000
PENALTIES = {
    "repetition_penalties": torch.full((ROWS,), 1.5),
    "presence_penalties": torch.full((ROWS,), 0.3),
    "frequency_penalties": torch.full((ROWS,), 0.2),
    "prompt_token_ids": torch.arange(ROWS * 40).view(ROWS, 40) * 7 % VOCAB,
    "output_token_ids": torch.arange(ROWS * 10).view(ROWS, 10) * 11 % VOCAB,
}


@pytest.mark.parametrize(
    ("changes", "through_the_kernel"),
    [
        ({}, True),  # plain temperature
        ({"seeded_rows": [(1, 7, 0), (4, 7, 3)]}, True),
        ({"temperatures": torch.tensor([0.0, 0.8, 0.0, 1.3, 0.5, 0.0])}, True),  # greedy rows beside random
        ({"temperatures": torch.zeros(ROWS)}, False),  # all greedy
        ({"top_ps": torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0])}, True),  # cuts, on some rows
        ({"top_ks": torch.tensor([40, 2**62, 40, 3000, 1, 40])}, True),  # past the vocabulary: none
        ({"min_ps": torch.full((ROWS,), 0.1)}, True),
        ({"max_num_logprobs": 2}, True),  # read from the logits, which it leaves as they are
        ({"banned_tokens": [(2, [5, 6])]}, True),  # these change a float32 copy, which the kernel reads
        ({"allowed_tokens": [(3, torch.tensor([1, 2, 3]))]}, True),
        ({"logit_biases": [(1, torch.tensor([4]), torch.tensor([2.0]))]}, True),
        (PENALTIES, True),
    ],
    ids=[
        "temperature",
        "seeded",
        "some-greedy",
        "all-greedy",
        "top-p",
        "top-k",
        "min-p",
        "logprobs",
        "bans",
        "allowed",
        "bias",
        "penalties",
    ],
)
def test_the_sampler_draws_through_the_kernel_whenever_a_row_is_random(
    changes: dict[str, object], through_the_kernel: bool
) -> None:
    """Batches with a random row take the kernel, cut or not, logprobs or not, on the logits as the
    rows' controls and penalties change them (a float32 copy), with the uniforms and cuts the torch
    path would take: the same tokens but near an edge. All-greedy batches do not."""
    logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    draws = CountingDraws()
    for seed in range(5):
        tensors = sampling_tensors(ROWS, 0.8, **changes)
        with_kernel = Sampler(seed, sample_rows=draws)(logits.clone(), tensors)
        without = Sampler(seed)(logits.clone(), sampling_tensors(ROWS, 0.8, **changes))
        if not through_the_kernel:
            assert torch.equal(with_kernel.token_ids, without.token_ids)
            continue
        drawn_from = logits.float()  # what the rows draw from: the logits as their changes leave them
        sampler_module._apply_logit_controls(drawn_from, tensors)
        if tensors.repetition_penalties is not None:
            sampler_module._apply_penalties(drawn_from, tensors)
        uniforms = Sampler(seed)._uniforms(ROWS, tensors, torch.device("cpu"))
        differ = with_kernel.token_ids != without.token_ids
        random = (tensors.temperatures >= 1e-5).nonzero().flatten().tolist()  # the others take the argmax
        ks = tensors.top_ks.tolist() if tensors.top_ks is not None else [VOCAB] * ROWS
        ps = tensors.top_ps.tolist() if tensors.top_ps is not None else [1.0] * ROWS
        min_ps = tensors.min_ps.tolist() if tensors.min_ps is not None else [0.0] * ROWS
        cuts: list[Cut | None] = [Cut(ks[r], ps[r], min_ps[r]) for r in random]
        near = check_draws(
            with_kernel.token_ids[random],
            drawn_from[random],
            tensors.temperatures[random],
            uniforms[random],
            cuts,
        )
        assert not bool((differ[random] & ~torch.tensor(near)).any())
        assert not bool(differ[tensors.temperatures < 1e-5].any())
    assert draws.calls == (5 if through_the_kernel else 0)


def test_a_seeded_row_draws_the_same_token_in_any_batch() -> None:
    """A seeded request's uniform comes from its own generator: alone or among other rows, greedy or
    random, through the kernel it draws the same token."""
    logits = (torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    sampler = Sampler(0, sample_rows=cpu.sample_rows)
    alone = sampler(logits[3:4].clone(), sampling_tensors(1, 1.2, seeded_rows=[(0, 99, 4)]))
    temperatures = torch.tensor([0.0, 0.7, 1.0, 1.2, 0.0])
    batch = sampler(
        logits.clone(), sampling_tensors(5, 1.2, temperatures=temperatures, seeded_rows=[(3, 99, 4)])
    )
    assert int(batch.token_ids[3]) == int(alone.token_ids[0])
