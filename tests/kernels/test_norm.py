"""RMSNorm and fused residual-add RMSNorm against the pure-torch reference, on 1, 2 and 7 rows of
hidden sizes 64 to 4096 (577 odd), and the launchers' argument checks.

Tolerances: float32 atol = rtol = 1e-5. bfloat16 atol = rtol = 2e-2 against the reference run in
bfloat16: the kernel rounds where the reference does, but the interpreter truncates float32 to
bfloat16 where torch rounds to nearest, and a truncated residual sum feeds the norm (two steps).
"""

from __future__ import annotations

import pytest
import torch
from pagedserve_kernels import norm, reference

TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
SHAPES = [(1, 64), (7, 576), (7, 577), (2, 3, 128), (1, 4096)]


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    x = 3 * torch.randn(shape, dtype=dtype, device=device)
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    assert_matches(norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_add_rms_norm_matches_reference(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    out, new_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(new_residual, expected_residual, dtype)
    assert_matches(out, expected_out, dtype)


def test_rms_norm_float32_weight_on_bfloat16_input_promotes(device: torch.device) -> None:
    """A float32 weight (checkpoint kept in float32) gives a float32 output, as in the reference."""
    x = torch.randn(7, 577, dtype=torch.bfloat16, device=device)
    weight = torch.rand(577, device=device) + 0.5
    out = norm.rms_norm(x, weight, 1e-6)
    assert_matches(out, reference.rms_norm(x, weight, 1e-6), torch.bfloat16)
    assert out.dtype == torch.float32


def test_rms_norm_large_eps_shrinks_output(device: torch.device) -> None:
    """eps reaches the kernel: with eps far above mean(x^2) the output is about x / sqrt(eps)."""
    x = torch.randn(3, 64, device=device) * 1e-3
    weight = torch.ones(64, device=device)
    torch.testing.assert_close(norm.rms_norm(x, weight, 100.0), x / 10.0, atol=1e-7, rtol=1e-3)


def bad_norm_args(device: torch.device) -> dict[str, dict]:
    """Arguments both norm launchers take (x, weight, eps), each set with one problem."""
    good = {"x": torch.randn(3, 64, device=device), "weight": torch.ones(64, device=device), "eps": 1e-6}
    return {
        "x: dtype": {**good, "x": good["x"].int()},
        "x: must be contiguous": {**good, "x": torch.randn(3, 128, device=device)[:, ::2]},
        "x: expected a tensor of at least one dimension": {**good, "x": torch.tensor(1.0, device=device)},
        "x: hidden size": {**good, "x": torch.randn(1, 65537, device=device)},
        "weight: dtype": {**good, "weight": good["weight"].int()},
        "weight: expected shape": {**good, "weight": torch.ones(32, device=device)},
        "weight: must be contiguous": {**good, "weight": torch.ones(128, device=device)[::2]},
        # on CPU the device check names both tensors; on a GPU the meta tensor fails the CUDA check
        "weight.*meta": {**good, "weight": torch.ones(64, device="meta")},
    }


def bad_residual_args(device: torch.device) -> dict[str, dict]:
    """fused_add_rms_norm arguments with good x and weight and one problem in residual."""
    good = {"x": torch.randn(3, 64, device=device), "weight": torch.ones(64, device=device), "eps": 1e-6}
    return {
        "residual: dtype": {**good, "residual": torch.ones(3, 64, dtype=torch.int64, device=device)},
        "residual: expected shape": {**good, "residual": torch.randn(2, 64, device=device)},
        "residual: expected 2 dimensions": {**good, "residual": torch.randn(3, 1, 64, device=device)},
        "residual: must be contiguous": {**good, "residual": torch.randn(3, 128, device=device)[:, ::2]},
        "residual.*meta": {**good, "residual": torch.randn(3, 64, device="meta")},
    }


@pytest.mark.parametrize("problem", list(bad_norm_args(torch.device("cpu"))))
def test_norm_launchers_reject_bad_arguments(problem: str, device: torch.device) -> None:
    """A bad tensor fails in the launcher with a message naming it, not inside the kernel."""
    kwargs = bad_norm_args(device)[problem]
    with pytest.raises(AssertionError, match=problem):
        norm.rms_norm(**kwargs)
    residual = torch.randn(kwargs["x"].shape, device=device) if kwargs["x"].dim() else kwargs["x"]
    with pytest.raises(AssertionError, match=problem):
        norm.fused_add_rms_norm(residual=residual, **kwargs)


@pytest.mark.parametrize("problem", list(bad_residual_args(torch.device("cpu"))))
def test_fused_add_rms_norm_rejects_bad_residual(problem: str, device: torch.device) -> None:
    with pytest.raises(AssertionError, match=problem):
        norm.fused_add_rms_norm(**bad_residual_args(device)[problem])
