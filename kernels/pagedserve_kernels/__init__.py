"""Triton kernels for pagedserve and their pure-torch references (`pagedserve_kernels.reference`).

The parameters of a `@triton.jit` function are annotated `tl.constexpr` (compile-time constants) or
`tl.tensor` (values traced at run time: pointers, scalars, blocks), an annotation Triton ignores; a
Python type such as `int` or `float` would not be ignored: Triton would pass that argument as int32
or float32 whatever its value.
"""
