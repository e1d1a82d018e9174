"""`apply_token_bitmask` against its definition, bit by bit: token t is allowed where bit t % 32 of
word t // 32 of its row's mask is set; every other logit becomes -inf, tokens past the mask included,
and every allowed logit keeps its exact value (a -0.0, an inf, and a NaN stays a NaN)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pagedserve.layers.sampler import apply_token_bitmask


def allowed_by_definition(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    allowed = np.zeros((bitmask.shape[0], vocab), dtype=bool)
    for row in range(bitmask.shape[0]):
        for token in range(min(vocab, 32 * bitmask.shape[1])):
            allowed[row, token] = (int(bitmask[row, token // 32]) >> (token % 32)) & 1 == 1
    return allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_rows", "vocab", "words", "rows"),
    [
        (4, 96, 3, [0, 1, 2, 3]),  # every row, in order: masked in place
        (5, 100, 4, [4, 0, 2]),  # some rows, out of order; a vocabulary that is no whole number of words
        (3, 150, 4, [1, 2]),  # a mask narrower than the vocabulary: the tokens past it are disallowed
    ],
)
def test_the_mask_sets_exactly_the_disallowed_logits_to_minus_inf(
    dtype: torch.dtype, num_rows: int, vocab: int, words: int, rows: list[int]
) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(num_rows, vocab, generator=generator) * 4).to(dtype)
    logits[:, 0] = -0.0
    logits[:, 1] = math.inf
    logits[:, 2] = math.nan
    logits[:, 3] = -math.inf
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=generator)
    bitmask[0, 0] = -1  # a word of all ones: tokens 0-31 allowed in the first row masked
    bitmask[-1, -1] = 0  # and a word of all zeros
    before = logits.clone()
    apply_token_bitmask(logits, bitmask, rows)
    allowed = allowed_by_definition(bitmask.numpy(), vocab)
    for i, row in enumerate(rows):
        kept = torch.from_numpy(allowed[i])
        kept_after, kept_before = logits[row, kept], before[row, kept]
        torch.testing.assert_close(kept_after, kept_before, rtol=0, atol=0, equal_nan=True)
        numbers = ~kept_before.isnan()
        assert torch.equal(kept_after[numbers].signbit(), kept_before[numbers].signbit()), f"row {row}"
        assert bool((logits[row, ~kept] == -math.inf).all()), f"row {row}"
    untouched = [r for r in range(num_rows) if r not in rows]
    torch.testing.assert_close(logits[untouched], before[untouched], rtol=0, atol=0, equal_nan=True)
