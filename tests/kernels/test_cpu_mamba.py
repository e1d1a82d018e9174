"""The C++ kernel of Mamba (1)'s selective scan (`pagedserve_kernels.cpu.mamba_scan`) against the torch
path (`pagedserve.layers.mamba.scan_states`): a step of decodes and prompts, each request's state
advanced in place in its row alone, and y. float32 states equal to float32 rounding; bfloat16 states
stored rounded to nearest even once a step (the torch path too), so a state may sit one bf16 ulp from
the torch path's where the two float32 results straddle a rounding boundary. State sizes a multiple
of 16 (the vector loop whole) and not (its masked tail), rows out of order, and the checks on what
it is given."""

from __future__ import annotations

import shutil

import pytest
import torch
from pagedserve.layers.mamba import scan_states
from pagedserve.layers.recurrent import RecurrentStep
from pagedserve_kernels import cpu

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernel"
)


def inputs(tokens: int, channels: int, size: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(tokens, channels)
    dt = torch.rand(tokens, channels) * 0.5
    a = -torch.rand(channels, size) * 4
    b, c = torch.randn(tokens, size), torch.randn(tokens, size)
    return x, dt, a, b, c


def step_of(rows: list[int], query_lens: list[int]) -> RecurrentStep:
    return RecurrentStep(torch.tensor(rows), rows, query_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("channels", "size"), [(24, 16), (10, 20), (7, 5)])
def test_the_kernel_advances_each_row_as_the_torch_path_does(
    dtype: torch.dtype, channels: int, size: int
) -> None:
    """Two decodes, a prompt of 37 tokens between them and one of 5 after."""
    assert cpu.load()
    torch.manual_seed(channels * size)
    states = torch.randn(9, channels, size).to(dtype)
    step = step_of([7, 2, 5, 0], [1, 37, 1, 5])
    args = inputs(44, channels, size)
    ours, theirs = states.clone(), states.clone()
    y = cpu.mamba_scan(ours, step.rows, step.token_starts, *args)
    expected = scan_states(theirs, step, *args)
    float32 = dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=1e-4 if float32 else 2e-2, atol=1e-4 if float32 else 2e-2)
    untouched = [r for r in range(9) if r not in step.row_ids]
    assert torch.equal(ours[untouched], states[untouched])  # the other rows as they were
    if float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    else:  # at most one bf16 rounding step apart, and mostly none
        ulp = theirs.float().abs().clamp(min=1e-30) * 2**-7
        assert ((ours.float() - theirs.float()).abs() <= ulp).all()
        assert (ours == theirs).float().mean() > 0.99
    assert not torch.equal(ours[step.rows], states[step.rows])


def test_what_it_cannot_run_is_refused_naming_it() -> None:
    assert cpu.load()
    states = torch.zeros(4, 8, 16)
    x, dt, a, b, c = inputs(3, 8, 16)
    starts = torch.tensor([0, 1, 3])
    with pytest.raises(RuntimeError, match="rows: row 4 is past the state's 4"):
        cpu.mamba_scan(states, torch.tensor([0, 4]), starts, x, dt, a, b, c)
    with pytest.raises(RuntimeError, match="starts: int64 \\[requests \\+ 1\\]"):
        cpu.mamba_scan(states, torch.tensor([0, 1]), starts[:2], x, dt, a, b, c)
    with pytest.raises(RuntimeError, match="starts: must not decrease"):
        cpu.mamba_scan(states, torch.tensor([0, 1]), torch.tensor([0, 3, 1]), x, dt, a, b, c)
    with pytest.raises(RuntimeError, match="x: float32 \\[3, 8\\]"):
        cpu.mamba_scan(states, torch.tensor([0, 1]), starts, x[:2], dt, a, b, c)
    with pytest.raises(RuntimeError, match="a: float32"):
        cpu.mamba_scan(states, torch.tensor([0, 1]), starts, x, dt, a.double(), b, c)
    with pytest.raises(RuntimeError, match="state: contiguous float32 or bfloat16"):
        cpu.mamba_scan(states.half(), torch.tensor([0, 1]), starts, x, dt, a, b, c)
    with pytest.raises(RuntimeError, match="state: at most 256 states a channel, got 300"):
        cpu.mamba_scan(torch.zeros(4, 8, 300), torch.tensor([0, 1]), starts, x, dt, a, b, c)
