"""Random rows drawn by inversion in the C++ CPU kernel (`cpu.invert_rows`, `Sampler(invert_rows=...)`):
the token torch's `_draw` picks for the same probabilities and uniform, on vocabularies of one block,
several, and a part of one; never a token of probability 0; the float64 sums that keep a tiny token's
share; a row of NaN confined to itself; and the inputs it refuses."""

from __future__ import annotations

import shutil

import pytest
import torch
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


@pytest.mark.parametrize("vocab", [1, 3, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 17, 49_152])
def test_each_row_draws_the_token_torch_s_inversion_draws(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    rows = 64
    scales = torch.rand(rows, 1, generator=generator) * 10  # flat rows to peaked ones
    probs = torch.softmax(torch.randn(rows, vocab, generator=generator) * scales, dim=-1)
    probs[::5, : vocab // 2] = 0.0  # rows whose first half cannot be drawn
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    uniforms[0], uniforms[1] = 0.0, 1.0 - 2**-53  # the target at the total, and just above 0
    ours = cpu.invert_rows(probs, uniforms, BLOCK)
    assert ours.dtype == torch.int64
    assert torch.equal(ours, sampler_module._draw(probs, uniforms))
    assert bool((probs.gather(1, ours.unsqueeze(1)) > 0).all()), "drew a token of probability 0"


def test_zero_probability_tokens_are_never_drawn_at_any_uniform() -> None:
    """Zeros before, between and after the tokens that can be drawn, across block edges; uniforms
    spread over [0, 1), 0 among them (the target at the total: the last token that can be drawn, not
    the zeros after it): every draw lands on a token of positive probability."""
    vocab = 3 * BLOCK
    probs = torch.zeros(vocab)
    allowed = [BLOCK - 1, BLOCK, 2 * BLOCK + 5]
    probs[allowed] = torch.tensor([0.2, 0.3, 0.5])
    uniforms = torch.linspace(0.0, 1.0 - 1e-12, 1001, dtype=torch.float64)
    ours = cpu.invert_rows(probs.expand(len(uniforms), vocab).contiguous(), uniforms, BLOCK)
    assert set(ours.tolist()) == set(allowed)
    assert torch.equal(ours, sampler_module._draw(probs.expand(len(uniforms), vocab), uniforms))


def test_a_tiny_token_keeps_its_share_after_a_large_one() -> None:
    """Half the mass on token 0, then tokens of 3e-8 (a float32 running sum moves one step every other
    one, 6e-8 at 0.5): uniforms aimed at the middle of tail tokens' intervals, computed here in
    float64, land on exactly those tokens."""
    vocab, tiny = 2048, 3e-8
    probs = torch.full((vocab,), tiny, dtype=torch.float64)
    probs[0] = 0.5
    probs[-1] = 0.5 - tiny * (vocab - 2)
    probs32 = probs.float()
    cdf = probs32.double().cumsum(dim=-1)
    targets = list(range(1, vocab - 1, 7))
    uniforms = torch.tensor(
        [1.0 - float((cdf[j - 1] + cdf[j]) / 2 / cdf[-1]) for j in targets], dtype=torch.float64
    )
    ours = cpu.invert_rows(probs32.expand(len(targets), vocab).contiguous(), uniforms, BLOCK)
    assert ours.tolist() == targets


def test_a_row_of_nan_draws_a_token_of_the_vocabulary_and_the_others_as_alone() -> None:
    generator = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4, 1000, generator=generator), dim=-1)
    uniforms = torch.rand(4, dtype=torch.float64, generator=generator)
    alone = cpu.invert_rows(probs, uniforms, BLOCK)
    probs[2] = float("nan")
    ours = cpu.invert_rows(probs, uniforms, BLOCK)
    assert 0 <= int(ours[2]) < 1000
    assert ours[[0, 1, 3]].tolist() == alone[[0, 1, 3]].tolist()


def test_rows_with_a_stride_draw_as_contiguous_ones() -> None:
    generator = torch.Generator().manual_seed(2)
    wide = torch.softmax(torch.randn(8, 2 * 700, generator=generator), dim=-1)
    uniforms = torch.rand(8, dtype=torch.float64, generator=generator)
    rows = wide[:, :700]  # every other row's start 1,400 floats apart
    assert torch.equal(
        cpu.invert_rows(rows, uniforms, BLOCK), cpu.invert_rows(rows.contiguous(), uniforms, BLOCK)
    )
    columns = wide.t().contiguous().t()[:, :700]  # a column stride: copied first
    assert torch.equal(
        cpu.invert_rows(columns, uniforms, BLOCK), cpu.invert_rows(rows.contiguous(), uniforms, BLOCK)
    )


@pytest.mark.parametrize(
    ("probs", "uniforms", "block", "message"),
    [
        (torch.rand(2, 5, dtype=torch.float64), torch.rand(2, dtype=torch.float64), BLOCK, "float32"),
        (torch.rand(5), torch.rand(1, dtype=torch.float64), BLOCK, r"\[rows, n\]"),
        (torch.rand(2, 0), torch.rand(2, dtype=torch.float64), BLOCK, "n > 0"),
        (torch.rand(2, 5), torch.rand(3, dtype=torch.float64), BLOCK, "uniforms"),
        (torch.rand(2, 5), torch.rand(2), BLOCK, "float64"),
        (torch.rand(2, 5), torch.rand(2, dtype=torch.float64), 0, "block"),
    ],
)
def test_refuses_inputs_it_would_misread(
    probs: torch.Tensor, uniforms: torch.Tensor, block: int, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu.invert_rows(probs, uniforms, block)


class CountingInversion:
    """The real kernel, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, probs: torch.Tensor, uniforms: torch.Tensor, block: int) -> torch.Tensor:
        self.calls += 1
        return cpu.invert_rows(probs, uniforms, block)


@pytest.mark.parametrize(
    "changes",
    [
        {},  # plain temperature
        {"seeded_rows": [(1, 7, 0), (4, 7, 3)]},
        {"top_ps": torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0])},  # cut rows beside uncut ones
        {"temperatures": torch.tensor([0.0, 0.8, 0.0, 1.3, 0.5, 0.0])},  # greedy rows beside random
    ],
    ids=["temperature", "seeded", "some-cut", "some-greedy"],
)
def test_the_sampler_draws_the_same_tokens_through_the_kernel(changes: dict[str, object]) -> None:
    rows, vocab = 6, 3000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 4
    inversion = CountingInversion()
    for seed in range(5):
        with_kernel = Sampler(seed, invert_rows=inversion)(
            logits.clone(), sampling_tensors(rows, 0.8, **changes)
        )
        without = Sampler(seed)(logits.clone(), sampling_tensors(rows, 0.8, **changes))
        assert torch.equal(with_kernel.token_ids, without.token_ids)
    assert inversion.calls == 5
