"""The prefix cache's changes as events (what a KV-aware router follows): blocks named when computed
(in runs, each with its parent hash and tokens), blocks evicted, none recorded while nobody listens,
and the hashes held when recording starts."""

from __future__ import annotations

import hashlib
from array import array

from pagedserve.core.block_manager import BlockManager, BlockRemoved, BlockStored
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=8))


def compute(bm: BlockManager, s: Sequence, num_tokens: int) -> None:
    """Allocate (with the prefix hits) and compute the first `num_tokens` tokens of `s` in one step."""
    hits = bm.match_prefix(s)
    bm.allocate(s, num_tokens - len(hits) * bm.block_size, hits)
    s.num_computed_tokens = num_tokens
    bm.cache_full_blocks(s)


def chain(tokens: list[int], block_size: int, root: bytes = b"") -> list[bytes]:
    """The documented hash: SHA-256 of the parent's digest and the block's tokens as int64 (the first
    block's parent: nothing, or for a LoRA adapter's requests `root`)."""
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", tokens[start : start + block_size]).tobytes()).digest()
        hashes.append(parent)
    return hashes


def test_nothing_is_recorded_until_recording_starts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=True)
    compute(bm, seq("a", list(range(9))), 9)
    assert bm.kv_events is None and bm.take_kv_events() == []
    assert bm.record_kv_events(True) == chain(list(range(9)), 4)  # what a new listener starts from
    assert bm.take_kv_events() == []


def test_named_blocks_come_as_one_run_per_sequence_with_parent_and_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=True)
    bm.record_kv_events(True)
    tokens = list(range(100, 110))  # 2 full blocks and 2 tokens
    a = seq("a", tokens)
    compute(bm, a, 6)  # block 0 full
    assert bm.take_kv_events() == [BlockStored(chain(tokens, 4)[:1], None, tokens[:4])]
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # block 1 full: its parent is block 0
    assert bm.take_kv_events() == [BlockStored(chain(tokens, 4)[1:2], chain(tokens, 4)[0], tokens[4:8])]
    # a second request hits block 0 and names a block of its own after it
    b = seq("b", tokens[:4] + [7, 7, 7, 7, 7])
    compute(bm, b, 9)
    assert bm.take_kv_events() == [BlockStored(chain(b.token_ids, 4)[1:2], chain(tokens, 4)[0], [7, 7, 7, 7])]
    assert bm.take_kv_events() == []  # taken


def test_a_block_computed_twice_is_named_once_and_splits_the_run() -> None:
    """Two requests with the same prompt admitted in one step compute the same blocks; the second's
    duplicates are not named (nor reported), and its own later block starts a run of its own."""
    bm = BlockManager(num_blocks=8, block_size=2, watermark=0.0, enable_prefix_caching=True)
    bm.record_kv_events(True)
    a, b = seq("a", [1, 2, 3, 4]), seq("b", [1, 2, 3, 4, 5, 6])
    bm.allocate(a, 4)
    bm.allocate(b, 6)  # no hits: nothing named yet
    a.num_computed_tokens, b.num_computed_tokens = 4, 6
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    hashes = chain([1, 2, 3, 4, 5, 6], 2)
    assert bm.take_kv_events() == [
        BlockStored(hashes[:2], None, [1, 2, 3, 4]),
        BlockStored(hashes[2:], hashes[1], [5, 6]),
    ]


def test_evictions_are_reported_once_in_a_run() -> None:
    bm = BlockManager(num_blocks=3, block_size=2, watermark=0.0, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    bm.free(a)  # blocks 0, 1 cached with ref count 0: still hit, not removed
    bm.record_kv_events(True)
    assert bm.take_kv_events() == []
    c = seq("c", [9, 9, 8, 8, 7, 7])
    bm.allocate(c, 6)  # 3 blocks: the free one and both cached ones, evicted (the tail first)
    hashes = chain([1, 2, 3, 4], 2)
    assert bm.take_kv_events() == [BlockRemoved([hashes[1], hashes[0]])]
    bm.record_kv_events(False)
    bm.free(c)
    assert bm.kv_events is None and bm.take_kv_events() == []


def test_a_lora_adapters_blocks_hash_from_its_root_and_name_it() -> None:
    """The same tokens through an adapter hold other KV: the first block's parent is SHA-256 of
    b"lora:" and the adapter's name, so they hash apart (no hits across adapters), and the stored
    event names the adapter for a router to do the same."""
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=True)
    bm.record_kv_events(True)
    tokens = list(range(100, 109))
    compute(bm, seq("base", tokens), 9)
    lora = Sequence("lora", tokens, SamplingParams(max_tokens=8), lora_name="sql")
    assert bm.match_prefix(lora) == []  # the base model's blocks are no hits for it
    compute(bm, lora, 9)
    root = hashlib.sha256(b"lora:sql").digest()
    assert bm.take_kv_events() == [
        BlockStored(chain(tokens, 4), None, tokens[:8]),
        BlockStored(chain(tokens, 4, root), None, tokens[:8], "sql"),
    ]
    again = Sequence("again", tokens, SamplingParams(max_tokens=8), lora_name="sql")
    assert len(bm.match_prefix(again)) == 2  # its own adapter's blocks are


def test_forgetting_an_adapter_evicts_its_blocks_alone() -> None:
    """Before an adapter is unloaded its cached blocks go (a router hears `removed`), the base model's
    and other adapters' stay, and the freed blocks are free again."""
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0, enable_prefix_caching=True)
    tokens = list(range(100, 109))
    runs = {}
    for name in (None, "sql", "chat"):
        s = Sequence(f"r-{name}", tokens, SamplingParams(max_tokens=8), lora_name=name)
        compute(bm, s, 9)
        bm.free(s)
        runs[name] = chain(tokens, 4, hashlib.sha256(f"lora:{name}".encode()).digest() if name else b"")
    bm.record_kv_events(True)
    free_before = len(bm.free_block_ids)
    bm.forget_lora("sql")
    assert bm.take_kv_events() == [BlockRemoved(runs["sql"])]
    assert len(bm.free_block_ids) == free_before + 2
    for name in (None, "chat"):
        again = Sequence(f"again-{name}", tokens, SamplingParams(max_tokens=8), lora_name=name)
        assert len(bm.match_prefix(again)) == 2, name
    assert bm.match_prefix(Sequence("again-sql", tokens, SamplingParams(max_tokens=8), lora_name="sql")) == []
