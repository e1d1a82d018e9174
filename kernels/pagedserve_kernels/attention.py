# Layouts (as in reference.py):
#   query          decode [num_seqs, num_heads, head_dim]; prefill [num_tokens, num_heads, head_dim]
#                  (any token/head strides, dense head_dim)
#   k/v_cache      [num_blocks, block_size, num_kv_heads, head_dim], contiguous, same dtype as query
#   block_tables   [num_seqs, max_blocks_per_seq] int32/int64
#   context_lens   [num_seqs] int32/int64, tokens in the cache per sequence including this step's
#   query_start_loc [num_seqs + 1] int32/int64, prefill only
#   out            same shape and dtype as query, contiguous
#
# Query head h reads KV head h // (num_heads // num_kv_heads) (GQA). One program owns one KV head
# and every query head of its group, so each K/V tile is loaded once per group.
#
# Keys are read in tiles of BLOCK_N token positions gathered through the block table, token by
# token, so a tile may span several cache blocks and block_size only needs to be a power of two:
#
#   positions   0 ........ 15 | 16 ....... 31 | 32 .. 40
#   block table [     7       |      2        |    9    ]   block_size 16, context_len 41
#   tile        [ 0 ........................ 63 ]            BLOCK_N 64, positions >= 41 masked
#
# Softmax is the online (flash) form in base 2: running max m, running sum l, unnormalised
# accumulator acc, rescaled by exp2(m_old - m_new) whenever the max grows.
#
# Sliding window (`window` W > 0; 0 is none): a query at position p sees keys p - W + 1..p. A key
# loop starts at the block holding its first visible position, so the blocks wholly before the window
# are never read (nor their block-table entries), and masks that block's positions before it:
#
#   positions   0 ........ 15 | 16 .. 28  29 .. 31 | 32 .. 40
#   window 12   skipped       | masked    seen ............. |   the query at 40 sees 29..40
#
# Soft-capping (`softcap` c > 0; 0 is none): each score s = scale * q.k becomes c * tanh(s / c)
# before the mask and the softmax, in base 2 as (c * log2 e) * tanh(q.k * (scale / c)). SOFTCAP is a
# constexpr, so the kernels without it are the arithmetic of scale_log2 alone; c is a runtime float.
#
# Attention sinks (`sinks` [num_heads] float32, GPT-OSS's; None is none): head h's softmax has one more
# logit, sinks[h], with no value. A row's online softmax starts from it (m = sinks[h] * log2 e, l = 1,
# acc = 0); split-K adds it once, in the merge. HAS_SINKS is a constexpr: without sinks, as before.
#
# ALiBi (`alibi_slopes` [num_heads] float32, BLOOM's and MPT's; None is none): head h's score of the key
# at position j, for the query at p, gains slopes[h] * (j - p) after any soft-capping, in base 2 as
# slopes[h] * log2 e * (j - p). ALIBI is a constexpr: without slopes, as before.
"""Paged attention kernels: decode (one query token per sequence, optional split-K) and prefill over
packed variable-length queries whose keys, earlier context included, are in the paged cache."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pagedserve_kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
)
from pagedserve_kernels.reference import check_alibi, check_sinks

_LOG2E = 1.4426950408889634
# tl.dot needs every dimension >= 16 on GPUs; smaller group/head/tile sizes are padded and masked.
_MIN_DOT = 16
_DECODE_BLOCK_N = 64
_PREFILL_BLOCK_M = 64
_PREFILL_BLOCK_N = 32
# Split-K: a split keeps at least this many keys, and splitting stops once the grid has enough programs.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def _load_kv_tile(
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    block_table_ptr: tl.tensor,
    offs_n: tl.tensor,
    n_mask: tl.tensor,
    kv_head: tl.tensor,
    offs_d: tl.tensor,
    d_mask: tl.tensor,
    stride_cb: tl.tensor,
    stride_ct: tl.tensor,
    stride_ch: tl.tensor,
    BLOCK_SIZE: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """K and V for token positions offs_n ([BLOCK_N, BLOCK_D]); masked positions read as zero."""
    block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = block_ids * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
    offs = rows[:, None] + offs_d[None, :]
    mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0)
    return k, v


@triton.jit
def _dot(a: tl.tensor, b: tl.tensor, UPCAST: tl.constexpr) -> tl.tensor:
    """a @ b with fp32 accumulation. fp32 inputs use exact products ("ieee"): TF32 would miss the fp32
    tolerance. UPCAST (set under TRITON_INTERPRET) feeds 16-bit inputs as fp32, because the
    interpreter multiplies bfloat16's raw bits; the products are exact either way, so results agree."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tanh(x: tl.tensor) -> tl.tensor:
    """tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1]: nothing overflows for any
    finite x (a large |x| gives e = 0, so +-1). Written out because triton.language has no tanh and
    libdevice's fails under the interpreter; the tests then run the arithmetic a GPU runs. Near 0,
    1 - e costs relative precision: tanh is off by ~1e-7 absolute, a score by c times that."""
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))  # exp(-2|x|); 1.44... is log2 e
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _softmax_start(
    sinks_ptr: tl.tensor, heads: tl.tensor, mask: tl.tensor, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr
) -> tuple[tl.tensor, tl.tensor]:
    """The running max and sum of ROWS rows (query heads `heads`, `mask`ed rows not read) before any
    key: -inf and 0; under HAS_SINKS each row's sink (in base 2: sinks[h] * log2 e) and exp2(0) = 1,
    as if the sink were a first key whose value is zero."""
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + heads, mask=mask, other=0.0) * 1.4426950408889634  # log2 e
        l_i = tl.full([ROWS], 1.0, tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
    return m_i, l_i


@triton.jit
def _alibi_slopes(
    alibi_ptr: tl.tensor, heads: tl.tensor, mask: tl.tensor, ROWS: tl.constexpr, ALIBI: tl.constexpr
) -> tl.tensor:
    """ROWS rows' ALiBi slopes (query heads `heads`, `mask`ed rows 0) in base 2; zeros, unread,
    without ALIBI."""
    if ALIBI:
        return tl.load(alibi_ptr + heads, mask=mask, other=0.0) * 1.4426950408889634  # log2 e
    return tl.zeros([ROWS], tl.float32)


@triton.jit
def _alibi_bias(slopes: tl.tensor, distance: tl.tensor, ALIBI: tl.constexpr) -> tl.tensor:
    """[rows, keys]: each row's slope times each key's distance to the row's query (key - query);
    nothing is computed without ALIBI (its scores never read it)."""
    if ALIBI:
        return slopes[:, None] * distance.to(tl.float32)
    return slopes[:, None]


@triton.jit
def _online_softmax_step(
    q: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    valid: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    acc: tl.tensor,
    scale_log2: tl.tensor,
    softcap_scale: tl.tensor,
    softcap_log2: tl.tensor,
    bias: tl.tensor,
    UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One key tile of flash attention. A row may have no valid key in a tile, and none yet at all:
    under a window a prefill row's keys start after its tile's first row's, and a split may hold
    only keys before the window. Such a row keeps m_i == -inf, l_i == 0 and acc == 0.

    Scores in base 2: q.k * scale_log2 (scale * log2 e), or under SOFTCAP the capped natural score
    c * tanh(scale * q.k / c) times log2 e, as tanh(q.k * softcap_scale) * softcap_log2 (scale / c and
    c * log2 e). Under ALIBI `bias` (in base 2, [rows, keys]) is added after the cap."""
    qk = _dot(q, tl.trans(k), UPCAST)
    # a constexpr condition: only the chosen branch is compiled
    scores = _tanh(qk * softcap_scale) * softcap_log2 if SOFTCAP else qk * scale_log2
    if ALIBI:
        scores = scores + bias
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # exponents are taken against 0 while a row's max is still -inf: exp2(-inf - 0) weighs 0, where
    # exp2(-inf - -inf) would be NaN
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(scores - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    query_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    context_lens_ptr: tl.tensor,
    out_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    sinks_ptr: tl.tensor,
    alibi_ptr: tl.tensor,
    scale_log2: tl.tensor,
    softcap_scale: tl.tensor,
    softcap_log2: tl.tensor,
    tokens_per_split: tl.tensor,
    window: tl.tensor,
    stride_qs: tl.tensor,
    stride_qh: tl.tensor,
    stride_cb: tl.tensor,
    stride_ct: tl.tensor,
    stride_ch: tl.tensor,
    stride_bt: tl.tensor,
    stride_os: tl.tensor,
    stride_oh: tl.tensor,
    stride_osplit: tl.tensor,
    stride_ls: tl.tensor,
    stride_lh: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    ALIBI: tl.constexpr,
) -> None:
    """Program (seq, kv_head, split): the group's query heads over keys
    [kv_start + split * tokens_per_split, min(kv_start + (split + 1) * tokens_per_split, context_len)),
    kv_start the first position of the block holding the first visible key (0 without a window), keys
    before that key masked. Without split the normalised output goes to out; with it, out holds each
    split's normalised partial output (fp32) and lse its log2-sum-exp2, merged by
    _merge_splits_kernel. HAS_SINKS (never with IS_SPLIT: the merge adds the sinks, once) starts the
    softmax from the sinks."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # the query sits at context_len - 1 and sees keys from `first` on
    first = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    kv_start = first // BLOCK_SIZE * BLOCK_SIZE
    start = kv_start + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        query_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )

    m_i, l_i = _softmax_start(sinks_ptr, heads, g_mask, BLOCK_G, HAS_SINKS)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    slopes = _alibi_slopes(alibi_ptr, heads, g_mask, BLOCK_G, ALIBI)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        # masked in the load, not only in the scores: a V slot read there would still meet its zero
        # weight in p @ v, and 0 * NaN (an unwritten or reused slot) is NaN
        n_mask = (offs_n >= first) & (offs_n < end)
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, offs_n, n_mask, kv_head, offs_d, d_mask,
            stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
        )  # fmt: skip
        bias = _alibi_bias(slopes, offs_n[None, :] - (context_len - 1), ALIBI)
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, n_mask[None, :], m_i, l_i, acc, scale_log2, softcap_scale, softcap_log2, bias, UPCAST,
            SOFTCAP, ALIBI,
        )  # fmt: skip

    # l_i >= 1 once a key was seen (the max key adds exp2(0)); an empty split (start >= context_len,
    # or a block longer than a split and every key of the split before `first`) keeps l_i == 0,
    # m_i == -inf and acc == 0, so it writes zeros and lse -inf: weight 0 in the merge
    out = acc / tl.maximum(l_i, 1.0)[:, None]
    out_offs = seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if IS_SPLIT:
        lse_offs = seq * stride_ls + heads * stride_lh + split
        tl.store(lse_ptr + lse_offs, m_i + tl.log2(tl.maximum(l_i, 1.0)), mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    out_ptr: tl.tensor,
    sinks_ptr: tl.tensor,
    num_splits: tl.tensor,
    stride_ps: tl.tensor,
    stride_ph: tl.tensor,
    stride_psplit: tl.tensor,
    stride_ls: tl.tensor,
    stride_lh: tl.tensor,
    stride_os: tl.tensor,
    stride_oh: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
) -> None:
    """Program (seq, head): out = sum_s w_s * partial_s with w_s = 2^lse_s / sum_s 2^lse_s.
    The split holding the query's first visible key is never empty (context_len >= 1), so the max lse
    is finite and an empty split's -inf weighs exp2(-inf) = 0 (times its partial of zeros). Under
    HAS_SINKS the head's sink joins the denominator here, once (the splits have none): as one more
    split, of lse sinks[head] * log2 e and a partial of zeros."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 e
        m = tl.maximum(m, sink)
    weights = tl.exp2(lse - m)
    offs = seq * stride_ps + head * stride_ph + offs_s[:, None] * stride_psplit + offs_d[None, :]
    partial = tl.load(partial_ptr + offs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    numerator = tl.sum(partial * weights[:, None], 0)
    denominator = tl.sum(weights, 0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - m)
    out = numerator / denominator
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


@triton.jit
def _prefill_kernel(
    query_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    query_start_loc_ptr: tl.tensor,
    context_lens_ptr: tl.tensor,
    out_ptr: tl.tensor,
    sinks_ptr: tl.tensor,
    alibi_ptr: tl.tensor,
    scale_log2: tl.tensor,
    softcap_scale: tl.tensor,
    softcap_log2: tl.tensor,
    window: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_cb: tl.tensor,
    stride_ct: tl.tensor,
    stride_ch: tl.tensor,
    stride_bt: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    ALIBI: tl.constexpr,
) -> None:
    """Program (seq, kv_head, q_tile): BLOCK_Q = BLOCK_M // GROUP query tokens of the sequence, times
    the GROUP query heads of kv_head, as BLOCK_M rows:

        row r -> token q_tile * BLOCK_Q + r // GROUP, head kv_head * GROUP + r % GROUP

    Token i of a sequence sits at position context_len - q_len + i and sees keys 0..position (under
    a window, position - window + 1..position)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    tokens = q_tile * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (tokens < q_len)
    # padded rows get positions too (past the last token's: they may see no key, and are not stored)
    positions = context_len - q_len + tokens
    # a row sees keys from row_first on; the tile's first token sees the earliest of them, from
    # `first`, and the key loop starts at the block holding that
    row_first = tl.where(window > 0, positions - window + 1, 0)
    first = tl.where(window > 0, tl.maximum(context_len - q_len + q_tile * BLOCK_Q - window + 1, 0), 0)
    kv_start = first // BLOCK_SIZE * BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tokens).to(tl.int64) * stride_qt + heads * stride_qh
    q_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(query_ptr + q_rows[:, None] + offs_d[None, :], mask=q_mask, other=0.0)

    m_i, l_i = _softmax_start(sinks_ptr, heads, m_mask, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slopes = _alibi_slopes(alibi_ptr, heads, m_mask, BLOCK_M, ALIBI)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # keys past the tile's last query position are causally masked for every row: stop there;
    # a tile past the sequence's last token (grid sized for the longest) reads nothing
    last_token = tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    kv_end = tl.where(q_tile * BLOCK_Q < q_len, context_len - q_len + last_token + 1, 0)
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = (offs_n >= first) & (offs_n < kv_end)  # in the load, as in _decode_kernel
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, offs_n, n_mask, kv_head, offs_d, d_mask,
            stride_cb, stride_ct, stride_ch, BLOCK_SIZE,
        )  # fmt: skip
        causal = (offs_n[None, :] <= positions[:, None]) & (offs_n[None, :] >= row_first[:, None])
        valid = n_mask[None, :] & causal
        bias = _alibi_bias(slopes, offs_n[None, :] - positions[:, None], ALIBI)
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, valid, m_i, l_i, acc, scale_log2, softcap_scale, softcap_log2, bias, UPCAST, SOFTCAP,
            ALIBI,
        )  # fmt: skip

    out = acc / tl.maximum(l_i, 1.0)[:, None]  # padded rows that saw no key keep l_i == 0
    out_rows = (q_start + tokens).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
) -> int:
    """Checks shared by decode and prefill; returns the GQA group size (query heads per KV head)."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 for no sliding window), got {window}")
    if not (softcap >= 0 and math.isfinite(softcap)):  # NaN fails both
        raise ValueError(f"softcap must be >= 0 and finite (0 for no soft-capping), got {softcap}")
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(query.dtype,), contiguous=True)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(query.dtype,), contiguous=True)
    check_shape("v_cache", v_cache, k_cache.shape)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_same_device(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens
    )
    check_sinks(sinks, query)
    check_alibi(alibi_slopes, query)
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert head_dim == cache_head_dim, f"query head_dim {head_dim} != cache head_dim {cache_head_dim}"
    assert num_heads % num_kv_heads == 0, (
        f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    )
    assert block_size & (block_size - 1) == 0, f"block_size must be a power of two, got {block_size}"
    check_shape("context_lens", context_lens, (block_tables.shape[0],))
    return num_heads // num_kv_heads


def _score_args(scale: float, softcap: float) -> tuple[float, float, float, bool]:
    """The kernels' scale_log2, softcap_scale, softcap_log2 and SOFTCAP (see _online_softmax_step).
    Without a cap the two softcap floats are unused (the SOFTCAP False kernel never reads them)."""
    if not softcap:
        return scale * _LOG2E, 0.0, 0.0, False
    return scale * _LOG2E, scale / softcap, softcap * _LOG2E, True


@functools.cache
def _num_sms(device_index: int | None) -> int:
    """Cached: the launcher runs once per layer per step, the property query is not free."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(num_programs: int, max_context_len: int, device: torch.device) -> int:
    """Split long contexts until the grid fills the device about twice, keeping splits long enough
    that the merge pass stays cheap."""
    by_length = max_context_len // _MIN_TOKENS_PER_SPLIT
    if by_length <= 1:
        return 1
    num_sms = _num_sms(device.index) if device.type == "cuda" else 64
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context, its last `window` tokens only under a
    sliding window (0: none; see reference.paged_attention_decode), its scores s soft-capped to
    softcap * tanh(s / softcap) under `softcap` (0: none; Gemma 2's attn_logit_softcapping), each
    head's softmax joined by its sink logit under `sinks` (float32 [num_heads], None: none; GPT-OSS's),
    its scores biased by distance under `alibi_slopes` (float32 [num_heads], None: none; BLOOM's).

    num_splits > 1 splits the keys each query sees into that many ranges run in parallel and merged
    (split-K, for long contexts and few sequences); None picks it from the context length (under a
    window, from the keys a window leaves). max_context_len (max of context_lens) spares a
    device-to-host sync when the caller knows it. The window is a runtime argument, not a constexpr,
    so layers of different windows share compiled kernels (Triton specializes an int argument only
    when it is 1 or a multiple of 16); a CUDA graph captures it as it captures the scale. Whether
    there is a softcap picks a compiled kernel (a constexpr); its value is a runtime float, captured
    as the scale is.

    Block ids are trusted, not checked: checking them would cost a device-to-host sync every step.
    Each sequence's first ceil(context_len / block_size) ids must name blocks of the cache (an id
    outside it reads other memory, or faults); the ids past them, and under a window those of the
    blocks wholly before it, are never read."""
    group = _check_attention_args(
        query, k_cache, v_cache, block_tables, context_lens, window, softcap, sinks, alibi_slopes
    )
    num_seqs, num_heads, head_dim = query.shape
    check_shape("context_lens", context_lens, (num_seqs,))
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    block_size = k_cache.shape[1]
    assert block_tables.shape[1] * block_size >= max_context_len, (
        f"block_tables: {block_tables.shape[1]} blocks of {block_size} cannot hold {max_context_len} tokens"
    )
    num_kv_heads = k_cache.shape[2]
    # the keys a program walks: from the start of the block holding the first visible key (at most
    # block_size - 1 keys before the window) to the end; only these are divided among the splits
    span = min(max_context_len, window + block_size - 1) if window else max_context_len
    if num_splits is None:
        num_splits = _default_num_splits(num_seqs * num_kv_heads, span, query.device)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    # splits are whole multiples of 16 keys; a request for more splits than that allows gets fewer
    tokens_per_split = triton.cdiv(triton.cdiv(span, num_splits), _MIN_DOT) * _MIN_DOT
    num_splits = triton.cdiv(span, tokens_per_split)
    if num_splits == 1:
        _launch_decode(
            query, k_cache, v_cache, block_tables, context_lens, scale, group, out, None, span, window,
            softcap, sinks, alibi_slopes,
        )  # fmt: skip
        return out
    partial = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    # the splits run without the sinks: the merge adds each once
    _launch_decode(
        query, k_cache, v_cache, block_tables, context_lens, scale, group, partial, lse, tokens_per_split,
        window, softcap, None, alibi_slopes,
    )  # fmt: skip
    _merge_splits_kernel[(num_seqs, num_heads)](
        partial, lse, out, out if sinks is None else sinks, num_splits,
        *partial.stride()[:3], *lse.stride()[:2], *out.stride()[:2],
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SPLITS=triton.next_power_of_2(num_splits), HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out


def _launch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    group: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    tokens_per_split: int,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
) -> None:
    """out is the final [S, H, D] output (lse None) or the [S, H, splits, D] partials with their
    [S, H, splits] log2-sum-exp2 in lse; `sinks` only with the final output (a split's partials have
    none: the merge adds them)."""
    assert sinks is None or lse is None, "split-K partials take no sinks: the merge adds them once"
    num_seqs, _, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    is_split = lse is not None
    num_splits = out.shape[2] if is_split else 1
    stride_split = out.stride(2) if is_split else 0
    lse_strides = lse.stride()[:2] if lse is not None else (0, 0)
    grid = (num_seqs, num_kv_heads, num_splits)
    scale_log2, softcap_scale, softcap_log2, has_softcap = _score_args(scale, softcap)
    _decode_kernel[grid](
        query, k_cache, v_cache, block_tables, context_lens, out, lse if is_split else out,
        out if sinks is None else sinks, out if alibi_slopes is None else alibi_slopes, scale_log2,
        softcap_scale, softcap_log2, tokens_per_split, window,
        *query.stride()[:2], *k_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), stride_split, *lse_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_N=max(_MIN_DOT, min(_DECODE_BLOCK_N, triton.next_power_of_2(tokens_per_split))),
        IS_SPLIT=is_split, UPCAST=triton.knobs.runtime.interpret, SOFTCAP=has_softcap,
        HAS_SINKS=sinks is not None, ALIBI=alibi_slopes is not None,
    )  # fmt: skip


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for packed variable-length queries over keys in the paged cache, each
    query over its last `window` positions only under a sliding window (0: none), scores
    soft-capped under `softcap` (0: none), softmaxes joined by `sinks` (None: none) and scores biased
    by `alibi_slopes` (None: none) as in paged_attention_decode (see reference.paged_attention_prefill). Requires q_len <= context_len
    for every sequence. max_query_len spares a device-to-host sync when the caller knows it.

    Block ids are trusted, as in paged_attention_decode: those covering each context must name
    blocks of the cache; the ids past them, and under a window those of the blocks wholly before
    the first query's, are never read."""
    group = _check_attention_args(
        query, k_cache, v_cache, block_tables, context_lens, window, softcap, sinks, alibi_slopes
    )
    num_seqs = context_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    head_dim = query.shape[2]
    block_m = max(_PREFILL_BLOCK_M, triton.next_power_of_2(group))
    grid = (num_seqs, k_cache.shape[2], triton.cdiv(max_query_len, block_m // group))
    scale_log2, softcap_scale, softcap_log2, has_softcap = _score_args(scale, softcap)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        out if sinks is None else sinks, out if alibi_slopes is None else alibi_slopes, scale_log2,
        softcap_scale, softcap_log2, window,
        *query.stride()[:2], *k_cache.stride()[:3], block_tables.stride(0), *out.stride()[:2],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m,
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)), BLOCK_N=_PREFILL_BLOCK_N,
        UPCAST=triton.knobs.runtime.interpret, SOFTCAP=has_softcap, HAS_SINKS=sinks is not None,
        ALIBI=alibi_slopes is not None,
    )  # fmt: skip
    return out
