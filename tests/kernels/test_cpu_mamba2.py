"""The C++ kernel of Mamba2's decode step (`pagedserve_kernels.cpu.mamba2_decode`) against the torch
path (`pagedserve.layers.mamba2.decode_states`): the requests' states advanced in place, in their rows
alone, and y. float32 states equal to float32 rounding (the kernel fuses S * exp(dt A) + dt x b into
one rounding); bfloat16 states stored rounded to nearest even, so a state may sit one bf16 ulp from
the torch path's where the two float32 results straddle a rounding boundary. State sizes a multiple
of 16 (the vector loop whole) and not (its masked tail), one group and several (B and C shared by
heads / groups heads), rows out of order, and the checks on what it is given."""

from __future__ import annotations

import shutil

import pytest
import torch
from pagedserve.layers.mamba2 import decode_states
from pagedserve_kernels import cpu

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernel"
)


def inputs(k: int, heads: int, head_dim: int, groups: int, size: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(k, heads, head_dim)
    dt = torch.rand(k, heads)
    a = -torch.rand(heads) * 2
    b, c = torch.randn(k, groups, size), torch.randn(k, groups, size)
    return x, dt, a, b, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "head_dim", "groups", "size"), [(4, 16, 1, 32), (6, 8, 2, 20), (8, 4, 8, 5)]
)
def test_the_kernel_advances_each_row_as_the_torch_path_does(
    dtype: torch.dtype, heads: int, head_dim: int, groups: int, size: int
) -> None:
    assert cpu.load()
    torch.manual_seed(heads * size)
    states = torch.randn(9, heads, head_dim, size).to(dtype)
    rows = torch.tensor([7, 2, 5, 0])
    args = inputs(len(rows), heads, head_dim, groups, size)
    ours, theirs = states.clone(), states.clone()
    y = cpu.mamba2_decode(ours, rows, *args)
    expected = decode_states(theirs, rows, *args)
    float32 = dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=1e-5 if float32 else 2e-2, atol=1e-4 if float32 else 2e-2)
    untouched = [r for r in range(9) if r not in rows.tolist()]
    assert torch.equal(ours[untouched], states[untouched])  # the other rows as they were
    if float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    else:  # at most one bf16 rounding step apart, and mostly none
        ulp = theirs.float().abs().clamp(min=1e-30) * 2**-7
        assert ((ours.float() - theirs.float()).abs() <= ulp).all()
        assert (ours == theirs).float().mean() > 0.99
    assert not torch.equal(ours[rows], states[rows])


def test_what_it_cannot_run_is_refused_naming_it() -> None:
    assert cpu.load()
    states = torch.zeros(4, 2, 8, 16)
    x, dt, a, b, c = inputs(2, 2, 8, 1, 16)
    with pytest.raises(RuntimeError, match="rows: row 4 is past the state's 4"):
        cpu.mamba2_decode(states, torch.tensor([0, 4]), x, dt, a, b, c)
    with pytest.raises(
        RuntimeError, match="b: \\[requests, groups, state_size\\] with groups dividing the heads"
    ):
        cpu.mamba2_decode(states, torch.tensor([0, 1]), x, dt, a, torch.randn(2, 3, 16), c)
    with pytest.raises(RuntimeError, match="x: float32"):
        cpu.mamba2_decode(states, torch.tensor([0, 1]), x.double(), dt, a, b, c)
    with pytest.raises(RuntimeError, match="state: contiguous float32 or bfloat16"):
        cpu.mamba2_decode(states.half(), torch.tensor([0, 1]), x, dt, a, b, c)
