# Layouts (as in reference.py):
#   positions      [num_tokens] int32/int64
#   query, key     [num_tokens, num_heads | num_kv_heads, head_dim], any token/head strides (the model
#                  passes views of the fused QKV projection), dense head_dim, same dtype
#   cos_sin_cache  [max_position, rotary_dim], contiguous: cos of the rotary_dim / 2 frequencies,
#                  then their sin
#   outputs        new contiguous tensors shaped like query and key
#
# NeoX-style rotation of the first rotary_dim lanes of each head (the rest pass through):
#
#   lane d < half:            out[d] = x[d] * cos[d]        - x[d + half] * sin[d]
#   lane half <= d < rot_dim: out[d] = x[d] * cos[d - half] + x[d - half] * sin[d - half]
"""Rotary position embedding (NeoX style, optionally partial) of query and key."""

from __future__ import annotations

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


@triton.jit
def _rotate_heads(
    in_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_h: tl.tensor,
    cos: tl.tensor,
    sin: tl.tensor,
    partner: tl.tensor,
    sign: tl.tensor,
    is_rotated: tl.tensor,
    offs_d: tl.tensor,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
) -> None:
    """Rotate one token's [NUM_HEADS, HEAD_DIM] heads; cos/sin/partner/sign are per lane."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    rows = in_ptr + offs_h[:, None] * stride_h
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0)
    x_partner = tl.load(rows + partner[None, :], mask=mask & is_rotated[None, :], other=0.0)
    # each product is rounded to x's dtype before the sum, as the reference computes in that dtype
    direct = (x.to(tl.float32) * cos[None, :]).to(x.dtype)
    crossed = (sign[None, :] * x_partner.to(tl.float32) * sin[None, :]).to(x.dtype)
    rotated = (direct.to(tl.float32) + crossed.to(tl.float32)).to(x.dtype)
    out = tl.where(is_rotated[None, :], rotated, x)
    tl.store(out_ptr + offs_h[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr: tl.tensor,
    query_ptr: tl.tensor,
    key_ptr: tl.tensor,
    cos_sin_ptr: tl.tensor,
    query_out_ptr: tl.tensor,
    key_out_ptr: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    """Program (token): rotate every query and key head of the token by its position's angles."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    HALF: tl.constexpr = ROTARY_DIM // 2
    offs_d = tl.arange(0, BLOCK_D)
    is_rotated = offs_d < ROTARY_DIM
    is_first_half = offs_d < HALF
    freq = tl.where(is_first_half, offs_d, offs_d - HALF)
    partner = tl.where(is_first_half, offs_d + HALF, offs_d - HALF)
    sign = tl.where(is_first_half, -1.0, 1.0)
    # the reference casts cos/sin to the query's dtype before multiplying: round them the same way
    row = cos_sin_ptr + position * ROTARY_DIM
    cos = tl.load(row + freq, mask=is_rotated, other=1.0).to(query_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.load(row + HALF + freq, mask=is_rotated, other=0.0).to(query_ptr.dtype.element_ty).to(tl.float32)
    _rotate_heads(
        query_ptr + token * stride_qt, query_out_ptr + token * (NUM_HEADS * HEAD_DIM), stride_qh,
        cos, sin, partner, sign, is_rotated, offs_d, NUM_HEADS, HEAD_DIM, BLOCK_H,
    )  # fmt: skip
    _rotate_heads(
        key_ptr + token * stride_kt, key_out_ptr + token * (NUM_KV_HEADS * HEAD_DIM), stride_kh,
        cos, sin, partner, sign, is_rotated, offs_d, NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_H,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary embedding of query and key (see reference.rotary_embedding); returns new
    tensors. Positions must lie in [0, max_position)."""
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    num_tokens, num_heads, head_dim = query.shape
    check_shape("positions", positions, (num_tokens,))
    check_shape("key", key, (num_tokens, key.shape[1], head_dim))
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, (
        f"cos_sin_cache: rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}"
    )
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, query_out, key_out, *query.stride()[:2], *key.stride()[:2],
        NUM_HEADS=num_heads, NUM_KV_HEADS=key.shape[1], HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV_H=triton.next_power_of_2(key.shape[1]),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return query_out, key_out
