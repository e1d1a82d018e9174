"""Pure-torch references for every kernel: the semantics the Triton kernels are tested against,
and the implementation CPU runs use.

Layouts (shared with the Triton kernels):
  k_cache, v_cache   [num_blocks, block_size, num_kv_heads, head_dim]  one pair per layer
  slot_mapping       [num_tokens] int64     slot = block_id * block_size + offset; -1 = skip
  block_tables       [num_seqs, max_blocks_per_seq] int32, rows padded with any valid block id
  context_lens       [num_seqs] int32       tokens in the cache per sequence, *including* this step's
  query_start_loc    [num_seqs + 1] int32   cumulative query token counts (varlen packing)
  cos_sin_cache      [max_position, rotary_dim]  first half cos, second half sin (NeoX-style rotation)

A query token i of a sequence with q_len query tokens and context_len cached tokens sits at
position context_len - q_len + i and attends to cache positions 0..that position (causal). Under a
sliding window of W tokens (`window` W > 0; 0 is none) it attends to the last W of them only: cache
positions p - W + 1..p for a query at p, as transformers' sliding-window mask (`kv > q - W`).
Under soft-capping (`softcap` c > 0; 0 is none: Gemma 2's attention logit soft-capping) each score
s = scale * q.k becomes c * tanh(s / c) before the mask and the softmax.
Under attention sinks (`sinks` [num_heads] float32; None is none: GPT-OSS's) query head h's softmax
has one more logit, sinks[h], with no value: p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h])).
Under ALiBi (`alibi_slopes` [num_heads] float32; None is none: BLOOM's, MPT's) query head h's score
of the key at position j, for the query at p, gains slopes[h] * (j - p) (after any soft-capping),
in float32: a linear penalty on distance in place of positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their cache slots."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_seqs, num_blocks * block_size, num_kv_heads, head_dim]: each sequence's first blocks, in order.
    One `index_select` over whole blocks (a row copy each), several times cheaper than advanced indexing."""
    num_seqs = block_tables.shape[0]
    block_ids = block_tables[:, :num_blocks].reshape(-1)
    blocks = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    return blocks.view(num_seqs, num_blocks * cache.shape[1], *cache.shape[2:])


def check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """sinks: None, or one float32 logit a query head ([num_heads], contiguous) on the query's
    device. Every entry point taking `sinks` checks them here: a ValueError names them."""
    _check_per_head("sinks", sinks, query, "logit")


def check_alibi(alibi_slopes: torch.Tensor | None, query: torch.Tensor) -> None:
    """alibi_slopes: None, or one float32 slope a query head ([num_heads], contiguous) on the query's
    device; a ValueError names them."""
    _check_per_head("alibi_slopes", alibi_slopes, query, "slope")


def _check_per_head(name: str, values: torch.Tensor | None, query: torch.Tensor, what: str) -> None:
    if values is None:
        return
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or None, got {type(values).__name__}")
    if values.dtype != torch.float32:
        raise ValueError(f"{name}: dtype {values.dtype}, expected torch.float32")
    if tuple(values.shape) != (query.shape[1],):
        raise ValueError(
            f"{name}: expected shape ({query.shape[1]},) (one {what} a query head), got {tuple(values.shape)}"
        )
    if not values.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {values.stride()}")
    if values.device != query.device:
        raise ValueError(f"{name}: on {values.device}, the query on {query.device}")


