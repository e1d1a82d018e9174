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
position context_len - q_len + i and attends to cache positions 0..that position (causal).
"""

from __future__ import annotations

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
    """[num_seqs, num_blocks * block_size, num_kv_heads, head_dim]: each sequence's first blocks, in order."""
    blocks = cache[block_tables[:, :num_blocks].long()]
    return blocks.flatten(1, 2)


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence ([num_seqs, num_heads, head_dim]) over its paged context."""
    block_size = k_cache.shape[1]
    max_context = int(context_lens.max())
    num_blocks = -(-max_context // block_size)
    keys = gather_kv(k_cache, block_tables, num_blocks).transpose(1, 2)  # [S, KVH, L, D]
    values = gather_kv(v_cache, block_tables, num_blocks).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = (positions[None, :] < context_lens[:, None].to(positions.dtype))[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for packed variable-length queries ([num_tokens, num_heads, head_dim]) whose
    keys, earlier context included, are already in the paged cache."""
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
        out[start:end] = _causal_attention(q, keys, values, scale).squeeze(0).transpose(0, 1)
    return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    q_len, kv_len = q.shape[2], k.shape[2]
    if q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
    mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """For each (src, dst) row of block_mapping [num_pairs, 2], copy block src onto block dst."""
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, scaled by weight in x's dtype (as Hugging Face Llama does)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


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
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot/2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(query.dtype)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(query.dtype)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.numel() else rotated


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: silu(first half) * second half."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
