"""CPU tensors in transparent huge pages (2 MiB instead of 4 KiB), for the memory a step reads most:
the packed linear weights and the KV cache.

A decode step streams every packed weight (~270 MB for SmolLM2-135M) and reads KV blocks scattered
over the cache. On 4 KiB pages that is a TLB miss every 4 KiB, and a hardware prefetcher that stops
at each page's end. Where the kernel's transparent huge pages are `madvise` (a common default) torch's
allocator never asks for them, so these tensors live in private anonymous mappings advised
MADV_HUGEPAGE instead, aligned to 2 MiB. Where the kernel has no huge pages to give (`never`, or
none free) the same mappings hold 4 KiB pages and nothing else changes: the bytes are the same and
only their page size differs.

    zeros(shape, dtype)          a zero-filled tensor in a fresh mapping (the KV cache)
    copy_to_huge_pages(tensors)  contiguous copies of `tensors` in one shared mapping (packed weights)

The mapping is released with the last tensor viewing it (`torch.frombuffer` keeps it alive).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # where each copied tensor starts: aligned for any vector load
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel may back an advised mapping with huge pages (Linux, THP not `never`)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping advised MADV_HUGEPAGE, zero-filled, and the offset in it of its
    first 2 MiB boundary (only whole, aligned 2 MiB ranges can be huge pages)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return mapping, -address % HUGE_PAGE


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the CPU, in huge pages where `available` (else exactly
    torch.zeros). Every page is touched here, as torch.zeros does, so that no step waits on a page
    fault (a huge page's fault costs the kernel 2 MiB of zeroing, and may compact memory)."""
    count = math.prod(shape)
    if not available() or count == 0:  # (nothing to map: a model without attention's KV cache)
        return torch.zeros(shape, dtype=dtype)
    mapping, start = _mapping(count * dtype.itemsize)
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=start).view(shape).zero_()


def copy_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors` (strided CPU tensors) laid out one after another in one mapping
    in huge pages, each on a 4 KiB boundary of its own; `tensors` themselves where not `available`."""
    if not tensors or not available():
        return list(tensors)
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    mapping, start = _mapping(end)
    copies = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        copy = torch.frombuffer(mapping, dtype=tensor.dtype, count=tensor.numel(), offset=start + offset)
        copies.append(copy.view(tensor.shape).copy_(tensor))
    logger.debug("%d tensors (%.0f MB) copied into huge pages", len(tensors), end / 1e6)
    return copies
