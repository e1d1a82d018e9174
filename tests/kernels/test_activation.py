"""SiLU-and-multiply against the pure-torch reference (1, 6 and 7 rows, odd widths), and the
launcher's argument checks.

Tolerances: float32 atol = rtol = 1e-5; bfloat16 atol = rtol = 2e-2 against the reference run in
bfloat16 (same rounding points; the interpreter truncates float32 to bfloat16 where torch rounds
to nearest).
"""

from __future__ import annotations

import pytest
import torch
from pagedserve_kernels import activation, reference

TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (7, 2 * 1536), (7, 2 * 1100), (2, 3, 2 * 17)], ids=str)
def test_silu_and_mul_matches_reference(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    x = 4 * torch.randn(shape, dtype=dtype, device=device)
    out = activation.silu_and_mul(x)
    expected = reference.silu_and_mul(x)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


def bad_activation_inputs(device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "x: dtype": torch.ones(3, 64, dtype=torch.int32, device=device),
        "x: last dimension must be even": torch.randn(3, 65, device=device),
        "x: must be contiguous": torch.randn(3, 128, device=device)[:, ::2],
        "x: expected a tensor of at least one dimension": torch.tensor(1.0, device=device),
    }


@pytest.mark.parametrize("problem", list(bad_activation_inputs(torch.device("cpu"))))
def test_silu_and_mul_launcher_rejects_bad_arguments(problem: str, device: torch.device) -> None:
    """A bad input fails in the launcher with a message naming it, not inside the kernel."""
    with pytest.raises(AssertionError, match=problem):
        activation.silu_and_mul(bad_activation_inputs(device)[problem])
