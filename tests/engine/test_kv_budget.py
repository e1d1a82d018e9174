"""The default KV-cache budget on the CPU: 1 GiB, at most a quarter of the free memory, and (on every
device) at most twice what max_num_seqs sequences of max_model_len tokens hold, so that a tiny model
fills MiB at start-up, not 1 GiB (vllm#33263 asked for such a cap); an explicit --kv-cache-memory is
taken as given. On a GPU, what `memory_utilization` leaves after what is in use; a budget too small
for one block is refused with the setting to change named."""

from __future__ import annotations

import logging

import pytest
from pagedserve import LLM
from pagedserve.worker import worker
from pagedserve.worker.worker import gpu_kv_budget

GiB = 1024**3

BLOCK_SIZE = 8
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 256
LIVE_BLOCKS = MAX_NUM_SEQS * MAX_MODEL_LEN // BLOCK_SIZE  # every sequence at full length


def build(model: str, **kwargs: object) -> LLM:
    return LLM(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        **kwargs,
    )


def bytes_per_block(llm: LLM) -> int:
    return llm.engine.executor.worker.bytes_per_block()  # type: ignore[attr-defined, no-any-return]


def test_a_small_models_default_cache_holds_its_live_sequences_twice(
    tiny_llama_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.worker"):
        llm = build(tiny_llama_dir)
    assert llm.engine.stats().num_total_blocks == 2 * LIVE_BLOCKS  # 2 MiB, where 1 GiB was filled before
    assert (
        f"twice what max_num_seqs ({MAX_NUM_SEQS}) sequences of max_model_len ({MAX_MODEL_LEN})"
        in caplog.text
    )


def test_the_1_gib_default_still_caps_a_larger_need(
    tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The cap below the live bound wins (as 1 GiB does for SmolLM2-135M, whose bound is 45 GiB)."""
    probe = build(tiny_llama_dir, num_kv_blocks=1)
    cap = LIVE_BLOCKS // 2 * bytes_per_block(probe)
    monkeypatch.setattr(worker, "_CPU_DEFAULT_KV_BYTES", cap)
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.worker"):
        assert build(tiny_llama_dir).engine.stats().num_total_blocks == LIVE_BLOCKS // 2
    assert "KV cache budget" not in caplog.text  # the live bound did not set it


def test_an_explicit_budget_is_taken_as_given(tiny_llama_dir: str) -> None:
    probe = build(tiny_llama_dir, num_kv_blocks=1)
    budget = 5 * LIVE_BLOCKS * bytes_per_block(probe)
    llm = build(tiny_llama_dir, kv_cache_memory=str(budget))  # as the flag gives it
    assert llm.engine.stats().num_total_blocks == 5 * LIVE_BLOCKS


def test_a_kv_budget_below_one_block_is_refused_naming_it(tiny_llama_dir: str) -> None:
    with pytest.raises(
        ValueError, match=r"^kv_cache_memory: 1024 bytes is less than one KV block \(\d+ bytes\)$"
    ):
        build(tiny_llama_dir, kv_cache_memory="1KiB")


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
