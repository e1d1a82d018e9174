"""The elementwise kernels the layers call. CPU runs use the pure-torch references; the Triton
attention backend (and kernels) are selected by the model runner."""

from pagedserve_kernels.reference import (
    apply_rotary,
    fused_add_rms_norm,
    rms_norm,
    rotary_cos_sin,
    silu_and_mul,
)

__all__ = ["apply_rotary", "fused_add_rms_norm", "rms_norm", "rotary_cos_sin", "silu_and_mul"]
