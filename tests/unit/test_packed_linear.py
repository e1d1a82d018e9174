"""bf16 weights packed once give exactly what `F.linear` on the plain weight gives, for every linear
layer kind and the LM head, at decode and prefill batch sizes. Packed for oneDNN: F.linear's bits at
every batch size. Packed for the AMX kernel (where the CPU has it): F.linear's bits for up to 32 rows,
and beyond that each row the bits F.linear gives that row alone (oneDNN sums differently from 33 rows
on), so a row's result no longer depends on the batch it is in. Packed for the AVX512-BF16 kernel
(where the CPU has it and not AMX): vdpbf16ps's sums in order (`reference.linear_bf16_pairs`), also
the same in any batch; weights it does not fit (in_features past MAX_AVX512_IN_FEATURES, out_features
not in multiples of 32) stay with oneDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedserve.layers import linear
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, can_pack_weights
from pagedserve_kernels import reference as kernel_reference

pytestmark = pytest.mark.skipif(
    not can_pack_weights(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN has no native bf16"
)

BATCH_SIZES = [1, 7, 32, 64, 300]  # decode batches, and a prefill chunk beyond the packing hint


@pytest.fixture(params=["onednn", "amx", "avx512"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param != "amx":
        monkeypatch.setattr(linear, "amx_linear_available", lambda: False)
    if request.param == "onednn":
        monkeypatch.setattr(linear, "avx512_linear_available", lambda: False)
    elif request.param == "amx" and not linear.amx_linear_available():
        pytest.skip("no AMX bf16 tiles (or no C++ compiler) here")
    elif request.param == "avx512" and not linear.avx512_linear_available():
        pytest.skip("no AVX512-BF16 (or no C++ compiler) here")
    return str(request.param)


def reference(packing: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packing == "avx512":
        return kernel_reference.linear_bf16_pairs(x, weight, bias)
    if packing == "amx" and x.shape[0] > 32:
        return torch.cat([F.linear(row, weight, bias) for row in x.split(1)])
    return F.linear(x, weight, bias)


PACKED_DIMS = {"onednn": 2, "avx512": 4, "amx": 5}


def filled(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
    return layer


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("kind", ["column", "column_bias", "row", "row_bias"])
def test_packed_linear_layers_equal_f_linear(packing: str, kind: str, batch_size: int) -> None:
    layer = {
        "column": lambda: ColumnParallelLinear(576, 1536),
        "column_bias": lambda: ColumnParallelLinear(576, 192, bias=True),
        "row": lambda: RowParallelLinear(1536, 576),
        "row_bias": lambda: RowParallelLinear(1536, 576, bias=True),
    }[kind]()
    filled(layer, seed=batch_size)
    weight, bias = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(batch_size, weight.shape[1]).to(torch.bfloat16)
    expected = reference(packing, x, weight, bias)
    layer.pack_weights(batch_size_hint=64)
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # the plain copy is released
    assert layer.packed_weight.dim() == PACKED_DIMS[packing]
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("vocab_size", [1024, 1000])  # 1000: not in multiples of 32, oneDNN's either way
def test_packed_lm_head_equals_f_linear_and_keeps_the_tied_weight(
    packing: str, vocab_size: int, batch_size: int
) -> None:
    head = filled(ParallelLMHead(vocab_size, 576), seed=batch_size)
    weight = head.weight.detach().clone()
    hidden = torch.randn(batch_size, 576).to(torch.bfloat16)
    packed_as = packing if vocab_size % 32 == 0 else "onednn"
    expected = reference(packed_as, hidden, weight, None)
    head.pack_weights(batch_size_hint=64)
    assert head.packed_weight is not None and head.packed_weight.dim() == PACKED_DIMS[packed_as]
    assert torch.equal(head.compute_logits(hidden), expected)
    assert torch.equal(head.weight, weight)  # a tied input embedding still reads it


@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("vocab_size", [1024, 1000])
def test_lm_head_greedy_token_ids_are_the_argmax_of_its_logits(
    packing: str, vocab_size: int, batch_size: int
) -> None:
    """In AMX tiles or AVX512-BF16 panels the kernel takes each row's argmax without the logits; the
    same tokens as argmax over compute_logits. In oneDNN's layout: None (the engine computes the
    logits)."""
    head = filled(ParallelLMHead(vocab_size, 576), seed=batch_size)
    hidden = torch.randn(batch_size, 576).to(torch.bfloat16)
    head.pack_weights(batch_size_hint=64)
    assert head.packed_weight is not None
    token_ids = head.greedy_token_ids(hidden)
    if head.packed_weight.dim() == 2:
        assert token_ids is None
        return
    assert token_ids is not None
    assert torch.equal(token_ids, head.compute_logits(hidden).max(dim=-1).indices)


def test_avx512_panels_only_up_to_their_longest_in_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """in_features past MAX_AVX512_IN_FEATURES (where the kernel is slower than oneDNN) stay with oneDNN."""
    if not linear.avx512_linear_available():
        pytest.skip("no AVX512-BF16 (or no C++ compiler) here")
    monkeypatch.setattr(linear, "amx_linear_available", lambda: False)
    longest = linear.MAX_AVX512_IN_FEATURES
    assert linear.pack_weight(torch.zeros(64, longest, dtype=torch.bfloat16), 64).dim() == 4
    assert linear.pack_weight(torch.zeros(64, longest + 2, dtype=torch.bfloat16), 64).dim() == 2
