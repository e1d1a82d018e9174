"""Lightning attention's chunked form (`layers.lightning.chunked_lightning`) against its recurrence a
token at a time, S <- exp(-s) S + k v^T, o = S^T q, from a state of its own: any chunk size (one token,
chunks that end inside the sequence, one chunk past its end) gives the same outputs and final state."""

from __future__ import annotations

import pytest
import torch
from pagedserve.layers.lightning import LightningDims, chunked_lightning


def stepwise(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rates: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    outputs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(-rates)[:, None, None] + k[t, :, :, None] * v[t, :, None, :]
        outputs.append(torch.einsum("hd,hde->he", q[t], state))
    return torch.stack(outputs), state


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 200])
def test_chunks_give_the_recurrences_outputs_and_state(chunk_size: int) -> None:
    torch.manual_seed(0)
    tokens, heads, dim = 150, 3, 8
    q, k, v = (torch.randn(tokens, heads, dim, dtype=torch.float64) for _ in range(3))
    rates = torch.tensor([0.5, 0.05, 0.002], dtype=torch.float64)
    state = torch.randn(heads, dim, dim, dtype=torch.float64)
    expected, expected_state = stepwise(q, k, v, rates, state)
    out, final = chunked_lightning(q, k, v, rates, state, chunk_size)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(final, expected_state)


def test_decay_rates_fall_by_head_and_by_layer_as_minimax_sets_them() -> None:
    """MiniMax's rates: (2^(-8 / heads))^(h + 1), scaled by 1 - layer / (layers - 1) (+1e-5 each)."""
    first = LightningDims(hidden_size=64, num_heads=4, head_dim=16, layer_index=0, num_layers=3)
    last = LightningDims(hidden_size=64, num_heads=4, head_dim=16, layer_index=2, num_layers=3)
    torch.testing.assert_close(
        first.decay_rates(), torch.tensor([0.25, 0.0625, 0.015625, 0.00390625]) * (1 + 1e-5)
    )
    assert bool((last.decay_rates() < first.decay_rates() * 1e-3).all())
