"""Logprobs in the C++ CPU kernel (`cpu.logprob_rows`, `Sampler(logprob_rows=...)`): each row's token's
logprob and rank and its top k equal torch's log_softmax, count and topk up to float32 rounding, ties
in id order; -inf logits (a grammar's mask) and rows of NaN; the inputs it refuses; and the sampler's
batches through it: the raw logits' logprobs, whatever changes the tokens' distribution, and those
logits left as they were."""

from __future__ import annotations

import shutil

import pytest
import torch
from pagedserve.layers.sampler import Sampler
from pagedserve_kernels import cpu
from sampling_tensors import sampling_tensors

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernels"
)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


def check_against_torch(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> None:
    """The kernel's output for these rows against torch's log_softmax of them, taken in float64 (torch's
    float32 one was 1.2e-5 off at 49,152 logits on an AVX2-only CPU, the kernel 4e-7): the token's
    logprob (within a few float32 ulps) and exact rank, then the top k: the likeliest min(k, n) tokens,
    most likely first, ties in id order."""
    values, ids, ranks = cpu.logprob_rows(logits, tokens, k)
    rows, n = logits.shape
    width = 1 + min(k, n)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64 and ranks.dtype == torch.int64
    assert values.shape == ids.shape == (rows, width) and ranks.shape == (rows,)
    reference = torch.log_softmax(logits.double(), dim=-1)
    values = values.double()
    chosen = reference.gather(1, tokens.unsqueeze(1))
    assert torch.equal(ids[:, 0], tokens)
    torch.testing.assert_close(values[:, 0:1], chosen, rtol=1e-6, atol=1e-5)
    assert torch.equal(ranks, (reference > chosen).sum(dim=-1) + 1)
    # the top: torch's top values, the kernel's values those of its ids, and among equal logits the
    # lower id first (torch's topk leaves the order of ties open; the logits break no tie)
    top_values = reference.topk(width - 1, dim=-1).values
    torch.testing.assert_close(values[:, 1:], top_values, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(values[:, 1:], reference.gather(1, ids[:, 1:]), rtol=1e-6, atol=1e-5)
    raw = logits.float().gather(1, ids[:, 1:])
    for r in range(rows):
        pairs = list(zip(raw[r].tolist(), ids[r, 1:].tolist(), strict=True))
        assert pairs == sorted(pairs, key=lambda pair: (-pair[0], pair[1])), f"row {r}"
        assert len(set(ids[r, 1:].tolist())) == width - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1, 3, 17, 256, 1000, 49_152])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_ranks_and_top_k_equal_torch_s(vocab: int, dtype: torch.dtype, k: int) -> None:
    generator = torch.Generator().manual_seed(vocab + k)
    rows = 24
    scales = torch.rand(rows, 1, generator=generator) * 10  # flat rows to peaked ones
    logits = (torch.randn(rows, vocab, generator=generator) * scales).to(dtype)
    tokens = torch.randint(0, vocab, (rows,), generator=generator)
    tokens[0] = int(logits[0].float().argmax())  # rank 1
    tokens[1] = int(logits[1].float().argmin())  # rank near the vocabulary's size
    check_against_torch(logits, tokens, k)


def test_tied_logits_are_ranked_and_listed_in_id_order() -> None:
    """bfloat16 logits tie often: a flat row lists its first k ids, each at -log(n); a tied token's rank
    counts only the strictly more likely; ties straddle the top k's edge."""
    vocab = 300
    logits = torch.zeros(3, vocab, dtype=torch.bfloat16)
    logits[1, [7, 100, 250]] = 2.0  # three tied maxima
    logits[2, ::3] = 1.0  # a hundred tied ones: the top 5 their first five
    tokens = torch.tensor([150, 250, 9])
    values, ids, ranks = cpu.logprob_rows(logits, tokens, 5)
    assert ids[0, 1:].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(values[0], torch.full((6,), -torch.log(torch.tensor(float(vocab)))))
    assert ids[1, 1:].tolist() == [7, 100, 250, 0, 1]
    assert ids[2, 1:].tolist() == [0, 3, 6, 9, 12]
    assert ranks.tolist() == [1, 1, 1]
    check_against_torch(logits, tokens, 5)


