"""The C++ greedy argmax (`pagedserve_kernels.cpu.argmax_rows`) against `max(dim=-1).indices`, which
greedy sampling used before: the same index in every case, ties, NaN, infinities and signed zeros
included, for the logits' dtypes, row lengths around the 16-lane vectors and strided rows.

Built with the machine's C++ compiler, as the engine builds it; skipped where there is none.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from pagedserve_kernels import cpu

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler to build the kernel"
)

NAN, INF = float("nan"), float("inf")
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu.load(), "the CPU kernels failed to build: see the warning logged above"


def expected(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().max(dim=-1).indices


@DTYPES
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 33, 1000, 49152, 49153])
def test_random_rows(dtype: torch.dtype, n: int) -> None:
    logits = (torch.randn(9, n) * 10).to(dtype)
    assert torch.equal(cpu.argmax_rows(logits), expected(logits))


@DTYPES
def test_ties_take_the_first_maximum(dtype: torch.dtype) -> None:
    logits = torch.zeros(4, 100, dtype=dtype)
    logits[0, [3, 40, 99]] = 7  # in different 16-lane chunks
    logits[1, [17, 18]] = 7  # neighbours in one chunk
    logits[2] = -INF  # every token banned: the first
    logits[3, [0, 5]] = torch.tensor([-0.0, 0.0], dtype=dtype)  # -0.0 and 0.0 tie; the rest is 0.0 too
    assert cpu.argmax_rows(logits).tolist() == [3, 17, 0, 0] == expected(logits).tolist()


@DTYPES
def test_nan_wins_and_the_first_nan_is_taken(dtype: torch.dtype) -> None:
    logits = torch.randn(5, 70).to(dtype)
    logits[0, [33, 50]] = NAN  # after the row's maximum
    logits[1, 0] = NAN
    logits[2, 69] = NAN  # in the last, partial chunk
    logits[3, 10] = INF
    logits[3, 60] = NAN  # NaN beats +inf too
    logits[4, [2, 64]] = INF  # +inf without NaN: the first
    assert cpu.argmax_rows(logits).tolist() == [33, 0, 69, 60, 2] == expected(logits).tolist()


@DTYPES
def test_strided_rows(dtype: torch.dtype) -> None:
    """Rows apart in a larger buffer (e.g. every other row of the logits) are read in place; a
    non-unit column stride is copied first: the answer is the same either way."""
    base = torch.randn(8, 300).to(dtype)
    rows, columns = base[::2, 5:290], base[:, ::3]
    assert torch.equal(cpu.argmax_rows(rows), expected(rows))
    assert torch.equal(cpu.argmax_rows(columns), expected(columns))


def test_no_rows_gives_no_indices() -> None:
    out = cpu.argmax_rows(torch.randn(0, 10).bfloat16())
    assert out.dtype == torch.int64 and out.shape == (0,)


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.randn(10), r"logits \[rows, n\]"),
        (torch.randn(3, 0), r"n > 0"),
        (torch.randint(0, 9, (3, 10)), "float32, bfloat16 or float16"),
    ],
    ids=["1-d", "empty-rows", "int64"],
)
def test_bad_input_is_refused(logits: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu.argmax_rows(logits)
