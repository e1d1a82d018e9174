# Layouts:
#   x, residual   [..., hidden], contiguous (rows = product of the leading dims); same shape
#   weight        [hidden], contiguous
#   outputs       new contiguous tensors: normed in promote(x.dtype, weight.dtype),
#                 residual' in promote(x.dtype, residual.dtype)
#
# One program normalises one row, the whole row in registers (hidden up to 64K elements).
# Rounding follows reference.py (Hugging Face Llama) step by step so bfloat16 agrees to the bit
# up to the order of the sum of squares: sum in fp32, round the normalised row to x's dtype, then
# multiply by weight in the output dtype.
"""RMSNorm, and RMSNorm fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve_kernels._checks import FLOAT_DTYPES, check_same_device, check_shape, check_tensor

_MAX_HIDDEN = 65536


@triton.jit
def _round_then_normalize(
    x: tl.tensor,
    weight_ptr: tl.tensor,
    out_ptr: tl.tensor,
    offs: tl.tensor,
    mask: tl.tensor,
    eps: tl.tensor,
    HIDDEN: tl.constexpr,
) -> None:
    """The reference rounds the normalised row to x's dtype before the weight multiply."""
    mean_square = tl.sum(x.to(tl.float32) * x.to(tl.float32), 0) / HIDDEN
    normed = (x.to(tl.float32) * tl.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (normed.to(tl.float32) * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    out_ptr: tl.tensor,
    eps: tl.tensor,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row_start = tl.program_id(0).to(tl.int64) * HIDDEN
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row_start + offs, mask=mask, other=0.0)
    _round_then_normalize(x, weight_ptr, out_ptr + row_start, offs, mask, eps, HIDDEN)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr: tl.tensor,
    residual_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    out_ptr: tl.tensor,
    residual_out_ptr: tl.tensor,
    eps: tl.tensor,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """residual' = x + residual (rounded to residual_out's dtype); out = rms_norm(residual')."""
    row_start = tl.program_id(0).to(tl.int64) * HIDDEN
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row_start + offs, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row_start + offs, mask=mask, other=0.0).to(tl.float32)
    summed = (x + residual).to(residual_out_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + row_start + offs, summed, mask=mask)
    _round_then_normalize(summed, weight_ptr, out_ptr + row_start, offs, mask, eps, HIDDEN)


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> int:
    assert isinstance(x, torch.Tensor) and x.dim() >= 1, "x: expected a tensor of at least one dimension"
    check_tensor("x", x, ndim=x.dim(), dtypes=FLOAT_DTYPES, contiguous=True)
    hidden = x.shape[-1]
    assert 0 < hidden <= _MAX_HIDDEN, f"x: hidden size {hidden} not in [1, {_MAX_HIDDEN}]"
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, contiguous=True)
    check_shape("weight", weight, (hidden,))
    check_same_device(x=x, weight=weight)
    return hidden


def _row_launch_config(hidden: int) -> dict[str, int]:
    """The whole row sits in registers: wider rows get more warps so no thread holds more than a
    few dozen elements (the thresholds Liger-Kernel uses); the interpreter ignores num_warps."""
    block = triton.next_power_of_2(hidden)
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return {"BLOCK": block, "num_warps": num_warps}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (see reference.rms_norm); returns a new tensor."""
    hidden = _check_norm_args(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    num_rows = x.numel() // hidden
    if num_rows:
        _rms_norm_kernel[(num_rows,)](x, weight, out, eps, HIDDEN=hidden, **_row_launch_config(hidden))
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual') as new tensors, reading
    x and residual once (see reference.fused_add_rms_norm)."""
    hidden = _check_norm_args(x, weight)
    check_tensor("residual", residual, ndim=x.dim(), dtypes=FLOAT_DTYPES, contiguous=True)
    check_shape("residual", residual, x.shape)
    check_same_device(x=x, residual=residual)
    residual_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out_dtype = torch.promote_types(residual_out.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    num_rows = x.numel() // hidden
    if num_rows:
        _fused_add_rms_norm_kernel[(num_rows,)](
            x, residual, weight, out, residual_out, eps, HIDDEN=hidden, **_row_launch_config(hidden)
        )
    return out, residual_out
