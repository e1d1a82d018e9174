"""Rotary embedding against the pure-torch reference, on strided query/key views of a fused QKV
output (as the model passes them), full and partial rotary_dim: 1, 7, 15, 16, 17 and 300 tokens,
head_dim 64, 128 and 80, query heads per KV head 1, 3 and 8, random positions below 512; and the
launcher's argument checks.

Tolerances: float32 atol = rtol = 1e-5. bfloat16 atol = rtol = 2e-2 against the reference run in
bfloat16 (the kernel rounds each product as the reference does; the interpreter truncates).
"""

from __future__ import annotations

import pytest
import torch
from pagedserve_kernels import reference, rotary

TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
MAX_POSITION = 512


def cos_sin_cache(rotary_dim: int, device: torch.device) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.arange(MAX_POSITION, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [
        (1, 4, 4, 64, 64),
        (7, 9, 3, 64, 64),
        (7, 24, 3, 128, 128),
        (15, 8, 1, 128, 64),
        (16, 16, 2, 128, 128),
        (16, 2, 2, 64, 32),
        (17, 6, 2, 80, 80),
        (300, 9, 3, 64, 64),  # one long case: the interpreter runs one program per token
    ],
)
def test_rotary_embedding_matches_reference(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=device)
    cache = cos_sin_cache(rotary_dim, device)
    query_out, key_out = rotary.rotary_embedding(positions, query, key, cache)
    expected_query, expected_key = reference.rotary_embedding(positions, query, key, cache)
    torch.testing.assert_close(query_out.float(), expected_query.float(), **TOLERANCES[dtype])
    torch.testing.assert_close(key_out.float(), expected_key.float(), **TOLERANCES[dtype])
    assert query_out.dtype == dtype and key_out.shape == key.shape


def test_rotary_embedding_leaves_inputs_untouched_and_position_zero_fixed(device: torch.device) -> None:
    query = torch.randn(2, 2, 64, device=device)
    key = torch.randn(2, 1, 64, device=device)
    query_before = query.clone()
    positions = torch.tensor([0, 5], device=device)
    query_out, key_out = rotary.rotary_embedding(positions, query, key, cos_sin_cache(64, device))
    assert torch.equal(query, query_before)
    torch.testing.assert_close(query_out[0], query[0])  # angle 0 is the identity
    assert not torch.allclose(query_out[1], query[1])


def bad_rotary_args(device: torch.device) -> dict[str, dict]:
    good = {
        "positions": torch.arange(3, device=device),
        "query": torch.randn(3, 4, 64, device=device),
        "key": torch.randn(3, 2, 64, device=device),
        "cos_sin_cache": cos_sin_cache(64, device),
    }
    return {
        "positions: dtype": {**good, "positions": good["positions"].float()},
        "positions: expected shape": {**good, "positions": torch.arange(2, device=device)},
        "query: dtype": {**good, "query": good["query"].int()},
        "query: expected 3 dimensions": {**good, "query": torch.randn(3, 256, device=device)},
        "query: last dimension must be contiguous": {
            **good,
            "query": torch.randn(3, 4, 128, device=device)[..., ::2],
        },
        "key: dtype": {**good, "key": good["key"].bfloat16()},
        "key: last dimension must be contiguous": {
            **good,
            "key": torch.randn(3, 2, 128, device=device)[..., ::2],
        },
        "key: expected shape": {**good, "key": torch.randn(3, 2, 32, device=device)},
        "cos_sin_cache: rotary_dim 128 must be even and <= head_dim 64": {
            **good,
            "cos_sin_cache": cos_sin_cache(128, device),
        },
        "cos_sin_cache: must be contiguous": {
            **good,
            "cos_sin_cache": cos_sin_cache(64, device).t().contiguous().t(),
        },
        # on CPU the device check names both tensors; on a GPU the meta tensor fails the CUDA check
        "cos_sin_cache.*meta": {**good, "cos_sin_cache": torch.empty(MAX_POSITION, 64, device="meta")},
    }


@pytest.mark.parametrize("problem", list(bad_rotary_args(torch.device("cpu"))))
def test_rotary_launcher_rejects_bad_arguments(problem: str, device: torch.device) -> None:
    """A bad tensor fails in the launcher with a message naming it, not inside the kernel."""
    with pytest.raises(AssertionError, match=problem):
        rotary.rotary_embedding(**bad_rotary_args(device)[problem])
