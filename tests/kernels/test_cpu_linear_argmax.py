"""Greedy sampling from an LM head without its logits: `linear_argmax_amx` (AMX tiles) and
`linear_argmax_avx512` (AVX512-BF16 panels) against `argmax_rows` over the logits their plain multiply
writes (`linear_amx`, `linear_avx512`): the same column for every row (the first maximum, a NaN first),
whichever thread's columns hold it, and the inputs they refuse.

Built with the machine's C++ compiler, as the engine builds it; each kernel runs only on CPUs that have
its instructions (skipped elsewhere).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from pagedserve_kernels import cpu

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler to build the kernel",
)


@dataclass(frozen=True)
class Kernel:
    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    argmax: Callable[..., torch.Tensor]
    packer: str  # what `packed` must come from, as the refusal names it

    def greedy(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        num_columns: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What the engine did before the fused kernels: the logits, then argmax_rows over the
        vocabulary's."""
        return cpu.argmax_rows(self.linear(x, packed, bias)[:, :num_columns])


KERNELS = {
    "amx": Kernel(
        cpu.pack_linear_weight,
        cpu.linear_amx,
        cpu.linear_argmax_amx,
        "pack_linear_weight",
    ),
    "avx512": Kernel(
        cpu.pack_linear_weight_avx512,
        cpu.linear_avx512,
        cpu.linear_argmax_avx512,
        "pack_linear_weight_avx512",
    ),
}
NEEDS = {
    "amx": pytest.mark.skipif("not cpu.load() or not cpu.linear_amx_supported()", reason="no AMX bf16 here"),
    "avx512": pytest.mark.skipif(
        "not cpu.load() or not cpu.linear_avx512_supported()",
        reason="no AVX512-BF16 here",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


@pytest.fixture(params=[pytest.param(name, marks=NEEDS[name]) for name in KERNELS])
def kernel(request: pytest.FixtureRequest) -> Kernel:
    return KERNELS[request.param]


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


# (kernel, n, k, num_columns): whole 32-column units, a part of the last, one column; the panels also
# take any even k, the tiles multiples of 32 alone
SHAPES = [
    pytest.param(name, *shape, marks=NEEDS[name], id=f"{name}-{'x'.join(map(str, shape))}")
    for name, shapes in (
        ("amx", [(96, 64, 96), (96, 64, 70), (64, 96, 33), (32, 32, 1)]),
        ("avx512", [(96, 64, 96), (96, 64, 70), (64, 70, 33), (32, 2, 1)]),
    )
    for shape in shapes
]


# rows: within one pass of either multiply (AMX takes 32 rows a pass in two tiles of 16, the panels 12),
# two of the panels' passes, both AMX tiles, two and six passes
@pytest.mark.parametrize("rows", [1, 5, 13, 20, 40, 64])
@pytest.mark.parametrize(("name", "n", "k", "num_columns"), SHAPES)
def test_argmax_equals_argmax_rows_of_the_logits(
    name: str, n: int, k: int, num_columns: int, rows: int
) -> None:
    kernel = KERNELS[name]
    torch.manual_seed(rows * n + num_columns)
    weight, bias, x = bf16(n, k), bf16(n), bf16(rows, k)
    packed = kernel.pack(weight)
    assert torch.equal(kernel.argmax(x, packed, num_columns), kernel.greedy(x, packed, num_columns))
    assert torch.equal(
        kernel.argmax(x, packed, num_columns, bias),
        kernel.greedy(x, packed, num_columns, bias),
    )


def test_argmax_of_a_vocabulary_split_over_both_threads(kernel: Kernel) -> None:
    """SmolLM2-135M's LM head (49,152 columns, 1,536 units of 32 split over the threads), decode batch
    sizes; each row also alone, as the argmax of a batch does not depend on it."""
    torch.manual_seed(0)
    packed = kernel.pack(bf16(49152, 576))
    for rows in (1, 16, 64):
        x = bf16(rows, 576)
        got = kernel.argmax(x, packed, 49152)
        assert torch.equal(got, kernel.greedy(x, packed, 49152))
        assert torch.equal(
            got,
            torch.cat([kernel.argmax(x[i : i + 1], packed, 49152) for i in range(rows)]),
        )


def test_argmax_ties_take_the_first_column_and_nan_beats_everything(
    kernel: Kernel,
) -> None:
    """Equal logits (duplicate weight rows, within 32 columns and in another thread's): the first column;
    a NaN logit wins wherever it is (the first of several); -inf everywhere: column 0. 40 rows: more than
    one pass of either multiply."""
    torch.manual_seed(1)
    weight = bf16(4096, 64)
    weight[3000] = weight[2000] = weight[40] = weight[7]  # 7 is the largest in every row below
    x = weight[7:8].repeat(40, 1) * 4  # each row's largest logit: weight row 7 against itself
    packed = kernel.pack(weight)
    assert kernel.argmax(x, packed, 4096).tolist() == kernel.greedy(x, packed, 4096).tolist() == [7] * 40
    nan_weight = weight.clone()
    nan_weight[[2500, 3100]] = float("nan")
    packed = kernel.pack(nan_weight)
    assert kernel.argmax(x, packed, 4096).tolist() == kernel.greedy(x, packed, 4096).tolist() == [2500] * 40
    assert kernel.argmax(x, packed, 2500).tolist() == [7] * 40  # the NaNs are past num_columns
    packed = kernel.pack(torch.full((96, 64), float("-inf"), dtype=torch.bfloat16))
    positive = bf16(2, 64).abs() + 0.5
    assert (
        kernel.argmax(positive, packed, 96).tolist() == kernel.greedy(positive, packed, 96).tolist() == [0, 0]
    )


def test_argmax_ties_when_threads_take_each_others_panels(kernel: Kernel) -> None:
    """A thread done with its own panels takes another's from the back, and the bests are then taken
    in column order, whoever multiplied which panel: with five threads on this machine's cores the
    panels change hands in most runs (timing decides which), so ten runs each check different
    hand-overs of the ties and NaNs above (the first column; the first NaN)."""
    torch.manual_seed(1)
    weight = bf16(4096, 64)
    weight[3000] = weight[2000] = weight[40] = weight[7]
    x = weight[7:8].repeat(40, 1) * 4
    nan_weight = weight.clone()
    nan_weight[[2500, 3100, 4000]] = float("nan")
    packed, nan_packed = kernel.pack(weight), kernel.pack(nan_weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(5)
        for _ in range(10):
            assert kernel.argmax(x, packed, 4096).tolist() == [7] * 40
            assert kernel.argmax(x, nan_packed, 4096).tolist() == [2500] * 40
    finally:
        torch.set_num_threads(threads)


def test_argmax_shapes_and_refusals(kernel: Kernel) -> None:
    weight = bf16(64, 96)
    packed = kernel.pack(weight)
    x = bf16(2, 3, 96)
    assert torch.equal(
        kernel.argmax(x, packed, 64),
        kernel.greedy(x.view(6, 96), packed, 64).view(2, 3),
    )
    assert kernel.argmax(bf16(0, 96), packed, 64).shape == (0,)
    for num_columns in (0, 65):
        with pytest.raises(RuntimeError, match=r"num_columns must be in 1\.\.64"):
            kernel.argmax(bf16(2, 96), packed, num_columns)
    with pytest.raises(RuntimeError, match="last dimension must be 96"):
        kernel.argmax(bf16(4, 64), packed, 64)
    with pytest.raises(RuntimeError, match=f"`packed` must come from {kernel.packer}"):
        kernel.argmax(bf16(4, 96), weight, 64)
