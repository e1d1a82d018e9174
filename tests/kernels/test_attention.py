"""Paged attention kernels (decode, split-K decode, prefill) against the pure-torch reference.

The grid names every required size without the full cartesian product (the interpreter is slow):
every (head_dim 64/128, block_size 16/32, GQA ratio 1/3/8) combination on a batch of 7 sequences
whose context lengths include 1, 15, 16, 17 and several hundred; batch 1 at each of those lengths;
head_dim 80 (not a power of two); each in float32 and bfloat16. Split-K decode, forced through the
launcher's num_splits, runs every (head_dim, block_size, GQA ratio, dtype) combination on that batch
of 7 and on batch 1 at 17 and 417 tokens. Beyond the grid: the default split-K choice on a long
context, unused cache slots holding NaN, logits large enough to overflow a naive softmax, int64
index tensors, and the launchers' argument checks. Sliding windows (1, under a block, a block,
several blocks, longer than every context) run decode, split-K decode (a split wholly before the
window among them) and prefill (chunks after earlier context, query tiles starting before the
window), with NaN in every slot before the window, and a negative window is refused.
Soft-capped scores (caps 0.5 and 50, each with and without a window) run decode, split-K decode and
prefill (chunks after earlier context) in both dtypes, huge scores under a cap stay finite, and a
negative or non-finite cap is refused.

Tolerances: float32 atol = rtol = 1e-4 against the float32 reference. bfloat16 atol = rtol = 2e-2
against the reference run in float32 on the same bfloat16 inputs (the kernel rounds the softmax
weights and the output to bfloat16).
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import pytest
import torch
from pagedserve_kernels import attention, reference

TOLERANCES = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@dataclass(frozen=True)
class PagedCache:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def make_paged_cache(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PagedCache:
    """Random K/V in every slot (unused ones too, so a masking bug shows), each sequence's blocks
    scattered over the pool in random order, table rows padded with valid block ids."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    pool = torch.randperm(num_blocks).tolist()
    max_blocks = max(blocks_per_seq) + 1
    rows = []
    for n in blocks_per_seq:
        own, pool = pool[:n], pool[n:]
        rows.append(own + [num_blocks - 1] * (max_blocks - n))
    block_tables = torch.tensor(rows, dtype=torch.int32, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return PagedCache(k_cache, v_cache, block_tables, lens)


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


def shape_grid(seq_lens: list, extra: list) -> list:
    """Every (head_dim, block_size, GQA ratio) combination on one batch of 7 sequences with
    num_kv_heads 2, then the extra cases (batch 1, long contexts, head_dim 80)."""
    grid = [
        pytest.param(
            2 * ratio, 2, head_dim, block_size, seq_lens, id=f"b7-gqa{ratio}-d{head_dim}-bs{block_size}"
        )
        for head_dim, block_size, ratio in itertools.product((64, 128), (16, 32), (1, 3, 8))
    ]
    return grid + extra


# (num_heads, num_kv_heads, head_dim, block_size, context_lens)
DECODE_CASES = shape_grid(
    [1, 15, 16, 17, 33, 300, 2],
    [
        pytest.param(8, 1, 128, 16, [417], id="b1-gqa8-d128-bs16-long"),
        pytest.param(9, 3, 64, 32, [1], id="b1-gqa3-d64-bs32"),
        pytest.param(16, 2, 80, 16, [15, 250], id="b2-gqa8-d80-bs16"),
        *[pytest.param(6, 2, 128, 32, [n], id=f"b1-gqa3-d128-bs32-ctx{n}") for n in (1, 15, 16, 17, 300)],
    ],
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "context_lens"), DECODE_CASES
)
def test_decode_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    cache = make_paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, device)
    query = torch.randn(len(context_lens), num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
    out = attention.paged_attention_decode(query, *args)
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args[2:]
    )
    assert_matches_reference(out, expected, dtype)


