"""Greedy sampling through the C++ argmax (`Sampler(argmax_rows=...)`): taken only for batches where
every row is greedy and nothing else touches the logits, and then the same tokens as torch's path;
every other batch (a banned token, logprobs, penalties, a random row) keeps torch's path."""

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
    return tensors(
        repetition_penalties=torch.full((ROWS,), 1.3),
        presence_penalties=torch.zeros(ROWS),
        frequency_penalties=torch.zeros(ROWS),
        prompt_token_ids=torch.randint(0, VOCAB, (ROWS, 5)),
        output_token_ids=torch.randint(0, VOCAB, (ROWS, 3)),
    )


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    out = torch.randn(ROWS, VOCAB, dtype=torch.bfloat16) * 5
    out[1, [10, 2000]] = 40.0  # a tie: the first wins either way
    return out


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
    "make",
    [
        lambda: tensors(banned_tokens=[(0, [5, 6])]),
        penalties,
        lambda: tensors(temperatures=torch.tensor([0.0, 0.8, 0.0, 0.0, 0.0, 0.0])),
    ],
    ids=["banned-token", "penalties", "one-random-row"],
)
def test_other_batches_keep_torchs_path(logits: torch.Tensor, make: Callable[[], SamplingTensors]) -> None:
    """The kernel is not called, and the sampled tokens (and logprobs) are those of a sampler without
    it, the same seed drawing the random row."""
    argmax = CountingArgmax()
    with_kernel = Sampler(seed=0, argmax_rows=argmax)(logits, make())
    without = Sampler(seed=0)(logits, make())
    assert argmax.calls == 0
    assert torch.equal(with_kernel.token_ids, without.token_ids)
    if without.logprobs is not None:
        assert with_kernel.logprobs is not None
        assert torch.equal(with_kernel.logprobs, without.logprobs)


def test_banned_token_still_banned_in_a_greedy_batch(logits: torch.Tensor) -> None:
    """Row 1's maximum (token 10) is banned: torch's path picks its tie at 2000."""
    argmax = CountingArgmax()
    out = Sampler(seed=0, argmax_rows=argmax)(logits, tensors(banned_tokens=[(1, [10])]))
    assert out.token_ids.tolist()[1] == 2000 and argmax.calls == 0
