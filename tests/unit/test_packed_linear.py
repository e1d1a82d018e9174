"""bf16 weights packed once for oneDNN give exactly what `F.linear` on the plain weight gives, for
every linear layer kind and the LM head, at decode and prefill batch sizes: the packing is a speed-up
only, so greedy outputs cannot change with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, can_pack_weights

pytestmark = pytest.mark.skipif(
    not can_pack_weights(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN has no native bf16"
)

BATCH_SIZES = [1, 7, 64, 300]  # decode batches, and a prefill chunk beyond the packing hint


def filled(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
    return layer


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("kind", ["column", "column_bias", "row"])
def test_packed_linear_layers_equal_f_linear(kind: str, batch_size: int) -> None:
    layer = {
        "column": lambda: ColumnParallelLinear(576, 1536),
        "column_bias": lambda: ColumnParallelLinear(576, 192, bias=True),
        "row": lambda: RowParallelLinear(1536, 576),
    }[kind]()
    filled(layer, seed=batch_size)
    weight, bias = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(batch_size, weight.shape[1]).to(torch.bfloat16)
    expected = F.linear(x, weight, bias)
    layer.pack_weights(batch_size_hint=64)
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # the plain copy is released
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_packed_lm_head_equals_f_linear_and_keeps_the_tied_weight(batch_size: int) -> None:
    head = filled(ParallelLMHead(1000, 576), seed=batch_size)
    weight = head.weight.detach().clone()
    hidden = torch.randn(batch_size, 576).to(torch.bfloat16)
    expected = F.linear(hidden, weight)
    head.pack_weights(batch_size_hint=64)
    assert head.packed_weight is not None
    assert torch.equal(head.compute_logits(hidden), expected)
    assert torch.equal(head.weight, weight)  # a tied input embedding still reads it
