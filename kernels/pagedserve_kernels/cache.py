# Layouts (as in reference.py):
#   key, value     [num_tokens, num_kv_heads, head_dim]  any token/head strides, dense head_dim;
#                  any float dtype, cast to the cache's on store
#   k/v_cache      [num_blocks, block_size, num_kv_heads, head_dim], contiguous, written in place
#   slot_mapping   [num_tokens] int32/int64, slot = block_id * block_size + offset; -1 = skip the token
#   block_mapping  [num_pairs, 2] int32/int64 rows of (src block, dst block)
#
# With a contiguous cache, slot s starts at element s * num_kv_heads * head_dim, so a token's
# [num_kv_heads, head_dim] tile is one dense run of the cache:
#
#   cache  | block 0: slot 0 | slot 1 | ... | block 1: slot 16 | ...   (block_size 16)
#             [kvh, d] dense
"""KV cache writes: scatter this step's K/V into their slots, and copy whole blocks (copy-on-write)."""

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

_COPY_BLOCK = 1024


@triton.jit
def _write_kv_kernel(
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_mapping_ptr: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    """Program (token): copy its [num_kv_heads, head_dim] key and value into slot slot_mapping[token]."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # a skipped token (slot -1, e.g. padding) has no heads to write: every lane masked, no branch
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    key = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    block_mapping_ptr: tl.tensor,
    BLOCK_NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """Program (pair, chunk): copy elements [chunk * BLOCK, (chunk + 1) * BLOCK) of block src onto dst."""
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < BLOCK_NUMEL
    k = tl.load(k_cache_ptr + src * BLOCK_NUMEL + offs, mask=mask)
    v = tl.load(v_cache_ptr + src * BLOCK_NUMEL + offs, mask=mask)
    tl.store(k_cache_ptr + dst * BLOCK_NUMEL + offs, k, mask=mask)
    tl.store(v_cache_ptr + dst * BLOCK_NUMEL + offs, v, mask=mask)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), contiguous=True)
    check_shape("v_cache", v_cache, k_cache.shape)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into their cache slots, in place.
    Slots must be distinct (two tokens writing one slot race); -1 skips a token."""
    _check_caches(k_cache, v_cache)
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES)
    check_shape("key", key, (key.shape[0], *k_cache.shape[2:]))
    check_shape("value", value, key.shape)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    check_shape("slot_mapping", slot_mapping, key.shape[:1])
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, *key.stride()[:2], *value.stride()[:2],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """For each (src, dst) row of block_mapping, copy block src onto block dst in both caches, in
    place. Invariant (copy-on-write gives it): no dst is also a src or repeated, so the pairs are
    independent and run in parallel."""
    _check_caches(k_cache, v_cache)
    check_tensor("block_mapping", block_mapping, ndim=2, dtypes=INDEX_DTYPES, contiguous=True)
    check_shape("block_mapping", block_mapping, (block_mapping.shape[0], 2))
    check_same_device(k_cache=k_cache, v_cache=v_cache, block_mapping=block_mapping)
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    block_numel = k_cache[0].numel()
    block = min(_COPY_BLOCK, triton.next_power_of_2(block_numel))
    grid = (num_pairs, triton.cdiv(block_numel, block))
    _copy_blocks_kernel[grid](k_cache, v_cache, block_mapping, BLOCK_NUMEL=block_numel, BLOCK=block)
