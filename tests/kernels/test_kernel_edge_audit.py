"""Edge shapes the kernel grids of the other tests leave out, each kernel against its pure-torch
reference: context lengths of 1, a block - 1, a block, a block + 1 and many blocks; block sizes 8, 16
and 32; head sizes 64, 80, 96 and 128; GQA ratios 1, 2, 4, 8 and multi-query (one KV head); batches
of one sequence and of sequences of very different lengths; block tables in shuffled order that
share a prefix block between sequences (one id in several rows) and reach the pool's last block,
rows padded with stale ids; float32, bfloat16 and float16; empty batches; the largest slot; slot
mappings in any order with -1 padding first, inside and last.

The C++ CPU decode kernel gets the whole grid (it is fast): on a CPU with AVX512-BF16, bfloat16 with
head size 64, 96 or 128 takes the vdpbf16ps path and every other case (head size 80, float32,
float16) the generic loops, so both run.
The Triton kernels run under the interpreter on CPU: a few deliberate cases each, float16 and head
size 96 among them (the Triton grid elsewhere has float32 and bfloat16, head sizes 64/80/128).

Tolerances, against the reference run in float32 on the same inputs: float32 atol = rtol = 1e-5
(C++) and 1e-4 (Triton, as tests/kernels/test_attention.py); bfloat16 2e-2 (the output's rounding,
and the Triton kernel rounds its softmax weights to bfloat16); float16 2e-3. Writes move values
without arithmetic: the caches must be bit-identical to the reference's.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from pagedserve_kernels import activation, attention, cache, cpu, norm, reference, rotary

CPU = torch.device("cpu")
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
TRITON_TOLERANCES = {**TOLERANCES, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]
# (num_heads, num_kv_heads): GQA ratios 1, 2, 4, 8 and multi-query
HEADS = {"gqa1": (4, 4), "gqa2": (4, 2), "gqa4": (8, 2), "gqa8": (16, 2), "mqa": (8, 1)}

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernels"
)


def edge_lens(block_size: int) -> list[int]:
    """One sequence at each boundary of a block, and one of many blocks."""
    return [1, block_size - 1, block_size, block_size + 1, 20 * block_size + 3]


@dataclass(frozen=True)
class Batch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32
    context_lens: torch.Tensor  # int32


def paged_batch(
    context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> Batch:
    """Random K/V in every slot; the blocks of each sequence in shuffled pool order. Every sequence
    longer than a block starts with the same full block, the pool's last one (a shared prompt prefix:
    one id in several rows, and the largest slot is read); rows are padded with stale valid ids."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shared = num_blocks - 1
    pool = torch.randperm(num_blocks - 1).tolist()
    width = max(blocks_per_seq) + 2
    rows = []
    for context_len, n in zip(context_lens, blocks_per_seq):
        prefix = [shared] if context_len > block_size else []
        own, pool = pool[: n - len(prefix)], pool[n - len(prefix) :]
        rows.append(prefix + own + torch.randint(0, num_blocks, (width - n,)).tolist())
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return Batch(
        torch.randn(shape).to(dtype),
        torch.randn(shape).to(dtype),
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor(context_lens, dtype=torch.int32),
    )


def exact_decode(query: torch.Tensor, batch: Batch, scale: float) -> torch.Tensor:
    """The reference in float32 on the same (possibly low-precision) inputs."""
    return reference.paged_attention_decode(
        query.float(),
        batch.k_cache.float(),
        batch.v_cache.float(),
        batch.block_tables,
        batch.context_lens,
        scale,
    )


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tolerances: dict) -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), **tolerances[dtype])


# -- the paged layout itself ------------------------------------------------------------------------


