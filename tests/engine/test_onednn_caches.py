"""oneDNN's primitive cache and ideep's descriptor cache, under torch's CPU linear layers, keep an entry
per input shape. Importing pagedserve bounds both (128 each, a value in the environment wins), so that
a server meeting a new step size every step stops growing once they are full."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys

import pytest
import torch
from pagedserve import LLM, ONEDNN_CACHE_CAPACITY, SamplingParams
from pagedserve.layers.linear import can_pack_weights

VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def capacities_on_import(env: dict[str, str]) -> list[str]:
    code = f"import os, pagedserve; print(*(os.environ[v] for v in {VARIABLES}))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return run.stdout.split()


def test_import_sets_both_capacities_unless_the_environment_has() -> None:
    env = {name: value for name, value in os.environ.items() if name not in VARIABLES}
    assert capacities_on_import(env) == [str(ONEDNN_CACHE_CAPACITY)] * 2
    assert capacities_on_import({**env, "LRU_CACHE_CAPACITY": "512"}) == [str(ONEDNN_CACHE_CAPACITY), "512"]


class _MallInfo2(ctypes.Structure):
    _FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS.split()]


def heap_in_use_mb() -> float:
    """glibc's bytes in use (freed memory it keeps is not counted): the caches' entries, not
    fragmentation."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("no glibc mallinfo2 here")
    libc.mallinfo2.restype = _MallInfo2
    gc.collect()
    return float(libc.mallinfo2().uordblks) / 2**20


def prefill_one_step_each(llm: LLM, lengths: range) -> None:
    """One prompt at a time, so each prefill step runs exactly `length` tokens: a new shape each."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for length in lengths:
        llm.generate([[1 + length, *range(100, 100 + length - 1)]], params, use_tqdm=False)


def test_new_step_sizes_stop_growing_memory_once_the_caches_are_full(tiny_llama_dir: str) -> None:
    """Each new step size makes a oneDNN primitive for each of the model's four linear shapes (the LM
    head reads one row): 64 sizes fill both caches, 64 more replace entries. With the caches at
    1,024 (oneDNN's and ideep's default), the 64 more added 142 MB here; bounded, nothing."""
    if not can_pack_weights(torch.device("cpu"), torch.float32):
        pytest.skip("float32 linear layers do not run through oneDNN here (an Intel CPU)")
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=256,
    )
    prefill_one_step_each(llm, range(2, 66))
    before = heap_in_use_mb()
    prefill_one_step_each(llm, range(66, 130))
    assert heap_in_use_mb() - before < 20
