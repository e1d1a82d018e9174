"""Block manager basics with tiny pools and exact ids: where blocks are placed (ascending runs),
append_slot taking a block only when the last one is full, ref counts, the watermark at its exact
boundary, and prefix-cache hashes."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from pagedserve.core.block_manager import BlockManager
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence


def seq(request_id: str, tokens: list[int], computed: int = 0, max_tokens: int = 8) -> Sequence:
    s = Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens))
    s.num_computed_tokens = computed
    return s


def test_a_sequence_continues_at_the_block_after_its_last_and_frees_blocks_back_to_the_pool() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, watermark=0.0)
    a, b = seq("a", list(range(10))), seq("b", list(range(3)))
    assert bm.allocate(a, 10) == [0, 1, 2]  # an empty pool: from its start, ascending
    assert bm.allocate(b, 3) == [3]  # the free run 3..5 holds the 3 blocks b may grow to: its start
    assert sorted(bm.free_block_ids) == [4, 5] and bm.ref_counts == [1, 1, 1, 1, 0, 0]
    bm.free(a)
    assert a.block_table == [] and sorted(bm.free_block_ids) == [0, 1, 2, 4, 5]
    assert bm.ref_counts == [0, 0, 0, 1, 0, 0] and (bm.num_free_blocks, bm.num_used_blocks) == (5, 1)
    c = seq("c", list(range(12)))  # 3 blocks now, 5 at most: no run holds 5, the longest is 0..2
    assert bm.allocate(c, 12) == [0, 1, 2] and sorted(bm.free_block_ids) == [4, 5]
    b.num_computed_tokens = 3
    assert bm.append_slot(b, 2) == [4]  # block 3's successor is free: b's run goes on
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0]


def test_a_new_run_starts_in_the_shortest_free_run_that_holds_it_centred() -> None:
    bm = BlockManager(num_blocks=20, block_size=4, watermark=0.0)
    holders = [seq(f"h{i}", [i], max_tokens=1) for i in range(20)]
    for h in holders:
        bm.allocate(h, 1)
    by_block = {h.block_table[0]: h for h in holders}
    assert sorted(by_block) == list(range(20))
    for block_id in [2, 3, 4, *range(8, 14)]:  # free runs 2..4 (3 blocks) and 8..13 (6 blocks)
        bm.free(by_block[block_id])
    # 2 blocks now, 3 at most (8 + 5 tokens, the last never run): 2..4 holds them exactly
    assert bm.allocate(seq("a", list(range(8)), max_tokens=5), 8) == [2, 3]
    # 4 at most: only 8..13 holds them; centred, 1 block is left on either side
    d = seq("d", list(range(8)), max_tokens=9)
    assert bm.allocate(d, 8) == [9, 10]
    d.num_computed_tokens = 8
    assert bm.append_slot(d, 1) == [11]  # and it grows into its own run
    # 20 at most: nothing holds that, so the longest run left (12..13), from its start
    assert bm.allocate(seq("e", list(range(4)), max_tokens=76), 4) == [12]


def test_without_find_room_a_new_run_starts_at_the_block_freed_first() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, find_room=False)
    a, b = seq("a", list(range(8))), seq("b", list(range(8)))
    assert bm.allocate(a, 8) == [0, 1] and bm.allocate(b, 8) == [2, 3]  # no room left for a to grow
    bm.free(a)  # free, in the order freed: 4 .. 7, then 1, 0 (the tail first)
    c = seq("c", list(range(4)), max_tokens=4)  # 2 blocks at most: 0..1 would hold them exactly
    assert bm.allocate(c, 4) == [4]  # but it takes the oldest free block
    c.num_computed_tokens = 4
    assert bm.append_slot(c, 1) == [5]  # runs still go on where the next block is free
    b.num_computed_tokens = 8
    assert bm.append_slot(b, 1) == [6]  # b's next block (4) is c's: the oldest free one


def test_free_blocks_are_taken_before_any_cached_block_is_evicted() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, watermark=0.0, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4])
    bm.allocate(a, 4)  # [0, 1]
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    b = seq("b", [9, 9], max_tokens=20)
    assert bm.allocate(b, 2) == [2]  # the run 2..5 cannot hold b's 11 blocks: its start
    bm.free(a)  # 0 and 1 idle and cached
    c = seq("c", [5, 6, 7, 8, 9, 10, 11, 12])
    # 3 .. 5 are free and taken first, in a run; then 1 is evicted (freed after 0, tail first)
    assert bm.allocate(c, 8) == [3, 4, 5, 1] and list(bm.evictor) == [0]
    assert bm.match_prefix(seq("again", [1, 2, 3, 4, 0])) == [0]  # a's first block still hits


def test_append_slot_takes_a_new_block_only_when_the_last_one_is_full() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0.0)
    a = seq("a", [5, 6, 7])
    assert bm.allocate(a, 3) == [0]  # slots 0..2 of block 0
    added = []
    for computed in range(3, 9):  # decode one token at a time: slots 3 .. 8
        a.num_computed_tokens = computed
        a.append_token(9)
        added.append(bm.append_slot(a, 1))
    # slot 3 ends block 0; slot 4 opens block 1; slot 8 opens block 2
    assert added == [[], [1], [], [], [], [2]]
    assert a.block_table == [0, 1, 2] and bm.ref_counts == [1, 1, 1, 0]
    a.num_computed_tokens = 9  # a chunk of 7 tokens (slots 9 .. 15) fills block 2 and needs block 3
    assert bm.num_required_blocks(a, 7) == 1 and bm.append_slot(a, 7) == [3]
    assert a.block_table == [0, 1, 2, 3] and bm.ref_counts == [1, 1, 1, 1] and bm.num_free_blocks == 0
    a.num_computed_tokens = 16
    assert bm.can_append_slot(a, 0) and not bm.can_append_slot(a, 1)  # slot 16 would need a 5th block
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.append_slot(a, 1)


def test_admission_keeps_the_watermark_free_to_the_exact_block() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.1)  # 1 block kept free
    assert bm.watermark_blocks == 1 and bm.max_num_blocks_per_seq == 9
    assert bm.can_allocate(seq("x", list(range(36))), 36)  # 9 blocks: 10 - 9 == 1 left
    assert not bm.can_allocate(seq("x", list(range(37))), 37)  # 10 blocks: the whole pool
    other = seq("o", [1, 2, 3])
    bm.allocate(other, 3)  # 9 free now
    assert bm.can_allocate(seq("x", list(range(32))), 32)  # 8 blocks: 9 - 8 == 1
    assert not bm.can_allocate(seq("x", list(range(33))), 33)  # 9 blocks would fit but eat the watermark
    assert bm.can_append_slot(other, 30)  # a running sequence may grow into the watermark


def test_swap_in_keeps_the_watermark_free_to_the_exact_block() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.1, num_cpu_blocks=10)
    a = seq("a", list(range(33)), computed=32)  # 32 computed tokens, 1 to run: 9 blocks to resume
    bm.allocate(a, 32)
    assert bm.swap_out(a) == [(i, i) for i in range(8)]
    other = seq("o", [1])
    bm.allocate(other, 1)  # 9 free: a would fit, but only by taking the watermark
    assert not bm.can_swap_in(a, 1) and bm.can_swap_in(a, 0)  # 8 blocks: 9 - 8 == 1
    bm.free(other)
    assert bm.can_swap_in(a, 1)  # 10 - 9 == 1
    assert bm.swap_in(a) == list(zip(range(8), range(8)))  # an empty pool: from its start
    assert bm.append_slot(a, 1) == [8] and list(bm.free_block_ids) == [9]


def test_can_ever_fit_is_the_pool_less_the_watermark_and_counts_no_slot_for_the_last_token() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.1)
    # a sequence growing to 37 tokens runs 36 of them (the 37th is sampled, never cached): 9 blocks
    assert bm.num_blocks_to_hold(37) == 9 and bm.can_ever_fit(37) and not bm.can_ever_fit(38)
    no_watermark = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
    assert no_watermark.can_ever_fit(41) and not no_watermark.can_ever_fit(42)


def test_prefix_hashes_hit_equal_prefixes_and_miss_at_the_first_different_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, watermark=0.0, enable_prefix_caching=True)
    tokens = list(range(100, 113))  # 13 tokens: 3 full blocks
    a = seq("a", tokens)
    bm.allocate(a, 13)
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    assert [bm.cached_block_ids[h] for h in bm.seq_hashes["a"]] == [0, 1, 2]
    assert bm.match_prefix(seq("same", tokens[:12] + [7])) == [0, 1, 2]
    assert bm.match_prefix(seq("at-8", tokens[:8] + [7, 7, 7, 7, 7])) == [0, 1]  # first token of block 2
    assert bm.match_prefix(seq("at-7", tokens[:7] + [7] * 6)) == [0]  # last token of block 1
    assert bm.match_prefix(seq("at-0", [7] + tokens[1:])) == []  # a later block equal, its prefix not
    assert bm.num_prefix_queries == 13 and bm.num_prefix_hits == 0  # lookups count only when allocated


def test_reset_prefix_cache_forgets_the_blocks_no_sequence_holds() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=True)
    done, running = seq("done", list(range(100, 109))), seq("running", list(range(200, 208)))
    for s in (done, running):
        bm.allocate(s, len(s.token_ids))
        s.num_computed_tokens = len(s.token_ids)
        bm.cache_full_blocks(s)
    bm.free(done)  # its two full blocks wait in the evictor, named; its partial block is free
    assert bm.match_prefix(seq("again", list(range(100, 109)))) == [0, 1]
    bm.record_kv_events(True)
    assert bm.reset_prefix_cache() == 2
    assert bm.match_prefix(seq("again", list(range(100, 109)))) == []
    assert bm.match_prefix(seq("running too", list(range(200, 208)) + [1])) == [3, 4]  # still held
    assert (
        len(bm.evictor) == 0 and bm.num_free_blocks == 6 and sorted(bm.free_block_ids) == [0, 1, 2, 5, 6, 7]
    )
    removed = bm.take_kv_events()
    assert [type(e).__name__ for e in removed] == ["BlockRemoved"] and len(removed[0].block_hashes) == 2  # type: ignore[attr-defined]
    assert bm.reset_prefix_cache() == 0


def test_prefix_hashes_are_sha256_of_the_parent_digest_and_the_tokens() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0.0, enable_prefix_caching=True)
    first = hashlib.sha256(array("q", [3, 4]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", [5, 6]).tobytes()).digest()
    assert list(bm._block_hashes(None, [3, 4, 5, 6, 7], 0, 2)) == [first, second]


def test_tokens_whose_python_hashes_collide_do_not_share_blocks() -> None:
    # hash(2**61 - 1) == hash(0) in CPython: hash(tuple) would name both blocks alike and serve one
    # request the other's KV. Token ids are only checked against the vocabulary above this layer.
    crafted = [2**61 - 1, 1, 2, 3]
    assert hash((None, tuple(crafted))) == hash((None, (0, 1, 2, 3)))
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0.0, enable_prefix_caching=True)
    victim = seq("victim", [0, 1, 2, 3, 4])
    bm.allocate(victim, 5)
    victim.num_computed_tokens = 5
    bm.cache_full_blocks(victim)
    assert bm.match_prefix(seq("attacker", [*crafted, 4])) == []
    assert bm.match_prefix(seq("same", [0, 1, 2, 3, 9])) == [0]
