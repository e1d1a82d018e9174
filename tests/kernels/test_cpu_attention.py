"""The C++ CPU kernels (`pagedserve_kernels.cpu`: decode attention, KV writes) against the pure-torch
reference.

It is built here with the machine's C++ compiler (as the engine builds it on first use); on a machine
without one these tests are skipped, and tests/engine/test_compile.py checks the engine then falls back.

Grid: head_dim 64 and 128 (the unrolled paths, and in bf16 the AVX512-BF16 one where the CPU has
it) and 80 (the generic one), GQA ratios 1/3/4/8 (the AVX512 path accumulates 4 heads at a time for
head size 64, 2 for 128), block sizes 8 and 16, context lengths across block, 16-token chunk and
(bf16) 256-token tile boundaries (1, 7, 8, 9, 16, 17, 33, 300), float32, bfloat16 and float16. Phi-3's
head size 96 and Gemma's 256 on the AVX512-BF16 paths (bf16 decode, plain, windowed and capped; the
prefill kernel) in a few cases each: passes of 2 heads (96) and of 1 (256), whole and partial.
Tolerances: float32 1e-5 against the float32 reference; bf16 and fp16 against the reference run in
float32 on the same inputs, no further off than the reference's own low-precision result. Also
prefill attention: as decode rows (`reference.prefill_rows`), in the bf16 prefill kernel
(`paged_attention_prefill`, AVX512-BF16 builds), and the CPU backend's use of the latter. Sliding
windows (`window`): decode and prefill against the reference's windowed attention, windows of 1, below
a block, of a block, across blocks (and the 256-token tile) and longer than every context; the slots
before a row's window are never read. Soft-capping (`softcap`, Gemma 2's): decode (every dtype, both
paths) and the prefill kernel against the reference's capped attention under caps of 0.5 (every score
bent) and 50 (Gemma 2's), with and without a window, on queries scaled up so that scores reach several
units, and on huge ones (tanh saturated); negative, NaN and infinite caps refused.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable

import pytest
import torch
from pagedserve.layers.attention import AttentionMetadata, TorchAttentionBackend
from pagedserve_kernels import cpu, reference
from test_attention import PagedCache, make_paged_cache, poison_unused_slots

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernel"
)

CASES = [
    pytest.param(
        num_kv_heads * ratio, num_kv_heads, head_dim, block_size, id=f"gqa{ratio}-d{head_dim}-bs{block_size}"
    )
    for head_dim in (64, 128, 80)
    for ratio, num_kv_heads in ((1, 2), (3, 3), (4, 2), (8, 1))
    for block_size in (8, 16)
]
CONTEXT_LENS = [1, 7, 8, 9, 16, 17, 33, 300]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), CASES)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_decode_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    cache = make_paged_cache(CONTEXT_LENS, num_kv_heads, head_dim, block_size, dtype, torch.device("cpu"))
    query = torch.randn(len(CONTEXT_LENS), num_heads, head_dim, dtype=dtype)
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail)
    assert out.dtype == dtype and out.shape == query.shape
    assert_as_near_as_the_reference(out, reference.paged_attention_decode, query, cache, tail)


def assert_as_near_as_the_reference(
    out: torch.Tensor,
    reference_fn: Callable[..., torch.Tensor],
    query: torch.Tensor,
    cache: PagedCache,
    tail: tuple[object, ...],
    rounds_weights: bool = False,
) -> None:
    """float32: within 1e-5 of the reference; bf16, fp16: no further off the reference run in float32
    on the same inputs than the reference's own low-precision result, plus 1e-3 (and, where the
    kernel rounds the softmax weights to bfloat16 for P V as flash attention does, 2^-9 max|V|)."""
    exact = reference_fn(query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail)
    if query.dtype == torch.float32:
        torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)
        return
    theirs = (reference_fn(query, cache.k_cache, cache.v_cache, *tail).float() - exact).abs().max().item()
    slack = 1e-3 + (2**-9 * cache.v_cache.float().abs().max().item() if rounds_weights else 0.0)
    assert (out.float() - exact).abs().max().item() <= theirs + slack


# bf16 decode at Phi-3's head size 96 (2 heads a pass: GQA 3 leaves a pass of 1) and Gemma's 256 (1
# head a pass: MHA, and Gemma-2B's 8 heads on one KV head)
WIDE_CASES = [
    pytest.param(6, 2, 96, 8, id="gqa3-d96-bs8"),
    pytest.param(8, 2, 96, 16, id="gqa4-d96-bs16"),
    pytest.param(4, 4, 256, 16, id="gqa1-d256-bs16"),
    pytest.param(8, 1, 256, 8, id="gqa8-d256-bs8"),
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), WIDE_CASES)
@pytest.mark.parametrize(
    ("window", "softcap"), [(0, 0.0), (260, 0.0), (7, 50.0)], ids=["full", "window260", "window7-cap50"]
)
def test_bf16_decode_at_head_sizes_96_and_256_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int, softcap: float
) -> None:
    """The AVX512-BF16 decode path (the generic loops where the CPU lacks it) at head sizes 96 and 256,
    over the whole context (300 tokens: two tiles), a window past the first tile, and a short window
    under Gemma 2's cap (queries scaled up so that the cap bends the scores)."""
    cache = make_paged_cache(
        CONTEXT_LENS, num_kv_heads, head_dim, block_size, torch.bfloat16, torch.device("cpu")
    )
    query = torch.randn(len(CONTEXT_LENS), num_heads, head_dim)
    query = (SOFTCAP_QUERY_SCALE * query if softcap else query).to(torch.bfloat16)
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *tail, window=window, softcap=softcap
    )
    assert out.shape == query.shape
    limited = functools.partial(reference.paged_attention_decode, window=window, softcap=softcap)
    assert_as_near_as_the_reference(out, limited, query, cache, tail)


