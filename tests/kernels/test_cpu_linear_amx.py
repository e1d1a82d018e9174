"""The AMX bfloat16 linear layer (`pagedserve_kernels.cpu.linear_amx`) against `F.linear`: the same bits
for batches of up to 32 rows (decode), and beyond that each row exactly what it is alone, within bf16
rounding of a float64 product. Also the packed layout, the shapes the engine feeds it (3-d, strided,
empty) and the inputs it refuses.

Built with the machine's C++ compiler, as the engine builds it; the multiply runs only on CPUs with
AMX bfloat16 tiles (skipped elsewhere, where the engine keeps oneDNN).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernel"
)

# SmolLM2-135M's projections (qkv, o, gate_up, down, LM head) and a Llama-7B-sized one
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (11008, 4096)]
needs_amx = pytest.mark.skipif("not cpu.load() or not cpu.linear_amx_supported()", reason="no AMX bf16 here")


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def test_packed_layout() -> None:
    """[N/16, K/32, 16 pairs of k, 16 n, 2]: tile (nb, kb) row p, column n = weight[16 nb + n, 32 kb + 2p + h]."""
    weight = bf16(64, 96)
    packed = cpu.pack_linear_weight(weight)
    assert packed.shape == (4, 3, 16, 16, 2)
    assert torch.equal(packed.permute(0, 3, 1, 2, 4).reshape(64, 96), weight)


@needs_amx
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_up_to_32_rows_as_f_linear_bit_for_bit(shape: tuple[int, int]) -> None:
    weight, bias = bf16(*shape), bf16(shape[0])
    packed = cpu.pack_linear_weight(weight)
    for rows in [1, 2, 7, 15, 16, 17, 31, 32] if shape[1] < 4096 else [1, 16, 32]:
        x = bf16(rows, shape[1])
        assert torch.equal(cpu.linear_amx(x, packed), F.linear(x, weight)), rows
        assert torch.equal(cpu.linear_amx(x, packed, bias), F.linear(x, weight, bias)), rows


@needs_amx
@pytest.mark.parametrize("rows", [33, 48, 64, 100, 300])
def test_a_row_gets_what_it_gets_alone(rows: int) -> None:
    """More than 32 rows: oneDNN changes how it sums (F.linear is no longer the reference); this kernel
    gives every row the bits it gives that row alone, close to the float64 product."""
    weight, bias = bf16(3072, 576), bf16(3072)
    packed = cpu.pack_linear_weight(weight)
    x = bf16(rows, 576)
    out = cpu.linear_amx(x, packed, bias)
    alone = torch.cat([cpu.linear_amx(x[i : i + 1], packed, bias) for i in range(rows)])
    assert torch.equal(out, alone)
    exact = x.double() @ weight.double().T + bias.double()
    assert torch.allclose(out.double(), exact, rtol=2**-8, atol=1e-2)


@needs_amx
def test_leading_dimensions_strided_and_empty_inputs() -> None:
    weight = bf16(960, 576)
    packed = cpu.pack_linear_weight(weight)
    x = bf16(3, 10, 576)[:, ::2]  # [3, 5, 576], rows 2 apart
    assert torch.equal(cpu.linear_amx(x, packed), F.linear(x, weight))
    columns = bf16(4, 1152)[:, 288:864]  # rows longer than K
    assert torch.equal(cpu.linear_amx(columns, packed), F.linear(columns, weight))
    assert cpu.linear_amx(bf16(0, 576), packed).shape == (0, 960)


def test_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.pack_linear_weight(bf16(48, 576))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.pack_linear_weight(bf16(64, 48))
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.pack_linear_weight(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match=r"\[out_features, in_features\]"):
        cpu.pack_linear_weight(bf16(64))


@needs_amx
def test_refuses_bad_inputs() -> None:
    weight = bf16(64, 96)
    packed = cpu.pack_linear_weight(weight)
    with pytest.raises(RuntimeError, match="last dimension must be 96"):
        cpu.linear_amx(bf16(4, 64), packed)
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        cpu.linear_amx(torch.randn(4, 96), packed)
    with pytest.raises(RuntimeError, match=r"bias must be bfloat16 \[64\]"):
        cpu.linear_amx(bf16(4, 96), packed, bf16(32))
    with pytest.raises(RuntimeError, match=r"bias must be bfloat16 \[64\], got Float"):
        cpu.linear_amx(bf16(4, 96), packed, torch.randn(64))
    with pytest.raises(RuntimeError, match="must come from pack_linear_weight"):
        cpu.linear_amx(bf16(4, 96), weight)


def greedy(
    x: torch.Tensor, packed: torch.Tensor, num_columns: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the engine did before the fused kernel: the logits, then argmax_rows over the vocabulary's."""
    return cpu.argmax_rows(cpu.linear_amx(x, packed, bias)[:, :num_columns])


