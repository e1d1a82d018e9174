"""Rows cut by top-k, top-p or min-p drawn in the C++ CPU kernel (`cpu.sample_rows` with its cuts,
`Sampler(sample_rows=...)`): each draw is a token its cut keeps (`_top_cut`'s definitions in float64,
draw_reference) and lands in that token's interval, the kept tokens taken most likely first and ties
by id; the torch path draws the same token but within float32 rounding of an edge; every tie of the
k-th and of top-p's least token kept; the floors lowered wherever a cut reaches below them; never a
token of weight 0; greedy and uncut rows beside cut ones; a row of NaN confined to itself; the cuts it
refuses; and a seeded cut row drawing the same token whichever path its batch takes."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from draw_reference import EDGE, Cut, check_draws, masked_rows, row_draws
from pagedserve.layers import sampler as sampler_module
from pagedserve.layers.sampler import Sampler
from pagedserve_kernels import cpu
from sampling_tensors import sampling_tensors

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernels"
)

BLOCK = sampler_module._INVERSION_BLOCK
NONE = 2**62  # a top-k past any vocabulary: no cut (the kernel takes it as n)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


def draw(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor, cuts: list[Cut]
) -> torch.Tensor:
    return cpu.sample_rows(
        logits,
        temperatures,
        uniforms,
        BLOCK,
        torch.tensor([c.top_k for c in cuts]),
        torch.tensor([c.top_p for c in cuts]),
        torch.tensor([c.min_p for c in cuts]),
    )


# Every kind of cut, a row each in turn: top-k alone (ties of the k-th, the floor raised many times or
# never), top-p alone (within the first floor or past it), both, min-p alone and with the others.
CUTS = [
    Cut(1),
    Cut(50),
    Cut(5000),
    Cut(NONE, 0.9),
    Cut(NONE, 0.999),
    Cut(NONE, 0.3),
    Cut(40, 0.95),
    Cut(NONE, 1.0, 0.05),
    Cut(200, 0.8, 0.1),
    Cut(NONE, 0.95, 0.01),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1, 3, BLOCK + 1, 5 * BLOCK + 17, 49_152])
def test_each_draw_is_a_token_its_cut_keeps_and_the_torch_path_s(vocab: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(vocab)
    rows = 40
    scales = torch.rand(rows, 1, generator=generator) * 10  # flat rows to peaked ones
    logits = (torch.randn(rows, vocab, generator=generator) * scales).to(dtype)
    temperatures = torch.rand(rows, generator=generator) * 3 + 0.05
    cuts = [CUTS[r % len(CUTS)] for r in range(rows)]
    tensors = sampling_tensors(
        rows,
        1.0,
        temperatures=temperatures,
        top_ks=torch.tensor([min(c.top_k, vocab) for c in cuts]),
        top_ps=torch.tensor([c.top_p for c in cuts]),
        min_ps=torch.tensor([c.min_p for c in cuts]),
    )
    uniforms = Sampler(vocab)._uniforms(rows, tensors, torch.device("cpu"))
    ours = Sampler(vocab, sample_rows=cpu.sample_rows)(logits.clone(), tensors).token_ids
    assert torch.equal(ours, draw(logits, temperatures, uniforms, cuts))  # the sampler's uniforms, its cuts
    near = torch.tensor(check_draws(ours, logits, temperatures, uniforms, list(cuts)))
    # float32 rounding's edges are rare: here the top-p of 0.999 and 0.3 on some 49,152 distinct tokens
    assert int(near.sum()) <= rows // 10
    torch_path = Sampler(vocab)(logits.clone(), tensors).token_ids
    assert not bool(((ours != torch_path) & ~near).any())


def test_the_ends_of_the_uniforms_draw_the_first_and_the_last_token_kept() -> None:
    """u = 1 - 2^-53 puts the target just above 0: the likeliest token; u = 0 puts it at the kept
    mass: the last token kept, which is exactly where each cut ends."""
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(len(CUTS), 20_000, generator=generator) * 3).bfloat16()
    temperatures = torch.full((len(CUTS),), 0.9)
    for u, end in ((1.0 - 2**-53, 0), (0.0, -1)):
        uniforms = torch.full((len(CUTS),), u, dtype=torch.float64)
        ours = draw(logits, temperatures, uniforms, CUTS)
        expected = [int(row_draws(logits[r], 0.9, CUTS[r]).ids[end]) for r in range(len(CUTS))]
        assert ours.tolist() == expected, u


def middles(draws_: torch.Tensor) -> torch.Tensor:
    """Uniforms whose targets fall in the middle of each kept token's interval, in draw order."""
    cdf = draws_.double()
    lower = torch.cat((torch.zeros(1, dtype=torch.float64), cdf[:-1]))
    return 1.0 - (lower + cdf) / 2 / cdf[-1]


