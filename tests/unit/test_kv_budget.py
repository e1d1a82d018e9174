"""The KV cache's size when none is given: on a GPU, what `memory_utilization` leaves after what is in
use; a budget too small for one block is refused with the setting to change named."""

from __future__ import annotations

import pytest
from pagedserve import LLM
from pagedserve.worker.worker import gpu_kv_budget

GiB = 1024**3


def test_a_gpu_leaves_its_utilization_share_less_what_is_in_use() -> None:
    # 80 GiB, 20 in use (weights, other processes): 0.9 of it is 72 GiB, 52 of which are left
    assert gpu_kv_budget(60 * GiB, 80 * GiB, 0.9) == 52 * GiB
    assert gpu_kv_budget(60 * GiB, 80 * GiB, 1.0) == 60 * GiB  # all of what is free


def test_a_gpu_with_nothing_left_under_the_utilization_is_refused_naming_it() -> None:
    # 75 GiB of 80 in use: 0.9 (72 GiB) is already taken
    with pytest.raises(ValueError) as refused:
        gpu_kv_budget(5 * GiB, 80 * GiB, 0.9)
    assert str(refused.value) == (
        "memory_utilization: 0.9 of the GPU's 80.0 GiB leaves nothing for the KV cache, 75.0 GiB being "
        "in use already; raise it, free the GPU, or set kv_cache_memory"
    )
    with pytest.raises(ValueError, match="^memory_utilization: "):
        gpu_kv_budget(8 * GiB, 80 * GiB, 0.9)  # exactly the 10% kept back is free: nothing left


def test_a_kv_budget_below_one_block_is_refused_naming_it(tiny_llama_dir: str) -> None:
    with pytest.raises(
        ValueError, match=r"^kv_cache_memory: 1024 bytes is less than one KV block \(\d+ bytes\)$"
    ):
        LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory="1KiB", enforce_eager=True)
