"""Attention sinks (GPT-OSS's): one learned logit a query head, sinks[h], joins each of that head's
softmaxes as an extra column with no value, p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h])).

The reference is held to that formula written out as transformers' GPT-OSS eager attention writes it
(`gpt_oss_attention`: the sink column concatenated to the masked scores, the softmax, the column
dropped) over a small paged cache: decode and prefill (whole prompts and chunks after earlier context,
both of its paths), GQA, with and without a sliding window (and once under a softcap), float32; and
to out = plain attention * sigmoid(lse - sink), per head. Bad `sinks` arguments (dtype, shape,
device, layout) are refused with a ValueError naming them.
"""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch
from pagedserve_kernels import reference

from tests.kernels.test_attention import PagedCache, make_paged_cache

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
    shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, device: torch.device = CPU,
) -> tuple[PagedCache, torch.Tensor, torch.Tensor]:  # fmt: skip
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


# Bad arguments


def call_with_sinks(entry: str, sinks: object) -> torch.Tensor:
    """Entry point `entry` ("module.decode" or "module.prefill") on a small float32 case, with `sinks`."""
    module_name, kind = entry.split(".")
    module = {"reference": reference}[module_name]
    cache, starts, query = prefill_case([(1, 5), (1, 9)], HEADS, KV_HEADS, 64, BLOCK_SIZE)
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
ENTRY_POINTS = ["reference.decode", "reference.prefill"]


@pytest.mark.parametrize("problem", list(BAD_SINKS))
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_bad_sinks_are_refused_naming_them(entry: str, problem: str) -> None:
    make, message = BAD_SINKS[problem]
    with pytest.raises(ValueError, match=message):
        call_with_sinks(entry, make())