def decode_key_mask(
    context_lens: torch.Tensor, num_slots: int, dtype: torch.dtype, window: int = 0
) -> torch.Tensor:
    """[num_seqs, 1, 1, num_slots] additive mask: 0 for a sequence's cached slots, -inf past its end
    (and, under a `window`, before its last `window` slots). Every layer of a step with this window
    shares it."""
    slots = torch.arange(num_slots, device=context_lens.device)
    hidden = slots[None, :] >= context_lens[:, None]
    if window:
        hidden |= slots[None, :] < context_lens[:, None] - window
    mask = torch.zeros(hidden.shape, dtype=dtype, device=context_lens.device)
    return mask.masked_fill_(hidden, float("-inf"))[:, None, None, :]


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    key_mask: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence ([num_seqs, num_heads, head_dim]) over its paged context (its
    last `window` tokens under a sliding window; scores soft-capped by `softcap`; each head's softmax
    joined by its sink logit under `sinks`; biased by distance under `alibi_slopes`).
    `max_context_len` (host-side) and `key_mask` (`decode_key_mask`, of the same window) may be
    passed in to save work.

    The query heads sharing a KV head ride in the query-length dimension of one SDPA call:

        query [S, H, D] -> [S, KVH, H / KVH, D]  against  keys [S, KVH, slots, D]
    """
    check_sinks(sinks, query)
    check_alibi(alibi_slopes, query)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_seqs == 0:  # an empty batch, as the kernels return it (context_lens.max() has no value)
        return query.new_empty(query.shape)
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    num_blocks = -(-max_context_len // block_size)
    if key_mask is None:
        key_mask = decode_key_mask(context_lens, num_blocks * block_size, query.dtype, window)
    keys = gather_kv(k_cache, block_tables, num_blocks).transpose(1, 2)  # [S, KVH, slots, D]
    values = gather_kv(v_cache, block_tables, num_blocks).transpose(1, 2)
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # the group's heads are the rows of a KV head's scores: their sinks [KVH, H / KVH] likewise
    group_sinks = None if sinks is None else sinks.view(num_kv_heads, -1)
    bias = None
    if alibi_slopes is not None:  # [S, KVH, H / KVH, slots]: the query sits at context_len - 1
        distance = torch.arange(keys.shape[2], device=query.device) - (context_lens.long() - 1)[:, None]
        bias = alibi_slopes.view(num_kv_heads, -1)[None, :, :, None] * distance[:, None, None, :]
    out = _attention(grouped, keys, values, key_mask, scale, softcap, group_sinks, bias)
    return out.reshape(num_seqs, num_heads, head_dim)


@dataclass
class PrefillBatch:
    """How packed variable-length prefill queries sit in one padded batch, for a single SDPA call:

        packed  [ p0 p0 p0 | p1 ]          padded  [ p0 p0 p0 ]   row r of sequence s is
                                                   [ p1 -- -- ]   padded row s * max_query_len + r

    Padded rows attend to the sequence's first slot (a finite value) and are dropped afterwards."""

    rows: torch.Tensor  # [num_tokens] int64: the padded row of each packed query token
    mask: torch.Tensor  # [num_seqs, 1, max_query_len, num_blocks * block_size] additive, causal
    max_query_len: int
    num_blocks: int
    positions: torch.Tensor  # [num_seqs, max_query_len] int64: each padded row's position


# One padded SDPA call computes every query-key pair of the padded batch (its mask lets SDPA skip
# none); a call per sequence computes only the causal half of a prompt without earlier context
# (`is_causal`) and all of a chunk's pairs after one, and costs about this many pairs more per call
# (bf16 on 2 cores, 9 query / 3 KV heads of 64: ~80 us for the gather and the call at ~4.5 ns per
# pair). Padded wins for many short prompts (64 prompts of 16-44 tokens: 3.7 against 5.4 ms per
# layer), the loop for long ones (1,000 + 600 + 448 tokens: 6.0 against 17.0 ms).
_PAIRS_PER_CALL = 16 * 1024


def plan_prefill_batch(
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    window: int = 0,
) -> PrefillBatch | None:
    """The padded layout of a step's prefills (its mask sliding under a `window`), or None when
    attending each sequence on its own costs less (long prompts, or one long chunk beside short
    prompts)."""
    starts, ctx = query_start_loc.tolist(), context_lens.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    max_q, max_ctx = max(q_lens), max(ctx)
    num_blocks = -(-max_ctx // block_size)
    padded_pairs = len(q_lens) * max_q * num_blocks * block_size
    per_sequence_pairs = sum(q * (q + 1) // 2 if q == c else q * c for q, c in zip(q_lens, ctx))
    if padded_pairs > per_sequence_pairs + len(q_lens) * _PAIRS_PER_CALL:
        return None
    device = context_lens.device
    q_lens_t = torch.tensor(q_lens, device=device)
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens), device=device), q_lens_t)
    row_in_seq = torch.arange(int(starts[-1]), device=device) - query_start_loc[:-1].long()[seq_of_token]
    rows = seq_of_token * max_q + row_in_seq
    # query row r of sequence s sits at position ctx - q_len + r and sees slots up to it
    query_pos = (context_lens.long() - q_lens_t)[:, None] + torch.arange(max_q, device=device)[None, :]
    slots = torch.arange(num_blocks * block_size, device=device)
    visible = (slots[None, None, :] <= query_pos[:, :, None]) & (slots < context_lens[:, None, None])
    if window:
        visible &= slots[None, None, :] > query_pos[:, :, None] - window
    visible[:, :, 0] |= ~visible.any(dim=-1)  # padded rows (r >= q_len) see slot 0: a finite row
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return PrefillBatch(rows, mask[:, None], max_q, num_blocks, query_pos)