# Split-K decode runs the same grid with the split count forced through the launcher's num_splits.
# Splits are whole multiples of 16 keys, so the requested count sets the split length on the 300-key
# sequence: 19 -> 16 keys (several splits per 32-token block, 17 tokens split 16 + 1), 7 -> 48 (cuts
# through 32-token blocks), 3 -> 112 (short sequences of the batch leave every split but the first
# empty). A single sequence of 15 or 16 tokens cannot be split, so batch 1 runs 17 tokens (16 + 1)
# and 417 tokens (the last split partly filled).
SPLITS_BY_GQA_RATIO = {1: 19, 3: 7, 8: 3}
SPLIT_BATCHES = {"b7": [1, 15, 16, 17, 33, 300, 2], "b1-ctx17": [17], "b1-ctx417": [417]}
# Every GQA ratio (so split count) with every batch and block size, which set where the splits cut;
# head size and dtype, which change only the width of each row's arithmetic, taken in turn so that
# each pair of factors meets at least once (the full product, 76 cases, took 90 s of the suite's
# time in the Triton interpreter; these 20 take about a quarter of it).
HEAD_DIM_AND_DTYPE = [(64, torch.float32), (64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float32)]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# (gqa ratio, batch, block_size, head_dim, dtype)
SPLIT_FACTORS = [
    (ratio, batch, block_size, *HEAD_DIM_AND_DTYPE[i % 4])
    for i, (ratio, batch, block_size) in enumerate(itertools.product((1, 3, 8), SPLIT_BATCHES, (16, 32)))
]
# (num_heads, num_kv_heads, head_dim, block_size, context_lens, num_splits, dtype)
SPLIT_CASES = [
    pytest.param(
        2 * ratio, 2, head_dim, block_size, SPLIT_BATCHES[batch], SPLITS_BY_GQA_RATIO[ratio], dtype,
        id=f"{batch}-gqa{ratio}-d{head_dim}-bs{block_size}-{SPLITS_BY_GQA_RATIO[ratio]}splits-{DTYPE_IDS[dtype]}",
    )
    for ratio, batch, block_size, head_dim, dtype in SPLIT_FACTORS
] + [
    pytest.param(16, 2, 80, 16, [15, 250], 5, dtype, id=f"b2-gqa8-d80-bs16-5splits-{DTYPE_IDS[dtype]}")
    for dtype in DTYPE_IDS
]  # fmt: skip


def test_the_split_cases_meet_every_pair_of_factors() -> None:
    for a, b in itertools.combinations(range(5), 2):
        pairs = {(f[a], f[b]) for f in SPLIT_FACTORS}
        assert len(pairs) == len({f[a] for f in SPLIT_FACTORS}) * len({f[b] for f in SPLIT_FACTORS}), (a, b)


def spy_on_decode_splits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of key splits of each decode launch (1 = no split-K), recorded on the way into
    the real launch: a launcher that ignored num_splits would still match the reference."""
    num_splits_launched = []
    launch = attention._launch_decode
    signature = inspect.signature(launch)

    def recording_launch(*args, **kwargs) -> None:
        bound = signature.bind(*args, **kwargs).arguments
        num_splits_launched.append(1 if bound["lse"] is None else bound["out"].shape[2])
        launch(*args, **kwargs)

    monkeypatch.setattr(attention, "_launch_decode", recording_launch)
    return num_splits_launched


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "context_lens", "num_splits", "dtype"),
    SPLIT_CASES,
)
def test_split_k_decode_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
    num_splits: int,
    dtype: torch.dtype,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = make_paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, device)
    query = torch.randn(len(context_lens), num_heads, head_dim, dtype=dtype, device=device)
    args = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    num_splits_launched = spy_on_decode_splits(monkeypatch)
    out = attention.paged_attention_decode(query, cache.k_cache, cache.v_cache, *args, num_splits=num_splits)
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args
    )
    assert len(num_splits_launched) == 1 and 1 < num_splits_launched[0] <= num_splits
    assert_matches_reference(out, expected, dtype)


def test_default_num_splits_splits_only_long_contexts_on_small_grids() -> None:
    cpu = torch.device("cpu")
    assert attention._default_num_splits(num_programs=8, max_context_len=300, device=cpu) == 1
    assert attention._default_num_splits(num_programs=8, max_context_len=4096, device=cpu) == 16
    # a grid that already fills the device is not split
    assert attention._default_num_splits(num_programs=4096, max_context_len=4096, device=cpu) == 1


def test_decode_accepts_strided_query(device: torch.device) -> None:
    """The model passes query heads as a view of the fused QKV projection's output."""
    cache = make_paged_cache([17, 5], 2, 64, 16, torch.float32, device)
    qkv = torch.randn(2, 10, 64, device=device)
    query = qkv[:, :6]
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    out = attention.paged_attention_decode(query, *args)
    torch.testing.assert_close(out, reference.paged_attention_decode(query, *args), atol=1e-4, rtol=1e-4)


