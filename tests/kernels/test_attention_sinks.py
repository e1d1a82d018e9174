"""Attention sinks (GPT-OSS's): one learned logit a query head, sinks[h], joins each of that head's
softmaxes as an extra column with no value, p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h])).

The reference is held to that formula written out as transformers' GPT-OSS eager attention writes it
(`gpt_oss_attention`: the sink column concatenated to the masked scores, the softmax, the column
dropped) over a small paged cache: decode and prefill (whole prompts and chunks after earlier context,
both of its paths), GQA, with and without a sliding window (and once under a softcap), float32; and
to out = plain attention * sigmoid(lse - sink), per head. The C++ kernels are held to the reference
with sinks: decode in float32 and bfloat16 (the generic loops, and the AVX512-BF16 path where the CPU
has it) at head sizes 64 and 128, and at 80, 96 and 256 (float16 once); the bfloat16 prefill kernel in
each lane arrangement. So are the Triton kernels (under the interpreter on CPU, small shapes): decode
single-pass and with 3 splits forced (the sink counts once, in the merge), and prefill, with and
without a window. Large sinks (+8) must shrink every implementation's output by sigmoid(lse - sink)
(one that ignored them fails), very negative ones (-1e4) leave it as attention without sinks. Bad
`sinks` arguments (dtype, shape, device, layout) are refused by every entry point with a ValueError
naming them.
"""

from __future__ import annotations

import functools
import shutil
from itertools import accumulate

import pytest
import torch
from pagedserve_kernels import attention, cpu, reference
from test_attention import PagedCache, make_paged_cache, spy_on_decode_splits
from test_cpu_attention import assert_as_near_as_the_reference, needs_the_prefill_kernel

HEADS, KV_HEADS, BLOCK_SIZE = 6, 2, 4  # GQA: 3 query heads a KV head
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
CPU = torch.device("cpu")

# (query tokens, context): a whole prompt, a chunk after earlier context, one token after a context,
# odd lengths across blocks
PREFILL_SHAPES = [(5, 5), (7, 23), (1, 9), (3, 11)]
DECODE_CONTEXTS = [1, 5, 8, 9, 23]


