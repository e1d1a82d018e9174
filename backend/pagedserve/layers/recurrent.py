"""Layers that carry a state per request from step to step in place of a KV cache (LFM2's short
convolutions, `layers.short_conv`; Mamba2's convolution and state space, `layers.mamba2`), and what a
step tells them.

Each such layer keeps a request's state in a row of its state tensors, the row the model runner gives
the request (its block-table row), reset when the request is announced at its first token. Nothing else
can rebuild it: a request resumes from no cached or swapped KV blocks, only from its first token
(`SchedulerConfig.recurrent_state`).

A step's tokens are packed, sequences of any length side by side. A causal convolution of `width` taps
gathers each token's inputs from the step's inputs and the states before them through indices built once
a step (`conv_windows`, in numpy, where the rest of the step's inputs are built).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedserve.distributed import get_tp_rank


@dataclass
class ConvWindows:
    """Where a step's convolutions of one width read, in `torch.cat((states of the step's rows,
    flattened), inputs)`: the sequences' states (`width - 1` entries each, oldest first), then the tokens."""

    taps: torch.Tensor  # [tokens, width] int64: each token's inputs, oldest first (its own last)
    keep: torch.Tensor  # [sequences, width - 1] int64: each sequence's state after the step


@dataclass
class RecurrentStep:
    """A step's sequences, in the packed batch's order, as the layers with a state read them."""

    rows: torch.Tensor  # [sequences] int64: each sequence's state row
    row_ids: list[int]  # the same, on the host
    query_lens: list[int]  # each sequence's tokens this step
    windows: dict[int, ConvWindows] = field(default_factory=dict)  # by convolution width

    @functools.cached_property
    def single_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(their rows, their tokens' indices) of the sequences with one token this step (decodes), which
        a state space advances together."""
        starts = np.cumsum([0, *self.query_lens[:-1]])
        ones = [i for i, n in enumerate(self.query_lens) if n == 1]
        device = self.rows.device
        return self.rows[torch.tensor(ones, dtype=torch.int64, device=device)], torch.tensor(
            starts[ones], dtype=torch.int64, device=device
        )

    @functools.cached_property
    def token_starts(self) -> torch.Tensor:
        """[sequences + 1] int64 on the host: where each sequence's tokens start in the packed batch,
        then their count."""
        return torch.tensor(np.cumsum([0, *self.query_lens]), dtype=torch.int64)

    @functools.cached_property
    def runs(self) -> list[tuple[int, int, int]]:
        """(row, first token, tokens) of each sequence with more than one token this step (prompts)."""
        starts = np.cumsum([0, *self.query_lens[:-1]])
        return [
            (row, int(start), n)
            for row, start, n in zip(self.row_ids, starts, self.query_lens, strict=True)
            if n > 1
        ]


class RecurrentLayer(nn.Module, abc.ABC):
    """A layer with a state per request: `width`, its causal convolution's taps (the step's windows it
    reads); its state tensors allocated by `bind_state`, a row reset by `reset_state`."""

    width: int

    @abc.abstractmethod
    def state_bytes(self, rows: int) -> int:
        """What `bind_state(rows)` would allocate."""

    @abc.abstractmethod
    def bind_state(self, rows: int) -> None:
        """Zeroed states for `rows` requests (`state_bytes(rows)` of them)."""

    @abc.abstractmethod
    def reset_state(self, row: int) -> None:
        """Zero one request's state (it starts at its first token)."""


def rows_loader(rows: torch.Tensor) -> Callable[[nn.Parameter, torch.Tensor], None]:
    """A weight loader keeping the checkpoint tensor's `rows` (this rank's channels or heads; a Conv1d
    weight [channels, 1, width] as [channels, width])."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[rows].reshape(param.shape))

    return load


def rank_rows(size: int) -> torch.Tensor:
    """This rank's `size` rows, where each rank holds as many in rank order."""
    return torch.arange(get_tp_rank() * size, (get_tp_rank() + 1) * size)


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
    rows: torch.Tensor,
    windows: ConvWindows,
) -> torch.Tensor:
    """Each channel of x [tokens, channels] convolved causally with its taps (weight [channels,
    width]) over its sequence, the sequence's state (in `state`'s `rows`) before its first token; the
    states advanced past the step's tokens. Summed in float32, rounded once to x's dtype (as Conv1d
    accumulates)."""
    both = torch.cat((state[rows].flatten(0, 1), x))
    out = torch.einsum("twc,cw->tc", both[windows.taps].float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    state[rows] = both[windows.keep]
    return out.to(x.dtype)
