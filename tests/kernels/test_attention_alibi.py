"""ALiBi (BLOOM's, MPT's, Falcon-RW's): query head h's score of the key at position j, for the query at
p, gains slopes[h] * (j - p), a linear penalty on distance in place of positions.

The reference is held to that formula written out as transformers' BLOOM attention writes it
(`bloom_attention`: slopes times each key's absolute position added to the scaled scores, which the
softmax's shift invariance makes the same) over a small paged cache: decode and prefill (whole prompts
and chunks after earlier context, both of its paths), GQA, with and without a sliding window, float32.
The C++ kernels are held to the reference with slopes: decode in float32 (the generic loops) and
bfloat16 (the AVX512-BF16 path where the CPU has it) at head sizes 64 and 128, with and without a
window, and at 80, 96 and 256; the bfloat16 prefill kernel in each lane arrangement. So are the
Triton kernels (under the interpreter on CPU, small shapes): decode single-pass and with 3 splits
forced, and prefill, float32 and bfloat16. Large slopes must leave each query on its own key alone
(an implementation that ignored them fails). Bad `alibi_slopes` arguments are refused by every entry
point with a ValueError naming them (by the C++ ops' own checks with a RuntimeError too).
"""

from __future__ import annotations

import functools

import pytest
import torch
from pagedserve_kernels import attention, cpu, reference
from test_attention import make_paged_cache, spy_on_decode_splits
from test_attention_sinks import (
    CPU_DECODE_CONTEXTS,
    CPU_DECODE_HEADS,
    CPU_PREFILL_SHAPES,
    TRITON_TOLERANCES,
    built,  # noqa: F401 (a fixture)
    needs_a_compiler,
    prefill_case,
    sequence_kv,
)
from test_cpu_attention import assert_as_near_as_the_reference, needs_the_prefill_kernel

HEADS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 6, 2, 4, 16
SCALE = HEAD_DIM**-0.5
CPU = torch.device("cpu")
PREFILL_SHAPES = [(5, 5), (7, 23), (1, 9), (3, 11)]
DECODE_CONTEXTS = [1, 5, 8, 9, 23]


def slopes_of(num_heads: int) -> torch.Tensor:
    """BLOOM's slopes for 8 heads, 2^-1 .. 2^-8, cut to `num_heads`: each head a visibly different bias."""
    return 2.0 ** -torch.arange(1, num_heads + 1, dtype=torch.float32)


def bloom_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """transformers' BLOOM attention for one sequence: query [q_len, heads, dim] at the last q_len
    positions of keys, values [context, kv_heads, dim]: `alibi.baddbmm(q, k^T, alpha=scale)` with
    alibi = slopes x each key's position, causal (and under a window, kv > q - window), softmax."""
    q_len, num_heads, _ = query.shape
    context, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.transpose(0, 1)  # [heads, q_len, dim]
    k = keys.transpose(0, 1).repeat_interleave(group, dim=0)
    v = values.transpose(0, 1).repeat_interleave(group, dim=0)
    alibi = slopes[:, None, None] * torch.arange(context, dtype=torch.float32)[None, None, :]
    scores = alibi.expand(-1, q_len, -1).baddbmm(q, k.transpose(1, 2), alpha=scale)
    q_pos = torch.arange(context - q_len, context)[:, None]
    kv_pos = torch.arange(context)[None, :]
    visible = kv_pos <= q_pos
    if window:
        visible &= kv_pos > q_pos - window
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)  # [q_len, heads, dim]


@pytest.mark.parametrize("window", [0, 6], ids=["full", "w6"])
def test_reference_decode_is_bloom_attention(window: int) -> None:
    cache = make_paged_cache(DECODE_CONTEXTS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, CPU)
    query = torch.randn(len(DECODE_CONTEXTS), HEADS, HEAD_DIM)
    slopes = slopes_of(HEADS)
    tail = (cache.block_tables, cache.context_lens, SCALE)
    out = reference.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *tail, window=window, alibi_slopes=slopes
    )
    for seq in range(len(DECODE_CONTEXTS)):
        keys, values = sequence_kv(cache, seq)
        expected = bloom_attention(query[seq : seq + 1], keys, values, slopes, SCALE, window)
        torch.testing.assert_close(out[seq], expected[0], atol=1e-6, rtol=1e-5)
    plain = reference.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, window=window)
    assert (out - plain).abs().max() > 0.1  # the slopes moved the output: the comparison had teeth


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "each-sequence"])
@pytest.mark.parametrize("window", [0, 6], ids=["full", "w6"])
def test_reference_prefill_is_bloom_attention(window: int, padded: bool) -> None:
    cache, starts, query = prefill_case(PREFILL_SHAPES, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    slopes = slopes_of(HEADS)
    batch = None
    if padded:
        batch = reference.plan_prefill_batch(starts, cache.context_lens, BLOCK_SIZE, torch.float32, window)
        assert batch is not None  # small enough for one padded call: that path is the one tested
    tail = (cache.block_tables, starts, cache.context_lens, SCALE, batch, window)
    out = reference.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail, alibi_slopes=slopes)
    for seq in range(len(PREFILL_SHAPES)):
        keys, values = sequence_kv(cache, seq)
        rows = slice(int(starts[seq]), int(starts[seq + 1]))
        expected = bloom_attention(query[rows], keys, values, slopes, SCALE, window)
        torch.testing.assert_close(out[rows], expected, atol=1e-6, rtol=1e-5)
    plain = reference.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail)
    assert (out - plain).abs().max() > 0.1