def prefill_rows(
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed prefill token as a decode query of its own: its sequence's block-table row
    ([num_tokens, max_blocks] int32) and the context it sees, itself included ([num_tokens] int32).
    `paged_attention_decode` over these rows is `paged_attention_prefill`."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens)
    first_pos = context_lens - q_lens  # the position of each sequence's first query token
    row_in_seq = (
        torch.arange(seq_of_token.shape[0], device=q_lens.device) - query_start_loc[:-1][seq_of_token]
    )
    lens = (first_pos[seq_of_token] + row_in_seq + 1).to(torch.int32)
    return block_tables.index_select(0, seq_of_token), lens


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    batch: PrefillBatch | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for packed variable-length queries ([num_tokens, num_heads, head_dim]) whose
    keys, earlier context included, are already in the paged cache, each query over the last
    `window` positions only under a sliding window. `batch` (`plan_prefill_batch`, of the same
    window) pads them into one SDPA call; without it each sequence is attended on its own. Scores
    are soft-capped by `softcap`, each head's softmax joined by its sink logit under `sinks`, and
    scores biased by distance under `alibi_slopes`."""
    check_sinks(sinks, query)
    check_alibi(alibi_slopes, query)
    if batch is None:
        return _prefill_each_sequence(
            query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window, softcap,
            sinks, alibi_slopes,
        )  # fmt: skip
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    padded = query.new_zeros(num_seqs * batch.max_query_len, num_heads, head_dim)
    padded.index_copy_(0, batch.rows, query)
    padded_q = padded.view(num_seqs, batch.max_query_len, num_heads, head_dim).transpose(1, 2)
    keys = gather_kv(k_cache, block_tables, batch.num_blocks).transpose(1, 2)  # [S, KVH, slots, D]
    values = gather_kv(v_cache, block_tables, batch.num_blocks).transpose(1, 2)
    head_sinks = None if sinks is None else sinks[:, None]  # a head's rows: [H, 1]
    bias = None
    if alibi_slopes is not None:  # [S, H, max_q, slots]
        distance = torch.arange(keys.shape[2], device=query.device) - batch.positions[:, :, None]
        bias = alibi_slopes[None, :, None, None] * distance[:, None]
    out = _attention(padded_q, keys, values, batch.mask, scale, softcap, head_sinks, bias)  # [S, H, max_q, D]
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim).index_select(0, batch.rows)


def _prefill_each_sequence(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if start == end:
            continue
        num_blocks = -(-context_len // block_size)
        table = block_tables[seq : seq + 1]
        keys = gather_kv(k_cache, table, num_blocks)[:, :context_len].transpose(1, 2)
        values = gather_kv(v_cache, table, num_blocks)[:, :context_len].transpose(1, 2)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        attended = _causal_attention(q, keys, values, scale, window, softcap, sinks, alibi_slopes)
        out[start:end] = attended.squeeze(0).transpose(0, 1)
    return out


def _causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    q_len, kv_len = q.shape[2], k.shape[2]
    if q_len == kv_len and not window and not softcap and sinks is None and alibi_slopes is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
    kv_pos = torch.arange(kv_len, device=q.device)[None, :]
    mask = (kv_pos <= q_pos) & (kv_pos > q_pos - window) if window else kv_pos <= q_pos
    head_sinks = None if sinks is None else sinks[:, None]  # a head's rows: [H, 1]
    bias = None if alibi_slopes is None else alibi_slopes[:, None, None] * (kv_pos - q_pos)  # [H, q, kv]
    return _attention(q, k, v, mask, scale, softcap, head_sinks, bias)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """scaled_dot_product_attention of q [..., H, q_len, D] over k, v [..., KVH, kv_len, D] (query
    heads grouped over KV heads), `mask` boolean (True: seen) or additive; under `softcap` the scores
    soft-capped before the mask, under `sinks` (float32, broadcast against the scores' rows
    [..., H, q_len]) each row's softmax joined by its sink logit, and `bias` (float32, broadcast
    against the scores: ALiBi's) added after the cap: all in float32 (SDPA has none of them)."""
    if not softcap and sinks is None and bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3).float(), v.repeat_interleave(group, dim=-3).float()
    scores = q.float() @ k.transpose(-1, -2)
    scores = torch.tanh(scores * (scale / softcap)) * softcap if softcap else scores * scale
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    scores = scores + mask.float()
    if bias is not None:
        scores = scores + bias
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:  # exp(s_j) / (sum_k exp(s_k) + exp(sink)), each exponent taken against the row's total
        total = torch.logaddexp(torch.logsumexp(scores, dim=-1), sinks)
        weights = torch.exp(scores - total[..., None])
    return (weights @ v).to(q.dtype)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """For each (src, dst) row of block_mapping [num_pairs, 2], copy block src onto block dst."""
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled by weight in x's dtype (as Hugging Face Llama does):
    weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype). `F.rms_norm` computes exactly that inner
    part in float32 for half-precision inputs, in one fused pass."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary embedding on [num_tokens, heads, head_dim] query and key (returns new tensors)."""
    cos, sin = rotary_cos_sin(positions, cos_sin_cache, query.dtype)
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)