def test_paged_batch_shares_a_prefix_block_and_reaches_the_last_slot() -> None:
    """The builder does what the grid relies on; the reference agrees with attention over each
    sequence's own K/V, gathered slot by slot (no paging)."""
    batch = paged_batch([1, 7, 8, 9, 163], 2, 64, 8, torch.float32)
    tables, last = batch.block_tables, batch.k_cache.shape[0] - 1
    assert tables[3, 0] == tables[4, 0] == last and last not in tables[:3, :1]
    query, scale = torch.randn(5, 4, 64, dtype=torch.float64), 0.125
    out = reference.paged_attention_decode(
        query, batch.k_cache.double(), batch.v_cache.double(), tables, batch.context_lens, scale
    )
    for seq, context_len in enumerate(batch.context_lens.tolist()):
        positions = torch.arange(context_len)
        blocks = tables[seq, positions // 8].long()
        keys = batch.k_cache.double()[blocks, positions % 8].transpose(0, 1)  # [KVH, ctx, D]
        values = batch.v_cache.double()[blocks, positions % 8].transpose(0, 1)
        dense = F.scaled_dot_product_attention(
            query[seq, :, None], keys, values, scale=scale, enable_gqa=True
        )
        torch.testing.assert_close(out[seq], dense[:, 0], atol=1e-12, rtol=1e-12)


def test_reference_decode_of_an_empty_batch_is_empty() -> None:
    batch = paged_batch([5], 2, 64, 8, torch.float32)
    tables, lens = batch.block_tables[:0], batch.context_lens[:0]
    out = reference.paged_attention_decode(
        torch.randn(0, 4, 64), batch.k_cache, batch.v_cache, tables, lens, 0.1
    )
    assert out.shape == (0, 4, 64)


# -- C++ CPU kernels ---------------------------------------------------------------------------------

CPP_DECODE_CASES = [
    pytest.param(*HEADS[ratio], head_dim, block_size, id=f"{ratio}-d{head_dim}-bs{block_size}")
    for head_dim in (64, 80, 96, 128)
    for ratio in HEADS
    for block_size in (8, 16, 32)
]


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), CPP_DECODE_CASES)
def test_cpu_decode_edge_shapes(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    assert cpu.load()
    batch = paged_batch(edge_lens(block_size), num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(5, num_heads, head_dim).to(dtype)
    tail = (batch.block_tables, batch.context_lens, head_dim**-0.5)
    out = cpu.paged_attention_decode(query, batch.k_cache, batch.v_cache, *tail)
    assert_close(out, exact_decode(query, batch, head_dim**-0.5), dtype, TOLERANCES)


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_cpu_decode_batch_of_one_at_each_edge(head_dim: int, dtype: torch.dtype) -> None:
    assert cpu.load()
    for context_len in edge_lens(16):
        batch = paged_batch([context_len], 1, head_dim, 16, dtype)
        query = torch.randn(1, 8, head_dim).to(dtype)
        out = cpu.paged_attention_decode(
            query, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.1
        )
        assert_close(out, exact_decode(query, batch, 0.1), dtype, TOLERANCES)


@needs_compiler
def test_cpu_decode_of_an_empty_batch() -> None:
    assert cpu.load()
    batch = paged_batch([5], 2, 128, 8, torch.bfloat16)
    query = torch.randn(0, 4, 128).bfloat16()
    out = cpu.paged_attention_decode(
        query, batch.k_cache, batch.v_cache, batch.block_tables[:0], batch.context_lens[:0], 0.1
    )
    assert out.shape == (0, 4, 128) and out.dtype == torch.bfloat16


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_decode_refuses_a_context_longer_than_its_block_table(dtype: torch.dtype) -> None:
    """A context past its table row used to be cut to the row's capacity silently: a wrong answer
    (the reference and the Triton launcher refuse it). A negative one is refused too."""
    assert cpu.load()
    batch = paged_batch([9, 40], 2, 64, 8, dtype)  # rows of 5 + 2 = 7 blocks: 56 slots
    query = torch.randn(2, 4, 64).to(dtype)
    for lens in ([9, 57], [-1, 40]):
        with pytest.raises(RuntimeError, match="block table row holds"):
            cpu.paged_attention_decode(
                query,
                batch.k_cache,
                batch.v_cache,
                batch.block_tables,
                torch.tensor(lens, dtype=torch.int32),
                0.1,
            )
    full = torch.tensor([9, 56], dtype=torch.int32)  # exactly the row's capacity is fine
    out = cpu.paged_attention_decode(query, batch.k_cache, batch.v_cache, batch.block_tables, full, 0.1)
    expected = exact_decode(query, Batch(batch.k_cache, batch.v_cache, batch.block_tables, full), 0.1)
    assert_close(out, expected, dtype, TOLERANCES)


def edge_slots(num_tokens: int, num_slots: int) -> torch.Tensor:
    """Distinct slots in random order, the largest among them, with -1 first, in the middle and last."""
    slots = torch.randperm(num_slots - 1)[:num_tokens]
    slots[num_tokens // 3] = num_slots - 1
    slots[0] = slots[num_tokens // 2] = slots[-1] = -1
    return slots


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 80), (2, 96), (8, 128)])
def test_cpu_write_kv_cache_edge_slots(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    assert cpu.load()
    ours = tuple(torch.randn(6, 8, num_kv_heads, head_dim).to(dtype) for _ in range(2))
    theirs = tuple(c.clone() for c in ours)
    for num_tokens in (0, 1, 17, 40):
        kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim).to(dtype)  # views of one projection
        key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
        slots = edge_slots(num_tokens, 48) if num_tokens > 1 else torch.full((num_tokens,), 47)
        cpu.write_kv_cache(key, value, *ours, slots)
        reference.write_kv_cache(key, value, *theirs, slots)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    cpu.write_kv_cache(key[:2], value[:2], *ours, torch.tensor([-1, -1]))  # all padding: nothing
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@needs_compiler
def test_cpu_write_kv_cache_refuses_a_key_that_only_has_the_right_size() -> None:
    """The C++ write checked the number of elements only: a key of the wrong head layout was copied
    byte for byte, and a value cache of another dtype got the key cache's row size: half a float64
    row (the Triton launcher refuses both; the reference refuses the first and casts the second)."""
    assert cpu.load()
    k_cache, v_cache = torch.zeros(2, 8, 2, 64), torch.zeros(2, 8, 2, 64)
    slots = torch.tensor([3, 9])
    with pytest.raises(RuntimeError, match="kv_heads, head_dim"):
        cpu.write_kv_cache(torch.ones(2, 1, 128), torch.ones(2, 1, 128), k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="kv_heads, head_dim"):
        cpu.write_kv_cache(torch.ones(2, 128), torch.ones(2, 128), k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="kv_heads, head_dim"):
        cpu.write_kv_cache(torch.ones(2, 2, 64), torch.ones(2, 4, 32), k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu.write_kv_cache(
            torch.ones(2, 2, 64), torch.ones(2, 2, 64).double(), k_cache, v_cache.double(), slots
        )
    assert not k_cache.any() and not v_cache.any()


@needs_compiler
@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 128), (torch.bfloat16, 96), (torch.float16, 64)]
)
def test_attention_layer_on_the_cpu_kernels_matches_the_reference_backend(
    dtype: torch.dtype, head_dim: int
) -> None:
    """The layer's path on CPU (C++ KV write and decode; prefill in the prefill kernel in bfloat16 where
    the CPU has AVX512-BF16, else the reference's SDPA), bfloat16 head sizes 128 and 96 on the
    AVX512-BF16 paths where the CPU has them and float16 on the generic one, against the same layer
    on the pure-torch reference, over a mixed step: three decodes, a prompt and a chunk."""
    from pagedserve.layers.attention import Attention, AttentionMetadata, TorchAttentionBackend

    fast, slow = TorchAttentionBackend(CPU), TorchAttentionBackend(None)
    assert fast.cpu_kernels and not slow.cpu_kernels
    block_size, num_heads, num_kv_heads = 8, 8, 2
    context_lens, q_lens = [1, 9, 170, 8, 30], [1, 1, 1, 8, 13]
    batch = paged_batch(context_lens, num_kv_heads, head_dim, block_size, dtype)
    positions = torch.cat([torch.arange(c - q, c) for c, q in zip(context_lens, q_lens)])
    seq_of_token = torch.repeat_interleave(torch.arange(5), torch.tensor(q_lens))
    tables = batch.block_tables
    slots = tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    starts = torch.tensor([0, 8, 21], dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=slots, num_decodes=3, decode_block_tables=tables[:3], decode_context_lens=batch.context_lens[:3],
        prefill_block_tables=tables[3:], prefill_query_start_loc=starts, prefill_context_lens=batch.context_lens[3:],
        max_decode_context_len=170, max_prefill_query_len=13,
    )  # fmt: skip
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_heads * head_dim).to(dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads * head_dim).to(dtype) for _ in range(2))
    outs, caches = [], []
    for backend in (fast, slow):
        layer = Attention(num_heads, num_kv_heads, head_dim, backend, layer_index=0)
        layer.kv_cache = (batch.k_cache.clone(), batch.v_cache.clone())
        outs.append(layer(q, k, v, metadata))
        caches.append(layer.kv_cache)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert_close(outs[0], outs[1].float(), dtype, TOLERANCES)


