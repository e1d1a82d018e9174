# Layouts:
#   x     [..., 2 * d], contiguous: each row is [gate (d) | up (d)], as the merged gate/up projection
#         writes it
#   out   [..., d], new contiguous tensor of x's dtype
#
# Rounding follows reference.py: silu(gate) in fp32 rounded to x's dtype, then times up, rounded.
"""SiLU-and-multiply, the SwiGLU activation: silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve_kernels._checks import FLOAT_DTYPES, check_tensor

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr: tl.tensor, out_ptr: tl.tensor, D: tl.constexpr, BLOCK: tl.constexpr) -> None:
    """Program (row, chunk): lanes [chunk * BLOCK, (chunk + 1) * BLOCK) of one row's d outputs."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * (2 * D) + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * (2 * D) + D + offs, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * D + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: silu(first half) * second half (see reference.silu_and_mul)."""
    assert isinstance(x, torch.Tensor) and x.dim() >= 1, "x: expected a tensor of at least one dimension"
    check_tensor("x", x, ndim=x.dim(), dtypes=FLOAT_DTYPES, contiguous=True)
    assert x.shape[-1] % 2 == 0, f"x: last dimension must be even (gate | up), got {x.shape[-1]}"
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    num_rows = x.numel() // x.shape[-1] if d else 0
    if num_rows:
        block = min(_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](x, out, D=d, BLOCK=block)
    return out