# rows: one row block, both blocks of a 32-row pass, two passes, four; columns: whole pairs of
# n-blocks, a part of the last, one column
@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 20, 40, 64])
@pytest.mark.parametrize(("n", "k", "num_columns"), [(96, 64, 96), (96, 64, 70), (64, 96, 33), (32, 32, 1)])
def test_argmax_equals_argmax_rows_of_the_logits(rows: int, n: int, k: int, num_columns: int) -> None:
    torch.manual_seed(rows * n + num_columns)
    weight, bias, x = bf16(n, k), bf16(n), bf16(rows, k)
    packed = cpu.pack_linear_weight(weight)
    assert torch.equal(cpu.linear_argmax_amx(x, packed, num_columns), greedy(x, packed, num_columns))
    assert torch.equal(
        cpu.linear_argmax_amx(x, packed, num_columns, bias), greedy(x, packed, num_columns, bias)
    )


@needs_amx
def test_argmax_of_a_vocabulary_split_over_both_threads() -> None:
    """SmolLM2-135M's LM head (49,152 columns, 1,536 pairs of n-blocks split over the threads), decode
    batch sizes; each row also alone, as the argmax of a batch does not depend on it."""
    torch.manual_seed(0)
    weight = bf16(49152, 576)
    packed = cpu.pack_linear_weight(weight)
    for rows in (1, 16, 64):
        x = bf16(rows, 576)
        got = cpu.linear_argmax_amx(x, packed, 49152)
        assert torch.equal(got, greedy(x, packed, 49152))
        assert torch.equal(
            got, torch.cat([cpu.linear_argmax_amx(x[i : i + 1], packed, 49152) for i in range(rows)])
        )


@needs_amx
def test_argmax_ties_take_the_first_column_and_nan_beats_everything() -> None:
    """Equal logits (duplicate weight rows, within a pair of n-blocks and in another thread's): the
    first column; a NaN logit wins wherever it is (the first of several); -inf everywhere: column 0."""
    torch.manual_seed(1)
    weight = bf16(4096, 64)
    weight[3000] = weight[2000] = weight[40] = weight[7]  # 7 is the largest in every row below
    x = weight[7:8].repeat(40, 1) * 4  # each row's largest logit: weight row 7 against itself
    packed = cpu.pack_linear_weight(weight)
    assert cpu.linear_argmax_amx(x, packed, 4096).tolist() == greedy(x, packed, 4096).tolist() == [7] * 40
    nan_weight = weight.clone()
    nan_weight[[2500, 3100]] = float("nan")
    packed = cpu.pack_linear_weight(nan_weight)
    assert cpu.linear_argmax_amx(x, packed, 4096).tolist() == greedy(x, packed, 4096).tolist() == [2500] * 40
    assert cpu.linear_argmax_amx(x, packed, 2500).tolist() == [7] * 40  # the NaNs are past num_columns
    packed = cpu.pack_linear_weight(torch.full((96, 64), float("-inf"), dtype=torch.bfloat16))
    positive = bf16(2, 64).abs() + 0.5
    assert (
        cpu.linear_argmax_amx(positive, packed, 96).tolist()
        == greedy(positive, packed, 96).tolist()
        == [0, 0]
    )


@needs_amx
def test_argmax_shapes_and_refusals() -> None:
    weight = bf16(64, 96)
    packed = cpu.pack_linear_weight(weight)
    x = bf16(2, 3, 96)
    assert torch.equal(cpu.linear_argmax_amx(x, packed, 64), greedy(x.view(6, 96), packed, 64).view(2, 3))
    assert cpu.linear_argmax_amx(bf16(0, 96), packed, 64).shape == (0,)
    for num_columns in (0, 65):
        with pytest.raises(RuntimeError, match=r"num_columns must be in 1\.\.64"):
            cpu.linear_argmax_amx(bf16(2, 96), packed, num_columns)
    with pytest.raises(RuntimeError, match="last dimension must be 96"):
        cpu.linear_argmax_amx(bf16(4, 64), packed, 64)
    with pytest.raises(RuntimeError, match="linear_argmax_amx: `packed` must come from pack_linear_weight"):
        cpu.linear_argmax_amx(bf16(4, 96), weight, 64)


@pytest.mark.skipif("cpu.load() and cpu.linear_amx_supported()", reason="this CPU has AMX")
def test_without_amx_the_multiply_says_so() -> None:
    weight = bf16(64, 96)
    packed = cpu.pack_linear_weight(weight)
    with pytest.raises(RuntimeError, match="no AMX"):
        cpu.linear_amx(bf16(4, 96), packed)
    with pytest.raises(RuntimeError, match="linear_argmax_amx: this build or CPU has no AMX"):
        cpu.linear_argmax_amx(bf16(4, 96), packed, 64)
