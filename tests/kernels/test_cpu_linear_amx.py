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


@pytest.mark.skipif("cpu.load() and cpu.linear_amx_supported()", reason="this CPU has AMX")
def test_without_amx_the_multiply_says_so() -> None:
    weight = bf16(64, 96)
    packed = cpu.pack_linear_weight(weight)
    with pytest.raises(RuntimeError, match="no AMX"):
        cpu.linear_amx(bf16(4, 96), packed)
    with pytest.raises(RuntimeError, match="linear_argmax_amx: this build or CPU has no AMX"):
        cpu.linear_argmax_amx(bf16(4, 96), packed, 64)
