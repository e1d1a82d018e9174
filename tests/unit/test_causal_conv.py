"""LFM2's causal short convolution over packed steps (`layers.recurrent`): sequences of any length
side by side, each split into chunks of any size (a decode step's one token, chunks shorter than the
state), give what one causal Conv1d over each whole sequence gives, the state carried between steps in
each sequence's own row."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pagedserve.layers.recurrent import ConvWindows, causal_conv, conv_windows


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """transformers' Lfm2ShortConv's: a depthwise Conv1d padded by width - 1, its first outputs kept."""
    width = weight.shape[1]
    out = F.conv1d(x.t()[None], weight[:, None], bias, padding=width - 1, groups=weight.shape[0])
    return out[0, :, : x.shape[0]].t()


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_chunked_steps_equal_one_conv1d_over_each_sequence(width: int, bias: bool) -> None:
    torch.manual_seed(width)
    rng = random.Random(width)
    channels, lengths = 8, [1, 2, 7, 19, 40]
    inputs = [torch.randn(n, channels, dtype=torch.float32) for n in lengths]
    weight = torch.randn(channels, width, dtype=torch.float32)
    conv_bias = torch.randn(channels, dtype=torch.float32) if bias else None
    state = torch.randn(
        8, width - 1, channels, dtype=torch.float32
    )  # stale rows: zeroed when a sequence starts
    rows = [6, 0, 3, 5, 1]  # each sequence's row, not in order
    state[rows] = 0
    done, outputs = [0] * len(lengths), [[] for _ in lengths]
    while any(d < n for d, n in zip(done, lengths)):
        # a step: some of the unfinished sequences, in shuffled order, each with a chunk of 1-5 tokens
        step = [i for i in range(len(lengths)) if done[i] < lengths[i] and rng.random() < 0.7]
        rng.shuffle(step)
        if not step:
            continue
        chunks = [min(rng.choice([1, 1, 2, 3, 5]), lengths[i] - done[i]) for i in step]
        x = torch.cat([inputs[i][done[i] : done[i] + c] for i, c in zip(step, chunks)])
        taps, keep = conv_windows(np.array(chunks, dtype=np.int64), width)
        step_rows, windows = (
            torch.tensor([rows[i] for i in step]),
            ConvWindows(torch.from_numpy(taps), torch.from_numpy(keep)),
        )
        for i, out in zip(step, causal_conv(x, state, weight, conv_bias, step_rows, windows).split(chunks)):
            outputs[i].append(out)
        for i, c in zip(step, chunks):
            done[i] += c
    for i, x in enumerate(inputs):
        torch.testing.assert_close(torch.cat(outputs[i]), conv1d(x, weight, conv_bias))
        # each row holds its sequence's last width - 1 inputs (zeros before its first)
        held = torch.cat((torch.zeros(width - 1, channels, dtype=torch.float32), x))[-(width - 1) :]
        torch.testing.assert_close(state[rows[i]], held)


def test_the_windows_index_states_then_tokens() -> None:
    """Two sequences of 1 and 3 tokens, width 3: the combined rows are [s0 s0' s1 s1' | t0 | u0 u1 u2]."""
    taps, keep = conv_windows(np.array([1, 3]), 3)
    assert taps.tolist() == [[0, 1, 4], [2, 3, 5], [3, 5, 6], [5, 6, 7]]
    assert keep.tolist() == [[1, 4], [6, 7]]