def rotary_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_tokens, 1, rotary_dim] (each half repeated) cast to `dtype`, as Hugging Face Llama
    casts them: the part of the rotary embedding that every layer of a step shares."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, rot/2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(dtype)
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] rotated by `rotary_cos_sin`'s tables (a new tensor in x's dtype,
    computed in the tables': float32 tables rotate a bf16 x with one rounding)."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = (x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.numel() else rotated


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: silu(first half) * second half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_oai_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: GPT-OSS's clamped SwiGLU of gate = the first half, up = the second
    (transformers' `GptOssExperts._apply_gate`, whose gate and up are interleaved instead):
    gate = min(gate, limit), up = clamp(up, -limit, limit), gate * sigmoid(alpha * gate) * (up + 1).
    Each op rounds to x's dtype, as the eager module's do."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: GELU (tanh approximation) of the first half times the second (Gemma 4's
    experts)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


MOE_ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    weighted_inputs: bool = False,
) -> torch.Tensor:
    """A mixture-of-experts MLP, as `pagedserve.layers.moe.run_experts` computes it: out[t] =
    sum_j weights[t, j] * down_e(act(gate_e(x[t]), up_e(x[t]))) with e = expert_ids[t, j]; under
    `weighted_inputs` (Llama 4's) sum_j down_e(act(... x[t] * weights[t, j])), the weight rounded to x's
    dtype and the product too.

    x [T, H]; w13 [E, 2I, H] (expert e's gate rows [:I], up rows [I:]); w2 [E, H, I]; weights
    [T, k] float32; expert_ids [T, k]; optional biases w13_bias [E, 2I] (gate [:I], up [I:]) and
    w2_bias [E, H] in x's dtype (GPT-OSS's experts). `activation` "silu": silu(gate) * up
    (`silu_and_mul`); "swiglu_oai": GPT-OSS's clamped SwiGLU (`swiglu_oai_and_mul`, with
    `swiglu_alpha` and `swiglu_limit`); "gelu_tanh": GELU's tanh approximation of gate, times up
    (Gemma 4's, `gelu_tanh_and_mul`). Each expert's output is computed in x's dtype (an `Expert`'s
    linears, their biases added as F.linear adds them), weighted and summed in float32, expert by
    expert, and the sum cast to x's dtype."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {MOE_ACTIVATIONS}, got {activation!r}")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        if not len(tokens):
            continue
        b13 = None if w13_bias is None else w13_bias[expert]
        b2 = None if w2_bias is None else w2_bias[expert]
        rows = x[tokens] * weights[tokens, slots, None].to(x.dtype) if weighted_inputs else x[tokens]
        gate_up = F.linear(rows, w13[expert], b13)
        if activation == "silu":
            h = silu_and_mul(gate_up)
        elif activation == "gelu_tanh":
            h = gelu_tanh_and_mul(gate_up)
        else:
            h = swiglu_oai_and_mul(gate_up, swiglu_alpha, swiglu_limit)
        y = F.linear(h, w2[expert], b2)
        out.index_add_(0, tokens, y.float() if weighted_inputs else weights[tokens, slots, None] * y.float())
    return out.to(x.dtype)


def linear_bf16_pairs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """bfloat16 x [M, K] @ weight [N, K]^T summed as AVX512-BF16's dot product (vdpbf16ps) sums it, the
    semantics of `cpu.linear_avx512`: a float32 accumulator per output takes, for each pair of k in
    order, the odd k's product and then the even k's (each product exact in float32, each sum rounded),
    the bias is added in float32, and the total is rounded to bfloat16 once. Slow (a step per k)."""
    xs, ws = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for pair in range(weight.shape[1] // 2):
        for k in (2 * pair + 1, 2 * pair):
            acc = acc + xs[:, k : k + 1] * ws[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(torch.bfloat16)
