"""The gated delta rule's decode step in C++ (`pagedserve_kernels.cpu.gated_delta_decode`) against
the torch path it stands in for (`layers.gated_delta.delta_rule_step`)."""

from __future__ import annotations

import pytest
import torch
from pagedserve.layers.gated_delta import delta_rule_step
from pagedserve_kernels import cpu


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


def step_inputs(
    requests: int, heads: int, dk: int, dv: int, seed: int = 0, by_channel: bool = False
) -> tuple[torch.Tensor, ...]:
    """g a decay a head, or `by_channel` one a key channel (Kimi Delta Attention's)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(requests, heads, dk, generator=generator)
    k = torch.nn.functional.normalize(torch.randn(requests, heads, dk, generator=generator), dim=-1)
    v = torch.randn(requests, heads, dv, generator=generator)
    g = -torch.rand(requests, heads, *((dk,) if by_channel else ()), generator=generator)
    beta = torch.rand(requests, heads, generator=generator)
    return q, k, v, g, beta


@pytest.mark.parametrize("by_channel", [False, True])
@pytest.mark.parametrize(("dk", "dv"), [(128, 128), (20, 24), (8, 40)])
def test_float32_states_advance_as_the_torch_path_does(dk: int, dv: int, by_channel: bool) -> None:
    """Rows out of order (and some not stepped), head widths off the vector width, a decay a head or
    a key channel: the outputs and every state as the torch path leaves them, to float32 rounding."""
    generator = torch.Generator().manual_seed(1)
    states = torch.randn(6, 3, dk, dv, generator=generator)
    rows = torch.tensor([4, 0, 2, 5])
    q, k, v, g, beta = step_inputs(4, 3, dk, dv, by_channel=by_channel)
    expected_states = states.clone()
    stepped = expected_states[rows]
    expected = delta_rule_step(stepped, q, k, v, g, beta)
    expected_states[rows] = stepped
    out = cpu.gated_delta_decode(states, rows, q, k, v, g, beta)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[[1, 3]], expected_states[[1, 3]])  # (rows not stepped: untouched)


@pytest.mark.parametrize("by_channel", [False, True])
def test_bfloat16_states_are_advanced_in_float32_and_rounded_once(by_channel: bool) -> None:
    generator = torch.Generator().manual_seed(2)
    states = torch.randn(4, 2, 64, 64, generator=generator).bfloat16()
    rows = torch.tensor([3, 1])
    q, k, v, g, beta = step_inputs(2, 2, 64, 64, seed=3, by_channel=by_channel)
    stepped = states[rows].float()
    expected = delta_rule_step(stepped, q, k, v, g, beta)
    out = cpu.gated_delta_decode(states, rows, q, k, v, g, beta)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # the stored states: float32's advanced states rounded to bfloat16, within one rounding
    torch.testing.assert_close(states[rows].float(), stepped, rtol=2**-8, atol=1e-6)
    assert (states[rows] == stepped.bfloat16()).float().mean() > 0.99


def test_what_it_cannot_take_is_refused_naming_it() -> None:
    q, k, v, g, beta = step_inputs(2, 2, 16, 16)
    states, rows = torch.zeros(4, 2, 16, 16), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="state: contiguous float32 or bfloat16"):
        cpu.gated_delta_decode(states.half(), rows, q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="rows: row 4 is past the state's 4"):
        cpu.gated_delta_decode(states, torch.tensor([0, 4]), q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="q: float32"):
        cpu.gated_delta_decode(states, rows, q[:, :, :8], k, v, g, beta)
    with pytest.raises(RuntimeError, match="g: float32"):
        cpu.gated_delta_decode(states, rows, q, k, v, torch.zeros(2, 2, 8), beta)
    with pytest.raises(RuntimeError, match="head_v_dim 600 is past 512"):
        cpu.gated_delta_decode(torch.zeros(4, 2, 16, 600), rows, q, k, torch.zeros(2, 2, 600), g, beta)