def window_of(kind: str, block_size: int) -> int:
    """A window of one token, below a block, of a block, across blocks, across 256 tokens (the bf16
    decode path's tile, on the context of 300), or longer than every context."""
    return {
        "1": 1,
        "below-block": block_size // 2 + 1,
        "block": block_size,
        "blocks": 2 * block_size + 3,
        "past-tile": 260,
        "past-all": 2000,
    }[kind]


WINDOWS = ["1", "below-block", "block", "blocks", "past-tile", "past-all"]
# GQA 3 and 4 of CASES: the AVX512-BF16 path's passes of heads (4 for head size 64, 2 for 128) partial
# and whole
WINDOW_CASES = [case for case in CASES if case.id is not None and case.id.startswith(("gqa3-", "gqa4-"))]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), WINDOW_CASES)
@pytest.mark.parametrize("kind", WINDOWS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_decode_under_a_window_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kind: str, dtype: torch.dtype
) -> None:
    """Each row over its context's last `window` tokens, on contexts shorter and longer than the window
    (head sizes 64 and 128 in bf16: the AVX512-BF16 path; the rest the generic loops)."""
    window = window_of(kind, block_size)
    cache = make_paged_cache(CONTEXT_LENS, num_kv_heads, head_dim, block_size, dtype, torch.device("cpu"))
    query = torch.randn(len(CONTEXT_LENS), num_heads, head_dim, dtype=dtype)
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, window=window)
    windowed = functools.partial(reference.paged_attention_decode, window=window)
    assert_as_near_as_the_reference(out, windowed, query, cache, tail)


