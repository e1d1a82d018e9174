"""Chunked attention's view of a step (`layers.chunked`): prefills cut into one sequence a chunk,
decode rows' tables shifted to their chunk. The engine-level checks against transformers are in
tests/engine/test_model_config_audit.py (Llama 4) and tests/kernels/test_backend_e2e.py (Triton)."""

from __future__ import annotations

import numpy as np
import torch
from pagedserve.layers.chunked import chunk_decodes, chunk_prefills

CPU = torch.device("cpu")


def test_a_prefill_across_chunks_becomes_a_sequence_a_chunk() -> None:
    """The module docstring's picture: chunk 32, blocks of 16, positions 20..69 (context 70); and
    beside it a prefill inside one chunk (positions 64..66, after a prefix of 64)."""
    tables = np.array([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]], dtype=np.int32)
    cut = chunk_prefills(np.array([20, 64]), np.array([50, 3]), tables, 32, 16, CPU)
    assert cut.query_start_loc.tolist() == [0, 12, 44, 50, 53]
    assert cut.context_lens.tolist() == [32, 32, 6, 3]
    assert cut.block_tables.tolist() == [[10, 11], [12, 13], [14, 15], [24, 25]]
    assert cut.max_query_len == 32
    assert cut.block_tables.dtype == cut.context_lens.dtype == cut.query_start_loc.dtype == torch.int32


def test_a_prefill_ending_on_a_chunks_last_position_takes_no_part_of_the_next() -> None:
    tables = np.arange(8, dtype=np.int32)[None]
    cut = chunk_prefills(np.array([0]), np.array([64]), tables, 32, 16, CPU)
    assert cut.query_start_loc.tolist() == [0, 32, 64]
    assert cut.context_lens.tolist() == [32, 32]
    assert cut.block_tables.tolist() == [[0, 1], [2, 3]]


def test_decode_rows_see_their_last_tokens_chunk() -> None:
    """Contexts 32 (the first chunk's last position), 33 (the second chunk's first) and 70."""
    tables = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], dtype=torch.int32)
    context_lens = torch.tensor([32, 33, 70], dtype=torch.int32)
    shifted, lens, longest = chunk_decodes(tables, context_lens, 70, 32, 16)
    assert lens.tolist() == [32, 1, 6] and lens.dtype == torch.int32
    assert longest == 32
    # (two blocks a row: as many as the longest cut context takes; past a row's end, its last id)
    assert shifted.tolist() == [[0, 1], [7, 8], [14, 14]]