def gpt_oss_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """transformers' GPT-OSS `eager_attention_forward` for one sequence: query [q_len, heads, dim] at
    the last q_len positions of keys, values [context, kv_heads, dim] (in position order), causal,
    under a sliding window of `window` (0: none) as its sliding-window mask (kv > q - window); under a
    `softcap` (GPT-OSS has none) each score capped before the mask, as Gemma 2's eager attention."""
    q_len, num_heads, _ = query.shape
    context, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.transpose(0, 1)[None]  # [1, heads, q_len, dim]
    k = keys.transpose(0, 1)[None].repeat_interleave(group, dim=1)  # repeat_kv
    v = values.transpose(0, 1)[None].repeat_interleave(group, dim=1)
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    q_pos = torch.arange(context - q_len, context)[:, None]
    kv_pos = torch.arange(context)[None, :]
    visible = kv_pos <= q_pos
    if window:
        visible &= kv_pos > q_pos - window
    min_value = torch.finfo(attn_weights.dtype).min
    attn_weights = attn_weights + torch.zeros(visible.shape).masked_fill(~visible, min_value)
    sink_column = sinks.reshape(1, -1, 1, 1).expand(1, -1, q_len, -1)
    combined_logits = torch.cat([attn_weights, sink_column], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
    scores = probs[..., :-1]  # the sink's column dropped
    return torch.matmul(scores, v)[0].transpose(0, 1)  # [q_len, heads, dim]


def sequence_kv(cache: PagedCache, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values in position order, read through its block table."""
    block_size, num_kv_heads, head_dim = cache.k_cache.shape[1:]
    table, length = cache.block_tables[seq], int(cache.context_lens[seq])
    slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(length)]
    k_flat = cache.k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = cache.v_cache.view(-1, num_kv_heads, head_dim)
    return k_flat[slots], v_flat[slots]


def random_sinks(num_heads: int) -> torch.Tensor:
    """Sinks of the size of the scores (a few units): each moves its head's output a visible amount."""
    return 2 * torch.randn(num_heads) + 1


def prefill_case(
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> tuple[PagedCache, torch.Tensor, torch.Tensor]:
    cache = make_paged_cache([c for _, c in shapes], num_kv_heads, head_dim, block_size, dtype, device)
    starts = torch.tensor([0, *accumulate(q for q, _ in shapes)], dtype=torch.int32, device=device)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, device=device).to(dtype)
    return cache, starts, query


# The reference against transformers' formula


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (6, 0.0), (6, 1.5)], ids=["full", "w6", "w6-cap"])
def test_reference_decode_is_gpt_oss_attention(window: int, softcap: float) -> None:
    cache = make_paged_cache(DECODE_CONTEXTS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, CPU)
    query = 2 * torch.randn(len(DECODE_CONTEXTS), HEADS, HEAD_DIM)
    sinks = random_sinks(HEADS)
    tail = (cache.block_tables, cache.context_lens, SCALE)
    out = reference.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *tail, window=window, softcap=softcap, sinks=sinks
    )
    for seq in range(len(DECODE_CONTEXTS)):
        keys, values = sequence_kv(cache, seq)
        expected = gpt_oss_attention(query[seq : seq + 1], keys, values, sinks, SCALE, window, softcap)
        torch.testing.assert_close(out[seq], expected[0], atol=1e-6, rtol=1e-5)
    plain = reference.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *tail, window=window, softcap=softcap
    )
    assert (out - plain).abs().max() > 0.1  # the sinks moved the output: the comparison above had teeth


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "each-sequence"])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (6, 0.0), (6, 1.5)], ids=["full", "w6", "w6-cap"])
def test_reference_prefill_is_gpt_oss_attention(window: int, softcap: float, padded: bool) -> None:
    cache, starts, query = prefill_case(PREFILL_SHAPES, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    query = 2 * query
    sinks = random_sinks(HEADS)
    batch = None
    if padded:
        batch = reference.plan_prefill_batch(starts, cache.context_lens, BLOCK_SIZE, torch.float32, window)
        assert batch is not None  # small enough for one padded call: that path is the one tested
    tail = (cache.block_tables, starts, cache.context_lens, SCALE, batch, window, softcap)
    out = reference.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail, sinks=sinks)
    for seq in range(len(PREFILL_SHAPES)):
        keys, values = sequence_kv(cache, seq)
        rows = slice(int(starts[seq]), int(starts[seq + 1]))
        expected = gpt_oss_attention(query[rows], keys, values, sinks, SCALE, window, softcap)
        torch.testing.assert_close(out[rows], expected, atol=1e-6, rtol=1e-5)
    plain = reference.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail)
    assert (out - plain).abs().max() > 0.1


def test_reference_sinks_scale_attention_by_sigmoid_of_lse_minus_sink() -> None:
    """out = plain attention * sigmoid(lse - sink), lse the log-sum-exp of the visible scores: a
    second formula, per head (a sink read at the wrong head fails it)."""
    cache = make_paged_cache(DECODE_CONTEXTS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, CPU)
    query = torch.randn(len(DECODE_CONTEXTS), HEADS, HEAD_DIM)
    sinks = torch.linspace(-3, 6, HEADS)
    tail = (cache.block_tables, cache.context_lens, SCALE)
    out = reference.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, sinks=sinks)
    plain = reference.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail)
    group = HEADS // KV_HEADS
    for seq in range(len(DECODE_CONTEXTS)):
        keys, _ = sequence_kv(cache, seq)
        scores = torch.einsum("hd,phd->hp", query[seq], keys.repeat_interleave(group, dim=1)) * SCALE
        factor = torch.sigmoid(torch.logsumexp(scores, dim=-1) - sinks)
        torch.testing.assert_close(out[seq], plain[seq] * factor[:, None], atol=1e-6, rtol=1e-5)