def poison_before_the_windows(
    cache: PagedCache, caches: tuple[torch.Tensor, torch.Tensor], first_visible: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of `caches` with NaN also in each sequence's slots before position first_visible[seq]
    (its blocks are its own: no other sequence reads them)."""
    block_size = cache.k_cache.shape[1]
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    for seq, first in enumerate(first_visible):
        positions = torch.arange(first)
        blocks = cache.block_tables[seq, positions // block_size].long()
        k_cache[blocks, positions % block_size] = float("nan")
        v_cache[blocks, positions % block_size] = float("nan")
    return k_cache, v_cache


@pytest.mark.parametrize("head_dim", [64, 80], ids=["d64", "d80"])
@pytest.mark.parametrize("window", [1, 5, 8, 20, 260])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_decode_never_reads_the_slots_before_the_window(
    head_dim: int, window: int, dtype: torch.dtype
) -> None:
    """The slots before each row's window (and past its context) hold NaN: a row that read one, even
    masked, would turn NaN (0 * NaN). The output is finite and the reference's on the clean cache."""
    lens = [1, 17, 100, 33, 300]
    cache = make_paged_cache(lens, 2, head_dim, 8, dtype, torch.device("cpu"))
    caches = poison_before_the_windows(cache, poison_unused_slots(cache), [max(0, n - window) for n in lens])
    query = torch.randn(len(lens), 6, head_dim).to(dtype)
    tail = (cache.block_tables, cache.context_lens, 0.125)
    out = cpu.paged_attention_decode(query, *caches, *tail, window=window)
    assert torch.isfinite(out).all()
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail, window=window
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16, fp16: the output's rounding
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


# caps that bend every score of SOFTCAP_QUERY_SCALE-scaled queries (0.5) and Gemma 2's (50: scores of
# several units bent by a few percent)
SOFTCAPS = [0.5, 50.0]
SOFTCAP_QUERY_SCALE = 4  # q.k * scale ~ N(0, 16): scores of several units, the largest past 10
# one case a decode path: AVX512-BF16 passes of 3 of 4 heads (d64) and 2 (d128) in bf16, the
# generic loops' unrolled (d64, d128) and run-time (d80) head sizes
SOFTCAP_CASES = [case for case in CASES if case.id in ("gqa3-d64-bs8", "gqa4-d128-bs16", "gqa8-d80-bs8")]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SOFTCAP_CASES)
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_decode_under_a_softcap_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    softcap: float,
    window: int,
    dtype: torch.dtype,
) -> None:
    """Each score s becomes softcap * tanh(s / softcap) before the softmax, as the reference caps it,
    alone and under a window."""
    cache = make_paged_cache(CONTEXT_LENS, num_kv_heads, head_dim, block_size, dtype, torch.device("cpu"))
    query = (SOFTCAP_QUERY_SCALE * torch.randn(len(CONTEXT_LENS), num_heads, head_dim)).to(dtype)
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *tail, window=window, softcap=softcap
    )
    capped = functools.partial(reference.paged_attention_decode, window=window, softcap=softcap)
    assert_as_near_as_the_reference(out, capped, query, cache, tail)


