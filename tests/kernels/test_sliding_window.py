"""The reference's sliding-window attention and score soft-capping against dense attention written
out position by position.

A query at position p under a window of W attends to positions p - W + 1..p (transformers'
`kv > q - W`); under a soft-cap c each score s becomes c * tanh(s / c) (Gemma 2's). Each path of the
reference (decode, the padded prefill batch, a call a sequence) is held to a loop over explicit
positions, on contexts shorter than, equal to and longer than the window, with chunks that start
before the window and inside it.
"""

from __future__ import annotations

import math
from itertools import accumulate

import pytest
import torch
from pagedserve_kernels import reference

from tests.kernels.test_attention import make_paged_cache

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
SCALE = HEAD_DIM**-0.5


def dense(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: int,
    window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query [heads, dim] at `position` over keys/values [positions, kv_heads, dim], by loops."""
    first = max(0, position - window + 1) if window else 0
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for head in range(HEADS):
        k, v = keys[first : position + 1, head // group], values[first : position + 1, head // group]
        scores = (k @ q[head]) * SCALE
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        weights = torch.softmax(scores, dim=0)
        out[head] = weights @ v
    return out


def sequence_kv(cache: object, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values in position order, read through its block table."""
    table, length = cache.block_tables[seq], int(cache.context_lens[seq])  # type: ignore[attr-defined]
    slots = [int(table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)]
    k_flat = cache.k_cache.view(-1, KV_HEADS, HEAD_DIM)  # type: ignore[attr-defined]
    v_flat = cache.v_cache.view(-1, KV_HEADS, HEAD_DIM)  # type: ignore[attr-defined]
    return k_flat[slots], v_flat[slots]


CONTEXTS = [1, 5, 8, 9, 23]  # shorter than, equal to and longer than the windows below


# (window, softcap): a cap of 0.5 bends every score (they reach several units here), one of 50 few
CASES = [(0, 0.0), (1, 0.0), (8, 0.0), (9, 0.0), (0, 0.5), (9, 50.0)]


@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_decode_sees_the_last_window_positions(window: int, softcap: float) -> None:
    cache = make_paged_cache(CONTEXTS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    query = torch.randn(len(CONTEXTS), HEADS, HEAD_DIM) * 4
    out = reference.paged_attention_decode(
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        cache.context_lens,
        SCALE,
        window=window,
        softcap=softcap,
    )
    for seq, length in enumerate(CONTEXTS):
        keys, values = sequence_kv(cache, seq)
        expected = dense(query[seq], keys, values, length - 1, window, softcap)
        torch.testing.assert_close(out[seq], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "each-sequence"])
@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_prefill_sees_the_last_window_positions(window: int, softcap: float, padded: bool) -> None:
    # (query tokens, context): a whole prompt, a chunk after earlier context, one token, a long chunk
    shapes = [(5, 5), (7, 23), (1, 9), (20, 20)]
    cache = make_paged_cache(
        [c for _, c in shapes], KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu")
    )
    starts = torch.tensor([0, *accumulate([q for q, _ in shapes])], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), HEADS, HEAD_DIM) * 4
    batch = (
        reference.plan_prefill_batch(starts, cache.context_lens, BLOCK_SIZE, torch.float32, window)
        if padded
        else None
    )
    if padded:
        assert batch is not None  # small enough for one padded call: that path is the one tested
    out = reference.paged_attention_prefill(
        query,
        cache.k_cache,
        cache.v_cache,
        cache.block_tables,
        starts,
        cache.context_lens,
        SCALE,
        batch,
        window,
        softcap,
    )
    for seq, (q_len, context) in enumerate(shapes):
        keys, values = sequence_kv(cache, seq)
        for row in range(q_len):
            token = int(starts[seq]) + row
            expected = dense(query[token], keys, values, context - q_len + row, window, softcap)
            torch.testing.assert_close(out[token], expected, atol=1e-5, rtol=1e-5)


def test_a_window_of_one_is_each_positions_own_value() -> None:
    """The degenerate window: every query sees only itself, so the output is its own value row."""
    cache = make_paged_cache([11], KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    _, values = sequence_kv(cache, 0)
    query = torch.randn(11, HEADS, HEAD_DIM)
    starts = torch.tensor([0, 11], dtype=torch.int32)
    out = reference.paged_attention_prefill(
        query, cache.k_cache, cache.v_cache, cache.block_tables, starts, cache.context_lens, SCALE, window=1
    )
    expected = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    torch.testing.assert_close(out, expected)
    assert not math.isnan(float(out.sum()))
