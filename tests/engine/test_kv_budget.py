"""The default KV-cache budget on the CPU: 1 GiB, at most a quarter of the free memory, and (on every
device) at most twice what max_num_seqs sequences of max_model_len tokens hold, so that a tiny model
fills MiB at start-up, not 1 GiB (vllm#33263 asked for such a cap); an explicit --kv-cache-memory is
taken as given."""

from __future__ import annotations

import logging

import pytest
from pagedserve import LLM
from pagedserve.worker import worker

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
