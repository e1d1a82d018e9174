"""Kernel tests run natively on a GPU, else under the Triton interpreter on CPU.

Triton wraps a kernel for its interpreter or for its GPU compiler when the kernel's module is
imported, and reads TRITON_INTERPRET at that moment (not when triton itself is imported). So the
variable is set here, before the test modules of this folder import the kernels, and a kernel
module that something collected earlier already imported is an error rather than a mystery.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# triton.language too: its own @triton.jit helpers (tl.zeros, ...) are wrapped when it is imported,
# and torch._dynamo / torch.compile import it (a test module importing them at collection did).
_KERNELS_IMPORTED_EARLY = sorted(
    name
    for name in sys.modules
    if (name.startswith("pagedserve_kernels.") or name == "triton.language")
    and name not in ("pagedserve_kernels.reference", "pagedserve_kernels._checks", "pagedserve_kernels.cpu")
)
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    assert not _KERNELS_IMPORTED_EARLY, (
        f"{_KERNELS_IMPORTED_EARLY} imported before TRITON_INTERPRET=1 was set: their kernels are wrapped "
        "for the GPU compiler (import them lazily, or export TRITON_INTERPRET=1)"
    )
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
