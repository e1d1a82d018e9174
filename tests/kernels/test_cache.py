"""KV cache writes (slot mapping) and block copies against the pure-torch reference.

Grid: writes of 1, 15, 16, 17 and 300 tokens with head_dim 64 and 128, block sizes 16 and 32, plus
head_dim 80; block copies of 1, 3, 4 and 7 pairs; each in float32 and bfloat16.

Tolerances: none. Both kernels move values without arithmetic, so the caches must be bit-identical
to the reference's, except that the interpreter truncates where torch rounds to nearest when a
float32 key is stored into a bfloat16 cache (atol = rtol = 8e-3, one bfloat16 step).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pagedserve_kernels import cache, reference

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def random_caches(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)


# num_kv_heads varies with the token count (1, 3 and 8 KV heads each appear), so the grid stays the
# product of token count, head_dim, block size and dtype
KV_HEADS_BY_NUM_TOKENS = {1: 1, 15: 3, 16: 8, 17: 2, 300: 3}
# (num_tokens, num_kv_heads, head_dim, block_size)
WRITE_CASES = [
    pytest.param(num_tokens, KV_HEADS_BY_NUM_TOKENS[num_tokens], head_dim, block_size,
                 id=f"t{num_tokens}-kvh{KV_HEADS_BY_NUM_TOKENS[num_tokens]}-d{head_dim}-bs{block_size}")
    for num_tokens, head_dim, block_size in itertools.product(KV_HEADS_BY_NUM_TOKENS, (64, 128), (16, 32))
] + [pytest.param(33, 2, 80, 16, id="t33-kvh2-d80-bs16")]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "num_kv_heads", "head_dim", "block_size"), WRITE_CASES)
def test_write_kv_cache_matches_reference(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    # room for every token plus a few blocks, so the slots scatter and most of the cache stays untouched
    num_blocks = -(-num_tokens // block_size) + 3
    k_cache, v_cache = random_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    # value is a strided view, as the model passes the V part of its fused QKV output
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    key, value = kv[:, :num_kv_heads].contiguous(), kv[:, num_kv_heads:]
    slot_mapping = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    if num_tokens > 1:
        slot_mapping[num_tokens // 2] = -1  # a padding token: written nowhere
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expected_k, expected_v, slot_mapping)
    cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_write_kv_cache_casts_to_the_cache_dtype(device: torch.device) -> None:
    k_cache, v_cache = random_caches(4, 16, 2, 64, torch.bfloat16, device)
    key, value = torch.randn(2, 5, 2, 64, device=device)
    slot_mapping = torch.tensor([3, 17, 40, 63, 0], dtype=torch.int32, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expected_k, expected_v, slot_mapping.long())
    cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, expected_k, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(v_cache, expected_v, atol=8e-3, rtol=8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "pairs"),
    [
        (1, 64, 16, [[0, 5]]),
        (3, 128, 32, [[2, 7], [2, 1], [6, 0]]),
        (8, 64, 16, [[1, 3], [4, 6], [5, 2], [0, 7]]),
        # seven copy-on-write pairs at once (one program row each), sources and targets interleaved
        (2, 128, 32, [[0, 9], [3, 10], [5, 15], [1, 11], [7, 12], [2, 14], [4, 13]]),
        (3, 64, 16, [[15, 0], [8, 3], [9, 1], [14, 6], [10, 2], [11, 7], [12, 5]]),
    ],
)
def test_copy_blocks_matches_reference(
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    pairs: list[list[int]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    k_cache, v_cache = random_caches(16, block_size, num_kv_heads, head_dim, dtype, device)
    block_mapping = torch.tensor(pairs, dtype=torch.int64, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.copy_blocks(expected_k, expected_v, block_mapping)
    cache.copy_blocks(k_cache, v_cache, block_mapping)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache[pairs[0][1]], k_cache[pairs[0][0]])


def test_write_kv_cache_token_strided_key_and_int32_slots(device: torch.device) -> None:
    """Every other token of a larger tensor (a token stride of twice the row) lands in its slot."""
    k_cache, v_cache = random_caches(4, 16, 2, 64, torch.float32, device)
    key = torch.randn(10, 2, 64, device=device)[::2]
    value = torch.randn(5, 2, 64, device=device)
    slot_mapping = torch.tensor([63, 0, 17, -1, 32], dtype=torch.int32, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expected_k, expected_v, slot_mapping.long())
    cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache[3, 15], key[0])  # slot 63 = block 3, offset 15


def test_copy_blocks_int32_mapping(device: torch.device) -> None:
    k_cache, v_cache = random_caches(5, 32, 2, 128, torch.bfloat16, device)
    block_mapping = torch.tensor([[4, 0], [1, 3]], dtype=torch.int32, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.copy_blocks(expected_k, expected_v, block_mapping)
    cache.copy_blocks(k_cache, v_cache, block_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_cache_launchers_reject_bad_arguments(device: torch.device) -> None:
    k_cache, v_cache = random_caches(4, 16, 2, 64, torch.float32, device)
    key = torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(AssertionError, match="key: expected shape"):
        cache.write_kv_cache(key[:, :1], key[:, :1], k_cache, v_cache, slots)
    with pytest.raises(AssertionError, match="slot_mapping: expected shape"):
        cache.write_kv_cache(key, key, k_cache, v_cache, slots[:2])
    with pytest.raises(AssertionError, match="k_cache: must be contiguous"):
        cache.write_kv_cache(key, key, k_cache.transpose(0, 1), v_cache.transpose(0, 1), slots)
    with pytest.raises(AssertionError, match="block_mapping: expected shape"):
        cache.copy_blocks(k_cache, v_cache, torch.tensor([[0, 1, 2]], device=device))