# The C++ kernels against the reference

needs_a_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernels"
)


@pytest.fixture(scope="module")
def built() -> None:
    """The C++ kernels, built on first use (or found in TORCH_EXTENSIONS_DIR)."""
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


# contexts across a block, the generic path's 16-token chunks and the AVX512-BF16 path's 256-token tile
CPU_DECODE_CONTEXTS = [1, 7, 17, 40, 300]
# (num_heads, num_kv_heads): GQA 3 (a partial pass of heads on the AVX512-BF16 path at head size 64)
# and 4 (whole passes)
CPU_DECODE_HEADS = [pytest.param(6, 2, id="gqa3"), pytest.param(8, 2, id="gqa4")]


@needs_a_compiler
@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("window", [0, 7], ids=["full", "w7"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), CPU_DECODE_HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_decode_with_sinks_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, window: int
) -> None:
    """float32: the generic loops; bfloat16: the AVX512-BF16 path where the CPU has it (the generic
    loops elsewhere)."""
    cache = make_paged_cache(CPU_DECODE_CONTEXTS, num_kv_heads, head_dim, 16, dtype, CPU)
    query = torch.randn(len(CPU_DECODE_CONTEXTS), num_heads, head_dim).to(dtype)
    sinks = random_sinks(num_heads)
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, window=window, sinks=sinks)
    with_sinks = functools.partial(reference.paged_attention_decode, window=window, sinks=sinks)
    assert_as_near_as_the_reference(out, with_sinks, query, cache, tail)


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
def test_cpu_decode_with_sinks_at_other_head_sizes_and_a_softcap(dtype: torch.dtype, head_dim: int) -> None:
    """The rest of the paths decode dispatches to: the generic loops' run-time head size (80) in
    float32 and bfloat16, float16, and the AVX512-BF16 path's head sizes 96 and 256 (the generic
    loops where the CPU lacks it); under a cap that bends the scores and a window."""
    cache = make_paged_cache(CPU_DECODE_CONTEXTS, 2, head_dim, 8, dtype, CPU)
    query = (4 * torch.randn(len(CPU_DECODE_CONTEXTS), 6, head_dim)).to(dtype)
    sinks = random_sinks(6)
    tail = (cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, 7, 2.0, sinks)
    capped = functools.partial(reference.paged_attention_decode, window=7, softcap=2.0, sinks=sinks)
    assert_as_near_as_the_reference(out, capped, query, cache, tail)


# (query tokens, context): one-token prompt, a prompt past a 16-key chunk, chunks after earlier
# context, a sequence with nothing to run, a prompt past several tiles of rows
CPU_PREFILL_SHAPES = [(1, 1), (17, 17), (5, 40), (0, 3), (3, 20), (37, 70)]


@needs_a_compiler
@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("window", [0, 7], ids=["full", "w7"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(6, 2, 64), (20, 1, 64), (8, 2, 128)],
    ids=["gqa3-d64", "gqa20-d64", "gqa4-d128"],
)
def test_cpu_prefill_with_sinks_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int
) -> None:
    """The bfloat16 prefill kernel's lane arrangements: 5 rows of 3 heads (a dead lane past the rows),
    20 heads of one KV head (a second lane group of 4 heads, 12 lanes past the group's heads: no sink
    of theirs to read) and 4 rows of 4 heads at head size 128."""
    needs_the_prefill_kernel()
    cache, starts, query = prefill_case(
        CPU_PREFILL_SHAPES, num_heads, num_kv_heads, head_dim, 8, torch.bfloat16
    )
    sinks = random_sinks(num_heads)
    tail = (cache.block_tables, starts, cache.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail, window=window, sinks=sinks)
    with_sinks = functools.partial(reference.paged_attention_prefill, window=window, sinks=sinks)
    assert_as_near_as_the_reference(out, with_sinks, query, cache, tail, rounds_weights=True)


