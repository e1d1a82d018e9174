"""Decode-only steps on a GPU replayed from CUDA graphs: one graph per bucket of batch size and
context length, captured the first time a step falls in it.

Eager, a decode step of a 1B Llama on an H200 took 8.5 ms for 2.0 ms of kernels: Python launched its
~320 kernels one by one. A graph launches them all in one call: the step (scheduling and sampling
included) took 2.1 / 3.0 / 3.9 / 6.3 ms at batch 1 / 16 / 64 / 128 with 1,024-token contexts, against
13.3 / 13.2 / 15.7 / 18.3 ms eager in the same run (bench/README.md, "Decode step").

A step's inputs are copied into static buffers, which every graph reads, padded to the bucket's batch
size: a padding row writes no K/V (slot -1) and attends to one token of its block-table row (whatever
ids that row holds name blocks of the cache), and its output is dropped. The context bucket (a power of
two, at least `MIN_CONTEXT_BUCKET` tokens) is the longest context a graph's attention launch is sized
for: the split-K grid of `pagedserve_kernels.attention.paged_attention_decode` is fixed at capture,
while each sequence's own length is read on the device.

    static buffers (max_num_seqs rows)      a step of 5 decodes in the (8, 512) graph
    input_ids / positions / slot_mapping    [ r0 r1 r2 r3 r4 | pad pad pad | unused ... ]
    context_lens                            [ .. real ..     | 1   1   1   | unused ... ]

Used on CUDA with the Triton attention backend, one rank and the eager forward pass, unless
--enforce-eager (`config.resolve_cuda_graphs`). Steps with prompt tokens, LoRA rows, or more decode
rows than max_num_seqs (speculative drafts) run the forward pass eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]  # a model's forward pass

# The shortest context bucket: one split of the decode kernel (its splits are at least 256 tokens).
MIN_CONTEXT_BUCKET = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for (vLLM's): 1, 2, 4, every multiple of 8, up to and
    including max_num_seqs."""
    small = [size for size in (1, 2, 4) if size < max_num_seqs]
    return [*small, *range(8, max_num_seqs, 8), max_num_seqs]


def padded_batch_size(num_decodes: int, sizes: list[int]) -> int:
    """The smallest of `sizes` (ascending) that holds `num_decodes` rows."""
    return sizes[bisect.bisect_left(sizes, num_decodes)]


def context_bucket(max_context_len: int, max_context: int) -> int:
    """The smallest power of two, at least `MIN_CONTEXT_BUCKET`, holding `max_context_len` tokens;
    at most `max_context` (what a block-table row holds)."""
    return min(max(MIN_CONTEXT_BUCKET, 1 << (max_context_len - 1).bit_length()), max_context)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the forward pass's output [batch, hidden], rewritten by every replay


class CudaGraphs:
    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
    ) -> None:
        self.forward = forward
        self.batch_sizes = capture_sizes(max_num_seqs)
        self.max_context = max_blocks_per_seq * block_size
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_num_seqs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_num_seqs, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (batch size, context bucket) -> its graph
        # the memory pool every graph shares, one running at a time (torch's opaque handle, a private type)
        self.pool: Any = None
        self.failed = False  # a capture failed: every step runs the forward pass from then on

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return not self.failed and metadata.num_prefills == 0 and metadata.num_decodes <= self.batch_sizes[-1]

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The final-normed hidden states [tokens, hidden] of a step whose tokens are all decodes
        (`can_run`). The tensor is the graph's output: valid until the next call."""
        num_decodes = metadata.num_decodes
        batch = padded_batch_size(num_decodes, self.batch_sizes)
        context = context_bucket(metadata.max_decode_context_len, self.max_context)
        self.fill(input_ids, positions, metadata, batch)
        graph = self.graphs.get((batch, context))
        if graph is None:
            try:
                graph = self.graphs[batch, context] = self._capture(batch, context)
            except Exception as exc:  # e.g. an op that cannot be captured: slower, but serving
                logger.warning("CUDA graph capture failed, decode steps run eagerly from now on: %s", exc)
                self.failed = True
                return self.forward(input_ids, positions, metadata)
        graph.graph.replay()
        return graph.hidden[:num_decodes]

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, batch: int
    ) -> None:
        """Copy the step into the static buffers and pad it to `batch` rows. Only the padding's slots
        and context lengths must be reset: a stale slot would overwrite another sequence's K/V, a stale
        length read up to a whole context. Its ids, positions and block ids may stay as they were."""
        num_decodes = metadata.num_decodes
        self.input_ids[:num_decodes].copy_(input_ids)
        self.positions[:num_decodes].copy_(positions)
        self.slot_mapping[:num_decodes].copy_(metadata.slot_mapping)
        tables = metadata.decode_block_tables
        self.block_tables[:num_decodes, : tables.shape[1]].copy_(tables)
        self.context_lens[:num_decodes].copy_(metadata.decode_context_lens)
        if batch > num_decodes:
            self.slot_mapping[num_decodes:batch].fill_(-1)
            self.context_lens[num_decodes:batch].fill_(1)

    def static_inputs(self, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The forward pass's inputs over the first `batch` rows of the static buffers, its attention
        sized for contexts of up to `context` tokens."""
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decodes=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_context_lens=self.context_lens[:batch],
            prefill_block_tables=self.block_tables[:0],
            prefill_query_start_loc=torch.zeros_like(self.context_lens[:1]),
            prefill_context_lens=self.context_lens[:0],
            max_decode_context_len=context,
        )
        return self.input_ids[:batch], self.positions[:batch], metadata

    def _capture(self, batch: int, context: int) -> _Graph:
        """Capture the forward pass over the static buffers (filled with the current step, so the
        eager run before it, which compiles the step's Triton kernels outside the capture, writes the
        same K/V as the replay that follows). The capture takes metadata of its own: what layers
        derive from it (chunked attention's views, `AttentionMetadata.chunk_local`) is then derived
        inside the graph, again at every replay, not kept from the eager run."""
        start = time.perf_counter()
        self.forward(*self.static_inputs(batch, context))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.forward(*self.static_inputs(batch, context))
        self.pool = graph.pool()
        logger.debug(
            "CUDA graph for decode steps of %d sequences, contexts up to %d tokens, captured in %.0f ms",
            batch,
            context,
            1000 * (time.perf_counter() - start),
        )
        return _Graph(graph, hidden)
