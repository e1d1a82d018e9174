"""Block ids outside the KV cache, in the C++ CPU kernels that read block tables:
`cpu.paged_attention_decode` and `cpu.decode_layers` (every decoder layer of a decode step). They
turned any id into a pointer, reading whatever memory it named or crashing the process; they now
refuse the call, before reading anything, with an error naming the row, the entry and the valid ids.
Only the ids covering each context are checked: entries past it are padding the engine leaves in
its rows, never read, so any value there gives the result of a clean row.

Grid: the decode paths (the generic loops: float32, bfloat16 with head size 80; AVX512-BF16 where the
CPU has it: bfloat16 with head size 64 or 128), an id one past the cache and a negative one, each in
the last block of a context. decode_layers refuses a bad table on any build (its checks come before
its AVX-512 code); it runs a padded table where the build has it (AVX512-BF16). The Triton kernels
trust their ids (a check would cost a device sync each step) and are not tested here.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from pagedserve_kernels import cpu, reference
from test_cpu_decode_layers import BLOCK_SIZE as LAYERS_BLOCK_SIZE
from test_cpu_decode_layers import NUM_BLOCKS as LAYERS_NUM_BLOCKS
from test_cpu_decode_layers import clone_step, make_model, make_step, run_kernel, run_reference

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernels"
)

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS = 10, 8, 4, 2
# contexts of exactly 2 blocks, 3 blocks (one token in the third) and 1 block, in rows of 4
CONTEXT_LENS = [16, 17, 3]
TABLES = [[0, 1, 9, 9], [2, 3, 4, 9], [5, 9, 9, 9]]  # padded with a valid id, as the engine pads
# ids past each context: one past the cache, negative, the int32 extremes
JUNK = [[0, 1, NUM_BLOCKS, -1], [2, 3, 4, 2**31 - 1], [5, -(2**31), 1000, -5]]
PATHS = [
    pytest.param(torch.float32, 64, id="fp32-d64"),
    pytest.param(torch.bfloat16, 64, id="bf16-d64"),
    pytest.param(torch.bfloat16, 128, id="bf16-d128"),
    pytest.param(torch.bfloat16, 80, id="bf16-d80"),
]
# (row, entry, id): an id one past the cache, and a negative one, in the last block of a context
BAD_IDS = [pytest.param(1, 2, NUM_BLOCKS, id="past-the-cache"), pytest.param(0, 1, -1, id="negative")]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


def decode_inputs(dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A query for 3 sequences and a cache of 10 blocks (small: a read past it stays in this process's heap)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    query = torch.randn(len(CONTEXT_LENS), NUM_HEADS, head_dim).to(dtype)
    return query, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def int32(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def bad_id_message(row: int, entry: int, block_id: int, num_blocks: int) -> str:
    return rf"block_tables\[{row}, {entry}\] = {block_id} is not a block of the KV cache \(ids 0 to {num_blocks - 1};"


@pytest.mark.parametrize(("dtype", "head_dim"), PATHS)
@pytest.mark.parametrize(("row", "entry", "block_id"), BAD_IDS)
def test_decode_refuses_a_block_id_outside_the_cache(
    dtype: torch.dtype, head_dim: int, row: int, entry: int, block_id: int
) -> None:
    query, k_cache, v_cache = decode_inputs(dtype, head_dim)
    tables = int32(TABLES)
    tables[row, entry] = block_id
    with pytest.raises(RuntimeError, match=bad_id_message(row, entry, block_id, NUM_BLOCKS)):
        cpu.paged_attention_decode(query, k_cache, v_cache, tables, int32(CONTEXT_LENS), head_dim**-0.5)


@pytest.mark.parametrize(("dtype", "head_dim"), PATHS)
def test_decode_ignores_any_id_past_each_context(dtype: torch.dtype, head_dim: int) -> None:
    query, k_cache, v_cache = decode_inputs(dtype, head_dim)
    lens, scale = int32(CONTEXT_LENS), head_dim**-0.5
    padded = cpu.paged_attention_decode(query, k_cache, v_cache, int32(JUNK), lens, scale)
    clean = cpu.paged_attention_decode(query, k_cache, v_cache, int32(TABLES), lens, scale)
    assert torch.equal(padded, clean)
    expected = reference.paged_attention_decode(
        query.float(), k_cache.float(), v_cache.float(), int32(TABLES), lens, scale
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(padded.float(), expected, atol=tolerance, rtol=tolerance)


def padded_step(num_seqs: int) -> dict:
    """test_cpu_decode_layers' step (contexts of 5 + (7 i mod 27) tokens in rows of 4 blocks), with
    junk in every entry past a context."""
    step = make_step(num_seqs)
    for seq, context_len in enumerate(step["context_lens"].tolist()):
        for entry in range(-(-context_len // LAYERS_BLOCK_SIZE), 4):  # entry 0 always holds tokens
            step["block_tables"][seq, entry] = [LAYERS_NUM_BLOCKS, -1, -(2**31)][entry - 1]
    return step


@pytest.mark.parametrize(("row", "entry", "block_id"), [(2, 2, LAYERS_NUM_BLOCKS), (3, 3, -1)])
def test_decode_layers_refuses_a_block_id_outside_the_cache(row: int, entry: int, block_id: int) -> None:
    """Before any layer runs: no KV row is written. Rows 2 and 3 hold 19 and 26 tokens (3 and 4 blocks)."""
    model, step = make_model(False), padded_step(4)
    step["block_tables"][row, entry] = block_id
    ours = clone_step(step)
    with pytest.raises(RuntimeError, match=bad_id_message(row, entry, block_id, LAYERS_NUM_BLOCKS)):
        run_kernel(model, ours)
    for name in ("k_caches", "v_caches"):
        assert all(torch.equal(a, b) for a, b in zip(ours[name], step[name]))


def test_decode_layers_refuses_block_tables_of_another_dtype() -> None:
    model, step = make_model(False), make_step(4)
    step["block_tables"] = step["block_tables"].long()
    with pytest.raises(RuntimeError, match="block_tables .* must be int32"):
        run_kernel(model, step)


@pytest.mark.skipif("not cpu.load() or not cpu.decode_layers_supported()", reason="no AVX512-BF16 build")
def test_decode_layers_ignores_any_id_past_each_context() -> None:
    model, step = make_model(False), padded_step(6)
    clean = clone_step(step)
    clean["block_tables"] = torch.arange(6 * 4, dtype=torch.int32).view(6, 4)  # make_step's rows
    padded_out, clean_out = run_kernel(model, clone_step(step)), run_kernel(model, clone_step(clean))
    assert torch.equal(padded_out, clean_out)
    expected = run_reference(model, clone_step(clean))
    torch.testing.assert_close(padded_out.float(), expected.float(), atol=0.05, rtol=0.03)