@needs_a_compiler
@pytest.mark.usefixtures("built")
def test_cpu_ops_refuse_bad_sinks_naming_them() -> None:
    """The C++ ops check `sinks` themselves too (a caller may reach torch.ops directly)."""
    cache, starts, query = prefill_case([(1, 5), (1, 9)], HEADS, KV_HEADS, 64, BLOCK_SIZE, torch.bfloat16)
    kv = (query, cache.k_cache, cache.v_cache, cache.block_tables)
    for bad in (torch.zeros(HEADS, dtype=torch.float64), torch.zeros(KV_HEADS), torch.zeros(2 * HEADS)[::2]):
        with pytest.raises(RuntimeError, match="paged_attention_decode: sinks must be float32"):
            torch.ops.pagedserve_cpu.paged_attention_decode(*kv, cache.context_lens, 0.125, 0, 0.0, bad)
        with pytest.raises(RuntimeError, match="paged_attention_prefill: sinks must be float32"):
            torch.ops.pagedserve_cpu.paged_attention_prefill(
                *kv, starts, cache.context_lens, 0.125, 0, 0.0, bad
            )


# The Triton kernels against the reference (under the interpreter on CPU: small shapes)

TRITON_TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
TRITON_HEAD_DIM = 32


@pytest.mark.parametrize(
    ("window", "dtype"),
    [(0, torch.float32), (20, torch.float32), (20, torch.bfloat16)],
    ids=["full-fp32", "w20-fp32", "w20-bf16"],
)
def test_triton_decode_with_sinks_matches_reference(
    window: int, dtype: torch.dtype, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Single pass and 3 splits forced: without a window splits of 48 keys (the short sequences leave
    the last ones empty), under one splits of 16 from the block holding the first visible key (the
    100-token sequence: 80..95, its first 0 before the window, then 96..99 and an empty third). The
    sink must count once whatever the split count."""
    contexts = [1, 17, 40, 100]
    cache = make_paged_cache(contexts, KV_HEADS, TRITON_HEAD_DIM, 16, dtype, device)
    query = torch.randn(len(contexts), HEADS, TRITON_HEAD_DIM, device=device).to(dtype)
    sinks = random_sinks(HEADS).to(device)
    args = (cache.block_tables, cache.context_lens, TRITON_HEAD_DIM**-0.5)
    expected = reference.paged_attention_decode(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, window=window, sinks=sinks
    )
    num_splits_launched = spy_on_decode_splits(monkeypatch)
    for num_splits in (1, 3):
        out = attention.paged_attention_decode(
            query, cache.k_cache, cache.v_cache, *args, num_splits=num_splits, window=window, sinks=sinks
        )
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, **TRITON_TOLERANCES[dtype])
    assert num_splits_launched == [1, 3]


# whole prompts, a chunk after earlier context, a sequence with nothing to run, and a chunk of two
# query tiles (21 tokens a tile at GQA 3) after earlier context
TRITON_PREFILL_SHAPES = [(1, 1), (17, 17), (5, 40), (0, 3), (30, 70)]


@pytest.mark.parametrize(
    ("window", "dtype"),
    [(0, torch.float32), (20, torch.float32), (20, torch.bfloat16)],
    ids=["full-fp32", "w20-fp32", "w20-bf16"],
)
def test_triton_prefill_with_sinks_matches_reference(
    window: int, dtype: torch.dtype, device: torch.device
) -> None:
    cache, starts, query = prefill_case(
        TRITON_PREFILL_SHAPES, HEADS, KV_HEADS, TRITON_HEAD_DIM, 16, dtype, device
    )
    sinks = random_sinks(HEADS).to(device)
    args = (cache.block_tables, starts, cache.context_lens, TRITON_HEAD_DIM**-0.5)
    out = attention.paged_attention_prefill(
        query, cache.k_cache, cache.v_cache, *args, window=window, sinks=sinks
    )
    expected = reference.paged_attention_prefill(
        query.float(), cache.k_cache.float(), cache.v_cache.float(), *args, window=window, sinks=sinks
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TRITON_TOLERANCES[dtype])


# Large and very negative sinks, every implementation


def run_decode(impl: str, query: torch.Tensor, cache: PagedCache, sinks: torch.Tensor | None) -> torch.Tensor:
    tail = (cache.block_tables, cache.context_lens, query.shape[-1] ** -0.5)
    if impl == "reference":
        return reference.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, sinks=sinks)
    if impl == "cpu":
        return cpu.paged_attention_decode(query, cache.k_cache, cache.v_cache, *tail, sinks=sinks)
    num_splits = {"triton": 1, "triton-split": 3}[impl]
    return attention.paged_attention_decode(
        query, cache.k_cache, cache.v_cache, *tail, num_splits=num_splits, sinks=sinks
    )


def run_prefill(
    impl: str, query: torch.Tensor, cache: PagedCache, starts: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    tail = (cache.block_tables, starts, cache.context_lens, query.shape[-1] ** -0.5)
    if impl == "reference":
        return reference.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail, sinks=sinks)
    if impl == "cpu":
        return cpu.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail, sinks=sinks)
    return attention.paged_attention_prefill(query, cache.k_cache, cache.v_cache, *tail, sinks=sinks)


# (implementation, kind, dtype): the C++ prefill kernel is bfloat16 only
EXTREME_CASES = [
    pytest.param("reference", "decode", torch.float32, id="reference-decode"),
    pytest.param("reference", "prefill", torch.float32, id="reference-prefill"),
    pytest.param("cpu", "decode", torch.float32, id="cpu-decode-fp32", marks=needs_a_compiler),
    pytest.param("cpu", "decode", torch.bfloat16, id="cpu-decode-bf16", marks=needs_a_compiler),
    pytest.param("cpu", "prefill", torch.bfloat16, id="cpu-prefill-bf16", marks=needs_a_compiler),
    pytest.param("triton", "decode", torch.float32, id="triton-decode"),
    pytest.param("triton-split", "decode", torch.float32, id="triton-split-decode"),
    pytest.param("triton", "prefill", torch.float32, id="triton-prefill"),
]


Case = tuple[PagedCache, torch.Tensor, torch.Tensor]


def extreme_case(impl: str, kind: str, dtype: torch.dtype, device: torch.device) -> Case:
    """Three sequences of 1, 17 and 40 tokens (the last 1, 4 and 9 of them queries in prefill): 3
    splits of 16 keys for the 40 (one for the 1, two for the 17) in split-K decode."""
    if impl == "cpu":
        assert cpu.load(), "the CPU kernels failed to build"
        if kind == "prefill":
            needs_the_prefill_kernel()
    device = device if impl.startswith("triton") else CPU
    return prefill_case([(1, 1), (4, 17), (9, 40)], HEADS, KV_HEADS, 64, 16, dtype, device)


def run_with_sinks(impl: str, kind: str, case: Case, sink: float | None) -> torch.Tensor:
    """One implementation on `case`, every head's sink `sink` (None: no sinks)."""
    cache, starts, query = case
    sinks = None if sink is None else torch.full((HEADS,), sink, device=query.device)
    if kind == "decode":
        return run_decode(impl, query[starts[1:] - 1], cache, sinks)  # each sequence's last query
    return run_prefill(impl, query, cache, starts, sinks)


def upcast(case: Case) -> Case:
    cache, starts, query = case
    k_cache, v_cache = cache.k_cache.float(), cache.v_cache.float()
    return PagedCache(k_cache, v_cache, cache.block_tables, cache.context_lens), starts, query.float()


@pytest.mark.parametrize(("impl", "kind", "dtype"), EXTREME_CASES)
def test_large_sinks_shrink_the_output(
    impl: str, kind: str, dtype: torch.dtype, device: torch.device
) -> None:
    """A sink of +8 outweighs the few visible keys (scores of about 1): every output shrinks by
    sigmoid(lse - 8), below a fifth of attention without sinks, as the reference shrinks it."""
    case = extreme_case(impl, kind, dtype, device)
    plain = run_with_sinks(impl, kind, case, None).float()
    out = run_with_sinks(impl, kind, case, 8.0).float()
    expected = run_with_sinks("reference", kind, upcast(case), 8.0)
    assert out.abs().amax(dim=-1).max() < 0.2 * plain.abs().amax(dim=-1).min()
    # float32: the C++ kernels' 1e-5, the Triton kernels' 1e-4; bf16: outputs of ~0.05, rounded
    tolerance = 2e-3 if dtype == torch.bfloat16 else 1e-4 if impl.startswith("triton") else 1e-5
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("impl", "kind", "dtype"), EXTREME_CASES)
def test_very_negative_sinks_leave_attention_as_it_is(
    impl: str, kind: str, dtype: torch.dtype, device: torch.device
) -> None:
    """exp(-1e4) is 0 in float32: the sinks weigh nothing (and overflow nothing)."""
    case = extreme_case(impl, kind, dtype, device)
    plain = run_with_sinks(impl, kind, case, None)
    out = run_with_sinks(impl, kind, case, -1e4)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)


