"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Float32RMSNorm(RMSNorm):
    """x / rms(x) * (weight_offset + weight), all in float32, rounded to x's dtype once (transformers'
    Olmo2RMSNorm; GemmaRMSNorm with its offset of 1; Llama's rounds before it multiplies). `forward`
    keeps RMSNorm's form (with `residual`, their sum normed and returned too); the layers that use it
    call `normed`."""

    weight_offset = 0.0

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.normed(x)
        summed = x + residual
        return self.normed(summed), summed

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (self.weight_offset + self.weight.float())).to(x.dtype)


class LayerNorm(Float32RMSNorm):
    """(x - mean(x)) / std(x) * weight + bias, in float32, rounded to x's dtype once, with RMSNorm's
    call form: StarCoder2's (nn.LayerNorm), Cohere's (no bias), Nemotron's LayerNorm1P (its weight
    plus `weight_offset` 1, added in the weight's dtype as transformers adds it)."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = True, weight_offset: float = 0.0) -> None:
        super().__init__(hidden_size, eps)
        self.weight_offset = weight_offset
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        weight = (self.weight + self.weight_offset).float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, self.eps).to(x.dtype)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32, no weight, rounded to x's dtype once
    (Llama4TextWeightlessRMSNorm: Llama 4's q and k, Gemma 4's values, FalconMamba's B, C and time step,
    NanoChat's every norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class WeightlessRMSNorm(Float32RMSNorm):
    """`weightless_rms_norm` with RMSNorm's call form (NanoChat's norms): no parameters."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        nn.Module.__init__(self)  # (no weight)
        self.eps = eps

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return weightless_rms_norm(x, self.eps)