@pytest.mark.parametrize("head_dim", [64, 80], ids=["d64", "d80"])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_under_a_softcap_is_stable_for_huge_logits(
    head_dim: int, softcap: float, dtype: torch.dtype
) -> None:
    """Scores in the hundreds and thousands: s / softcap far past where tanh is 1 in float32 (and
    exp(-2|x|) underflows), every capped score +-softcap or near it."""
    cache = make_paged_cache([300, 17, 1], 2, head_dim, 8, dtype, torch.device("cpu"))
    query = (500 * torch.randn(3, 4, head_dim)).to(dtype)
    tail = (cache.block_tables, cache.context_lens, 0.125)
    out = cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, softcap=softcap)
    assert torch.isfinite(out).all()
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail, softcap=softcap
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_reads_a_strided_query_and_never_the_unused_slots(dtype: torch.dtype) -> None:
    """The query is a view into the fused qkv projection (rows wider than heads * head_dim), and
    slots past a sequence's end hold NaN: the kernel must neither assume contiguity nor read them."""
    cache = make_paged_cache([1, 17, 100, 33], 2, 64, 8, dtype, torch.device("cpu"))
    k_cache, v_cache = poison_unused_slots(cache)
    qkv = torch.randn(4, (6 + 2 + 2) * 64).to(dtype)
    query = qkv[:, : 6 * 64].view(4, 6, 64)
    assert not query.is_contiguous()
    tail = (cache.block_tables, cache.context_lens, 0.125)
    out = cpu.paged_attention_decode(query, k_cache, v_cache, *tail)
    assert torch.isfinite(out).all()
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softmax_is_stable_for_huge_logits(dtype: torch.dtype) -> None:
    cache = make_paged_cache([300, 17, 1], 2, 64, 8, dtype, torch.device("cpu"))
    query = (500 * torch.randn(3, 4, 64)).to(dtype)
    tail = (cache.block_tables, cache.context_lens, 0.125)
    out = cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail)
    assert torch.isfinite(out).all()
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail
    )
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_bad_arguments_are_refused_with_the_reason() -> None:
    cache = make_paged_cache([5, 9], 2, 64, 8, torch.float32, torch.device("cpu"))
    query = torch.randn(2, 4, 64)
    scale = 0.125
    with pytest.raises(RuntimeError, match="int32"):
        cpu.paged_attention_decode(
            query, cache.k_cache, cache.v_cache, cache.block_tables.long(), cache.context_lens, scale
        )
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu.paged_attention_decode(
            query.double(), cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
        )
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        cpu.paged_attention_decode(
            torch.randn(2, 3, 64), cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
        )
    with pytest.raises(RuntimeError, match="one block table row"):
        cpu.paged_attention_decode(
            query[:1], cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
        )
    with pytest.raises(RuntimeError, match="window must be 0 .none. or positive, got -1"):
        cpu.paged_attention_decode(
            query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale, window=-1
        )
    for softcap in (-50.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="softcap must be 0 .none. or positive and finite, got"):
            cpu.paged_attention_decode(
                query,
                cache.k_cache,
                cache.v_cache,
                cache.block_tables,
                cache.context_lens,
                scale,
                softcap=softcap,
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_cache_matches_reference_and_skips_slot_minus_one(dtype: torch.dtype) -> None:
    shape = (6, 8, 3, 64)
    ours = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    theirs = (ours[0].clone(), ours[1].clone())
    qkv = torch.randn(5, (9 + 3 + 3) * 64).to(dtype)  # key and value as views of a fused projection
    key, value = qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64), qkv[:, 12 * 64 :].view(5, 3, 64)
    slots = torch.tensor([17, -1, 0, 47, 9])
    cpu.write_kv_cache(key, value, *ours, slots)
    reference.write_kv_cache(key, value, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    # rows that are not contiguous inside (heads and head_dim swapped in memory) are copied first
    key = torch.randn(5, 64, 3).to(dtype).transpose(1, 2)
    cpu.write_kv_cache(key, key, *ours, torch.tensor([3, 4, 5, -1, 40]))
    reference.write_kv_cache(key, key, *theirs, torch.tensor([3, 4, 5, -1, 40]))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_write_kv_cache_refuses_a_slot_past_the_cache() -> None:
    caches = (torch.zeros(2, 8, 1, 4), torch.zeros(2, 8, 1, 4))
    key = torch.ones(2, 1, 4)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu.write_kv_cache(key, key, *caches, torch.tensor([3, 16]))
    with pytest.raises(RuntimeError, match="int64"):
        cpu.write_kv_cache(key, key, *caches, torch.tensor([3, 5], dtype=torch.int32))


# (query_len, context_len) a sequence: prompts, a chunk after cached context, a sequence with nothing
# this step, a chunk and a prompt reaching past the bf16 kernel's 256-token tile
PREFILL_LENS = [(1, 1), (17, 17), (5, 17), (0, 3), (40, 300), (300, 300)]


def prefill_case(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[PagedCache, torch.Tensor, torch.Tensor]:
    cache = make_paged_cache(
        [c for _, c in PREFILL_LENS], num_kv_heads, head_dim, 8, dtype, torch.device("cpu")
    )
    starts = torch.tensor([0, *(q for q, _ in PREFILL_LENS)]).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, dtype=dtype)
    return cache, starts, query


def test_prefill_rows_are_each_tokens_sequence_and_context() -> None:
    cache, starts, _ = prefill_case(6, 2, 64, torch.float32)
    tables, lens = reference.prefill_rows(cache.block_tables, starts, cache.context_lens)
    expected_lens = [pos + 1 for q, c in PREFILL_LENS for pos in range(c - q, c)]
    expected_seqs = [seq for seq, (q, _) in enumerate(PREFILL_LENS) for _ in range(q)]
    assert lens.dtype == tables.dtype == torch.int32
    assert lens.tolist() == expected_lens
    assert torch.equal(tables, cache.block_tables[expected_seqs])


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128), (6, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 1, 7, 40])
def test_decode_over_prefill_rows_is_prefill_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, window: int
) -> None:
    """The decode kernel over `prefill_rows` is causal prefill attention, earlier context included
    (bf16 head sizes 64 and 128: the AVX512-BF16 path, tiles of 256 tokens; 80: the generic one), and
    under a window the prefill's sliding-window attention."""
    cache, starts, query = prefill_case(num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    rows = reference.prefill_rows(cache.block_tables, starts, cache.context_lens)
    out = cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *rows, scale, window=window)
    tail = (cache.block_tables, starts, cache.context_lens, scale)
    windowed = functools.partial(reference.paged_attention_prefill, window=window)
    assert_as_near_as_the_reference(out, windowed, query, cache, tail)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("softcap", "window"), [(0.5, 0), (50.0, 7)])
