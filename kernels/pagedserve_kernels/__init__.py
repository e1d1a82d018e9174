"""Triton kernels for pagedserve and their pure-torch references (`pagedserve_kernels.reference`)."""