# (num_heads, num_kv_heads, head_dim, block_size, [(query_len, context_len), ...]): query_len <
# context_len is a chunked prefill (or prefix-cache hit) whose earlier tokens are already cached;
# query_len 0 is a sequence with nothing to run this step
PREFILL_CASES = shape_grid(
    [(1, 1), (15, 15), (16, 16), (17, 17), (5, 17), (0, 3), (20, 300)],
    [
        pytest.param(8, 1, 128, 32, [(300, 300)], id="b1-gqa8-d128-bs32-long"),
        pytest.param(3, 1, 64, 16, [(100, 340)], id="b1-gqa3-d64-bs16-chunk"),
        pytest.param(9, 3, 80, 16, [(17, 17), (15, 31)], id="b2-gqa3-d80-bs16"),
        *[pytest.param(6, 2, 64, 32, [(n, n)], id=f"b1-gqa3-d64-bs32-ctx{n}") for n in (1, 15, 16, 17, 300)],
    ],
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "lens"), PREFILL_CASES)
def test_prefill_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    lens: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    query_lens = [q for q, _ in lens]
    cache = make_paged_cache([c for _, c in lens], num_kv_heads, head_dim, block_size, dtype, device)
    starts = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    query = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype, device=device)
    args = (cache.block_tables, starts, cache.context_lens, head_dim**-0.5)
    out = attention.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *args)
    expected = reference.paged_attention_prefill(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args
    )
    assert_matches_reference(out, expected, dtype)


def test_prefill_of_one_token_equals_decode(device: torch.device) -> None:
    """A one-token prefill is a decode step: the two kernels must agree with each other."""
    cache = make_paged_cache([15, 33, 1], 3, 64, 16, torch.float32, device)
    query = torch.randn(3, 9, 64, device=device)
    starts = torch.arange(4, dtype=torch.int32, device=device)
    kv = (cache.k_cache, cache.v_cache, cache.block_tables)
    decode = attention.paged_attention_decode(query, *kv, cache.context_lens, 0.125)
    prefill = attention.paged_attention_prefill(query, *kv, starts, cache.context_lens, 0.125)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


def test_decode_default_split_k_on_long_context(device: torch.device) -> None:
    """num_splits=None picks split-K for one long sequence; the merged result matches."""
    cache = make_paged_cache([1200, 3], 1, 64, 16, torch.float32, device)
    assert attention._default_num_splits(2, 1200, device) > 1
    query = torch.randn(2, 8, 64, device=device)
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    out = attention.paged_attention_decode(query, *args)
    torch.testing.assert_close(out, reference.paged_attention_decode(query, *args), atol=1e-4, rtol=1e-4)


