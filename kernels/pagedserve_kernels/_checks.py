"""Argument checks shared by the kernel launchers: a bad tensor fails here with a message naming it,
instead of as a wrong answer or an illegal memory access inside a kernel."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    contiguous: bool = False,
) -> None:
    """Rank, dtype and memory layout. Kernels index every tensor through its strides but assume the
    last dimension is dense; `contiguous` demands a fully dense tensor."""
    assert isinstance(tensor, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(tensor).__name__}"
    assert tensor.dim() == ndim, f"{name}: expected {ndim} dimensions, got shape {tuple(tensor.shape)}"
    assert tensor.dtype in dtypes, f"{name}: dtype {tensor.dtype} not in {tuple(dtypes)}"
    if contiguous:
        assert tensor.is_contiguous(), f"{name}: must be contiguous, got strides {tensor.stride()}"
    else:
        assert tensor.shape[-1] <= 1 or tensor.stride(-1) == 1, (
            f"{name}: last dimension must be contiguous, got strides {tensor.stride()}"
        )
    assert tensor.is_cuda or triton.knobs.runtime.interpret, (
        f"{name}: on {tensor.device}; Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 on CPU"
    )


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    assert len(set(devices.values())) == 1, f"tensors on different devices: {devices}"


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    assert tuple(tensor.shape) == tuple(expected), (
        f"{name}: expected shape {tuple(expected)}, got {tuple(tensor.shape)}"
    )
