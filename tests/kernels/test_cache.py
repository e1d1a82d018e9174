"""KV cache writes (slot mapping) and block copies against the pure-torch reference. Both move
values without arithmetic, so results must be bit-identical, except that the interpreter truncates
where torch rounds to nearest when a float32 key is stored into a bfloat16 cache (atol = rtol = 8e-3,
one bfloat16 step)."""

from __future__ import annotations

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "block_size"),
    [(1, 1, 64, 16), (7, 3, 128, 32), (17, 8, 64, 32), (33, 2, 80, 16)],
)
def test_write_kv_cache_matches_reference(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    k_cache, v_cache = random_caches(6, block_size, num_kv_heads, head_dim, dtype, device)
    # value is a strided view, as the model passes the V part of its fused QKV output
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    key, value = kv[:, :num_kv_heads].contiguous(), kv[:, num_kv_heads:]
    slot_mapping = torch.randperm(k_cache.shape[0] * block_size, device=device)[:num_tokens]
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
    k_cache, v_cache = random_caches(8, block_size, num_kv_heads, head_dim, dtype, device)
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
