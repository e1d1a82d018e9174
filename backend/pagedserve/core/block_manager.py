"""The KV block pool: free list and ref counts. The only thing it writes on a sequence is its block table."""

from __future__ import annotations

from collections import deque

from pagedserve.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Fixed-size blocks of `block_size` token slots.

    A sequence's block table covers its computed tokens plus the tokens scheduled this step:

        block_table  [ 7 | 2 | 9 ]        block_size = 4
        slots        [xxxx|xxxx|xx..]     a new block is taken only when the last one is full

    Admission of a waiting sequence keeps `watermark_blocks` free, so that running sequences can
    grow for a while before anything must be preempted.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def num_required_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers the computed tokens plus `num_new_tokens`."""
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` fits in the whole pool (alone, after preempting everyone)."""
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        required = self.num_required_blocks(seq, num_new_tokens)
        return self.num_free_blocks - required >= self.watermark_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Give a waiting sequence (no blocks yet) the blocks for its first `num_new_tokens` tokens."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        return self._grow(seq, num_new_tokens)

    def can_append_slot(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self.num_required_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slot(self, seq: Sequence, num_new_tokens: int = 1) -> list[int]:
        """Make room for `num_new_tokens` more tokens; returns the block ids added (often none)."""
        return self._grow(seq, num_new_tokens)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []

    def _grow(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        required = self.num_required_blocks(seq, num_new_tokens)
        if required > self.num_free_blocks:
            raise RuntimeError(
                f"out of KV blocks: {seq.request_id} needs {required}, {self.num_free_blocks} free"
            )
        new_block_ids = [self.free_block_ids.popleft() for _ in range(required)]
        for block_id in new_block_ids:
            self.ref_counts[block_id] = 1
        seq.block_table.extend(new_block_ids)
        return new_block_ids
