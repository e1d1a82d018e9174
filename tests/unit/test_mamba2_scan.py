"""Mamba2's state space over packed steps (`layers.mamba2`): sequences side by side, each split into
steps of any size (a decode step's one token, prompts in chunks that cross the SSD's chunks of 3 or
not), give what the recurrence gives token by token over each whole sequence, S <- exp(dt A) S +
dt x B^T, y = S C + D x, the state carried between steps in each sequence's own row."""

from __future__ import annotations

import random

import pytest
import torch
from pagedserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pagedserve.layers.recurrent import RecurrentStep

DIMS = Mamba2Dims(
    hidden_size=16,
    num_heads=4,
    head_dim=8,
    num_groups=2,
    state_size=5,
    conv_width=4,
    chunk_size=3,
    conv_bias=True,
    proj_bias=False,
    norm_eps=1e-5,
)


def token_by_token(
    mixer: Mamba2Mixer, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    a = -torch.exp(mixer.A_log.double())
    b, c = (t.repeat_interleave(DIMS.num_heads // DIMS.num_groups, dim=1) for t in (b, c))
    state = torch.zeros(DIMS.num_heads, DIMS.head_dim, DIMS.state_size, dtype=torch.float64)
    ys = []
    for t in range(x.shape[0]):
        state = (
            state * torch.exp(dt[t] * a)[:, None, None]
            + (dt[t, :, None] * x[t])[..., None] * b[t, :, None, :]
        )
        ys.append(torch.einsum("hpn,hn->hp", state, c[t]) + mixer.D.double()[:, None] * x[t])
    return torch.stack(ys)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_steps_equal_the_recurrence_token_by_token(seed: int) -> None:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    mixer = Mamba2Mixer(DIMS)
    for param in (mixer.A_log, mixer.D):
        param.data.normal_(0.0, 0.5)
    mixer.bind_state(6)
    assert mixer.ssm_state is not None
    mixer.ssm_state.normal_()  # stale rows: reset when a sequence starts
    rows, lengths = [4, 1, 5, 0], [1, 5, 9, 14]
    for row in rows:
        mixer.reset_state(row)
    h, p, n = DIMS.num_heads, DIMS.head_dim, DIMS.state_size
    g = DIMS.num_groups  # B and C a group's, each shared by heads / groups heads
    seqs = [
        (torch.randn(k, h, p), torch.rand(k, h) * 0.8, torch.randn(k, g, n), torch.randn(k, g, n))
        for k in lengths
    ]
    done, outputs = [0] * len(lengths), [[] for _ in lengths]
    while any(d < k for d, k in zip(done, lengths)):
        step = [i for i in range(len(lengths)) if done[i] < lengths[i] and rng.random() < 0.7]
        rng.shuffle(step)
        if not step:
            continue
        sizes = [min(rng.choice([1, 1, 2, 4, 7]), lengths[i] - done[i]) for i in step]
        packed = [
            torch.cat([seqs[i][part][done[i] : done[i] + k] for i, k in zip(step, sizes)])
            for part in range(4)
        ]
        recurrent = RecurrentStep(torch.tensor([rows[i] for i in step]), [rows[i] for i in step], sizes)
        for i, y in zip(step, mixer.scan(*packed, recurrent).split(sizes)):
            outputs[i].append(y)
        for i, k in zip(step, sizes):
            done[i] += k
    for i, (x, dt, b, c) in enumerate(seqs):
        expected = token_by_token(mixer, x.double(), dt.double(), b.double(), c.double())
        torch.testing.assert_close(torch.cat(outputs[i]).double(), expected, rtol=1e-4, atol=1e-4)