# -- Triton kernels (the interpreter on CPU) -----------------------------------------------------------

# (num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype)
TRITON_DECODE_CASES = [
    pytest.param(8, 2, 64, 16, edge_lens(16), torch.float16, id="gqa4-d64-bs16-fp16"),
    pytest.param(4, 2, 96, 8, edge_lens(8), torch.float32, id="gqa2-d96-bs8-fp32"),
    pytest.param(4, 2, 96, 8, edge_lens(8), torch.bfloat16, id="gqa2-d96-bs8-bf16"),
    pytest.param(16, 1, 128, 32, edge_lens(32), torch.bfloat16, id="mqa16-d128-bs32-bf16"),
    pytest.param(4, 4, 80, 8, edge_lens(8), torch.float16, id="gqa1-d80-bs8-fp16"),
    pytest.param(8, 1, 96, 16, [17], torch.float16, id="b1-mqa-d96-bs16-fp16-ctx17"),
    pytest.param(8, 1, 128, 32, [1], torch.float32, id="b1-mqa-d128-bs32-fp32-ctx1"),
]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "lens", "dtype"), TRITON_DECODE_CASES
)
def test_triton_decode_edge_shapes(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    lens: list[int],
    dtype: torch.dtype,
    num_splits: int,
    device: torch.device,
) -> None:
    batch = paged_batch(lens, num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    tail = (batch.block_tables, batch.context_lens, head_dim**-0.5)
    out = attention.paged_attention_decode(
        query.to(device), batch.k_cache.to(device), batch.v_cache.to(device),
        *(t.to(device) for t in tail[:2]), tail[2], num_splits=num_splits,
    )  # fmt: skip
    assert_close(out.cpu(), exact_decode(query, batch, head_dim**-0.5), dtype, TRITON_TOLERANCES)


# (num_heads, num_kv_heads, head_dim, block_size, [(query_len, context_len), ...], dtype): group 6
# fills 60 of the kernel's 64 rows; query_len < context_len is a chunk after cached context
TRITON_PREFILL_CASES = [
    pytest.param(
        12, 2, 96, 8, [(1, 1), (7, 7), (8, 8), (9, 9), (40, 163)], torch.float16, id="gqa6-d96-bs8-fp16"
    ),
    pytest.param(
        8, 1, 64, 32, [(31, 31), (32, 32), (5, 33), (70, 70)], torch.bfloat16, id="mqa-d64-bs32-bf16"
    ),
    pytest.param(4, 2, 80, 16, [(1, 17), (16, 16), (12, 323)], torch.float32, id="gqa2-d80-bs16-fp32"),
]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "lens", "dtype"), TRITON_PREFILL_CASES
)
def test_triton_prefill_edge_shapes(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    lens: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    batch = paged_batch([c for _, c in lens], num_kv_heads, head_dim, block_size, dtype)
    starts = torch.tensor([0, *(q for q, _ in lens)]).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim).to(dtype)
    tail = (batch.block_tables, starts, batch.context_lens, head_dim**-0.5)
    out = attention.paged_attention_prefill(
        query.to(device), batch.k_cache.to(device), batch.v_cache.to(device),
        *(t.to(device) for t in tail[:3]), tail[3],
    )  # fmt: skip
    expected = reference.paged_attention_prefill(
        query.float(), batch.k_cache.float(), batch.v_cache.float(), *tail
    )
    assert_close(out.cpu(), expected, dtype, TRITON_TOLERANCES)