def test_decode_over_prefill_rows_under_a_softcap_is_prefill_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, softcap: float, window: int
) -> None:
    """Prompts and chunks after earlier context (PREFILL_LENS) as decode rows, their scores capped as
    the reference's capped prefill attention caps them."""
    cache, starts, query = prefill_case(num_heads, num_kv_heads, head_dim, dtype)
    query = (SOFTCAP_QUERY_SCALE * query.float()).to(dtype)
    scale = head_dim**-0.5
    rows = reference.prefill_rows(cache.block_tables, starts, cache.context_lens)
    out = cpu.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *rows, scale, window=window, softcap=softcap
    )
    tail = (cache.block_tables, starts, cache.context_lens, scale)
    capped = functools.partial(reference.paged_attention_prefill, window=window, softcap=softcap)
    assert_as_near_as_the_reference(out, capped, query, cache, tail)


@pytest.mark.parametrize(("head_dim", "kernel"), [(256, True), (576, False)], ids=["d256", "d576-latent"])
def test_decode_past_head_size_256_runs_the_reference(head_dim: int, kernel: bool) -> None:
    """DeepSeek's latent heads (576, read by every query head) decode in the reference's batched
    matmuls, up to 2.9x faster there than the kernel's generic loop (bench/README.md); 256 and below in
    the kernel. Both give the reference's output."""
    lens = [1, 9, 300]
    cache = make_paged_cache(lens, 1, head_dim, 8, torch.bfloat16, torch.device("cpu"))
    query = torch.randn(len(lens), 16, head_dim).to(torch.bfloat16)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((len(lens),), -1), num_decodes=len(lens),
        decode_block_tables=cache.block_tables, decode_context_lens=cache.context_lens,
        prefill_block_tables=cache.block_tables[:0], prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=cache.context_lens[:0], max_decode_context_len=max(lens),
    )  # fmt: skip
    backend = TorchAttentionBackend(torch.device("cpu"))
    with torch.profiler.profile() as prof:
        out = backend.decode(
            query, cache.k_cache, cache.v_cache, metadata, head_dim**-0.5, 0, 0.0, None, None
        )
    calls = {event.key for event in prof.key_averages()}
    assert ("pagedserve_cpu::paged_attention_decode" in calls) is kernel
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    assert_as_near_as_the_reference(out, reference.paged_attention_decode, query, cache, tail)


def prefill_metadata(cache: PagedCache, starts: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.full((int(starts[-1]),), -1), num_decodes=0,
        decode_block_tables=cache.block_tables[:0], decode_context_lens=cache.context_lens[:0],
        prefill_block_tables=cache.block_tables, prefill_query_start_loc=starts,
        prefill_context_lens=cache.context_lens, max_prefill_query_len=max(q for q, _ in PREFILL_LENS),
    )  # fmt: skip


def prefill_and_its_calls(
    backend: TorchAttentionBackend, cache: PagedCache, query: torch.Tensor, metadata: AttentionMetadata
) -> tuple[torch.Tensor, dict[str, int]]:
    """The backend's prefill attention, and the ops it called (name -> count)."""
    with torch.profiler.profile() as prof:
        out = backend.prefill(
            query,
            cache.k_cache,
            cache.v_cache,
            metadata,
            0.125,
            window=0,
            softcap=0.0,
            sinks=None,
            alibi_slopes=None,
        )
    return out, {event.key: event.count for event in prof.key_averages()}


def needs_the_prefill_kernel() -> None:
    if cpu.decode_isa() != "avx512_bf16":
        pytest.skip("no AVX512-BF16 here: the bf16 prefill kernel is not built")


