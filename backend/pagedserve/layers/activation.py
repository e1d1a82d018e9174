"""SwiGLU's activation: silu(gate) * up on a merged [gate | up] projection."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.layers import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
