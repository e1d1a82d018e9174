"""Chunked attention (Llama 4's rope layers, `attention_chunk_size` C): a query at position p sees
the keys of its own chunk alone, positions C * (p // C)..p.

No kernel learns of it. A chunk starts on a block boundary (C is a multiple of the block size), so
a chunk's keys are a run of its sequence's block table, and a query over them is an ordinary causal
query of a shorter sequence: the block table shifted by the blocks before the chunk, the context
counted from the chunk's start. A prefill whose tokens span several chunks becomes one such sequence
a chunk (vLLM's "virtual batches"):

    chunk 32, block 16: a prefill of positions 20..69 (50 tokens, context 70)
    blocks        |  b0  b1  |  b2  b3  |  b4  b5  |
    positions     0 ...   31  32 ...  63  64 ... 69
    sequences        20..31      32..63      64..69      query lens 12, 32, 6
                     ctx 32      ctx 32      ctx 6       tables [b0 b1], [b2 b3], [b4 b5]

A decode row stays one row (its table shifted, its context cut): derived on the device from the
step's metadata, with no host sync, so a CUDA graph captures it. Prefills are cut on the host, where
the model runner has their lengths (`chunk_prefills`). The cache is written as every layer writes
it: the step's slots are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ChunkedPrefills:
    """A step's prefills cut at chunk boundaries, each part a sequence of its own."""

    block_tables: torch.Tensor  # [parts, blocks] int32: each part's chunk's blocks
    query_start_loc: torch.Tensor  # [parts + 1] int32: the parts in the prefills' token order
    context_lens: torch.Tensor  # [parts] int32: counted from the part's chunk's start
    max_query_len: int


def chunk_prefills(
    starts: np.ndarray,
    query_lens: np.ndarray,
    tables: np.ndarray,
    chunk: int,
    block_size: int,
    device: torch.device,
) -> ChunkedPrefills:
    """Prefills of `query_lens` tokens from positions `starts`, over block-table rows `tables`, cut
    on the host into one part a chunk they cross, then copied to `device`."""
    ends = starts + query_lens
    first_chunks, last_chunks = starts // chunk, (ends - 1) // chunk
    counts = last_chunks - first_chunks + 1
    seq = np.repeat(np.arange(len(starts)), counts)
    nth = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    chunk_starts = (first_chunks[seq] + nth) * chunk
    part_starts = np.maximum(starts[seq], chunk_starts)
    part_ends = np.minimum(ends[seq], chunk_starts + chunk)
    context_lens = part_ends - chunk_starts
    query_start_loc = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(part_ends - part_starts, out=query_start_loc[1:])
    tables = _shifted(tables, seq, chunk_starts // block_size, int(context_lens.max()), block_size)
    return ChunkedPrefills(
        block_tables=torch.from_numpy(tables).to(device, torch.int32, non_blocking=True),
        query_start_loc=torch.from_numpy(query_start_loc).to(device, non_blocking=True),
        context_lens=torch.from_numpy(context_lens).to(device, torch.int32, non_blocking=True),
        max_query_len=int((part_ends - part_starts).max()),
    )


def _shifted(
    tables: np.ndarray, rows: np.ndarray, shifts: np.ndarray, max_context: int, block_size: int
) -> np.ndarray:
    """Row `rows[i]` of `tables` from block `shifts[i]` on, as many blocks as `max_context` tokens
    take (past a row's end its last id, which no context reaches)."""
    columns = shifts[:, None] + np.arange(-(-max_context // block_size))
    return tables[rows[:, None], np.minimum(columns, tables.shape[1] - 1)]


def chunk_decodes(
    block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int, chunk: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Decode rows' block tables and context lengths within their last token's chunk, and the
    longest context after the cut (on the device, no sync)."""
    chunk_starts = torch.div(context_lens - 1, chunk, rounding_mode="floor") * chunk
    max_context_len = min(max_context_len, chunk)
    blocks = torch.arange(-(-max_context_len // block_size), device=block_tables.device)
    columns = (chunk_starts // block_size).long()[:, None] + blocks
    tables = block_tables.gather(1, columns.clamp(max=block_tables.shape[1] - 1))
    return tables, (context_lens - chunk_starts).to(context_lens.dtype), max_context_len