def test_triton_attention_of_empty_batches(device: torch.device) -> None:
    batch = paged_batch([5], 2, 64, 8, torch.float32)
    kv = (batch.k_cache.to(device), batch.v_cache.to(device), batch.block_tables[:0].to(device))
    lens = batch.context_lens[:0].to(device)
    decode = attention.paged_attention_decode(torch.randn(0, 4, 64, device=device), *kv, lens, 0.1)
    starts = torch.zeros(1, dtype=torch.int32, device=device)
    prefill = attention.paged_attention_prefill(torch.randn(0, 4, 64, device=device), *kv, starts, lens, 0.1)
    assert decode.shape == prefill.shape == (0, 4, 64)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_write_kv_cache_edge_slots(
    dtype: torch.dtype, index_dtype: torch.dtype, device: torch.device
) -> None:
    ours = tuple(torch.randn(6, 8, 3, 96).to(dtype).to(device) for _ in range(2))
    theirs = tuple(c.clone() for c in ours)
    for num_tokens in (0, 1, 17):
        kv = torch.randn(num_tokens, 6, 96).to(dtype).to(device)
        key, value = kv[:, :3], kv[:, 3:]
        slots = edge_slots(num_tokens, 48) if num_tokens > 1 else torch.full((num_tokens,), 47)
        cache.write_kv_cache(key, value, *ours, slots.to(index_dtype).to(device))
        reference.write_kv_cache(key, value, *theirs, slots.to(device))
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


