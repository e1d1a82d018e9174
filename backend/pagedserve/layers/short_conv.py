"""LFM2's gated short convolution, and the state it carries for each sequence from step to step.

A layer projects each token to three parts, B, C and x, convolves B * x causally over the sequence,
each channel with `width` taps of its own (a depthwise Conv1d), and gates the result by C. A token's
output reads its own input and the `width - 1` before it, so between steps a sequence keeps the last
`width - 1` inputs of every such layer: its state, a row of the layer's state tensor [rows, width - 1,
channels], the row the model runner gives the request (its block-table row), zeroed when the request
starts at its first token. Nothing else can rebuild it: a sequence resumes from no cached or swapped
KV blocks, only from its first token (`SchedulerConfig.recurrent_state`).

A step's tokens are packed, sequences of any length side by side, so each convolution gathers its
taps from the step's inputs and the states before them through indices built once a step
(`conv_windows`, in numpy, where the rest of the step's inputs are built).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.distributed import get_tp_rank, get_tp_size
from pagedserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear


@dataclass
class ConvWindows:
    """Where a step's convolutions of `width` taps read, in `torch.cat((states of rows, flattened),
    inputs)`: the step's sequences' states (`width - 1` entries each, oldest first) then its tokens."""

    rows: torch.Tensor  # [sequences] int64: each sequence's state row
    taps: torch.Tensor  # [tokens, width] int64: each token's inputs, oldest first (its own last)
    keep: torch.Tensor  # [sequences, width - 1] int64: each sequence's state after the step


def conv_windows(query_lens: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """`ConvWindows.taps` and `.keep` for sequences of `query_lens` tokens each this step."""
    n, held = len(query_lens), width - 1
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(query_lens[:-1], out=starts[1:])
    seq = np.repeat(np.arange(n), query_lens)
    offsets = np.arange(len(seq)) - starts[seq]

    def index(seqs: np.ndarray, local: np.ndarray) -> np.ndarray:
        # position `local` of the sequence's tokens this step: a token (>= 0) or its state (< 0)
        return np.where(local >= 0, n * held + starts[seqs] + local, seqs * held + held + local)

    taps = index(seq[:, None], offsets[:, None] - held + np.arange(width))
    keep = index(np.arange(n)[:, None], query_lens[:, None] - held + np.arange(held))
    return taps.astype(np.int64), keep.astype(np.int64)


def causal_conv(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: ConvWindows,
) -> torch.Tensor:
    """Each channel of x [tokens, channels] convolved causally with its taps (weight [channels,
    width]) over its sequence, the sequence's state before its first token; the states advanced past
    the step's tokens. Summed in float32, rounded once to x's dtype (as Conv1d accumulates)."""
    both = torch.cat((state[windows.rows].flatten(0, 1), x))
    out = torch.einsum("twc,cw->tc", both[windows.taps].float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    state[windows.rows] = both[windows.keep]
    return out.to(x.dtype)


class ShortConv(nn.Module):
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
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.channels = hidden // self.tp_size
        # the checkpoint's Conv1d weight [hidden, 1, width] as [channels, width], its bias [channels]
        self.conv_weight = nn.Parameter(torch.empty(self.channels, self.width), requires_grad=False)
        self.conv_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.conv_bias: nn.Parameter | None = None
        if bias:
            self.conv_bias = nn.Parameter(torch.empty(self.channels), requires_grad=False)
            self.conv_bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.state: torch.Tensor | None = None  # [rows, width - 1, channels], set by `bind_state`

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = loaded.reshape(loaded.shape[0], -1).narrow(0, self.tp_rank * self.channels, self.channels)
        param.data.copy_(rows.reshape(param.shape))

    def bind_state(self, rows: int) -> None:
        """A zeroed state for each of `rows` requests, in the weights' dtype and device."""
        weight = self.conv_weight
        self.state = torch.zeros(
            rows, self.width - 1, self.channels, dtype=weight.dtype, device=weight.device
        )

    def forward(self, hidden: torch.Tensor, windows: dict[int, ConvWindows]) -> torch.Tensor:
        assert self.state is not None, "bind_state() first"
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        conv = causal_conv(b * x, self.state, self.conv_weight, self.conv_bias, windows[self.width])
        return self.out_proj(c * conv)