def poison_unused_slots(
    cache: PagedCache, first_visible: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with NaN in every slot outside the sequences' contexts (and before each
    sequence's first_visible position, when given): a kernel that reads one (instead of masking the
    load) returns NaN, since 0 * NaN is NaN."""
    block_size = cache.k_cache.shape[1]
    unused = torch.ones(cache.k_cache.shape[:2], dtype=torch.bool, device=cache.k_cache.device)
    for seq, context_len in enumerate(cache.context_lens.tolist()):
        first = first_visible[seq] if first_visible else 0
        positions = torch.arange(first, context_len, device=unused.device)
        unused[cache.block_tables[seq, positions // block_size].long(), positions % block_size] = False
    k_cache, v_cache = cache.k_cache.clone(), cache.v_cache.clone()
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    return k_cache, v_cache


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_never_reads_unused_slots(num_splits: int, device: torch.device) -> None:
    cache = make_paged_cache([1, 17, 100, 33], 2, 64, 16, torch.float32, device)
    k_cache, v_cache = poison_unused_slots(cache)
    query = torch.randn(4, 6, 64, device=device)
    tail = (cache.block_tables, cache.context_lens, 0.125)
    out = attention.paged_attention_decode(query, k_cache, v_cache, *tail, num_splits=num_splits)
    expected = reference.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_prefill_never_reads_unused_slots(device: torch.device) -> None:
    lens = [(1, 1), (5, 17), (0, 3), (40, 40)]
    cache = make_paged_cache([c for _, c in lens], 2, 64, 16, torch.float32, device)
    k_cache, v_cache = poison_unused_slots(cache)
    starts = torch.tensor([0, *(q for q, _ in lens)], device=device).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), 6, 64, device=device)
    tail = (cache.block_tables, starts, cache.context_lens, 0.125)
    out = attention.paged_attention_prefill(query, k_cache, v_cache, *tail)
    expected = reference.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


# Sliding windows: 1, under a block, a block, several blocks, longer than every context (block size 16)
WINDOWS = [pytest.param(w, id=f"w{w}") for w in (1, 7, 16, 45, 1000)]
# contexts shorter and longer than the windows; one 300 tokens long, past several windows' blocks
WINDOW_CONTEXTS = [1, 15, 16, 17, 40, 300]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window_matches_reference(window: int, dtype: torch.dtype, device: torch.device) -> None:
    cache = make_paged_cache(WINDOW_CONTEXTS, 2, 64, 16, dtype, device)
    query = torch.randn(len(WINDOW_CONTEXTS), 6, 64, dtype=dtype, device=device)
    args = (cache.block_tables, cache.context_lens, 0.125)
    out = attention.paged_attention_decode(query, cache.k_cache, cache.v_cache, *args, window=window)
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, window=window
    )
    assert_matches_reference(out, expected, dtype)


# (window, block_size, num_splits): the splits divide only the keys from the block holding the first
# visible one. Window 7 in blocks of 32: one split's share (32 keys) holds the whole window, the
# second split is empty. Window 20 in blocks of 32: splits of 16 keys, so where the window starts in
# a block's second half (300 tokens: keys 280..299, in the block 256..287) split 0 holds only keys
# before it. Window 100: three splits of 48 keys share it.
WINDOW_SPLIT_CASES = [(7, 32, 2), (20, 32, 4), (100, 16, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("window", "block_size", "num_splits"),
    [pytest.param(*case, id="w{}-bs{}-{}splits".format(*case)) for case in WINDOW_SPLIT_CASES],
)
def test_split_k_decode_window_matches_reference(
    window: int,
    block_size: int,
    num_splits: int,
    dtype: torch.dtype,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = make_paged_cache(WINDOW_CONTEXTS, 2, 64, block_size, dtype, device)
    query = torch.randn(len(WINDOW_CONTEXTS), 6, 64, dtype=dtype, device=device)
    args = (cache.block_tables, cache.context_lens, 0.125)
    num_splits_launched = spy_on_decode_splits(monkeypatch)
    out = attention.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *args, num_splits=num_splits, window=window
    )
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, window=window
    )
    assert num_splits_launched == [num_splits]
    assert_matches_reference(out, expected, dtype)


def test_default_split_k_divides_only_the_window(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4,096-token context is split 16 ways without a window; under a window of 256 only ~256 keys
    are read, too few to split."""
    cache = make_paged_cache([4096], 1, 64, 16, torch.float32, device)
    query = torch.randn(1, 4, 64, device=device)
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    assert attention._default_num_splits(1, 4096, device) == 16
    num_splits_launched = spy_on_decode_splits(monkeypatch)
    out = attention.paged_attention_decode(query, *args, window=256)
    assert num_splits_launched == [1]
    torch.testing.assert_close(
        out, reference.paged_attention_decode(query, *args, window=256), atol=1e-4, rtol=1e-4
    )


