"""Shared fixtures: the embedded default model and a tiny random-weight Llama built from a config."""

from __future__ import annotations

import os

import pytest
from tiny_models import build_tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines (and spawned servers) run eagerly unless a test asks for the compiled forward pass, which
# takes ~30 s to compile: tests/engine/test_compile.py and the parity tests' compiled cases do.
os.environ.setdefault("PAGEDSERVE_ENFORCE_EAGER", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from pagedserve.default_model import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)
