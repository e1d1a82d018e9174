"""The KV block pools (device and CPU): free lists, ref counts, prefix hashes and swap maps.
The only thing it writes on a sequence is its block table."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from pagedserve.sequence import Sequence


@dataclass
class BlockStored:
    """Blocks named in the prefix cache: consecutive blocks of one sequence, the first one's parent
    being `parent_block_hash` (None: the first block of a prompt), with their tokens, computed through
    the LoRA adapter `lora_name` (None: the base model; see `lora_root_hash`)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    """Blocks evicted from the prefix cache: no request hits them any more."""

    block_hashes: list[bytes]


KvEvent = BlockStored | BlockRemoved


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Fixed-size blocks of `block_size` token slots.

    A sequence's block table covers its computed tokens plus the tokens scheduled this step:

        block_table  [ 7 | 2 | 9 ]        block_size = 4
        slots        [xxxx|xxxx|xx..]     a new block is taken only when the last one is full

    Admission of a waiting sequence (and swap-in) keeps `watermark_blocks` free, so that running
    sequences can grow for a while before anything must be preempted. It does so even in an otherwise
    empty pool, so one sequence may hold at most `max_num_blocks_per_seq` blocks; `can_ever_fit` is the
    matching test at arrival, and a sequence that passes it is always admitted once the pool is empty.

    Prefix caching: a full block is named by a SHA-256 of its tokens and of the blocks before it, so
    identical prefixes share blocks (ref counts). The hash is cryptographic because a collision would
    serve one request another's KV, and Python's hash() of a tuple can be collided on purpose. A cached
    block whose ref count drops to 0 goes to an LRU evictor; it is reused on a hit, or evicted (its hash
    forgotten, so it is never read as cached again) when a fresh block is needed and no uncached block
    is free.

    Blocks filled within a step are shared within it: every layer writes the whole batch's K/V
    before any token attends, so a request admitted after another in the same step can read the
    prefix the other computes in that step (vLLM's scheduler does the same). `note_filling` offers
    such blocks to `match_prefix` until the next step is scheduled; they are named in the cache only
    by `cache_full_blocks` once the step has run, so a failed step leaves no name on a block it never
    wrote.

    Placement: a sequence's next block is the one after its last where that is free, so its blocks
    lie in ascending runs, which CPU decode attention reads as one stream (~30% faster than scattered
    blocks: the hardware prefetchers follow a run, bench/README.md). A sequence that cannot continue
    (a new one, or one whose next block is taken) starts a new run in the shortest run of free blocks
    that holds what it may grow to (`_room_for`). That search reads the whole pool (13-19 us for
    6,000 blocks, up to ~0.3 ms for 170,000) and is measured to pay only on CPUs, so with `find_room`
    off a new run starts at the free block freed first. Free blocks are used before any cached block
    is evicted, and eviction keeps its LRU order: placement never costs the prefix cache a hit. So
    with the prefix cache full of idle blocks (every block named, as on a long busy run) the blocks
    come in eviction order and runs are short.

    Sharing a partly filled block (after a fork) is copy-on-write: the first sequence to write into
    it gets a copy, recorded in `blocks_to_copy` for the cache engine to perform before the step.
    Workers learn a running sequence's table only by additions, so only a sequence announced anew
    in that step (its whole table sent) may be the one to copy: the scheduler's forks see to that.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        find_room: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # free and not cached
        # 1 where a block is in free_block_ids, at index block id + 1, between two 0s: its runs of 1s are
        # the runs of free blocks (see _room_for)
        self._free_map = np.zeros(num_blocks + 2, dtype=np.int8)
        self._free_map[1:-1] = 1
        self.find_room = find_room
        self.ref_counts = [0] * num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.evictor: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached, ref count 0; least recently freed first
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached_block_ids: dict[bytes, int] = {}  # block hash -> block id
        self.seq_hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its leading full blocks
        self.filling_block_ids: dict[bytes, int] = {}  # block hash -> block id, filled by this step
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_block_ids: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_block_tables: dict[str, list[int]] = {}  # swapped-out request id -> its CPU blocks
        self.blocks_to_copy: list[tuple[int, int]] = []  # copy-on-write work for the next step
        self.num_prefix_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found
        # the prefix cache's changes since last taken, recorded only while someone listens (a router
        # tracking which replica holds which prefix): see record_kv_events
        self.kv_events: list[KvEvent] | None = None
        self.lora_block_names: dict[bytes, str] = {}  # cached LoRA blocks' hashes -> their adapter

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictor)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.free_cpu_block_ids)

    @property
    def max_num_blocks_per_seq(self) -> int:
        """Blocks one sequence may ever hold: admission and swap-in keep the watermark free even when
        nothing else runs, so a sequence needing more would be accepted but never admitted."""
        return self.num_blocks - self.watermark_blocks

    def num_blocks_to_hold(self, max_num_tokens: int) -> int:
        """Blocks a sequence that grows to `max_num_tokens` tokens needs at most. Its last token is
        sampled and never run through the model, so it never takes a KV slot."""
        return cdiv(max_num_tokens - 1, self.block_size)

    def can_ever_fit(self, max_num_tokens: int) -> bool:
        """Whether a sequence growing to `max_num_tokens` tokens can run alone in the pool: then it is
        admitted (or swapped back in) at the latest when everything else has finished."""
        return self.num_blocks_to_hold(max_num_tokens) <= self.max_num_blocks_per_seq

    # -- admission of waiting sequences ------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s leading full blocks. At least the last token is left to
        compute, so the model still produces the logits to sample from. Counted as a query only
        when `allocate` takes the hits: a sequence may be looked up on many steps before it fits.
        None for a sequence asking for prompt logprobs, or for an embedding that is the mean over its
        prompt: every prompt position must run (as in vLLM); it still fills the cache for others."""
        if not self.enable_prefix_caching or _runs_every_prompt_position(seq):
            return []
        hits: list[int] = []
        num_blocks = (seq.num_tokens - 1) // self.block_size
        for block_hash in self._block_hashes(lora_root_hash(seq.lora_name), seq.token_ids, 0, num_blocks):
            block_id = self.cached_block_ids.get(block_hash, self.filling_block_ids.get(block_hash))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_required_blocks(self, seq: Sequence, num_new_tokens: int, cached_block_ids: Seq[int] = ()) -> int:
        """Free blocks consumed to cover the computed tokens (or the cached prefix) plus
        `num_new_tokens`: new blocks, plus cached hits now idle in the evictor, plus a
        copy-on-write block when the first slot to write lands in a shared block."""
        if cached_block_ids:
            new = cdiv(len(cached_block_ids) * self.block_size + num_new_tokens, self.block_size)
            return new - len(cached_block_ids) + sum(1 for b in cached_block_ids if self.ref_counts[b] == 0)
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table)) + int(self._needs_copy_on_write(seq))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: Seq[int] = ()) -> bool:
        required = self.num_required_blocks(seq, num_new_tokens, cached_block_ids)
        return self.num_free_blocks - required >= self.watermark_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: Seq[int] = ()) -> list[int]:
        """Give a waiting sequence (no blocks yet) its cached prefix blocks and fresh blocks for
        `num_new_tokens` after them. Returns the whole new block table."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        for block_id in cached_block_ids:
            if self.ref_counts[block_id] == 0:
                del self.evictor[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = list(cached_block_ids)
        num_tokens = len(cached_block_ids) * self.block_size + num_new_tokens
        self._take(seq, cdiv(num_tokens, self.block_size) - len(seq.block_table))
        if cached_block_ids:  # the hits may still be filling, unnamed: hash the tokens again
            self.seq_hashes[seq.request_id] = list(
                self._block_hashes(lora_root_hash(seq.lora_name), seq.token_ids, 0, len(cached_block_ids))
            )
        if self.enable_prefix_caching:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += len(cached_block_ids) * self.block_size
        return list(seq.block_table)

    # -- running sequences ---------------------------------------------------------------------------

    def can_append_slot(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self.num_required_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slot(self, seq: Sequence, num_new_tokens: int = 1) -> list[int]:
        """Make room for `num_new_tokens` more tokens; returns the block ids added (often none).
        A shared last block is first replaced by a private copy (copy-on-write)."""
        if self._needs_copy_on_write(seq):
            self._copy_on_write(seq)
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return self._take(seq, max(0, needed - len(seq.block_table)))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares the blocks of `parent` that hold its `num_computed_tokens` tokens (the
        child's tokens must start with the parent's)."""
        assert not child.block_table and child.num_computed_tokens <= parent.num_computed_tokens
        shared = parent.block_table[: cdiv(child.num_computed_tokens, self.block_size)]
        for block_id in shared:
            self.ref_counts[block_id] += 1
        child.block_table = list(shared)
        if parent.request_id in self.seq_hashes:
            self.seq_hashes[child.request_id] = self.seq_hashes[parent.request_id][: len(shared)]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks that just became full of computed tokens, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes.setdefault(seq.request_id, [])
        stored: BlockStored | None = None  # this call's run of newly named blocks, for kv_events
        for block_id, block_hash in self._unnamed_full_blocks(seq, hashes, seq.num_computed_tokens):
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash)
            if block_hash in self.cached_block_ids or self.block_hashes[block_id] is not None:
                stored = None  # named already (another request computed it too): a run ends here
                continue
            self.cached_block_ids[block_hash] = block_id
            self.block_hashes[block_id] = block_hash
            if seq.lora_name is not None:
                self.lora_block_names[block_hash] = seq.lora_name
            if self.kv_events is not None:
                if stored is None:
                    stored = BlockStored([], parent, [], seq.lora_name)
                    self.kv_events.append(stored)
                index = len(hashes) - 1
                stored.block_hashes.append(block_hash)
                stored.token_ids += seq.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def note_filling(self, seq: Sequence, num_new_tokens: int) -> None:
        """Offer the full blocks `seq` is scheduled to fill this step to requests admitted after it."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes.get(seq.request_id, [])
        for block_id, block_hash in self._unnamed_full_blocks(
            seq, hashes, seq.num_computed_tokens + num_new_tokens
        ):
            self.filling_block_ids.setdefault(block_hash, block_id)

    def forget_filling(self) -> None:
        """A new step: last step's blocks are computed (and named) or were never written."""
        self.filling_block_ids.clear()

    def free(self, seq: Sequence) -> None:
        """Release a sequence's device blocks (cached ones to the evictor) and any CPU blocks."""
        for block_id in reversed(seq.block_table):  # the tail first: it is evicted before the prefix
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self._add_free(block_id)
                else:
                    self.evictor[block_id] = None
        seq.block_table = []
        self.seq_hashes.pop(seq.request_id, None)
        self.free_cpu_block_ids.extend(self.cpu_block_tables.pop(seq.request_id, []))

    # -- swap ------------------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(seq.block_table) <= len(self.free_cpu_block_ids)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move a sequence's blocks to the CPU pool; returns (device block, CPU block) pairs."""
        cpu_block_ids = [self.free_cpu_block_ids.popleft() for _ in seq.block_table]
        mapping = list(zip(seq.block_table, cpu_block_ids))
        self.free(seq)
        self.cpu_block_tables[seq.request_id] = cpu_block_ids
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_blocks = len(self.cpu_block_tables[seq.request_id])
        needed = max(num_blocks, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        return self.num_free_blocks - needed >= self.watermark_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back into fresh device blocks; returns (CPU, device) pairs."""
        cpu_block_ids = self.cpu_block_tables.pop(seq.request_id)
        self._take(seq, len(cpu_block_ids))
        self.free_cpu_block_ids.extend(cpu_block_ids)
        return list(zip(cpu_block_ids, seq.block_table))

    # -- helpers -------------------------------------------------------------------------------------

    def _take(self, seq: Sequence, num_blocks: int) -> list[int]:
        if not num_blocks:  # most decode steps of most sequences
            return []
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"out of KV blocks: {seq.request_id} needs {num_blocks}, {self.num_free_blocks} free"
            )
        # the table's length at most: now, or when the sequence runs to max_tokens
        final_length = max(len(seq.block_table) + num_blocks, self.num_blocks_to_hold(seq.max_num_tokens))
        for _ in range(num_blocks):
            last = seq.block_table[-1] if seq.block_table else None
            block_id = self._pop_free_block(last, final_length - len(seq.block_table))
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        return seq.block_table[len(seq.block_table) - num_blocks :]

    def _pop_free_block(self, after: int | None, num_expected: int) -> int:
        """A block to follow block `after` in a table, for a sequence expected to need `num_expected`
        more blocks (this one included). A free block if there is one: block `after` + 1 where that is
        free, else the start of a new run. Only when no block is free is a cached one evicted, the
        least recently freed."""
        if not self.free_block_ids:
            block_id, _ = self.evictor.popitem(last=False)  # evict: forget its hash first
            self._forget_hash(block_id)
            return block_id
        block_id = -1 if after is None else after + 1
        if not (0 <= block_id < self.num_blocks and self._free_map[block_id + 1]):
            block_id = self._room_for(num_expected) if self.find_room else next(iter(self.free_block_ids))
        del self.free_block_ids[block_id]
        self._free_map[block_id + 1] = 0
        return block_id

    def _room_for(self, num_expected: int) -> int:
        """The free block where a new run of blocks starts, for a sequence expected to need
        `num_expected` of them: in the shortest run of free blocks that holds them all (else in the
        longest), centred, so that a sequence ending just before the run can grow into it as well;
        at the run's start where it begins the pool or is too short (nothing else grows into it)."""
        edges = np.diff(self._free_map)
        starts = np.flatnonzero(edges == 1)  # the runs' first blocks
        lengths = np.flatnonzero(edges == -1) - starts
        fits = np.flatnonzero(lengths >= num_expected)
        chosen = int(fits[np.argmin(lengths[fits])]) if len(fits) else int(np.argmax(lengths))
        start, length = int(starts[chosen]), int(lengths[chosen])
        return start if start == 0 else start + max(0, length - num_expected) // 2

    def _add_free(self, block_id: int) -> None:
        self.free_block_ids[block_id] = None
        self._free_map[block_id + 1] = 1

    def _forget_hash(self, block_id: int) -> None:
        """Unname a cached block (no request holds it): no request hits it any more."""
        block_hash = self.block_hashes[block_id]
        assert block_hash is not None  # only named blocks wait in the evictor
        del self.cached_block_ids[block_hash]
        self.block_hashes[block_id] = None
        self.lora_block_names.pop(block_hash, None)
        if self.kv_events is not None:
            last = self.kv_events[-1] if self.kv_events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(block_hash)
            else:
                self.kv_events.append(BlockRemoved([block_hash]))

    def forget_lora(self, lora_name: str) -> None:
        """Evict every cached block an adapter computed, before it is unloaded: an adapter loaded later
        under its name hashes the same tokens alike, and must not read this one's KV. No request may
        hold such a block (none runs through the adapter)."""
        for block_hash in [h for h, name in self.lora_block_names.items() if name == lora_name]:
            block_id = self.cached_block_ids[block_hash]
            assert self.ref_counts[block_id] == 0, f"block {block_id} of LoRA {lora_name!r} is in use"
            del self.evictor[block_id]
            self._forget_hash(block_id)
            self._add_free(block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no sequence holds, as eviction would: later requests compute
        those prefixes afresh (benchmarks repeating a workload; a changed model). Blocks running
        sequences hold keep their names: the engine resets only when nothing runs. Returns how many
        blocks were forgotten."""
        forgotten = list(self.evictor)
        self.evictor.clear()
        for block_id in forgotten:
            self._forget_hash(block_id)
            self._add_free(block_id)
        return len(forgotten)

    # -- KV events -------------------------------------------------------------------------------------

    def record_kv_events(self, on: bool) -> list[bytes]:
        """Start (or stop) recording the prefix cache's changes; the hashes it holds now, the state the
        recorded events apply to (nothing is recorded while nobody listens)."""
        self.kv_events = [] if on else None
        return list(self.cached_block_ids)

    def take_kv_events(self) -> list[KvEvent]:
        """The changes recorded since the last call (none when not recording), oldest first."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        shared = seq.block_table[index]
        num_expected = max(1, self.num_blocks_to_hold(seq.max_num_tokens) - index)  # this one and after
        private = self._pop_free_block(seq.block_table[index - 1] if index else None, num_expected)
        self.ref_counts[shared] -= 1
        self.ref_counts[private] = 1
        seq.block_table[index] = private
        self.blocks_to_copy.append((shared, private))

    def _unnamed_full_blocks(
        self, seq: Sequence, hashes: list[bytes], num_tokens: int
    ) -> list[tuple[int, bytes]]:
        """(block id, hash) of `seq`'s blocks full within its first `num_tokens` tokens, after the
        leading blocks `hashes` already names."""
        start, parent = len(hashes), hashes[-1] if hashes else lora_root_hash(seq.lora_name)
        block_hashes = self._block_hashes(parent, seq.token_ids, start, num_tokens // self.block_size)
        return [(seq.block_table[index], h) for index, h in enumerate(block_hashes, start=start)]

    def _block_hashes(
        self, parent: bytes | None, token_ids: list[int], start: int, stop: int
    ) -> Iterator[bytes]:
        """Hashes of full blocks `start .. stop - 1`, `parent` being the hash of block `start - 1`.

        Each is the SHA-256 of its parent's 32-byte digest (for block 0: `lora_root_hash`) followed by its
        token ids as 8-byte little-endian integers: fixed widths, so distinct (parent, tokens) never
        encode alike; a router hashes a prompt the same way to follow the cache (KV events). The tokens
        are encoded once for the whole range; hashing costs ~1 us per block."""
        width = 8 * self.block_size
        tokens = array("q", token_ids[start * self.block_size : stop * self.block_size])
        if sys.byteorder == "big":
            tokens.byteswap()
        data = tokens.tobytes()
        block_hash = parent or b""
        for offset in range(0, len(data), width):
            block_hash = hashlib.sha256(block_hash + data[offset : offset + width]).digest()
            yield block_hash


def lora_root_hash(lora_name: str | None) -> bytes | None:
    """What a prompt's first block hashes as its parent: nothing for the base model; for a LoRA
    adapter's requests, SHA-256 of b"lora:" and the adapter's name in UTF-8, so the same tokens run
    through different adapters (different KV) never share blocks."""
    if lora_name is None:
        return None
    return hashlib.sha256(b"lora:" + lora_name.encode()).digest()


def _runs_every_prompt_position(seq: Sequence) -> bool:
    params = seq.sampling_params
    return params.prompt_logprobs is not None or (
        params.pooling is not None and params.pooling.pooling == "mean"
    )