def assert_draws_in_order(row: torch.Tensor, temperature: float, cut: Cut, expected_ids: list[int]) -> None:
    """The kernel draws exactly `expected_ids`, in that order, at uniforms aimed at their intervals."""
    reference = row_draws(row, temperature, cut)
    assert reference.ids.tolist() == expected_ids
    uniforms = middles(reference.cdf)
    rows = row.expand(len(uniforms), len(row)).contiguous()
    ours = draw(rows, torch.full((len(uniforms),), temperature), uniforms, [cut] * len(uniforms))
    assert ours.tolist() == expected_ids


def test_top_k_keeps_every_tie_of_its_k_th_drawn_in_id_order() -> None:
    row = torch.tensor([1.0, 2.0, 0.0, 2.0, 1.0, 1.0, 0.0, 1.0, -3.0]).bfloat16()
    # k = 3: the two 2s and the four 1s tied with the third
    assert_draws_in_order(row, 1.0, Cut(3), [1, 3, 0, 4, 5, 7])
    assert_draws_in_order(row, 1.0, Cut(2), [1, 3])
    assert_draws_in_order(row, 0.5, Cut(7), [1, 3, 0, 4, 5, 7, 2, 6])


def test_top_p_keeps_every_tie_of_its_least_token() -> None:
    """Weights 1, then three of e^-1 (0.37 each), then e^-9: p = 0.5 of 2.10 is reached inside the
    first of the three, and its two ties stay; p = 0.4 is reached by the first token alone."""
    row = torch.tensor([-1.0, 0.0, -1.0, -9.0, -1.0])
    assert_draws_in_order(row, 1.0, Cut(NONE, 0.5), [1, 0, 2, 4])
    assert_draws_in_order(row, 1.0, Cut(NONE, 0.4), [1])
    # on top-k's set and of its mass: k = 2 keeps 1 and the three ties (2.10 without e^-9), p = 0.5
    # reaches into the ties: all stay; min-p then keeps those at least 0.5 as likely as the likeliest
    assert_draws_in_order(row, 1.0, Cut(2, 0.5), [1, 0, 2, 4])
    assert_draws_in_order(row, 1.0, Cut(2, 0.5, 0.5), [1])
    assert_draws_in_order(row, 1.0, Cut(2, 0.45), [1])  # 0.45 of 2.10: within the likeliest's 1


