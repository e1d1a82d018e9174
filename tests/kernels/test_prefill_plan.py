"""The torch reference's two prefill layouts, one padded SDPA call or one call per sequence, give the
same attention, and the plan picks the cheaper one: padding for many short prompts, a causal call
per sequence for long prompts."""

from __future__ import annotations

import pytest
import torch
from pagedserve_kernels import reference

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 6, 2, 16


def plan(q_lens: list[int], context_lens: list[int]) -> reference.PrefillBatch | None:
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return reference.plan_prefill_batch(
        starts, torch.tensor(context_lens, dtype=torch.int32), BLOCK_SIZE, torch.float32
    )


@pytest.mark.parametrize(
    "q_lens, context_lens",
    [
        ([44, 16, 16, 20], [44, 40, 40, 44]),  # prompts after a shared prefix computed in the same step
        ([100, 60, 30], [100, 60, 30]),  # prompts without earlier context
        ([57, 200, 1], [300, 200, 90]),  # a chunk after its context, a prompt, a single-token chunk
    ],
)
def test_padded_and_per_sequence_layouts_agree(
    q_lens: list[int], context_lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = [-(-c // BLOCK_SIZE) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 4
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks in no particular order
    tables, width = [], max(blocks_per_seq)
    for n in blocks_per_seq:
        tables.append(order[:n] + [0] * (width - n))
        order = order[n:]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    context = torch.tensor(context_lens, dtype=torch.int32)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen)
    monkeypatch.setattr(reference, "_PAIRS_PER_CALL", 10**12)  # pad whatever it costs
    padded = reference.plan_prefill_batch(starts, context, BLOCK_SIZE, torch.float32)
    assert padded is not None
    args = (query, k_cache, v_cache, block_tables, starts, context, 0.25)
    out_padded = reference.paged_attention_prefill(*args, batch=padded)
    out_each = reference.paged_attention_prefill(*args, batch=None)
    torch.testing.assert_close(out_padded, out_each, rtol=1e-5, atol=1e-5)


def test_plan_pads_many_short_prompts_and_loops_over_long_ones() -> None:
    # 64 chat prompts, the shared template computed by the first: one padded call
    assert plan([44] + [16] * 63, [44] + [40] * 63) is not None
    # long prompts without context: each runs causal, computing half its pairs, not the padded square
    assert plan([1000, 600, 448], [1000, 600, 448]) is None
    assert plan([2048], [2048]) is None
    # a chunk after a long context computes all its pairs either way: one call, nothing padded
    assert plan([512], [1536]) is not None
    # a long chunk beside short prompts: padding every prompt to its length and context costs more
    assert plan([512, 16, 16], [1536, 16, 16]) is None