# (query_len, context_len) a sequence beyond PREFILL_LENS: a tile's rows past a 16-key chunk, one
# token after a long cached context, and prompts whose last tile is partial
LONG_PREFILL_LENS = [*PREFILL_LENS, (16, 16), (33, 33), (1, 1000), (77, 250)]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (8, 8, 64), (8, 2, 128), (16, 2, 64), (20, 1, 64), (6, 2, 128), (4, 4, 96), (8, 1, 256)],
    ids=["gqa3-d64", "mha-d64", "gqa4-d128", "gqa8-d64", "gqa20-d64", "gqa3-d128", "mha-d96", "gqa8-d256"],
)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_prefill_kernel_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Every (query token, query head) lane arrangement: 16 rows of one head (no grouping), 5 rows of
    3 heads, 2 of 8, and 20 heads of one KV head (two lane groups of 16 and 4), over chunks that
    span blocks of 1 to 32 slots; head sizes 64 and 128, Phi-3's 96 (no grouping, as Phi-3-mini) and
    Gemma's 256 (Gemma-2B's 8 heads on one KV head); as near the float32 reference as its own bf16
    run."""
    needs_the_prefill_kernel()
    lens = LONG_PREFILL_LENS
    cache = make_paged_cache(
        [c for _, c in lens], num_kv_heads, head_dim, block_size, torch.bfloat16, torch.device("cpu")
    )
    starts = torch.tensor([0, *(q for q, _ in lens)]).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, dtype=torch.bfloat16)
    tail = (cache.block_tables, starts, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    assert_as_near_as_flash_attention(out, query, cache, tail)


def assert_as_near_as_flash_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    cache: PagedCache,
    tail: tuple[object, ...],
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """The prefill kernel rounds the softmax weights to bf16 for P V (as flash attention does): each
    weight within 2^-9 of its value, so the output within 2^-9 max|V| of the exact one beyond the
    reference's own bf16 error; and on average no more than 1.5x as far off as the reference's (both
    under `window` and `softcap`)."""
    exact = reference.paged_attention_prefill(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail, window=window, softcap=softcap
    )
    theirs = (
        reference.paged_attention_prefill(
            query, cache.k_cache, cache.v_cache, *tail, window=window, softcap=softcap
        ).float()
        - exact
    ).abs()
    ours = (out.float() - exact).abs()
    weights_rounding = 2**-9 * cache.v_cache.float().abs().max().item()
    assert ours.max().item() <= theirs.max().item() + weights_rounding + 1e-3
    assert ours.mean().item() <= 1.5 * theirs.mean().item()


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (8, 8, 64), (20, 1, 64), (8, 2, 128)],
    ids=["gqa3-d64", "mha-d64", "gqa20-d64", "gqa4-d128"],
)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("kind", WINDOWS)
def test_prefill_kernel_under_a_window_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kind: str
) -> None:
    """Each query token over its last `window` positions: prompts and chunks after earlier context
    (LONG_PREFILL_LENS) shorter and longer than the window, a tile's rows (16 lanes: 16 rows of one
    head, 5 of 3, 1 of 20) reaching back to different first keys; as near the float32 reference as
    its own bf16 run (head sizes 96 and 256 under a window: the softcap test's window of 7)."""
    needs_the_prefill_kernel()
    window = window_of(kind, block_size)
    lens = LONG_PREFILL_LENS
    cache = make_paged_cache(
        [c for _, c in lens], num_kv_heads, head_dim, block_size, torch.bfloat16, torch.device("cpu")
    )
    starts = torch.tensor([0, *(q for q, _ in lens)]).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, dtype=torch.bfloat16)
    tail = (cache.block_tables, starts, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail, window=window)
    assert_as_near_as_flash_attention(out, query, cache, tail, window=window)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (8, 8, 64), (20, 1, 64), (8, 2, 128), (8, 4, 256), (6, 2, 96)],
    ids=["gqa3-d64", "mha-d64", "gqa20-d64", "gqa4-d128", "gqa2-d256", "gqa3-d96"],
)
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", [0, 7])
def test_prefill_kernel_under_a_softcap_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, softcap: float, window: int
) -> None:
    """Each score capped before the mask and the softmax, as the reference caps it: prompts and
    chunks after earlier context (LONG_PREFILL_LENS), alone and under a window, every lane
    arrangement, and at Gemma 2's head size 256 (8 rows of 2 heads) and Phi-3's 96; as near the
    float32 reference as its own bf16 run."""
    needs_the_prefill_kernel()
    lens = LONG_PREFILL_LENS
    cache = make_paged_cache(
        [c for _, c in lens], num_kv_heads, head_dim, 8, torch.bfloat16, torch.device("cpu")
    )
    starts = torch.tensor([0, *(q for q, _ in lens)]).cumsum(0).to(torch.int32)
    query = (SOFTCAP_QUERY_SCALE * torch.randn(int(starts[-1]), num_heads, head_dim)).to(torch.bfloat16)
    tail = (cache.block_tables, starts, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_prefill(
        query, cache.k_cache, cache.v_cache, *tail, window=window, softcap=softcap
    )
    assert_as_near_as_flash_attention(out, query, cache, tail, window=window, softcap=softcap)


@pytest.mark.parametrize("window", [1, 5, 8, 20, 45])
def test_prefill_kernel_never_reads_the_slots_before_the_windows(window: int) -> None:
    """The slots before each sequence's first query token's window (and past its context) hold NaN:
    no tile reads one. Finite, and near the float32 reference on the clean cache."""
    needs_the_prefill_kernel()
    lens = [(20, 20), (3, 40), (50, 57), (17, 300)]
    cache = make_paged_cache([c for _, c in lens], 2, 64, 8, torch.bfloat16, torch.device("cpu"))
    first_visible = [max(0, c - q - window + 1) for q, c in lens]
    caches = poison_before_the_windows(cache, poison_unused_slots(cache), first_visible)
    starts = torch.tensor([0, *(q for q, _ in lens)]).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), 6, 64).to(torch.bfloat16)
    assert_prefill_finite_and_near_float32(query, caches, cache, starts, window)