# The C++ kernels against the reference


@needs_a_compiler
@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("window", [0, 7], ids=["full", "w7"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), CPU_DECODE_HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_decode_with_alibi_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, window: int
) -> None:
    """float32: the generic loops; bfloat16: the AVX512-BF16 path where the CPU has it (its 256-token
    tiles padded with their last key: the 300-token context's second)."""
    cache = make_paged_cache(CPU_DECODE_CONTEXTS, num_kv_heads, head_dim, 16, dtype, CPU)
    query = torch.randn(len(CPU_DECODE_CONTEXTS), num_heads, head_dim).to(dtype)
    slopes = slopes_of(num_heads)
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *tail, window=window, alibi_slopes=slopes
    )
    biased = functools.partial(reference.paged_attention_decode, window=window, alibi_slopes=slopes)
    assert_as_near_as_the_reference(out, biased, query, cache, tail)
    plain = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *tail
    )
    assert (out.float() - plain).abs().max() > 0.1  # the slopes moved the output


@needs_a_compiler
@pytest.mark.usefixtures("built")
@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [
        (torch.float32, 80),
        (torch.bfloat16, 80),
        (torch.float16, 64),
        (torch.bfloat16, 96),
        (torch.bfloat16, 256),
    ],
    ids=["fp32-d80", "bf16-d80", "fp16-d64", "bf16-d96", "bf16-d256"],
)
def test_cpu_decode_with_alibi_at_other_head_sizes(dtype: torch.dtype, head_dim: int) -> None:
    cache = make_paged_cache(CPU_DECODE_CONTEXTS, 2, head_dim, 8, dtype, CPU)
    query = torch.randn(len(CPU_DECODE_CONTEXTS), 6, head_dim).to(dtype)
    slopes = slopes_of(6)
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, alibi_slopes=slopes)
    biased = functools.partial(reference.paged_attention_decode, alibi_slopes=slopes)
    assert_as_near_as_the_reference(out, biased, query, cache, tail)


