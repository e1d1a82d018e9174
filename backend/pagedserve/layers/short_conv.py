"""LFM2's gated short convolution: each token projected to three parts, B, C and x; B * x convolved
causally over the sequence, each channel with `width` taps of its own (a depthwise Conv1d); the result
gated by C. A token's output reads its own input and the `width - 1` before it, so a request keeps the
last `width - 1` inputs from step to step (`layers.recurrent`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.distributed import get_tp_size
from pagedserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedserve.layers.recurrent import RecurrentLayer, RecurrentStep, causal_conv, rank_rows, rows_loader


class ShortConv(RecurrentLayer):
    """LFM2's convolution block: in_proj to B, C and x, C * conv(B * x), out_proj. Under tensor
    parallelism each rank holds its share of the channels (in_proj's rows of each part, their taps
    and state), out_proj sums the ranks' parts."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, bias = cfg["hidden_size"], bool(cfg.get("conv_bias", False))
        self.width = int(cfg.get("conv_L_cache", 3))
        if self.width < 2:
            raise ValueError(f"model: config.json's conv_L_cache must be at least 2, got {self.width}")
        self.in_proj = MergedColumnParallelLinear(hidden, [hidden] * 3, bias=bias)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        self.channels = hidden // get_tp_size()
        # the checkpoint's Conv1d weight [hidden, 1, width] as [channels, width], its bias [channels]
        self.conv_weight = nn.Parameter(torch.empty(self.channels, self.width), requires_grad=False)
        self.conv_weight.weight_loader = rows_loader(rank_rows(self.channels))  # type: ignore[attr-defined]
        self.conv_bias: nn.Parameter | None = None
        if bias:
            self.conv_bias = nn.Parameter(torch.empty(self.channels), requires_grad=False)
            self.conv_bias.weight_loader = rows_loader(rank_rows(self.channels))  # type: ignore[attr-defined]
        self.state: torch.Tensor | None = None  # [rows, width - 1, channels], set by `bind_state`

    def state_bytes(self, rows: int) -> int:
        return rows * (self.width - 1) * self.channels * self.conv_weight.element_size()

    def bind_state(self, rows: int) -> None:
        weight = self.conv_weight
        self.state = torch.zeros(
            rows, self.width - 1, self.channels, dtype=weight.dtype, device=weight.device
        )

    def reset_state(self, row: int) -> None:
        assert self.state is not None, "bind_state() first"
        self.state[row] = 0

    def forward(self, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        assert self.state is not None, "bind_state() first"
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        windows = step.windows[self.width]
        conv = causal_conv(b * x, self.state, self.conv_weight, self.conv_bias, step.rows, windows)
        return self.out_proj(c * conv)