def test_prefill_kernel_reads_a_strided_query_and_never_the_unused_slots() -> None:
    """The query is a view into the fused qkv projection (rows wider than heads * head_dim, an odd
    number of elements apart), and slots past each context hold NaN."""
    needs_the_prefill_kernel()
    lens = [(20, 20), (3, 40), (50, 57)]
    cache = make_paged_cache([c for _, c in lens], 2, 64, 8, torch.bfloat16, torch.device("cpu"))
    k_cache, v_cache = poison_unused_slots(cache)
    starts = torch.tensor([0, *(q for q, _ in lens)]).cumsum(0).to(torch.int32)
    qkv = torch.randn(int(starts[-1]), (6 + 2 + 2) * 64 + 1).to(torch.bfloat16)
    query = qkv[:, 1 : 1 + 6 * 64].view(-1, 6, 64)
    assert not query.is_contiguous()
    assert_prefill_finite_and_near_float32(query, (k_cache, v_cache), cache, starts)


@pytest.mark.parametrize("softcap", [0.0, *SOFTCAPS])
def test_prefill_kernel_softmax_is_stable_for_huge_logits(softcap: float) -> None:
    """Also under caps: s / softcap far past where tanh is 1 in float32."""
    needs_the_prefill_kernel()
    cache, starts, _ = prefill_case(9, 3, 64, torch.bfloat16)
    query = (500 * torch.randn(int(starts[-1]), 9, 64)).to(torch.bfloat16)
    assert_prefill_finite_and_near_float32(
        query, (cache.k_cache, cache.v_cache), cache, starts, softcap=softcap
    )