# (query_len, context_len): whole prompts shorter and longer than the windows, a chunk after earlier
# context, a sequence with nothing to run, a short chunk deep in a long context, and a long chunk
# whose query tiles (21 tokens at GQA ratio 3) start before, inside and after the windows
WINDOW_PREFILL_LENS = [(1, 1), (17, 17), (5, 17), (0, 3), (20, 300), (100, 140)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_window_matches_reference(window: int, dtype: torch.dtype, device: torch.device) -> None:
    query_lens = [q for q, _ in WINDOW_PREFILL_LENS]
    cache = make_paged_cache([c for _, c in WINDOW_PREFILL_LENS], 2, 64, 16, dtype, device)
    starts = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    query = torch.randn(sum(query_lens), 6, 64, dtype=dtype, device=device)
    args = (cache.block_tables, starts, cache.context_lens, 0.125)
    out = attention.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *args, window=window)
    expected = reference.paged_attention_prefill(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, window=window
    )
    assert_matches_reference(out, expected, dtype)


@pytest.mark.parametrize("window", [pytest.param(w, id=f"w{w}") for w in (1, 40)])
def test_prefill_window_rows_of_a_tile_start_after_its_key_tiles(window: int, device: torch.device) -> None:
    """At GQA ratio 1 a query tile holds 64 tokens, a key tile 32: the tile's last rows see none of
    its first key tiles (their running max stays -inf for a while) and must still come out exact."""
    lens = [(64, 64), (70, 100)]
    cache = make_paged_cache([c for _, c in lens], 2, 64, 16, torch.float32, device)
    starts = torch.tensor([0, 64, 134], dtype=torch.int32, device=device)
    query = torch.randn(134, 2, 64, device=device)
    args = (cache.k_cache, cache.v_cache, cache.block_tables, starts, cache.context_lens, 0.125)
    out = attention.paged_attention_prefill(query, *args, window=window)
    expected = reference.paged_attention_prefill(query, *args, window=window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_never_reads_before_the_window(num_splits: int, device: torch.device) -> None:
    """NaN in every slot before the window (blocks of 32, so with 4 splits split 0 of the longest
    sequences holds only such slots) and outside the contexts: the output is the clean cache's."""
    window = 20
    cache = make_paged_cache(WINDOW_CONTEXTS, 2, 64, 32, torch.float32, device)
    k_cache, v_cache = poison_unused_slots(cache, [max(n - window, 0) for n in WINDOW_CONTEXTS])
    query = torch.randn(len(WINDOW_CONTEXTS), 6, 64, device=device)
    tail = (cache.block_tables, cache.context_lens, 0.125)
    out = attention.paged_attention_decode(
        query, k_cache, v_cache, *tail, num_splits=num_splits, window=window
    )
    expected = reference.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_prefill_never_reads_before_the_window(device: torch.device) -> None:
    """NaN in every slot before the first query token's window and outside the contexts."""
    window = 20
    lens = [(1, 1), (5, 17), (0, 3), (40, 40), (30, 200)]
    cache = make_paged_cache([c for _, c in lens], 2, 64, 16, torch.float32, device)
    k_cache, v_cache = poison_unused_slots(cache, [max(c - q - window + 1, 0) for q, c in lens])
    starts = torch.tensor([0, *(q for q, _ in lens)], device=device).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), 6, 64, device=device)
    tail = (cache.block_tables, starts, cache.context_lens, 0.125)
    out = attention.paged_attention_prefill(query, k_cache, v_cache, *tail, window=window)
    expected = reference.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_a_negative_window_is_refused(device: torch.device) -> None:
    cache = make_paged_cache([17, 5], 2, 64, 16, torch.float32, device)
    query = torch.randn(2, 4, 64, device=device)
    kv = (cache.k_cache, cache.v_cache, cache.block_tables)
    with pytest.raises(ValueError, match="window must be >= 0"):
        attention.paged_attention_decode(query, *kv, cache.context_lens, 0.125, window=-1)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="window must be >= 0"):
        attention.paged_attention_prefill(query, *kv, starts, cache.context_lens, 0.125, window=-1)


