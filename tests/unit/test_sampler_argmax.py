"""Greedy sampling through the C++ argmax (`Sampler(argmax_rows=...)`): taken for batches where every row
is greedy, on the raw logits or on the float32 copy that bans and penalties change (logprobs change
nothing), and then the same tokens as torch's path; a batch with a random row does not take it."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
import torch
from pagedserve.layers.sampler import Sampler, SamplingTensors
from pagedserve_kernels import cpu
from sampling_tensors import sampling_tensors

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernels"
)

ROWS, VOCAB = 6, 3000


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


class CountingArgmax:
    """The real kernel, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return cpu.argmax_rows(logits)


def tensors(**changes: object) -> SamplingTensors:
    return sampling_tensors(ROWS, 0.0, **changes)


def penalties() -> SamplingTensors:
    """Each row's two likeliest tokens seen (the logits fixture's), the first in the output too, their
    positive logits divided by a million: every row's argmax moves to its third likeliest."""
    top = logits_of_seed().topk(2, dim=-1).indices
    return tensors(
        repetition_penalties=torch.full((ROWS,), 1e6),
        presence_penalties=torch.full((ROWS,), 0.5),
        frequency_penalties=torch.full((ROWS,), 0.5),
        prompt_token_ids=top,
        output_token_ids=top[:, :1],
    )


def logits_of_seed() -> torch.Tensor:
    out = torch.randn(ROWS, VOCAB, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)) * 5
    out[1, [10, 2000]] = 40.0  # a tie: the first wins either way
    return out


@pytest.fixture
def logits() -> torch.Tensor:
    return logits_of_seed()


def test_all_greedy_batch_takes_the_kernel_with_torchs_tokens(logits: torch.Tensor) -> None:
    argmax = CountingArgmax()
    fast = Sampler(seed=0, argmax_rows=argmax)(logits, tensors())
    slow = Sampler(seed=0)(logits, tensors())
    assert argmax.calls == 1
    assert torch.equal(fast.token_ids, slow.token_ids)
    assert fast.token_ids.tolist()[1] == 10
    assert fast.logprobs is None


def test_a_greedy_batch_asking_for_logprobs_takes_the_kernel_for_its_tokens(logits: torch.Tensor) -> None:
    """Logprobs read the logits and change nothing in them: the tokens are still the argmax kernel's,
    the logprobs those of torch's path (this sampler has no logprob kernel)."""
    argmax = CountingArgmax()
    fast = Sampler(seed=0, argmax_rows=argmax)(logits, tensors(max_num_logprobs=2))
    slow = Sampler(seed=0)(logits, tensors(max_num_logprobs=2))
    assert argmax.calls == 1
    assert torch.equal(fast.token_ids, slow.token_ids)
    assert (
        fast.logprobs is not None and slow.logprobs is not None and torch.equal(fast.logprobs, slow.logprobs)
    )
    assert fast.logprob_token_ids is not None and slow.logprob_token_ids is not None
    assert torch.equal(fast.logprob_token_ids, slow.logprob_token_ids)


@pytest.mark.parametrize(
    "make", [lambda: tensors(banned_tokens=[(0, [5, 6])]), penalties], ids=["banned-token", "penalties"]
)
def test_greedy_batches_with_changed_logits_take_the_kernel_on_the_changed_copy(
    logits: torch.Tensor, make: Callable[[], SamplingTensors]
) -> None:
    """The kernel reads the float32 copy that bans and penalties change: torch's tokens, and the logits
    passed in (bfloat16) untouched."""
    before = logits.clone()
    argmax = CountingArgmax()
    with_kernel = Sampler(seed=0, argmax_rows=argmax)(logits, make())
    without = Sampler(seed=0)(logits, make())
    assert argmax.calls == 1
    assert torch.equal(with_kernel.token_ids, without.token_ids)
    assert torch.equal(logits, before)


def test_penalties_move_every_row_s_argmax_through_the_kernel(logits: torch.Tensor) -> None:
    """Not a batch the raw argmax would answer: each row's token is its third likeliest."""
    out = Sampler(seed=0, argmax_rows=cpu.argmax_rows)(logits, penalties())
    third = logits.float().topk(3, dim=-1)
    assert bool((third.values[:, 2] > 0.5).all())  # above what is left of the two penalized
    assert out.token_ids.tolist() == third.indices[:, 2].tolist()


def test_a_batch_with_a_random_row_keeps_torch_s_path(logits: torch.Tensor) -> None:
    """No argmax kernel for its greedy rows (a sampler without a draw kernel): the same tokens as a
    sampler without it, the same seed drawing the random row."""
    make = lambda: tensors(temperatures=torch.tensor([0.0, 0.8, 0.0, 0.0, 0.0, 0.0]))  # noqa: E731
    argmax = CountingArgmax()
    with_kernel = Sampler(seed=0, argmax_rows=argmax)(logits, make())
    without = Sampler(seed=0)(logits, make())
    assert argmax.calls == 0
    assert torch.equal(with_kernel.token_ids, without.token_ids)


def test_banned_token_still_banned_in_a_greedy_batch(logits: torch.Tensor) -> None:
    """Row 1's maximum (token 10) is banned: the kernel, on the changed copy, picks its tie at 2000."""
    argmax = CountingArgmax()
    out = Sampler(seed=0, argmax_rows=argmax)(logits, tensors(banned_tokens=[(1, [10])]))
    assert out.token_ids.tolist()[1] == 2000 and argmax.calls == 1