def assert_prefill_finite_and_near_float32(
    query: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    cache: PagedCache,
    starts: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """The prefill kernel over `caches` (the cache's own, or copies with its unused slots poisoned),
    under `window` and `softcap`: finite, and within 2e-2 (the output's bf16 rounding) of the float32
    reference on the clean cache."""
    tail = (cache.block_tables, starts, cache.context_lens, 0.125)
    out = cpu.paged_attention_prefill(query, *caches, *tail, window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    expected = reference.paged_attention_prefill(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail, window=window, softcap=softcap
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_prefill_kernel_refuses_bad_arguments_with_the_reason() -> None:
    needs_the_prefill_kernel()
    cache, starts, query = prefill_case(9, 3, 64, torch.bfloat16)
    caches, tables, lens = (cache.k_cache, cache.v_cache), cache.block_tables, cache.context_lens
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.paged_attention_prefill(
            query.float(), caches[0].float(), caches[1].float(), tables, starts, lens, 0.1
        )
    with pytest.raises(RuntimeError, match="head_dim 64, 96, 128 or 256, not 80"):
        other = make_paged_cache([c for _, c in PREFILL_LENS], 3, 80, 8, torch.bfloat16, torch.device("cpu"))
        cpu.paged_attention_prefill(
            torch.randn(query.shape[0], 9, 80).to(torch.bfloat16),
            other.k_cache,
            other.v_cache,
            tables,
            starts,
            lens,
            0.1,
        )
    with pytest.raises(RuntimeError, match="int32"):
        cpu.paged_attention_prefill(query, *caches, tables, starts.long(), lens, 0.1)
    with pytest.raises(RuntimeError, match="one more query start"):
        cpu.paged_attention_prefill(query, *caches, tables, starts[:-1], lens, 0.1)
    with pytest.raises(RuntimeError, match="query_start_loc: from 0"):
        cpu.paged_attention_prefill(query[:-1], *caches, tables, starts, lens, 0.1)
    shorter = lens.clone()
    shorter[1] = 3  # 17 query tokens, a context of 3
    with pytest.raises(RuntimeError, match="sequence 1 has 17 query tokens and a context of 3"):
        cpu.paged_attention_prefill(query, *caches, tables, starts, shorter, 0.1)
    outside = tables.clone()
    outside[4, 0] = cache.k_cache.shape[0]
    with pytest.raises(RuntimeError, match=r"block_tables\[4, 0\].*not a block of the KV cache"):
        cpu.paged_attention_prefill(query, *caches, outside, starts, lens, 0.1)
    with pytest.raises(RuntimeError, match="window must be 0 .none. or positive, got -2"):
        cpu.paged_attention_prefill(query, *caches, tables, starts, lens, 0.1, window=-2)
    for softcap in (-0.5, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="softcap must be 0 .none. or positive and finite, got"):
            cpu.paged_attention_prefill(query, *caches, tables, starts, lens, 0.1, softcap=softcap)


def test_the_backend_runs_bf16_prefill_in_the_prefill_kernel() -> None:
    """bfloat16 head size 64, 96 (Phi-3), 128 or 256 (Gemma): prefill attention is one prefill-kernel
    call a layer (3-5x faster than SDPA here); any other head size or dtype stays with SDPA."""
    backend = TorchAttentionBackend(torch.device("cpu"))
    if cpu.decode_isa() != "avx512_bf16":
        assert not backend.bf16_prefill
        pytest.skip("no AVX512-BF16 here: every prefill stays with SDPA")
    for num_heads, num_kv_heads, head_dim in ((9, 3, 64), (4, 4, 96), (4, 2, 256)):
        cache, starts, query = prefill_case(num_heads, num_kv_heads, head_dim, torch.bfloat16)
        metadata = prefill_metadata(cache, starts)
        out, calls = prefill_and_its_calls(backend, cache, query, metadata)
        assert not metadata.prefill_batches  # nothing planned for SDPA
        assert calls.get("pagedserve_cpu::paged_attention_prefill") == 1, head_dim
        assert not any("scaled_dot_product" in name or "paged_attention_decode" in name for name in calls)
        tail = (cache.block_tables, starts, cache.context_lens, 0.125)
        expected = reference.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)

    for dtype, head_dim in ((torch.bfloat16, 80), (torch.float32, 64)):
        cache, starts, query = prefill_case(6, 2, head_dim, dtype)
        metadata = prefill_metadata(cache, starts)
        _, calls = prefill_and_its_calls(backend, cache, query, metadata)
        assert "pagedserve_cpu::paged_attention_prefill" not in calls
        assert any("scaled_dot_product" in name for name in calls)


def test_the_engine_uses_the_kernels_on_cpu() -> None:
    """Where the kernels build, the CPU attention backend uses them (a silent fallback to the reference
    would cost 15% on the chat benchmark and 2x on long contexts)."""
    from pagedserve.layers.attention import make_attention_backend

    backend = make_attention_backend("torch", torch.device("cpu"))
    assert backend.cpu_kernels  # type: ignore[attr-defined]


def test_bf16_decode_takes_the_avx512_path_where_the_cpu_has_it() -> None:
    """The kernels are built with -march=native: on a CPU with AVX512-BF16 bf16 decode must take the
    vdpbf16ps path (1.3-1.7x the generic loops per call, bench/README.md), not silently the generic one."""
    with open("/proc/cpuinfo") as f:
        has_avx512_bf16 = " avx512_bf16" in f.read()
    assert cpu.decode_isa() == ("avx512_bf16" if has_avx512_bf16 else "generic")