@needs_a_compiler
@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("window", [0, 7], ids=["full", "w7"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(6, 2, 64), (20, 1, 64), (8, 2, 128)],
    ids=["gqa3-d64", "gqa20-d64", "gqa4-d128"],
)
def test_cpu_prefill_with_alibi_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int
) -> None:
    """The bfloat16 prefill kernel's lane arrangements: 5 rows of 3 heads (a dead lane past the rows),
    20 heads of one KV head (lanes past the group's heads: no slope of theirs to read) and 4 rows of 4
    heads at head size 128."""
    needs_the_prefill_kernel()
    cache, starts, query = prefill_case(
        CPU_PREFILL_SHAPES, num_heads, num_kv_heads, head_dim, 8, torch.bfloat16
    )
    slopes = 2.0 ** -torch.linspace(0.5, 8.0, num_heads)
    tail = (cache.block_tables, starts, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_prefill(
        query, cache.k_cache, cache.v_cache, *tail, window=window, alibi_slopes=slopes
    )
    biased = functools.partial(reference.paged_attention_prefill, window=window, alibi_slopes=slopes)
    assert_as_near_as_the_reference(out, biased, query, cache, tail, rounds_weights=True)


@needs_a_compiler
@pytest.mark.usefixtures("built")
def test_cpu_ops_refuse_bad_slopes_naming_them() -> None:
    """The C++ ops check `alibi_slopes` themselves too (a caller may reach torch.ops directly)."""
    cache, starts, query = prefill_case([(1, 5), (1, 9)], HEADS, KV_HEADS, 64, BLOCK_SIZE, torch.bfloat16)
    kv = (query, cache.k_cache, cache.v_cache, cache.block_tables)
    for bad in (torch.zeros(HEADS, dtype=torch.float64), torch.zeros(KV_HEADS), torch.zeros(2 * HEADS)[::2]):
        with pytest.raises(RuntimeError, match="paged_attention_decode: alibi_slopes must be float32"):
            torch.ops.pagedserve_cpu.paged_attention_decode(*kv, cache.context_lens, 0.125, 0, 0.0, None, bad)
        with pytest.raises(RuntimeError, match="paged_attention_prefill: alibi_slopes must be float32"):
            torch.ops.pagedserve_cpu.paged_attention_prefill(
                *kv, starts, cache.context_lens, 0.125, 0, 0.0, None, bad
            )


# The Triton kernels against the reference (under the interpreter on CPU: small shapes)

TRITON_HEAD_DIM = 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_with_alibi_matches_reference(
    dtype: torch.dtype, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Single pass and 3 splits forced (the bias read at each split's own key positions)."""
    contexts = [1, 17, 40, 100]
    cache = make_paged_cache(contexts, KV_HEADS, TRITON_HEAD_DIM, 16, dtype, device)
    query = torch.randn(len(contexts), HEADS, TRITON_HEAD_DIM, device=device).to(dtype)
    slopes = slopes_of(HEADS).to(device)
    args = (cache.block_tables, cache.context_lens, TRITON_HEAD_DIM**-0.5)
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, alibi_slopes=slopes
    )
    num_splits_launched = spy_on_decode_splits(monkeypatch)
    for num_splits in (1, 3):
        out = attention.paged_attention_decode(
            query, cache.k_cache, cache.v_cache, *args, num_splits=num_splits, alibi_slopes=slopes
        )
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, **TRITON_TOLERANCES[dtype])
    assert num_splits_launched == [1, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_with_alibi_matches_reference(dtype: torch.dtype, device: torch.device) -> None:
    """Whole prompts, a chunk after earlier context, a sequence with nothing to run, and a chunk of two
    query tiles after earlier context."""
    shapes = [(1, 1), (17, 17), (5, 40), (0, 3), (30, 70)]
    cache, starts, query = prefill_case(shapes, HEADS, KV_HEADS, TRITON_HEAD_DIM, 16, dtype, device)
    slopes = slopes_of(HEADS).to(device)
    args = (cache.block_tables, starts, cache.context_lens, TRITON_HEAD_DIM**-0.5)
    out = attention.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *args, alibi_slopes=slopes)
    expected = reference.paged_attention_prefill(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, alibi_slopes=slopes
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TRITON_TOLERANCES[dtype])


@pytest.mark.parametrize("impl", ["reference", "triton", "triton-split"])
def test_steep_slopes_leave_each_query_on_its_own_key(impl: str, device: torch.device) -> None:
    """Slopes of 1,000: every earlier key is at least 1,000 below the query's own, so the output is the
    value at the query's position (the last of its context)."""
    device = CPU if impl == "reference" else device
    contexts = [3, 17, 40]
    cache = make_paged_cache(contexts, KV_HEADS, TRITON_HEAD_DIM, 16, torch.float32, device)
    query = torch.randn(len(contexts), HEADS, TRITON_HEAD_DIM, device=device)
    slopes = torch.full((HEADS,), 1000.0, device=device)
    tail = (cache.block_tables, cache.context_lens, TRITON_HEAD_DIM**-0.5)
    if impl == "reference":
        out = reference.paged_attention_decode(
            query, cache.k_cache, cache.v_cache, *tail, alibi_slopes=slopes
        )
    else:
        splits = 3 if impl == "triton-split" else 1
        out = attention.paged_attention_decode(
            query, cache.k_cache, cache.v_cache, *tail, num_splits=splits, alibi_slopes=slopes
        )
    for seq, context in enumerate(contexts):
        _, values = sequence_kv(cache, seq)
        last = values[context - 1].repeat_interleave(HEADS // KV_HEADS, dim=0)  # [heads, dim]
        torch.testing.assert_close(out[seq], last, atol=1e-5, rtol=1e-5)


BAD_SLOPES = {
    "dtype": (lambda: torch.zeros(HEADS, dtype=torch.float64), r"alibi_slopes: dtype torch.float64"),
    "kv-heads": (lambda: torch.zeros(KV_HEADS), rf"alibi_slopes: expected shape \({HEADS},\)"),
    "strided": (lambda: torch.zeros(2 * HEADS)[::2], r"alibi_slopes: must be contiguous"),
    "device": (lambda: torch.zeros(HEADS, device="meta"), r"alibi_slopes: on meta"),
    "list": (lambda: [0.5] * HEADS, r"alibi_slopes: expected a torch.Tensor"),
}


@pytest.mark.parametrize("problem", list(BAD_SLOPES))
@pytest.mark.parametrize(
    "entry",
    [f"{module}.{kind}" for module in ("reference", "cpu", "triton") for kind in ("decode", "prefill")],
)
def test_bad_alibi_slopes_are_refused_naming_them(entry: str, problem: str, device: torch.device) -> None:
    module_name, kind = entry.split(".")
    module = {"reference": reference, "cpu": cpu, "triton": attention}[module_name]
    device = device if module_name == "triton" else CPU
    make, message = BAD_SLOPES[problem]
    cache, starts, query = prefill_case([(1, 5), (1, 9)], HEADS, KV_HEADS, 64, BLOCK_SIZE, device=device)
    kv = (query, cache.k_cache, cache.v_cache, cache.block_tables)
    with pytest.raises(ValueError, match=message):
        if kind == "decode":
            module.paged_attention_decode(*kv, cache.context_lens, 0.125, alibi_slopes=make())
        else:
            module.paged_attention_prefill(*kv, starts, cache.context_lens, 0.125, alibi_slopes=make())
