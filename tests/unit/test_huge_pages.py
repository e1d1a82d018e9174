"""CPU tensors in transparent huge pages (`worker.huge_pages`): what they hold, where they live, and
the engine's packed weights and KV cache among them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from pagedserve import LLM, SamplingParams
from pagedserve.layers.linear import LinearBase, can_pack_weights
from pagedserve.worker import huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")


def huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds `tensor`'s first byte, from /proc/self/smaps."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_zeros_are_zero_writable_and_in_huge_pages() -> None:
    shape = (4, 2, 512, 8, 3, 64)  # 12 MiB of bfloat16: whole 2 MiB pages inside it
    cache = huge_pages.zeros(shape, torch.bfloat16)
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    cache[3, 1, 511] = 1.5
    assert cache.sum().item() == 1.5 * 8 * 3 * 64
    assert huge_kib(cache) >= 2048


@needs_thp
def test_copies_hold_the_same_values_page_aligned_and_outlive_the_originals() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(96, 288, 32, 2, generator=generator).to(torch.bfloat16),  # 3.4 MiB
        torch.randn(3, 5, generator=generator),  # float32, a few bytes
        torch.arange(1000, dtype=torch.int32).view(10, 100)[:, ::2],  # not contiguous
    ]
    expected = [t.clone() for t in tensors]
    copies = huge_pages.copy_to_huge_pages(tensors)
    del tensors
    gc.collect()  # the mapping lives as long as a tensor viewing it
    for copy, want in zip(copies, expected, strict=True):
        assert copy.dtype == want.dtype and copy.is_contiguous()
        assert torch.equal(copy, want)
        assert copy.data_ptr() % 4096 == 0
    copies[1].add_(1)  # writable, and each copy its own bytes
    assert torch.equal(copies[1], expected[1] + 1) and torch.equal(copies[0], expected[0])
    assert huge_kib(copies[0]) >= 2048


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
        (None, False),  # no such file: not Linux, or a kernel without THP
    ],
)
def test_available_reads_the_kernels_thp_setting(
    setting: str | None, expected: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    monkeypatch.setattr(huge_pages, "_THP_SETTING", path)
    assert huge_pages.available() is expected


def test_without_huge_pages_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    tensors = [torch.ones(4, 4), torch.zeros(3)]
    assert all(a is b for a, b in zip(huge_pages.copy_to_huge_pages(tensors), tensors, strict=True))
    zeros = huge_pages.zeros((2, 3), torch.bfloat16)
    assert zeros.shape == (2, 3) and zeros.dtype == torch.bfloat16 and not zeros.any()


@needs_thp
@pytest.mark.skipif(
    not can_pack_weights(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN has no native bf16"
)
def test_the_engine_reads_its_packed_weights_and_kv_cache_from_huge_pages(tiny_llama_dir: str) -> None:
    llm = LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=1024, block_size=8, enforce_eager=True)
    runner = llm.engine.executor.worker.model_runner  # type: ignore[attr-defined]
    packed = [
        m.packed_weight
        for m in runner.model.modules()
        if isinstance(m, LinearBase)
        and m.packed_weight is not None
        and m.packed_weight.layout == torch.strided
    ]
    assert packed, "no linear weight packed into panels or tiles"
    assert huge_kib(packed[0]) >= 2048  # one mapping holds them all, whole huge pages inside it
    kv_cache = runner.model.attention_layers[0].kv_cache[0]
    assert huge_kib(kv_cache) >= 2048
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@needs_thp
def test_an_engine_without_huge_pages_gives_the_same_tokens(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel has THP off (`never`), the KV cache stays in torch's memory, 4 KiB pages (under
    `madvise`, where torch's allocator never asks for huge ones), and the tokens do not change."""
    prompts = [[1, 2, 3, 4], [1, 500, 600, 700, 800, 900]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run() -> tuple[list[list[int]], int]:
        llm = LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=1024, block_size=8, enforce_eager=True)
        runner = llm.engine.executor.worker.model_runner  # type: ignore[attr-defined]
        kv_kib = huge_kib(runner.model.attention_layers[0].kv_cache[0])
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)], kv_kib

    with_thp, with_kib = run()
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    without_thp, without_kib = run()
    assert with_kib >= 2048
    if "[madvise]" in huge_pages._THP_SETTING.read_text():  # under `always` torch's memory may be huge too
        assert without_kib == 0
    assert without_thp == with_thp