# Soft-capping: a cap of 0.5 bends every score (queries scaled by 4, so scores reach several units),
# Gemma 2's 50 only the largest; each without a window and under one of 20 tokens (block size 16)
SOFTCAPS = [pytest.param(c, id=f"cap{c:g}") for c in (0.5, 50.0)]
SOFTCAP_WINDOWS = [pytest.param(w, id=f"w{w}") for w in (0, 20)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", SOFTCAP_WINDOWS)
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_decode_softcap_matches_reference(
    softcap: float, window: int, dtype: torch.dtype, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without splits and with 3 forced. Without the window splits of 112 keys, the short sequences
    leaving the last ones empty; under it splits of 16 from the block holding the first visible key
    (300 tokens: 272..287, its first 8 before the window, then 288..299 and an empty third)."""
    contexts = [1, 17, 40, 300]
    cache = make_paged_cache(contexts, 2, 64, 16, dtype, device)
    query = 4 * torch.randn(len(contexts), 6, 64, dtype=dtype, device=device)
    args = (cache.block_tables, cache.context_lens, 0.125)
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, window=window, softcap=softcap
    )
    num_splits_launched = spy_on_decode_splits(monkeypatch)
    for num_splits in (1, 3):
        out = attention.paged_attention_decode(
            query, cache.k_cache, cache.v_cache, *args, num_splits=num_splits, window=window, softcap=softcap
        )
        assert_matches_reference(out, expected, dtype)
    assert num_splits_launched == [1, 3]


# whole prompts, a chunk after earlier context, a sequence with nothing to run, and a long chunk
# whose query tiles (21 tokens at GQA ratio 3) start before, inside and after the window
SOFTCAP_PREFILL_LENS = [(1, 1), (17, 17), (5, 40), (0, 3), (50, 120)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", SOFTCAP_WINDOWS)
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_prefill_softcap_matches_reference(
    softcap: float, window: int, dtype: torch.dtype, device: torch.device
) -> None:
    query_lens = [q for q, _ in SOFTCAP_PREFILL_LENS]
    cache = make_paged_cache([c for _, c in SOFTCAP_PREFILL_LENS], 2, 64, 16, dtype, device)
    starts = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    query = 4 * torch.randn(sum(query_lens), 6, 64, dtype=dtype, device=device)
    args = (cache.block_tables, starts, cache.context_lens, 0.125)
    out = attention.paged_attention_prefill(
        query, cache.k_cache, cache.v_cache, *args, window=window, softcap=softcap
    )
    expected = reference.paged_attention_prefill(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, window=window, softcap=softcap
    )
    assert_matches_reference(out, expected, dtype)


def test_softcap_of_huge_scores_stays_finite(device: torch.device) -> None:
    """Scores in the hundreds under a cap of 1: tanh written as (exp(2x) - 1) / (exp(2x) + 1) would
    overflow to inf / inf (NaN); the cap holds them at +-1."""
    cache = make_paged_cache([300, 17, 1], 2, 64, 16, torch.float32, device)
    query = 500 * torch.randn(3, 4, 64, device=device)
    args = (cache.k_cache, cache.v_cache, cache.block_tables)
    expected = reference.paged_attention_decode(query, *args, cache.context_lens, 0.125, softcap=1.0)
    decode = attention.paged_attention_decode(query, *args, cache.context_lens, 0.125, softcap=1.0)
    starts = torch.arange(4, dtype=torch.int32, device=device)
    prefill = attention.paged_attention_prefill(query, *args, starts, cache.context_lens, 0.125, softcap=1.0)
    for out in (decode, prefill):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_a_negative_or_non_finite_softcap_is_refused(softcap: float, device: torch.device) -> None:
    cache = make_paged_cache([17, 5], 2, 64, 16, torch.float32, device)
    query = torch.randn(2, 4, 64, device=device)
    kv = (cache.k_cache, cache.v_cache, cache.block_tables)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        attention.paged_attention_decode(query, *kv, cache.context_lens, 0.125, softcap=softcap)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        attention.paged_attention_prefill(query, *kv, starts, cache.context_lens, 0.125, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_is_stable_for_huge_logits(dtype: torch.dtype, device: torch.device) -> None:
    """Scores in the thousands overflow exp() in any float type; the running max keeps every
    exponent <= 0. The reference (softmax with max subtraction) is the truth."""
    cache = make_paged_cache([300, 17, 1], 2, 64, 16, dtype, device)
    query = 500 * torch.randn(3, 4, 64, dtype=dtype, device=device)
    tail = (cache.block_tables, cache.context_lens, 0.125)
    out = attention.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, num_splits=3)
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail
    )
    assert torch.isfinite(out).all()
    assert_matches_reference(out, expected, dtype)
    starts = torch.arange(4, dtype=torch.int32, device=device)
    prefill = attention.paged_attention_prefill(
        query, cache.k_cache, cache.v_cache, tail[0], starts, *tail[1:]
    )
    assert_matches_reference(prefill, expected, dtype)


def test_int64_indices_and_host_hints(device: torch.device) -> None:
    """int64 block tables, context lengths and query starts; the max_context_len / max_query_len
    hints the model runner passes give the same result as computing them."""
    lens = [(3, 3), (5, 40), (17, 17)]
    cache = make_paged_cache([c for _, c in lens], 2, 64, 32, torch.float32, device)
    tables, context_lens = cache.block_tables.long(), cache.context_lens.long()
    starts = torch.tensor([0, 3, 8, 25], dtype=torch.int64, device=device)
    query = torch.randn(25, 4, 64, device=device)
    kv = (cache.k_cache, cache.v_cache)
    prefill = attention.paged_attention_prefill(
        query, *kv, tables, starts, context_lens, 0.125, max_query_len=17
    )
    expected = reference.paged_attention_prefill(
        query, *kv, cache.block_tables, starts, cache.context_lens, 0.125
    )
    torch.testing.assert_close(prefill, expected, atol=1e-4, rtol=1e-4)
    decode = attention.paged_attention_decode(query[:3], *kv, tables, context_lens, 0.125, max_context_len=40)
    expected = reference.paged_attention_decode(query[:3], *kv, cache.block_tables, cache.context_lens, 0.125)
    torch.testing.assert_close(decode, expected, atol=1e-4, rtol=1e-4)


def bad_decode_args(device: torch.device) -> dict[str, dict]:
    cache = make_paged_cache([17, 5], 2, 64, 16, torch.float32, device)
    good = {
        "query": torch.randn(2, 4, 64, device=device),
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "block_tables": cache.block_tables,
        "context_lens": cache.context_lens,
        "scale": 0.125,
    }
    odd_block = torch.randn(8, 12, 2, 64, device=device)
    return {
        "query: dtype": {**good, "query": good["query"].int()},
        "k_cache: dtype": {**good, "query": good["query"].half()},
        "query: last dimension must be contiguous": {
            **good,
            "query": torch.randn(2, 4, 128, device=device)[..., ::2],
        },
        "k_cache: must be contiguous": {
            **good,
            "k_cache": cache.k_cache.transpose(1, 2).contiguous().transpose(1, 2),
        },
        "v_cache: expected shape": {**good, "v_cache": cache.v_cache[:-1]},
        "block_tables: dtype": {**good, "block_tables": cache.block_tables.float()},
        "context_lens: expected shape": {**good, "context_lens": cache.context_lens[:1]},
        "not a multiple of num_kv_heads": {**good, "query": torch.randn(2, 3, 64, device=device)},
        "head_dim": {**good, "query": torch.randn(2, 4, 32, device=device)},
        "power of two": {**good, "k_cache": odd_block, "v_cache": odd_block},
        "cannot hold": {**good, "block_tables": cache.block_tables[:, :1]},
    }


@pytest.mark.parametrize("problem", list(bad_decode_args(torch.device("cpu"))))
def test_decode_launcher_rejects_bad_arguments(problem: str, device: torch.device) -> None:
    """Bad shapes, strides and dtypes fail in the launcher with a message naming the problem,
    instead of as a wrong answer or an illegal memory access inside the kernel."""
    with pytest.raises(AssertionError, match=problem):
        attention.paged_attention_decode(**bad_decode_args(device)[problem])


def test_prefill_launcher_rejects_bad_query_start_loc(device: torch.device) -> None:
    cache = make_paged_cache([17, 5], 2, 64, 16, torch.float32, device)
    query = torch.randn(4, 4, 64, device=device)
    kv = (cache.k_cache, cache.v_cache, cache.block_tables)
    with pytest.raises(AssertionError, match="query_start_loc: expected shape"):
        attention.paged_attention_prefill(
            query, *kv, torch.tensor([0, 4], device=device), cache.context_lens, 0.1
        )