def test_masked_tokens_are_minus_inf_and_listed_last() -> None:
    """-inf logits (a grammar's mask): logprob -inf; a top k wider than the tokens left lists them
    after every allowed token, in id order; a masked token's rank counts every allowed one."""
    logits = torch.full((2, 40), float("-inf"))
    logits[0, [5, 30, 12]] = torch.tensor([1.0, 3.0, 2.0])
    logits[1] = torch.linspace(-2, 2, 40)
    logits[1, 20:] = float("-inf")
    values, ids, ranks = cpu.logprob_rows(logits, torch.tensor([12, 39]), 5)
    assert ids[0].tolist() == [12, 30, 12, 5, 0, 1]
    assert values[0, 4:].tolist() == [float("-inf")] * 2
    assert int(ranks[0]) == 2
    assert values[1, 0].item() == float("-inf") and int(ranks[1]) == 21
    assert ids[1, 1:].tolist() == [19, 18, 17, 16, 15]
    check_against_torch(logits, torch.tensor([12, 19]), 20)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_of_nan_or_inf_is_nan_and_stays_in_its_row(bad: float) -> None:
    """torch's log_softmax of a row holding NaN or +inf is NaN throughout: so are the kernel's, rank 1,
    its first ids as the top; the rows beside it are untouched."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 500, generator=generator).bfloat16()
    logits[1, 321] = bad
    tokens = torch.tensor([4, 8, 15])
    values, ids, ranks = cpu.logprob_rows(logits, tokens, 3)
    assert bool(values[1].isnan().all()) and int(ranks[1]) == 1
    assert ids[1].tolist() == [8, 0, 1, 2]
    keep = torch.tensor([0, 2])
    check_against_torch(logits[keep], tokens[keep], 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_without_tokens_each_row_reports_its_argmax(dtype: torch.dtype) -> None:
    """No tokens: each row's token is its argmax as `argmax_rows` finds it (the first maximum, NaN
    first), with the same logprobs, top and rank 1 as that token given."""
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 3000, generator=generator) * 4).to(dtype)
    logits[1, [40, 7, 2999]] = 30.0  # tied maxima: the first
    logits[2, 1500] = float("nan")
    logits[3, :] = float("-inf")
    logits[3, 2000] = 0.0  # all masked but one
    tokens = cpu.argmax_rows(logits)
    assert tokens[1] == 7 and tokens[2] == 1500 and tokens[3] == 2000
    values, ids, ranks = cpu.logprob_rows(logits, None, 5)
    given = cpu.logprob_rows(logits, tokens, 5)
    assert torch.equal(ids, given[1]) and torch.equal(ranks, given[2])
    torch.testing.assert_close(values, given[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ids[:, 0], tokens)
    keep = torch.tensor([0, 1, 3, 4, 5])
    check_against_torch(logits[keep], tokens[keep], 5)
    assert ranks[keep].tolist() == [1] * 5


def test_strided_and_row_sliced_logits_read_as_their_contiguous_copy() -> None:
    base = torch.randn(8, 2 * 999, generator=torch.Generator().manual_seed(2))
    for logits in (base[:, ::2], base[2:6, 10:1009]):
        tokens = torch.arange(len(logits)) * 100
        ours = cpu.logprob_rows(logits, tokens, 4)
        contiguous = cpu.logprob_rows(logits.contiguous(), tokens, 4)
        assert all(torch.equal(a, b) for a, b in zip(ours, contiguous, strict=True))


@pytest.mark.parametrize(
    ("logits", "tokens", "k", "message"),
    [
        (torch.zeros(2, 10), torch.tensor([0, 1], dtype=torch.int32), 1, "tokens must be int64"),
        (torch.zeros(2, 10), torch.tensor([0]), 1, "tokens must be int64 \\[rows\\]"),
        (torch.zeros(2, 10), torch.tensor([0, 10]), 1, "token 10 of row 1 is not in \\[0, 10\\)"),
        (torch.zeros(2, 10), torch.tensor([-1, 0]), 1, "token -1 of row 0"),
        (torch.zeros(2, 10), torch.tensor([0, 1]), -1, "k must be at least 0"),
        (torch.zeros(10), torch.tensor([0]), 1, "logits \\[rows, n\\]"),
        (torch.zeros(2, 0), torch.tensor([0, 0]), 1, "n > 0"),
        (torch.zeros(2, 10, dtype=torch.int64), torch.tensor([0, 1]), 1, "float32, bfloat16 or float16"),
    ],
)
def test_bad_inputs_are_refused_naming_what_is_wrong(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu.logprob_rows(logits, tokens, k)


# -- the sampler through it ------------------------------------------------------------------------


def test_the_sampler_reports_the_raw_logits_logprobs_and_leaves_them_as_they_were() -> None:
    """Penalties, bans, a bias and temperature change what rows draw from, on the torch path, which
    changes a float32 tensor in place: with the kernel the logprobs are still the raw logits', the
    logits passed in are unchanged, and the tokens are those of a sampler without the kernel."""
    rows, vocab = 4, 3000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 4
    before = logits.clone()
    tensors = sampling_tensors(
        rows,
        0.0,
        temperatures=torch.tensor([0.0, 0.7, 1.3, 0.0]),
        seeded_rows=[(1, 11, 0), (2, 12, 0)],
        repetition_penalties=torch.tensor([10.0, 1.0, 2.0, 1.0]),
        presence_penalties=torch.zeros(rows),
        frequency_penalties=torch.zeros(rows),
        prompt_token_ids=logits.topk(3, dim=-1).indices,  # each row's likeliest three, penalized
        output_token_ids=torch.full((rows, 1), vocab),  # none yet (padding)
        banned_tokens=[(3, logits[3].topk(2).indices.tolist())],
        logit_biases=[(1, torch.tensor([5]), torch.tensor([3.0]))],
        max_num_logprobs=4,
    )
    ours = Sampler(0, logprob_rows=cpu.logprob_rows)(logits, tensors)
    assert torch.equal(logits, before)
    theirs = Sampler(0)(logits.clone(), tensors)
    assert torch.equal(ours.token_ids, theirs.token_ids)
    assert ours.logprobs is not None and theirs.logprobs is not None
    assert ours.logprob_token_ids is not None and theirs.logprob_token_ids is not None
    assert torch.equal(ours.logprob_token_ids, theirs.logprob_token_ids)
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours.logprobs[:, 1:], torch.log_softmax(before, dim=-1).topk(4).values)
    assert ours.sampled_ranks is not None and theirs.sampled_ranks is not None
    assert torch.equal(ours.sampled_ranks, theirs.sampled_ranks)
    assert int(ours.sampled_ranks[0]) > 3 and int(ours.sampled_ranks[3]) == 3  # off the raw top


def test_a_batch_asking_for_logprobs_takes_every_kernel() -> None:
    """Logprobs change nothing in the logits: random batches take the draw kernel with the logprob
    kernel after it; greedy ones the logprob kernel alone, which finds each row's argmax as it reads
    the logits (with a penalty, which changes what the argmax is taken of, the argmax kernel and the
    logprob kernel after it); their tokens are those of the same batch without logprobs."""
    calls: list[str] = []

    def counted(name: str, kernel: object) -> object:
        def call(*args: object) -> object:
            calls.append(name)
            return kernel(*args)  # type: ignore[operator]

        return call

    sampler = Sampler(
        0,
        argmax_rows=counted("argmax", cpu.argmax_rows),  # type: ignore[arg-type]
        sample_rows=counted("draw", cpu.sample_rows),  # type: ignore[arg-type]
        logprob_rows=counted("logprobs", cpu.logprob_rows),  # type: ignore[arg-type]
    )
    logits = (torch.randn(6, 4000, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    seeded = [(r, 40 + r, 0) for r in range(6)]
    penalty = {
        "repetition_penalties": torch.full((6,), 3.0),
        "presence_penalties": torch.zeros(6),
        "frequency_penalties": torch.zeros(6),
        "prompt_token_ids": logits.float().topk(2, dim=-1).indices,  # each row's likeliest two, penalized
        "output_token_ids": torch.full((6, 1), 4000),  # none yet (padding)
    }
    for temperature, changes, asking, kernel in (
        (0.0, {}, ["logprobs"], "argmax"),
        (0.0, penalty, ["argmax", "logprobs"], "argmax"),
        (0.9, {}, ["draw", "logprobs"], "draw"),
    ):
        calls.clear()
        asked = sampler(
            logits, sampling_tensors(6, temperature, seeded_rows=seeded, max_num_logprobs=1, **changes)
        )
        plain = sampler(logits, sampling_tensors(6, temperature, seeded_rows=seeded, **changes))
        assert calls == [*asking, kernel]
        assert torch.equal(asked.token_ids, plain.token_ids)
        if changes:  # the penalty moved some row's token off its raw argmax
            assert not torch.equal(asked.token_ids, cpu.argmax_rows(logits))
        assert asked.logprob_token_ids is not None and torch.equal(
            asked.logprob_token_ids[:, 0], asked.token_ids
        )
