"""The AVX512-BF16 linear layer (`pagedserve_kernels.cpu.linear_avx512`) against its reference
(`reference.linear_bf16_pairs`: vdpbf16ps's sums in order, bit for bit), so each row's result is the
same in any batch; close to F.linear and to the float64 product. Also the packed layout, the shapes the
engine feeds it (3-d, strided, empty) and the inputs it refuses.

Built with the machine's C++ compiler, as the engine builds it; the multiply runs only on CPUs with
AVX512-BF16 (skipped elsewhere, where the engine keeps oneDNN).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from pagedserve_kernels import cpu, reference

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernel"
)
needs_avx512 = pytest.mark.skipif(
    "not cpu.load() or not cpu.linear_avx512_supported()", reason="no AVX512-BF16 here"
)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def test_packed_layout() -> None:
    """[N/32, K/2, 32 n, 2]: panel p, pair j, column n, half h = weight[32 p + n, 2 j + h]."""
    weight = bf16(64, 6)
    packed = cpu.pack_linear_weight_avx512(weight)
    assert packed.shape == (2, 3, 32, 2)
    assert torch.equal(packed.permute(0, 2, 1, 3).reshape(64, 6), weight)
    assert torch.equal(cpu.pack_linear_weight_avx512(weight.T.contiguous().T), packed)  # any strides


# rows: 1..12 run one tile of that many rows, 13 two of 7 + 6, 25 three, 40 four of 10
@needs_avx512
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 12, 13, 16, 25, 40])
@pytest.mark.parametrize("shape", [(96, 64), (64, 70), (32, 2)], ids=["96x64", "64x70", "32x2"])
def test_equals_the_reference_bit_for_bit(shape: tuple[int, int], rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias, x = bf16(*shape), bf16(shape[0]), bf16(rows, shape[1])
    packed = cpu.pack_linear_weight_avx512(weight)
    assert torch.equal(cpu.linear_avx512(x, packed), reference.linear_bf16_pairs(x, weight))
    assert torch.equal(cpu.linear_avx512(x, packed, bias), reference.linear_bf16_pairs(x, weight, bias))


@needs_avx512
@pytest.mark.parametrize("rows", [1, 16, 33, 300])
def test_a_row_gets_what_it_gets_alone_close_to_f_linear(rows: int) -> None:
    """SmolLM2-135M's gate_up: every row the bits it gets alone, within bf16 rounding of the float64
    product, as close to it as F.linear (oneDNN) is."""
    torch.manual_seed(rows)
    weight, bias, x = bf16(3072, 576), bf16(3072), bf16(rows, 576)
    packed = cpu.pack_linear_weight_avx512(weight)
    out = cpu.linear_avx512(x, packed, bias)
    alone = torch.cat([cpu.linear_avx512(x[i : i + 1], packed, bias) for i in range(rows)])
    assert torch.equal(out, alone)
    exact = x.double() @ weight.double().T + bias.double()
    assert torch.allclose(out.double(), exact, rtol=2**-8, atol=1e-2)
    ours, onednn = (
        (out.double() - exact).abs().mean(),
        (F.linear(x, weight, bias).double() - exact).abs().mean(),
    )
    assert ours <= 1.05 * onednn


@needs_avx512
def test_the_same_bits_when_threads_take_each_others_panels() -> None:
    """A thread done with its own panels takes another's from the back: with five threads on this
    machine's cores the panels change hands in most runs (timing decides which), and every run gives
    the reference's bits."""
    torch.manual_seed(5)
    weight, x = bf16(1024, 64), bf16(20, 64)
    packed, expected = cpu.pack_linear_weight_avx512(weight), reference.linear_bf16_pairs(x, weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(5)
        for _ in range(10):
            assert torch.equal(cpu.linear_avx512(x, packed), expected)
    finally:
        torch.set_num_threads(threads)


@needs_avx512
def test_leading_dimensions_strided_and_empty_inputs() -> None:
    weight = bf16(960, 576)
    packed = cpu.pack_linear_weight_avx512(weight)
    x = bf16(3, 10, 576)[:, ::2]  # [3, 5, 576], rows 2 apart
    expected = reference.linear_bf16_pairs(x.reshape(15, 576), weight).view(3, 5, 960)
    assert torch.equal(cpu.linear_avx512(x, packed), expected)
    columns = bf16(4, 1153)[:, 287:863]  # rows longer than K, starting at an odd element (unaligned pairs)
    assert torch.equal(cpu.linear_avx512(columns, packed), reference.linear_bf16_pairs(columns, weight))
    assert cpu.linear_avx512(bf16(0, 576), packed).shape == (0, 960)


def test_refuses_what_it_cannot_pack() -> None:
    with pytest.raises(RuntimeError, match="multiple of 32 and in_features even"):
        cpu.pack_linear_weight_avx512(bf16(48, 576))
    with pytest.raises(RuntimeError, match="multiple of 32 and in_features even"):
        cpu.pack_linear_weight_avx512(bf16(64, 45))
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.pack_linear_weight_avx512(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match=r"\[out_features, in_features\]"):
        cpu.pack_linear_weight_avx512(bf16(64))


@needs_avx512
def test_refuses_bad_inputs() -> None:
    weight = bf16(64, 96)
    packed = cpu.pack_linear_weight_avx512(weight)
    with pytest.raises(RuntimeError, match="last dimension must be 96"):
        cpu.linear_avx512(bf16(4, 64), packed)
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        cpu.linear_avx512(torch.randn(4, 96), packed)
    with pytest.raises(RuntimeError, match=r"bias must be bfloat16 \[64\]"):
        cpu.linear_avx512(bf16(4, 96), packed, bf16(32))
    with pytest.raises(RuntimeError, match=r"bias must be bfloat16 \[64\], got Float"):
        cpu.linear_avx512(bf16(4, 96), packed, torch.randn(64))
    with pytest.raises(RuntimeError, match="must come from pack_linear_weight_avx512"):
        cpu.linear_avx512(bf16(4, 96), weight)
    with pytest.raises(RuntimeError, match="must come from pack_linear_weight_avx512"):
        cpu.linear_avx512(bf16(4, 96), cpu.pack_linear_weight(weight))  # AMX tiles, 5-d
