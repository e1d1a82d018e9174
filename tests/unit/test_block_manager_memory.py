"""Block manager memory mechanisms with tiny pools and exact ids: swap maps, copy-on-write after a
fork, prefix hits with ref counts, and LRU eviction order (once no block is free)."""

from __future__ import annotations

from pagedserve.core.block_manager import BlockManager
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence


def seq(request_id: str, tokens: list[int], computed: int = 0) -> Sequence:
    s = Sequence(request_id, tokens, SamplingParams(max_tokens=8))
    s.num_computed_tokens = computed
    return s


def test_swap_out_and_in_map_blocks_exactly() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, watermark=0.0, num_cpu_blocks=4)
    a = seq("a", list(range(10)))
    assert bm.allocate(a, 10) == [0, 1, 2]
    assert bm.can_swap_out(a)
    assert bm.swap_out(a) == [(0, 0), (1, 1), (2, 2)]
    assert a.block_table == [] and bm.num_free_blocks == 6 and bm.num_free_cpu_blocks == 1
    assert bm.cpu_block_tables == {"a": [0, 1, 2]}
    b = seq("b", list(range(8)))
    assert bm.allocate(b, 8) == [0, 1]  # the whole pool is free: b starts at its start
    a.num_computed_tokens = 10
    assert bm.can_swap_in(a, 1) and not bm.can_swap_in(a, 7)
    # a comes back elsewhere, in the run after b's (2..5: shorter than the 5 blocks a may grow to)
    assert bm.swap_in(a) == [(0, 2), (1, 3), (2, 4)]
    assert a.block_table == [2, 3, 4] and bm.num_free_cpu_blocks == 4 and bm.cpu_block_tables == {}


def test_swap_out_needs_room_in_the_cpu_pool() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, watermark=0.0, num_cpu_blocks=2)
    a = seq("a", list(range(10)))
    bm.allocate(a, 10)
    assert not bm.can_swap_out(a)  # 3 blocks, 2 CPU blocks
    bm.free(a)
    assert bm.num_free_blocks == 6


def test_fork_shares_blocks_and_copy_on_write_gives_private_copies() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    parent = seq("p", list(range(6)))
    bm.allocate(parent, 6)  # [0, 1]: block 1 holds 2 of 4 tokens
    parent.num_computed_tokens = 6
    child = seq("c", list(range(6)), computed=5)
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and bm.ref_counts[:2] == [2, 2]
    # the child rewrites position 5, inside shared block 1: a copy is needed first
    assert bm.num_required_blocks(child, 1) == 1
    assert bm.append_slot(child, 1) == []
    # the copy starts the child's own run (3 blocks at most from index 1) in the free 2..7, centred
    assert child.block_table == [0, 3] and bm.blocks_to_copy == [(1, 3)]
    assert bm.ref_counts[:4] == [2, 1, 0, 1]
    # the parent now owns block 1 alone and writes in place
    assert bm.append_slot(parent, 1) == [] and parent.block_table == [0, 1] and bm.blocks_to_copy == [(1, 3)]
    bm.free(child)
    bm.free(parent)
    assert bm.ref_counts == [0] * 8 and bm.num_free_blocks == 8


def test_prefix_hits_share_full_blocks_and_keep_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=True)
    a = seq("a", list(range(10)))
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full: cached
    assert set(bm.cached_block_ids.values()) == {0, 1}
    b = seq("b", list(range(8)) + [99, 98, 97])
    assert bm.match_prefix(b) == [0, 1]
    assert bm.can_allocate(b, 3, [0, 1])
    # block 2, after the hits, is a's: b's own blocks start a run in the free 3..7, centred for the 3
    # blocks b may grow to
    assert bm.allocate(b, 3, [0, 1]) == [0, 1, 4]
    assert bm.ref_counts[:5] == [2, 2, 1, 0, 1]
    c = seq("c", list(range(8)))  # 8 tokens = exactly 2 blocks: the last block is recomputed
    assert bm.match_prefix(c) == [0]
    # counted per admitted sequence (a: 10 tokens, b: 11), not per lookup (c is never allocated)
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10 + 11, 8)


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0.0, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a, 5)  # [0, 1, 2]
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)  # blocks 0, 1 cached; block 2 (partial) not
    bm.free(a)
    assert list(bm.free_block_ids) == [3, 2] and list(bm.evictor) == [1, 0]
    b = seq("b", [7, 8, 9, 10, 11, 12])
    assert bm.match_prefix(b) == []
    bm.allocate(b, 6)  # takes the uncached 2 and 3 first (a run), then evicts 1 (freed before 0)
    assert b.block_table == [2, 3, 1] and list(bm.evictor) == [0]
    assert 1 not in bm.cached_block_ids.values() and bm.block_hashes[1] is None
    c = seq("c", [1, 2, 3, 4, 5])
    assert bm.match_prefix(c) == [0]  # block 0 is still cached; block 1's hash is gone


def test_a_hit_on_an_idle_cached_block_takes_it_out_of_the_evictor() -> None:
    bm = BlockManager(num_blocks=3, block_size=2, watermark=0.0, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3])
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    bm.free(a)
    assert bm.num_free_blocks == 3 and list(bm.evictor) == [0]
    b = seq("b", [1, 2, 5])
    hits = bm.match_prefix(b)
    assert hits == [0] and bm.num_required_blocks(b, 1, hits) == 2  # one new, one taken from the evictor
    bm.allocate(b, 1, hits)  # after the hit, its free neighbour (a's partial block, never cached)
    assert b.block_table == [0, 1] and bm.ref_counts == [1, 1, 0] and not bm.evictor
