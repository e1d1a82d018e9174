"""`--dtype auto`: the checkpoint's half precision on GPUs (as vLLM), the CPU's fast one on CPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagedserve.config import checkpoint_dtype, resolve_dtype
from pagedserve.settings import EngineSettings


@pytest.mark.parametrize(
    ("device", "saved", "resolved"),
    [
        ("cuda", "float16", "float16"),  # bfloat16 would drop mantissa bits the model was trained with
        ("cuda:1", "float16", "float16"),
        ("cuda", "bfloat16", "bfloat16"),
        ("cuda", "float32", "bfloat16"),
        ("cuda", None, "bfloat16"),
    ],
)
def test_auto_on_a_gpu_follows_a_float16_checkpoint(device: str, saved: str | None, resolved: str) -> None:
    assert resolve_dtype("auto", device, saved) == resolved


@pytest.mark.parametrize("saved", ["float16", "bfloat16", "float32", None])
def test_auto_on_a_cpu_is_never_float16(saved: str | None) -> None:
    """float16 matrix products are slow on CPUs: bfloat16 where the CPU has it, else float32."""
    assert resolve_dtype("auto", "cpu", saved) in ("bfloat16", "float32")
    assert resolve_dtype("auto", "cpu", saved) == resolve_dtype("auto", "cpu", None)


def test_an_explicit_dtype_wins() -> None:
    assert resolve_dtype("float32", "cuda", "float16") == "float32"
    assert resolve_dtype("float16", "cpu", "bfloat16") == "float16"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"torch_dtype": "float16"}, "float16"),  # transformers 4
        ({"dtype": "bfloat16"}, "bfloat16"),  # transformers 5
        ({"dtype": "float16", "torch_dtype": "float32"}, "float16"),
        ({}, None),
    ],
)
def test_checkpoint_dtype_reads_either_key(
    tmp_path: Path, fields: dict[str, str], expected: str | None
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8, **fields}))
    assert checkpoint_dtype(str(tmp_path)) == expected
    assert checkpoint_dtype(str(tmp_path / "missing")) is None


def test_the_engine_config_on_a_cpu_serves_a_float16_checkpoint_in_the_cpus_dtype(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine_config = EngineSettings(model=str(tmp_path), device="cpu").to_engine_config()
    assert engine_config.model.dtype == resolve_dtype("auto", "cpu")