@pytest.mark.parametrize("vocab", [300, 49_152])
def test_a_flat_row_keeps_all_its_ties_under_any_cut(vocab: int) -> None:
    """Every token equally likely: each cut keeps all of them (the ties of the k-th, of top-p's least
    token, and min-p's at 1), drawn in id order. At 49,152 tokens, top-k's floor meets ties past its
    room every time it rises."""
    row = torch.zeros(vocab).bfloat16()
    tokens = list(range(0, vocab, vocab // 50 + 1))
    uniforms = torch.tensor([1.0 - (j + 0.5) / vocab for j in tokens], dtype=torch.float64)
    rows = row.expand(len(uniforms), vocab).contiguous()
    for cut in (Cut(5), Cut(NONE, 0.1), Cut(NONE, 1.0, 1.0), Cut(3, 0.2, 0.5)):
        ours = draw(rows, torch.full((len(uniforms),), 1.3), uniforms, [cut] * len(uniforms))
        assert ours.tolist() == tokens, cut


@pytest.mark.parametrize(
    ("exponent", "tail", "top_p", "floor"),
    [
        (14, 20_000, 0.9, 2**-13),
        (18, 20_000, 0.99, 2**-16),
        (25, 20_000, 0.9999, 2**-20),
        (32, 40_000, 1.0 - 2**-20, 2**-30),
    ],
)
def test_top_p_reaching_below_the_floors_gathers_the_tokens_it_needs(
    exponent: int, tail: int, top_p: float, floor: float
) -> None:
    """One token of weight 1 and a long tail of distinct weights near 2^-exponent: top-p's set ends
    inside the tail, below the first floor (2^-13), the second (2^-16), the third (2^-20) or the
    fourth (2^-30), so the row is gathered again lower down. A tail token's share is then below
    float32's rounding of the cut (EDGE), so the set's end is checked to within EDGE of its mass: the
    last token kept (u = 0) is where the mass before it stays under p and reaches p with it, and
    every draw lands in its interval of the kept mass."""
    logits = torch.empty(tail + 1)
    logits[0] = 0.0
    logits[1:] = -exponent * math.log(2.0) - torch.arange(tail) * 1e-5  # distinct, slowly falling
    weights = torch.exp(logits.double())
    cdf = weights.cumsum(0)  # the likeliest first: id order here
    total = float(cdf[-1])
    uniforms = torch.cat((torch.zeros(1, dtype=torch.float64), torch.rand(200, dtype=torch.float64)))
    rows = logits.expand(len(uniforms), tail + 1).contiguous()
    ours = draw(rows, torch.ones(len(uniforms)), uniforms, [Cut(NONE, top_p)] * len(uniforms)).tolist()
    last = ours[0]
    assert 1_000 < last < tail and float(weights[last]) < floor  # the set ends in the tail, below the floor
    target = top_p * total
    assert float(cdf[last - 1]) < target + EDGE * total and float(cdf[last]) >= target - EDGE * total
    for u, token in zip(uniforms.tolist()[1:], ours[1:], strict=True):
        aim = (1.0 - u) * float(cdf[last])
        lower = float(cdf[token - 1]) if token else 0.0
        assert lower - EDGE * total <= aim <= float(cdf[token]) + EDGE * total


def test_tokens_of_weight_zero_are_never_drawn_whatever_the_cut() -> None:
    """A grammar's -inf on all but three tokens, across block edges: a top-k, a top-p or a min-p that
    would keep more keeps those three, and uniforms over [0, 1) draw each of them and nothing else."""
    rows, allowed, uniforms = masked_rows(BLOCK, 301)
    for cut in (Cut(100), Cut(NONE, 0.9999), Cut(NONE, 1.0, 1e-30), Cut(500, 0.999, 1e-9)):
        ours = draw(rows, torch.full((len(uniforms),), 0.7), uniforms, [cut] * len(uniforms))
        assert set(ours.tolist()) == set(allowed), cut


def test_greedy_and_uncut_rows_beside_cut_ones_draw_as_alone() -> None:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 1000, generator=generator).bfloat16()
    temperatures = torch.tensor([0.0, 0.8, 0.8, -1.0, 1e-39, 1.2])
    cuts = [Cut(20), Cut(20), Cut(NONE), Cut(NONE, 0.5), Cut(NONE, 0.5), Cut(NONE, 1.0, 0.2)]
    uniforms = torch.rand(6, dtype=torch.float64, generator=generator)
    ours = draw(logits, temperatures, uniforms, cuts)
    greedy = [0, 3, 4]
    assert ours[greedy].tolist() == cpu.argmax_rows(logits[greedy]).tolist()
    assert int(ours[2]) == int(cpu.sample_rows(logits[2:3], temperatures[2:3], uniforms[2:3], BLOCK)[0])
    for r in (1, 5):
        assert int(ours[r]) == int(
            draw(logits[r : r + 1], temperatures[r : r + 1], uniforms[r : r + 1], [cuts[r]])[0]
        )


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_row_of_nan_draws_a_token_and_the_others_as_alone(poison: float) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1000, generator=generator)
    temperatures = torch.full((4,), 0.9)
    uniforms = torch.rand(4, dtype=torch.float64, generator=generator)
    cuts = [Cut(30, 0.9)] * 4
    alone = draw(logits, temperatures, uniforms, cuts)
    logits[2, 500] = poison
    ours = draw(logits, temperatures, uniforms, cuts)
    assert 0 <= int(ours[2]) < 1000
    assert ours[[0, 1, 3]].tolist() == alone[[0, 1, 3]].tolist()


