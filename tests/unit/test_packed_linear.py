"""bf16 weights packed once give exactly what `F.linear` on the plain weight gives, for every linear
layer kind and the LM head, at decode and prefill batch sizes. Packed for oneDNN: F.linear's bits at
every batch size. Packed for the AMX kernel (where the CPU has it): F.linear's bits for up to 32 rows,
and beyond that each row the bits F.linear gives that row alone (oneDNN sums differently from 33 rows
on), so a row's result no longer depends on the batch it is in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedserve.layers import linear
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, can_pack_weights

pytestmark = pytest.mark.skipif(
    not can_pack_weights(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN has no native bf16"
)

BATCH_SIZES = [1, 7, 32, 64, 300]  # decode batches, and a prefill chunk beyond the packing hint


@pytest.fixture(params=["onednn", "amx"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "onednn":
        monkeypatch.setattr(linear, "amx_linear_available", lambda: False)
    elif not linear.amx_linear_available():
        pytest.skip("no AMX bf16 tiles (or no C++ compiler) here")
    return str(request.param)


def reference(packing: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packing == "amx" and x.shape[0] > 32:
        return torch.cat([F.linear(row, weight, bias) for row in x.split(1)])
    return F.linear(x, weight, bias)


def filled(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
    return layer


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("kind", ["column", "column_bias", "row"])
def test_packed_linear_layers_equal_f_linear(packing: str, kind: str, batch_size: int) -> None:
    layer = {
        "column": lambda: ColumnParallelLinear(576, 1536),
        "column_bias": lambda: ColumnParallelLinear(576, 192, bias=True),
        "row": lambda: RowParallelLinear(1536, 576),
    }[kind]()
    filled(layer, seed=batch_size)
    weight, bias = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(batch_size, weight.shape[1]).to(torch.bfloat16)
    expected = reference(packing, x, weight, bias)
    layer.pack_weights(batch_size_hint=64)
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # the plain copy is released
    assert layer.packed_weight.dim() == (5 if packing == "amx" else 2)
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("vocab_size", [1024, 1000])  # 1000: not in multiples of 32, oneDNN's either way
def test_packed_lm_head_equals_f_linear_and_keeps_the_tied_weight(
    packing: str, vocab_size: int, batch_size: int
) -> None:
    head = filled(ParallelLMHead(vocab_size, 576), seed=batch_size)
    weight = head.weight.detach().clone()
    hidden = torch.randn(batch_size, 576).to(torch.bfloat16)
    on_amx = packing == "amx" and vocab_size % 32 == 0
    expected = reference("amx" if on_amx else "onednn", hidden, weight, None)
    head.pack_weights(batch_size_hint=64)
    assert head.packed_weight is not None and head.packed_weight.dim() == (5 if on_amx else 2)
    assert torch.equal(head.compute_logits(hidden), expected)
    assert torch.equal(head.weight, weight)  # a tied input embedding still reads it