# Bad arguments: the device is checked last, so the CPU-made ones reach their check on a GPU too


def call_with_sinks(entry: str, sinks: object, device: torch.device) -> torch.Tensor:
    """Entry point `entry` ("module.decode" or "module.prefill") on a small float32 case, with `sinks`
    (the case on `device` for Triton's, on the CPU for the others)."""
    module_name, kind = entry.split(".")
    module = {"reference": reference, "cpu": cpu, "triton": attention}[module_name]
    device = device if module_name == "triton" else CPU
    cache, starts, query = prefill_case([(1, 5), (1, 9)], HEADS, KV_HEADS, 64, BLOCK_SIZE, device=device)
    kv = (query, cache.k_cache, cache.v_cache, cache.block_tables)
    if kind == "decode":
        return module.paged_attention_decode(*kv, cache.context_lens, 0.125, sinks=sinks)
    return module.paged_attention_prefill(*kv, starts, cache.context_lens, 0.125, sinks=sinks)


BAD_SINKS = {
    "dtype": (lambda: torch.zeros(HEADS, dtype=torch.float64), r"sinks: dtype torch.float64"),
    "bf16": (lambda: torch.zeros(HEADS, dtype=torch.bfloat16), r"sinks: dtype torch.bfloat16"),
    "kv-heads": (lambda: torch.zeros(KV_HEADS), rf"sinks: expected shape \({HEADS},\)"),
    "2d": (lambda: torch.zeros(1, HEADS), rf"sinks: expected shape \({HEADS},\)"),
    "strided": (lambda: torch.zeros(2 * HEADS)[::2], r"sinks: must be contiguous"),
    "device": (lambda: torch.zeros(HEADS, device="meta"), r"sinks: on meta"),
    "list": (lambda: [0.0] * HEADS, r"sinks: expected a torch.Tensor"),
}
ENTRY_POINTS = [
    f"{module}.{kind}" for module in ("reference", "cpu", "triton") for kind in ("decode", "prefill")
]


@pytest.mark.parametrize("problem", list(BAD_SINKS))
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_bad_sinks_are_refused_naming_them(entry: str, problem: str, device: torch.device) -> None:
    make, message = BAD_SINKS[problem]
    with pytest.raises(ValueError, match=message):
        call_with_sinks(entry, make(), device)