def test_cuts_past_their_ranges_keep_at_least_the_likeliest_token() -> None:
    """Values SamplingParams refuses but the op may be handed: a top-p of 0 or below keeps the likeliest
    token and its ties (the torch path's least count, 1), a top-k of 0 or below is 1, a min-p above 1
    is 1; a NaN top-p or min-p cuts nothing."""
    row = torch.tensor([0.5, 2.0, -1.0, 2.0, 1.0])
    uniforms = torch.linspace(0.0, 1.0 - 1e-9, 50, dtype=torch.float64)
    rows = row.expand(len(uniforms), len(row)).contiguous()
    for cut, kept in (
        (Cut(NONE, 0.0), {1, 3}),
        (Cut(NONE, -1.0), {1, 3}),
        (Cut(0), {1, 3}),
        (Cut(-5), {1, 3}),
        (Cut(NONE, 1.0, 7.0), {1, 3}),
        (Cut(NONE, math.nan), {0, 1, 2, 3, 4}),
        (Cut(NONE, 1.0, math.nan), {0, 1, 2, 3, 4}),
    ):
        assert set(draw(rows, torch.ones(len(uniforms)), uniforms, [cut] * len(uniforms)).tolist()) == kept, (
            cut
        )


L2, T2, U2 = torch.rand(2, 5), torch.ones(2), torch.rand(2, dtype=torch.float64)


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        ({"top_ks": torch.ones(2)}, "top_ks must be Long"),
        ({"top_ks": torch.ones(3, dtype=torch.int64)}, "top_ks"),
        ({"top_ps": torch.ones(2, dtype=torch.float64)}, "top_ps must be Float"),
        ({"top_ps": torch.ones(2, 1)}, "top_ps"),
        ({"min_ps": torch.zeros(1)}, "min_ps"),
    ],
)
def test_refuses_cuts_it_would_misread(cut: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu.sample_rows(L2, T2, U2, BLOCK, **cut)


def test_a_seeded_cut_row_draws_the_same_token_whichever_path_its_batch_takes() -> None:
    """A seeded request's uniform is its own; a batch with logprobs (or penalties, or bans) takes the
    torch path, one without takes the kernel, and the seeded row draws the same token in either."""
    logits = (torch.randn(3, 3000, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    sampler = Sampler(0, sample_rows=cpu.sample_rows)
    cut = {"top_ks": torch.tensor([3000, 50, 3000]), "top_ps": torch.tensor([1.0, 0.9, 0.8])}
    for index in range(20):
        seeded = [(1, 1234, index)]
        kernel = sampler(logits.clone(), sampling_tensors(3, 1.1, seeded_rows=seeded, **cut))
        torch_path = sampler(
            logits.clone(), sampling_tensors(3, 1.1, seeded_rows=seeded, max_num_logprobs=1, **cut)
        )
        assert torch_path.logprobs is not None  # the torch path it is
        assert int(kernel.token_ids[1]) == int(torch_path.token_ids[1]), index