# -- Triton elementwise kernels: float16 (the other tests cover float32 and bfloat16), head size 96,
# empty inputs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "rotary_dim"), [(0, 96), (3, 96), (5, 48)])
def test_triton_rotary_float16_head_dim_96(num_tokens: int, rotary_dim: int, device: torch.device) -> None:
    qkv = torch.randn(num_tokens, 8 + 2 * 2, 96, dtype=torch.float16, device=device)
    query, key = qkv[:, :8], qkv[:, 8:10]
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    for out, expected in zip(
        rotary.rotary_embedding(positions, query, key, cos_sin),
        reference.rotary_embedding(positions, query, key, cos_sin),
    ):
        assert_close(out, expected, torch.float16, TOLERANCES)


@pytest.mark.parametrize("shape", [(0, 96), (1, 1), (3, 96), (2, 5120)], ids=str)
def test_triton_norms_and_activation_float16(shape: tuple[int, int], device: torch.device) -> None:
    x, residual = (3 * torch.randn(shape, dtype=torch.float16, device=device) for _ in range(2))
    weight = torch.randn(shape[-1], dtype=torch.float16, device=device)
    assert_close(
        norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), torch.float16, TOLERANCES
    )
    for out, expected in zip(
        norm.fused_add_rms_norm(x, residual, weight, 1e-6),
        reference.fused_add_rms_norm(x, residual, weight, 1e-6),
    ):
        assert_close(out, expected, torch.float16, TOLERANCES)
    gate_up = torch.cat((x, residual), dim=-1)
    assert_close(activation.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), torch.float16, TOLERANCES)
